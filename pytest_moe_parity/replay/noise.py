"""The noise floor: the reference model itself run in a lower precision (`moe-parity golden
--noise-dtype bfloat16`), isolated and chained, judged against its own golden like a candidate.
Its error at each point is what rounding alone costs there; a candidate's error is then read as a
ratio to it (`noise_factor`), which separates a port bug of 1e-2 from bf16 rounding where a fixed
limit cannot, and keeps deep chained runs from failing on accumulated rounding."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..backends import BackendSetup
from ..backends.hf import TorchBackend
from ..dtypes import dtype_name, parse_dtype
from ..errors import BackendFailure, BadInput, PointUnavailable
from ..golden import GoldenStore
from ..golden.writer import update_manifest
from ..judge.verdict import PointResult
from ..points import ROUTER
from .batch import Rows
from .runner import ParityRunner

FIGURES = ("rel_l2", "max_token_rel_l2")


def noise_figures(result: PointResult) -> dict[str, dict[str, float]]:
    """Per compared tensor, the figures a noise ratio divides by; for routers and the logits, the
    share of real flips (routing top-k, next-token top-1). A tensor whose every token the run left
    out has no figure (one over no token would read as an error of 0)."""
    out: dict[str, dict[str, float]] = {}
    for target, m in result.metrics.items():
        values = {name: getattr(m, name) for name in FIGURES}
        record = result.token_d2.get(target)
        if record is not None and record.numel() and bool(torch.isnan(record).all()):
            continue
        if m.shape_match and all(v is None or math.isfinite(v) for v in values.values()):
            out[target] = {k: v for k, v in values.items() if v is not None}
    if result.component == ROUTER and result.routing:  # real routing flips of the reference itself
        out["top_k"] = {"flip_share": result.routing.flip_share}
    if result.logits is not None:
        out["top1"] = {"flip_share": result.logits.top1.flip_share}
    return out


def record_noise(
    golden_dir: Path | str,
    dtype: str,
    *,
    model_dir: Path | str | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the golden's own model in `dtype`, isolated (every point on its golden inputs) and
    chained (one whole-model forward, steered, and once more free), and add its error at every point
    to the golden's manifest (each token's, to a file beside it)."""
    say = progress or (lambda msg: None)
    try:
        torch_dtype = parse_dtype(dtype, floating=True)
    except ValueError:
        raise BadInput(f"--noise-dtype {dtype!r} is not a floating-point torch dtype (e.g. bfloat16)") from None
    golden = GoldenStore(golden_dir)
    name = dtype_name(torch_dtype)
    if name == golden.dtype:
        raise BadInput(f"--noise-dtype {name} is the golden's own dtype: its error would be zero; pick a lower one")
    golden.manifest.get("noise", {}).pop(name, None)  # recorded again: the old figures judge nothing here
    model = Path(model_dir) if model_dir is not None else Path(golden.manifest["model"]["path"])
    setup = BackendSetup(golden, model, torch_dtype, options={"device": device}, trust_remote_code=trust_remote_code)
    backend = TorchBackend(setup)
    # a --capture-tokens golden keeps no inputs: its points are judged chained only, on a chain that
    # cannot be steered (the free run's figures are the chained ones)
    captured = golden.captured_tokens is not None
    runner = ParityRunner(golden, backend, mode="chain" if captured else "both", steer=not captured)
    free = ParityRunner(golden, backend, mode="chain", steer=False)  # the same model, a chain nobody steers
    started = time.perf_counter()
    say(f"noise floor: the reference in {name}, isolated and chained (steered, free), at {len(golden.points)} points")
    figures: dict[str, dict[str, Any]] = {"isolated": {}, "chain": {}, "free": {}}
    rows = Rows.of(golden) if not captured else None
    if rows is not None and rows.count > 1:
        figures["batch"] = {}  # each prefill point's rows: the reference's own output in the batch against alone
    tokens: dict[str, torch.Tensor] = {}  # mode/point/tensor -> each token's squared error (NaN: left out)
    layer_groups = list(dict.fromkeys(p.group for p in golden.points if p.layer is not None))
    ends = {p.group: p.id for p in golden.points}  # each group's last point
    try:
        for point in golden.points:
            try:
                prepared = runner.prepare(point)
            except PointUnavailable:
                prepared = None
            except BackendFailure as exc:
                raise BadInput(f"the reference in {name} failed at {point.id}: {exc}") from None
            for mode, cand in (("isolated", prepared.candidate), ("chain", prepared.chained)) if prepared else ():
                if cand is not None:
                    _keep(figures, tokens, mode, point, runner.judge_output(point, prepared.golden, cand, mode, None))
            if "batch" in figures and prepared is not None and prepared.candidate is not None and point.step is None:
                figures["batch"][point.id] = batch_vs_alone(runner, rows, point, prepared.candidate)
            if prepared is not None and free._chained(point):
                free.started = runner.started  # one backend, started once
                own = free.chain.output(point, prepared.golden)
                _keep(figures, tokens, "free", point, free.judge_output(point, prepared.golden, own, "chain", None))
            if point.layer is not None and ends[point.group] == point.id:  # its layer's last point: done
                done = layer_groups.index(point.group) + 1
                say(f"  noise floor {point.group} [{done}/{len(layer_groups)}, {time.perf_counter() - started:.1f}s]")
    finally:
        free.chain.close()
        runner.close()
    entry = {
        **figures,
        "tokens": write_noise_tokens(golden.root, name, tokens),
        "recorded": {"seconds": round(time.perf_counter() - started, 3), "device": device, "model": str(model)},
    }
    noise = {**golden.manifest.get("noise", {}), name: entry}
    update_manifest(golden.root, "noise", noise)
    say(f"noise floor recorded in {time.perf_counter() - started:.1f}s")
    return entry


def batch_vs_alone(runner: ParityRunner, rows: Rows, point: Any, batch: Any) -> list[float | None]:
    """Each row's relative L2 between the reference's own output for it in the batch and alone (the
    golden's call cut to the row), in the noise floor's dtype: what batching alone costs the reference."""
    out: list[float | None] = [None] * rows.count  # None: a row of padding only
    for row, alone in rows.runs_alone(runner, point, runner.golden.load(point)):
        main = runner.judge_between(point, alone.output, rows.cut(batch.output, row)).main
        out[row] = float(main.rel_l2) if main is not None and math.isfinite(main.rel_l2) else None
    return out


def _keep(figures: dict, tokens: dict, mode: str, point: Any, result: PointResult) -> None:
    figures[mode][point.id] = noise_figures(result)
    tokens.update({f"{mode}/{point.id}/{t}": d2 for t, d2 in result.token_d2.items()})


def write_noise_tokens(root: Path, dtype: str, tokens: dict[str, torch.Tensor]) -> dict[str, str]:
    """The reference's own per-token errors, in `noise_tokens.<dtype>.safetensors` beside the points'
    files (not among them: the golden's fingerprint is what the reference recorded): the manifest's
    entry names the file and its sha256."""
    from safetensors.torch import save_file

    from ..files import atomic_replace
    from ..golden.store import sha256_file

    name = f"noise_tokens.{dtype}.safetensors"
    with atomic_replace(Path(root) / name) as tmp:
        save_file({k: v.contiguous() for k, v in tokens.items()}, str(tmp))
        digest = sha256_file(tmp)
    return {"file": name, "sha256": digest}
