"""`--hw nxdi --hw-option build=cpu` on DeepSeek-V3 (tiny: MLA attention, a dense first layer, then
MoE layers of grouped sigmoid routing with a score-correction bias and a shared expert), on what NxDI
2.29 ships of it (models/deepseek's MLA attention and RMSNorm) and NxD's MoE modules (GroupLimitedRouter,
ExpertMLPsV2, SharedExperts), prefill and two decode steps, from a golden recorded under transformers 5.
NxDI ships no DeepSeek-V3 application, decoder layer or MoE block: those points are unavailable, and
said so; the checkpoint is laid out for NxD's modules by the table's own conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import read_json, run_parity

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

CPU = ("--hw", "nxdi", "--hw-option", "build=cpu")
TABLE = nxdi.load_module_table("deepseek_v3")


def _golden(t5: Path) -> tuple[Path, Path, list[str]]:
    golden = t5 / "deepseek_v3-golden"
    return golden, t5 / "deepseek_v3-model", GoldenStore(golden).point_ids


def _unavailable(ids: list[str], tp: int) -> dict[str, str]:
    """The points the table does not build (and why), at this TP degree on the CPU."""
    out = {}
    for pid in ids:
        component = pid.rsplit(".", 1)[-1]
        if component in TABLE.unavailable:
            out[pid] = TABLE.unavailable[component]
        elif component == "attention" and tp > 1:
            out[pid] = TABLE.components["attention"].cpu_tp1_only
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_clean_deepseek_v3_passes_every_point_nxdi_builds(
    tp: int, dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point NxDI's and NxD's modules build passes: the MLA attention on its latent cache (at TP 1:
    NxDI's MLA takes every head in CPU mode, so at TP 2 it is unavailable, with why), the dense first
    layer's MLP and the shared experts reduced over the ranks, the grouped sigmoid router with its bias,
    the experts; the rotary embedding, the MoE block and the decoder layer are not built, each skipped
    with its reason, and no other point is."""
    golden, model, ids = _golden(t5)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", dtype, "--parity-report", str(report),
        "-W", "error", model=model,
    )  # fmt: skip
    unavailable = _unavailable(ids, tp)
    assert len(unavailable) == (3 + 9 + 12 if tp == 1 else 3 + 9 + 12 + 12)  # rotary, moe, output (, attention)
    result.assert_outcomes(passed=len(ids) - len(unavailable), skipped=len(unavailable))
    result.stdout.fnmatch_lines(["first divergence: none", "decode: the next token agrees with the golden*"])
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert {pid for pid, r in rows.items() if r["status"] == "skipped"} == set(unavailable)
    for pid, why in unavailable.items():
        assert why in rows[pid]["reason"], (pid, rows[pid]["reason"])
    if tp == 1:  # the latent cache NxDI writes at each decode step, against the one transformers writes
        for step in (1, 2):
            metrics = rows[f"step_{step}.layer_1.attention"]["metrics"]
            assert {"out", "cache.keys", "cache.values"} <= set(metrics)
    weights = rows["layer_1.router"]["metrics"]["weights"]  # renormalised and scaled as DeepSeek-V3 weighs them
    assert weights["shape_candidate"] == weights["shape_golden"] and weights["rel_l2"] < 0.01


def _shared_gate_up_swapped(converted: dict[str, torch.Tensor]) -> None:
    gate, up = (f"layers.0.mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up"))
    if gate in converted:
        converted[gate], converted[up] = converted[up], converted[gate]


def _score_bias_lost(converted: dict[str, torch.Tensor]) -> None:
    """The score-correction bias left at zeros (a conversion that never sets GroupLimitedRouter's)."""
    bias = "layers.0.mlp.router.e_score_correction_bias"
    if bias in converted:
        converted[bias] = torch.zeros_like(converted[bias])


@pytest.mark.parametrize(
    "fault, where",
    [(_shared_gate_up_swapped, "layer_1.shared_experts"), (_score_bias_lost, "layer_1.router")],
    ids=["shared-gate-up-swapped", "score-bias-lost"],
)
def test_a_conversion_fault_fails_first_at_its_point(
    fault, where: str, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fault in the converted checkpoint of the MoE layers fails first where its module runs, every
    point before it passing (the unavailable ones skipped)."""
    convert = nxdi.backend.convert_unit

    def faulty(*args, **kwargs):
        converted = convert(*args, **kwargs)
        fault(converted)
        return converted

    monkeypatch.setattr(nxdi.backend, "convert_unit", faulty)
    golden, model, ids = _golden(t5)
    report = tmp_path / "r"
    result = run_parity(pytester, golden, *CPU, "-x", "--parity-report", str(report), model=model)
    before = ids[: ids.index(where)]
    skipped = [p for p in before if p in _unavailable(ids, 1)]
    result.assert_outcomes(passed=len(before) - len(skipped), skipped=len(skipped), failed=1)
    result.stdout.fnmatch_lines([f"first divergence: {where} *", f"FAILED *parity::{where} *"])
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == where
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows[where]["status"] == "failed"
    assert all(rows[p]["status"] == ("skipped" if p in skipped else "passed") for p in before)
