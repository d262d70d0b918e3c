"""A writer of vLLM Neuron plugin captures, built from the plugin's own code (no device needed, but the plugin
is not installable here: PyPI's `vllm-neuron` 0.1.0 is a placeholder that says "WRONG PACKAGE", and the
stored snapshot of vllm-project/vllm-neuron, a5ef7c8 of 2025-11-17, predates its accuracy module).

Source: jinhuang12/vllm-neuron (a public fork that carries the module), `vllm_neuron/accuracy/tensor_capture.py`
at commit ed3580d01e8632897b29986ab7532d8c5925846f:

- `register_capture_hooks`: a forward hook per named module keeps `output[0] if isinstance(output, tuple)
  else output`, under the module's name;
- `CaptureWriter.write`: a pass is named `{phase}_{size_label}_{counter}`, `prefill_s{positions.shape[0]}`
  or `decode_b{positions.shape[0]}`, the counter per (phase, size label); its tensors `{name: {tp_rank: t}}`
  with `ForwardPassMetadata(req_ids, positions.cpu().tolist(), dp_rank)`, written under `dp{dp_rank}` by
  `tensor_io.write`: `{pass}/{name}/rank{r}.pt` (`torch.save(tensor.clone().detach().cpu(), ...)`) and
  `{pass}/{pass}_meta.json` (`{"req_ids", "positions", "dp_rank"}`, indent 2).

What the tensors are is this test's: each point's output from a session on the golden's inputs (as
`tests/test_dump.py`'s `write_dump` takes them), laid out as the Neuron runtime holds a pass (its requests'
tokens flattened and padded to the bucket, each TP rank's piece: norms sequence-parallel, `lm_head`
vocabulary-parallel, the rest all-reduced), or, with `hf=True`, as the plugin's HF reference run captures
(one request a pass, `[1, seq, ...]`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import session

from pytest_moe_parity.golden import GoldenStore


def point_outputs(golden: Path, model: Path, dtype: str) -> dict[tuple[int | None, str], torch.Tensor]:
    """(step, module) -> the module's first output (what the plugin's hook keeps), per point."""
    run = session(golden, model, dtype=dtype)
    out: dict[tuple[int | None, str], torch.Tensor] = {}
    for point in run.points:
        if not point.module or (point.step, point.module) in out:
            continue
        output = run.prepare(point).candidate.output
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, torch.Tensor):
            out[point.step, point.module] = first
    return out


def _per_request(t: torch.Tensor, batch: int, positions: int) -> torch.Tensor:
    """`[batch, positions, ...]` from the golden's `[batch, positions, ...]` or `[batch * positions, ...]`."""
    return t if t.shape[:2] == (batch, positions) else t.reshape(batch, positions, *t.shape[1:])


def _pieces(module: str, whole: torch.Tensor, tp: int) -> dict[int, torch.Tensor]:
    """Each TP rank's piece of a pass's `[bucket, ...]` tensor."""
    if tp == 1:
        return {0: whole}
    if module.endswith("norm"):  # sequence parallel: the bucket's tokens split
        return dict(enumerate(whole.chunk(tp, dim=0)))
    if module == "lm_head":  # vocabulary parallel
        return dict(enumerate(whole.chunk(tp, dim=-1)))
    return {r: whole for r in range(tp)}  # after the all-reduce: every rank holds it whole


class Writer:
    """`CaptureWriter` and `tensor_io.write`'s layout (see the module's docstring)."""

    def __init__(self, root: Path, dp_rank: int = 0, tp: int = 1):
        self.dir, self.dp_rank, self.tp = root / f"dp{dp_rank}", dp_rank, tp
        self.counters: dict[tuple[str, str], int] = {}

    def write(self, tensors: dict[str, torch.Tensor], req_ids: list[str], positions: list[int], prefill: bool):
        phase = "prefill" if prefill else "decode"
        label = f"{'s' if prefill else 'b'}{len(positions)}"
        name = f"{phase}_{label}_{self.counters.get((phase, label), 0)}"
        forward = self.dir / name
        for module, whole in tensors.items():
            for rank, piece in _pieces(module, whole, self.tp).items():
                (forward / module).mkdir(parents=True, exist_ok=True)
                torch.save(piece.clone().detach().cpu(), forward / module / f"rank{rank}.pt")
        meta = {"req_ids": req_ids, "positions": positions, "dp_rank": self.dp_rank}
        forward.mkdir(parents=True, exist_ok=True)
        (forward / f"{name}_meta.json").write_text(json.dumps(meta, indent=2))
        self.counters[phase, label] = self.counters.get((phase, label), 0) + 1


def write_capture(
    golden: Path,
    outputs: dict[tuple[int | None, str], torch.Tensor],
    out: Path,
    *,
    tp: int = 1,
    hf: bool = False,
    bucket: int = 0,
    req_ids: list[str] | None = None,
) -> Path:
    """A capture of `outputs` (`point_outputs`) on the golden's prompts: requests `req_ids` (default "0",
    "1", ...) in prompt order, scheduled together; with `hf`, as the plugin captures the HF reference run,
    else as a Neuron run with TP `tp` and a prefill bucket of at least `bucket` tokens."""
    store = GoldenStore(golden)
    batch, seq = store.sequences, store.prefill_tokens
    writer = Writer(out, tp=tp)
    reqs = req_ids or [str(b) for b in range(batch)]
    history: dict[str, torch.Tensor] = {}  # an HF run recomputes the whole sequence at each decode step
    for step in [None, *store.recorded_steps]:
        n = seq if step is None else 1
        rows = {m: _per_request(t, batch, n) for (s, m), t in outputs.items() if s == step}
        first = 0 if step is None else seq + step - 1  # the pass's first position of each request
        if hf:  # one request a pass, [1, tokens so far, ...], the positions of its whole sequence
            history = {m: torch.cat([history[m], t], dim=1) if m in history else t for m, t in rows.items()}
            for b in range(batch):
                whole = {m: history[m][b : b + 1] for m in rows}
                writer.write(whole, [reqs[b]], list(range(first + n)), step is None)
            continue
        positions = [p for _ in range(batch) for p in range(first, first + n)]
        size = max(bucket, len(positions) + 1)
        size += (-size) % tp
        positions += [0] * (size - len(positions))
        flat = {m: torch.cat([t.flatten(0, 1), t.new_zeros(size - batch * n, *t.shape[2:])]) for m, t in rows.items()}
        writer.write(flat, reqs, positions, step is None)
    return out
