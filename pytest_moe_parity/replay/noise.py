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

from ..backends import BackendSetup
from ..backends.hf import TorchBackend
from ..dtypes import dtype_name, parse_dtype
from ..errors import BackendFailure, BadInput, PointUnavailable
from ..golden import GoldenStore
from ..golden.writer import update_manifest
from ..judge.verdict import PointResult
from .runner import ParityRunner

FIGURES = ("rel_l2", "max_token_rel_l2")


def noise_figures(result: PointResult) -> dict[str, dict[str, float]]:
    """Per compared tensor, the figures a noise ratio divides by; for routers and the logits, the
    share of real flips (routing top-k, next-token top-1)."""
    out: dict[str, dict[str, float]] = {}
    for target, m in result.metrics.items():
        values = {name: getattr(m, name) for name in FIGURES}
        if m.shape_match and all(v is None or math.isfinite(v) for v in values.values()):
            out[target] = {k: v for k, v in values.items() if v is not None}
    if result.component == "router" and result.routing:  # real routing flips of the reference itself
        out["top_k"] = {"flip_share": result.routing["flip_share"]}
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
    chained (one whole-model forward), and add its error at every point to the golden's manifest."""
    say = progress or (lambda msg: None)
    try:
        torch_dtype = parse_dtype(dtype, floating=True)
    except ValueError:
        raise BadInput(f"--noise-dtype {dtype!r} is not a floating-point torch dtype (e.g. bfloat16)") from None
    golden = GoldenStore(golden_dir)
    name = dtype_name(torch_dtype)
    if name == golden.dtype:
        raise BadInput(f"--noise-dtype {name} is the golden's own dtype: its error would be zero; pick a lower one")
    model = Path(model_dir) if model_dir is not None else Path(golden.manifest["model"]["path"])
    setup = BackendSetup(golden, model, torch_dtype, options={"device": device}, trust_remote_code=trust_remote_code)
    runner = ParityRunner(golden, TorchBackend(setup), mode="both")
    started = time.perf_counter()
    say(f"noise floor: the reference in {name}, isolated and chained, at {len(golden.points)} points")
    figures: dict[str, dict[str, Any]] = {"isolated": {}, "chain": {}}
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
            for mode, cand in (("isolated", prepared.candidate), ("chain", prepared.chain)) if prepared else ():
                if cand is not None:
                    result = runner.judge_output(point, prepared.golden, cand, mode, None)
                    figures[mode][point.id] = noise_figures(result)
            if point.layer is not None and ends[point.group] == point.id:  # its layer's last point: done
                done = layer_groups.index(point.group) + 1
                say(f"  noise floor {point.group} [{done}/{len(layer_groups)}, {time.perf_counter() - started:.1f}s]")
    finally:
        runner.close()
    entry = {
        **figures,
        "recorded": {"seconds": round(time.perf_counter() - started, 3), "device": device, "model": str(model)},
    }
    noise = {**golden.manifest.get("noise", {}), name: entry}
    update_manifest(golden.root, "noise", noise)
    say(f"noise floor recorded in {time.perf_counter() - started:.1f}s")
    return entry
