"""`--hw nxdi --hw-option build=cpu` on NxDI's real DBRX modules (models/dbrx: its fused-QKV attention
with clip_qkv, its bias-free LayerNorms, the older modules/moe MoE with a softmax router whose top-k
affinities are renormalised), from tiny goldens recorded under transformers 5 (prefill and two decode
steps): every point clean at TP 1 and 2 in float32 and bfloat16, and a fault in NxDI's weight
conversion failing first at its point."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import read_json, run_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

CPU = ("--hw", "nxdi", "--hw-option", "build=cpu")
# the points NxDI's modules do not build, per architecture, and why (the table's `unavailable`)
UNAVAILABLE = {
    "dbrx": {"rotary": "NxDI computes the rotary embedding inside each attention module"},
}


def points(golden: Path) -> list[str]:
    return GoldenStore(golden).point_ids


def unavailable(arch: str, ids: list[str]) -> list[str]:
    return [p for p in ids if p.rpartition(".")[2] in UNAVAILABLE[arch]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", list(UNAVAILABLE))
def test_a_clean_run_passes_every_point_on_nxdi_s_real_modules(
    arch: str, tp: int, dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point NxDI builds passes, prefill and decode; the others are skipped with the table's reason."""
    golden = t5 / f"{arch}-golden"
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", dtype, "--parity-report", str(report),
        "-W", "error", model=t5 / f"{arch}-model",
    )  # fmt: skip
    ids = points(golden)
    skipped = unavailable(arch, ids)
    result.assert_outcomes(passed=len(ids) - len(skipped), skipped=len(skipped))
    rows = {r["id"]: r for r in read_json(report / "comparison_report.json")["points"]}
    for pid in skipped:
        assert UNAVAILABLE[arch][pid.rpartition(".")[2]] in rows[pid]["reason"], rows[pid]
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None
    assert any(p.endswith("layer_1.experts") for p in ids) and any(p.startswith("step_2.") for p in ids)


def _dbrx_gate_and_up_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxDI's DBRX conversion concatenates the experts' up projection (v1) before the gate (w1)."""
    from neuronx_distributed_inference.models.dbrx import modeling_dbrx

    convert = modeling_dbrx.convert_dbrx_to_neuron_state_dict

    def swapped(state, config):
        out = convert(state, config)
        for key in [k for k in out if k.endswith("expert_mlps.mlp_op.gate_up_proj.weight")]:
            gate, up = out[key].chunk(2, dim=-1)
            out[key] = torch.cat([up, gate], dim=-1)
        return out

    monkeypatch.setattr(modeling_dbrx, "convert_dbrx_to_neuron_state_dict", swapped)


@pytest.mark.parametrize(
    ("arch", "fault", "where"),
    [("dbrx", _dbrx_gate_and_up_swapped, "layer_0.experts")],
    ids=["dbrx-gate-up-swapped"],
)
def test_a_conversion_fault_fails_first_at_its_point(
    arch: str, fault, where: str, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fault in NxDI's own weight conversion: the run stops at the first point whose module holds the
    faulty tensors, every point before it passed (those NxDI does not build skipped)."""
    golden = t5 / f"{arch}-golden"
    fault(monkeypatch)
    report = tmp_path / "r"
    result = run_parity(pytester, golden, *CPU, "-x", "--parity-report", str(report), model=t5 / f"{arch}-model")
    ids = points(golden)
    before = ids[: ids.index(where)]
    skipped = unavailable(arch, before)
    result.assert_outcomes(passed=len(before) - len(skipped), skipped=len(skipped), failed=1)
    result.stdout.fnmatch_lines([f"first divergence: {where} *"])
    result.stdout.fnmatch_lines([f"FAILED *parity::{where} *"])
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == where
