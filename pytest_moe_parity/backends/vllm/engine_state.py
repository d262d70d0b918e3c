"""`moe-parity vllm-dump --state clean|reused|prefix`: vLLM's engine run on a one-prompt golden's prompt in a
serving state, hooked as `vllm-dump` hooks it (`engine.Tap`), written as the dump `--hw dump` reads, for
`pytest --hw dump --model CLEAN --parity-state DIR` (`replay.state`). Every state runs the same engine
settings (one sequence at a time, KV blocks of `BLOCK` tokens, prefix caching where the state needs it), so
that the state alone differs between two dumps:

- `clean`: the prompt alone on a fresh engine;
- `reused`: another request (the prompt's tokens reversed, as long) first, on an engine whose KV cache holds
  that one request's blocks, so the prompt is served in the batch row and KV blocks that request held;
- `prefix`: prefix caching on; another request sharing the prompt's first full blocks (another suffix)
  first, so the prompt hits those blocks: the engine computes its rows after them, and its rows there are
  that request's (the keys and values the prompt read are that request's).

`engine.json` says the state: the requests run before the prompt, the batch row and KV blocks each held,
the prompt's prefix-cache hit and who wrote it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ...errors import BackendError, BadInput
from ...golden import GoldenStore
from ...points import describe_layers
from ...words import counted
from .backend import DTYPES
from .engine import (
    EngineRun,
    Tap,
    _match,
    assemble,
    close_llm,
    combine,
    engine_failed,
    engine_inputs,
    first_line,
    in_process,
    own_trace,
    prompts_of,
    report_lines,
    runner_of,
    token_notes,
    write_dump,
)
from .imports import import_vllm

STATES = ("clean", "reused", "prefix")
BLOCK = 32  # tokens per KV block (vLLM's CPU attention takes multiples of 32): a prefix hit is of whole blocks


class StateTap(Tap):
    """The engine's hooks, and for each request the persistent batch row and the KV blocks it held."""

    def __init__(self, runner: Any, model_type: str):
        super().__init__(runner, model_type)
        self.rows: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}

    def _forward(self, module: Any, args: Any, kwargs: dict) -> None:
        super()._forward(module, args, kwargs)
        batch = self.runner.input_batch
        table = batch.block_table[0]
        for i in range(batch.num_reqs):
            request = batch.req_ids[i]
            self.rows.setdefault(request, i)
            self.blocks[request] = table.block_table.cpu[i, : table.num_blocks_per_row[i]].tolist()

    def lend(self, owner: str, to: str, below: int) -> None:
        """`owner`'s rows at positions below `below` as `to`'s, after `to`'s own (a position `to` computed keeps
        its own): the rows of a prompt's prefix-cache hit, which the request that wrote them computed."""
        for name, kept in self.kept.get(owner, {}).items():
            for positions, parts in kept:
                keep = positions < below
                if bool(keep.any()):
                    mine = self.kept.setdefault(to, {}).setdefault(name, [])
                    mine.append((positions[keep], tuple(p[keep] for p in parts)))


def _llm(model_dir: Path, dtype: Any, longest: int, state: str) -> Any:
    """vLLM's LLM as every state runs it: eager, one sequence at a time, KV blocks of BLOCK tokens; `reused`:
    a KV cache of one request's blocks (the next request gets the blocks the last one freed); `prefix`: prefix
    caching on."""
    from vllm import LLM

    length = -(-longest // BLOCK) * BLOCK
    args = {
        "model": str(model_dir), "skip_tokenizer_init": True, "enforce_eager": True, "dtype": DTYPES[dtype],
        "seed": 0, "max_model_len": length, "max_num_seqs": 1, "max_num_batched_tokens": max(2048, length),
        "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 64 << 20, "block_size": BLOCK,
        "enable_prefix_caching": state == "prefix",
    }  # fmt: skip
    if state == "reused":
        args["num_gpu_blocks_override"] = length // BLOCK + 1  # one request's blocks, and vLLM's null block
    try:
        return LLM(**args)
    except Exception as exc:
        raise BackendError(f"vLLM's engine refuses {model_dir}: {first_line(exc)}") from None


def _before(tokens: list[int], state: str) -> tuple[list[int], int]:
    """The request run before the prompt, and the prompt's tokens a prefix hit can cover (0: none)."""
    if state == "reused":
        return tokens[::-1], 0
    shared = (len(tokens) - 1) // BLOCK * BLOCK  # whole blocks, the last token left to compute
    if not shared:
        raise BadInput(
            f"the golden's prompt has {len(tokens)} tokens: a prefix-cache hit takes whole blocks of {BLOCK} and "
            f"leaves the last token to compute; record a prompt of more than {BLOCK} tokens"
        )
    suffix = [(t + 1) % 256 if (t + 1) % 256 not in tokens[shared:] else (t + 2) % 256 for t in tokens[shared:]]
    return tokens[:shared] + suffix, shared


def run_engine_state(
    model_dir: Path, golden_dir: Path, out_dir: Path, state: str, dtype: str | None = None
) -> tuple[EngineRun, list[str]]:
    """vLLM's engine on the golden's prompt in `state`, hooked; the dump written to `out_dir` (whole, or
    nothing: BadInput or BackendError first); and the state in words."""
    version, golden, torch_dtype, out_dir = engine_inputs(model_dir, golden_dir, out_dir, dtype)
    rows = prompts_of(golden)
    if len(rows) != 1 or golden.sequences != 1:
        raise BadInput("moe-parity vllm-dump --state runs one prompt: record the golden of one prompt")
    other, shared = _before(rows[0].tokens, state) if state != "clean" else ([], 0)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import_vllm()
    steps = golden.decode_steps
    started = time.perf_counter()
    with in_process():
        from vllm import SamplingParams

        llm = _llm(Path(model_dir), torch_dtype, len(rows[0].tokens) + steps + 1, state)
        try:
            runner = runner_of(llm)
            tap = StateTap(runner, golden.model_type)
            tap.start()
            params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
            try:
                before = llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False) if other else []
                outputs = llm.generate([{"prompt_token_ids": rows[0].tokens}], params, use_tqdm=False)
            except Exception as exc:
                raise engine_failed(exc, model_dir) from None
            finally:
                tap.close()
            model_class, device = type(runner.model).__name__, str(runner.device)
        finally:
            close_llm(llm)
    seconds = time.perf_counter() - started
    _match(tap, rows, outputs)
    first = before[0].request_id if before else None
    writer = next((s for s in tap.kept if first is not None and (s == first or s.startswith(f"{first}-"))), None)
    hit = int(getattr(outputs[0], "num_cached_tokens", 0) or 0)
    if state == "prefix" and writer is not None and hit:
        tap.lend(writer, rows[0].request, hit)
    said = _said(tap, state, rows[0].request, writer, len(other), hit, shared)
    dump, not_dumped = assemble(tap, golden, rows)
    trace, source = combine(golden, rows, own_trace(tap, golden, rows))
    other_held = {"batch_row": tap.rows.get(writer), "blocks": tap.blocks.get(writer)} if writer else None
    meta = {"writer": "moe-parity vllm-dump --state", "vllm": version, "model_class": model_class, "device": device,
            "dtype": DTYPES[torch_dtype], "model": {"model_type": golden.model_type, **_identity(golden)},
            "golden": str(golden_dir), "routed_experts": source, "forwards": tap.forwards,
            "state": {"name": state, "said": said, "block_size": BLOCK, "before": [len(other)] if other else [],
                      "prompt": {"batch_row": tap.rows.get(rows[0].request), "blocks": tap.blocks.get(rows[0].request),
                                 "prefix_hit_tokens": hit},
                      "other": other_held},
            "requests": [{"row": r.row, "tokens": len(r.tokens), "generated": r.generated} for r in rows]}  # fmt: skip
    write_dump(out_dir, dump, trace, meta)
    run = EngineRun(
        version=version, model_class=model_class, device=device, dtype=DTYPES[torch_dtype], seconds=seconds,
        rows=rows, forwards=tap.forwards, points=len(golden.point_ids) - len(not_dumped),
        tensors=sum(len(s) for s in dump.values()), routes=source, routes_note=None,
        token_notes=token_notes(golden, rows), not_dumped=not_dumped,
        caches=sum(k.endswith(".cache.keys") for tensors in dump.values() for k in tensors),
    )  # fmt: skip
    return run, said


def _identity(golden: GoldenStore) -> dict[str, Any]:
    from ...dump.identity import identity

    return identity(golden.config)


def _said(tap: StateTap, state: str, prompt: str, writer: str | None, other: int, hit: int, shared: int) -> list[str]:
    """The state the prompt ran in, in words, from what the hooks saw."""
    row, blocks = tap.rows.get(prompt), tap.blocks.get(prompt) or []
    held = f"batch row {row}, KV blocks {describe_layers(blocks)}"
    if state == "clean":
        return [f"the prompt alone on a fresh engine ({held})"]
    theirs = tap.blocks.get(writer) or [] if writer else []
    if state == "reused":
        same = sorted(set(blocks) & set(theirs))
        reused = f"{counted(len(same), 'KV block')} the other request held" if same else "no KV block the other held"
        return [f"after another request ({counted(other, 'token')}) in batch row {tap.rows.get(writer)}: the prompt "
                f"in {held}, {reused}"]  # fmt: skip
    if not hit:
        return [f"prefix caching on, after a request sharing the prompt's first {shared} tokens: no prefix-cache hit"]
    return [f"on a prefix-cache hit of {counted(hit, 'token')} (blocks of {BLOCK}) that another request wrote: the "
            f"prompt's rows 0-{hit - 1} are that request's, its own from {hit} ({held})"]  # fmt: skip


def state_report_lines(run: EngineRun, said: list[str], state: str, out_dir: Path, golden_dir: Path) -> list[str]:
    """What `moe-parity vllm-dump --state` says of its run."""
    lines = [line for line in report_lines(run, out_dir, golden_dir) if not line.startswith("  routed experts:")]
    lines.insert(2, "  routed experts: the engine's own selection (its MoE runners' select_experts)")
    lines[0] += f"; state {state} (KV blocks of {BLOCK}, one sequence at a time)"
    lines[1:1] = [f"  state: {s}" for s in said]
    lines[-1] = lines[-1].split("; compare:")[0] + (
        f"; compare with a dump of another state: pytest --golden-dir {golden_dir} --hw dump --model CLEAN "
        f"--parity-state {out_dir}"
    )
    return lines
