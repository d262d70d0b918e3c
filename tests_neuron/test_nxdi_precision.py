"""The precision search on `--hw nxdi` (its CPU build): the units are the precision settings NxDI's
config exposes for the point's module (`backends.nxdi.precision`). Qwen3-MoE's NxDI router run in
bfloat16 (`--hw-option router_dtype=bfloat16`, NxDI's `router_config.dtype`, which Qwen3-MoE's config
sets to float32 "for accuracy"; NxDI's default cast_type=config casts it to bfloat16 as well) gives
logits about 1.7 times as far from the reference's as its float32 router does (rel_l2 0.0024 against
0.0014 at layer 1, max_abs 0.0015 against 0.0006); its top-k affinities are rounded to bfloat16 either
way and no token's top-k flips on this golden. Under an elementwise tolerance of atol 5e-4 and rtol
8e-3 two of layer 1's 128 logits fall outside in bfloat16, none in float32: the point fails and the
search names exactly that setting. A clean point has nothing to search; a module that reads no setting is
skipped saying so; a weight fault fails with every setting in float32 (a defect, not precision)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faults import edit_checkpoint
from helpers import read_json, run_parity, usage_error

from pytest_moe_parity.report.files import REPORT_FILE
from pytest_moe_parity.report.rows import PrecisionRow, Row

CPU = ("--hw", "nxdi", "--hw-option", "build=cpu", "--dtype", "bfloat16")
BF16_ROUTER = ("--hw-option", "router_dtype=bfloat16")
TIGHT = ("--parity-tol", "layer_1.router:atol=0.0005,rtol=0.008")  # the float32 router's logits within, bf16's not


def _rows(report: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}


def test_a_bf16_router_is_named_by_the_search(t5: Path, pytester: pytest.Pytester) -> None:
    """layer_1's router fails and its search names router_config.dtype; the attention's norm passed
    (nothing to search); the experts, failed under a tolerance they cannot meet, read no setting."""
    report = pytester.path / "report"
    result = run_parity(
        pytester, t5 / "qwen3_moe-golden", *CPU, *BF16_ROUTER, *TIGHT,
        "--parity-tol", "layer_1.experts:rel_l2=1e-6",
        "--parity-precision-search", "layer_1.router,layer_1.post_attn_norm,layer_1.experts",
        "-k", "layer_1 and (router or post_attn_norm or experts) and not step", "--parity-report", str(report), "-rs",
        model=t5 / "qwen3_moe-model",
    )  # fmt: skip
    result.assert_outcomes(passed=1, failed=3, skipped=2)
    result.stdout.fnmatch_lines([
        "*layer_1.router::precision: layer_1.router passes with NxDI's router_config.dtype=float32; nothing else "
        "needs it*",
        "*2 runs of the point*",
    ])  # fmt: skip
    result.stdout.fnmatch_lines(["*layer_1.post_attn_norm passed: nothing to search*"])
    result.stdout.fnmatch_lines(["*layer_1.experts: NxDI exposes no precision setting for its module (*"])
    row = _rows(report)["layer_1.router::precision"]
    assert row["precision_verdict"] == "precision" and row["raised"] == ["router_config.dtype"], row
    assert row["units"] == ["router_config.dtype"]
    runs = {tuple(r["raised"]): r["status"] for r in row["runs"]}
    assert runs == {(): "failed", ("router_config.dtype",): "passed"}
    figures = {tuple(r["raised"]): r["rel_l2"] for r in row["runs"]}
    assert figures[()] > 1.5 * figures[("router_config.dtype",)], figures
    assert isinstance(Row.from_json(row), PrecisionRow) and Row.from_json(row).to_json() == row


def test_a_weight_fault_fails_with_every_setting_raised(t5: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        key = next(k for k in t if k.startswith("model.layers.1.") and k.endswith("mlp.gate.weight"))
        t[key] = t[key].flip(0)  # the experts' rows in another order

    port = edit_checkpoint(t5 / "qwen3_moe-model", tmp_path / "port", edit)
    result = run_parity(
        pytester, t5 / "qwen3_moe-golden", *CPU, *BF16_ROUTER, "--parity-precision-search", "layer_1.router",
        "-k", "layer_1 and router and not step", model=port,
    )  # fmt: skip
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*layer_1.router::precision: layer_1.router still fails with every precision setting NxDI exposes for its "
        "module in float32 (router_config.dtype raised): a defect, not precision",
    ])  # fmt: skip


def test_the_neuron_build_is_a_usage_error(t5: Path, pytester: pytest.Pytester) -> None:
    result = run_parity(
        pytester, t5 / "qwen3_moe-golden", "--hw", "nxdi", "--dtype", "bfloat16", "--parity-precision-search",
        "layer_1.router", model=t5 / "qwen3_moe-model",
    )  # fmt: skip
    usage_error(result, "searches NxDI's precision settings on its CPU build")
