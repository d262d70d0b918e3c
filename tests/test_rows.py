"""The report's typed rows: each kind written as report schema 1 holds it, and read back the same."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_moe_parity.judge.tolerances import default_tolerance
from pytest_moe_parity.judge.verdict import Case, judge_point
from pytest_moe_parity.points import Point
from pytest_moe_parity.report.rows import Row, point_row, unjudged_row, weights_row
from pytest_moe_parity.report.summary import counts, figure, first_divergence, modes

HEAD = ["id", "order", "layer", "step", "component", "status"]
JUDGED = [
    *HEAD, "mode", "verdicts", "noise", "metrics", "checks", "limits", "tolerance_sources", "routing",
    "excluded_tokens", "worst_tokens", "token_errors", "worst_experts", "logits", "worst_elements", "notes",
    "hint", "remedy", "candidate_dtype", "golden_dtype", "seconds", "backend", "chain",
]  # fmt: skip


def _judged(broken: bool, mode: str = "isolated"):
    point = Point("attention", 1, order=3)
    gen = torch.Generator().manual_seed(0)
    golden = torch.randn(1, 6, 16, generator=gen)
    candidate = golden * (1.5 if broken else 1.0)
    result = judge_point(Case(point, golden, candidate, default_tolerance(torch.bfloat16, "attention"), torch.bfloat16))
    result.mode = mode
    return result


def test_a_judged_row_is_written_with_schema_1s_keys_and_read_back_the_same() -> None:
    result = _judged(broken=True)
    result.add_chained(_judged(broken=False, mode="chain"))
    row = point_row(result)
    data = json.loads(json.dumps(row.to_json()))  # what comparison_report.json holds
    assert list(data) == JUDGED and list(data["chain"]) == JUDGED
    assert data["status"] == "failed" and data["verdicts"] == {"isolated": "failed", "chain": "passed"}
    assert data["remedy"].startswith("--parity-tol 'layer_1.attention:") and data["chain"]["remedy"] is None
    back = Row.from_json(data)
    assert back == row
    assert back.by_mode() == {"isolated": back, "chain": back.chained}
    assert figure(back, "rel_l2") == pytest.approx(0.5, rel=1e-3)
    assert first_divergence([back]) is back and first_divergence([back], "chain") is None
    assert modes([back]) == ["isolated", "chain"]


@pytest.mark.parametrize("status", ["skipped", "error"])
def test_unjudged_rows_say_why_in_their_own_key(status: str) -> None:
    row = unjudged_row(Point("experts", 2, order=9), status, "the dump has no layer_2.experts")
    key = "error" if status == "error" else "reason"
    assert row.to_json() == {
        "id": "layer_2.experts", "order": 9, "layer": 2, "step": None, "component": "experts", "status": status,
        key: "the dump has no layer_2.experts", "metrics": {}, "checks": [],
    }  # fmt: skip
    assert Row.from_json(row.to_json()) == row
    assert counts([row])[status] == 1


def test_weights_rows_carry_their_findings_and_first_as_hint() -> None:
    failed = weights_row("layer_0.weights", 0, 0.5, ["layer 0: q_proj.weight differs", "layer 0: k_proj.weight"])
    data = failed.to_json()
    assert data["status"] == "failed" and data["hint"] == "layer 0: q_proj.weight differs"
    assert list(data) == [*HEAD, "metrics", "checks", "findings", "hint"]
    assert "hint" not in weights_row("weights", None, -0.5, []).to_json()
    errored = unjudged_row(weights_row("layer_0.weights", 0, 0.5, []), "error", "checkpoint unreadable")
    assert errored.to_json() == {
        "id": "layer_0.weights", "order": 0.5, "layer": 0, "step": None, "component": "weights",
        "status": "error", "metrics": {}, "checks": [], "findings": [], "error": "checkpoint unreadable",
    }  # fmt: skip
    assert Row.from_json(errored.to_json()) == errored
