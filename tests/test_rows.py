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
    "hint", "remedy", "candidate_dtype", "golden_dtype", "seconds", "backend", "ran", "chain", "shown",
    "inherited",
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


def test_a_routers_flips_a_batchs_rows_and_the_logits_are_read_back_as_the_judges_types() -> None:
    """A router's routing (its flips), a batch's rows and the logits' next tokens are the judge's types
    in a row, written as report schema 1 holds them and read back equal."""
    from pytest_moe_parity.judge.logits import LogitsMetrics
    from pytest_moe_parity.judge.result import BatchRow, Check
    from pytest_moe_parity.judge.routing import RoutingMetrics

    point = Point("router", 0, order=2)
    logits = torch.tensor([[4.0, 3.0, 0.0, 1.0], [4.0, 3.0, 2.0, 0.0]])
    weights = torch.tensor([[0.6, 0.4], [0.6, 0.4]])
    golden = (logits, weights, torch.tensor([[0, 1], [0, 1]]))
    flipped = (logits, weights, torch.tensor([[0, 3], [0, 1]]))  # token 0: expert 3 instead of 1
    result = judge_point(Case(point, golden, flipped, default_tolerance(torch.bfloat16, "router"), torch.bfloat16))
    result.rows = [BatchRow(0, 1, 0.5, 0.5, True, prompt="the first"), BatchRow(1, 1, None, None, False)]
    row = point_row(result)
    assert isinstance(row.routing, RoutingMetrics) and [f.token for f in row.routing.flips] == [0]
    assert all(isinstance(c, Check) for c in row.checks)
    data = json.loads(json.dumps(row.to_json()))
    assert data["routing"]["flips"][0]["candidate_experts"] == [0, 3]
    assert data["rows"] == [
        {"row": 0, "tokens": 1, "rel_l2": 0.5, "max_token_rel_l2": 0.5, "failed": True, "prompt": "the first"},
        {"row": 1, "tokens": 1, "rel_l2": None, "max_token_rel_l2": None, "failed": False},
    ]
    assert Row.from_json(data) == row and Row.from_json(data).to_json() == data
    logits_row = Row.from_json({
        "id": "logits", "component": "logits", "status": "passed", "verdicts": {"isolated": "passed"},
        "logits": {"num_tokens": 2, "top1_agreement": 0.5, "top1": data["routing"], "top_k": 5,
                   "top_k_overlap": 1.0, "kl_mean": "inf", "kl_max": "inf", "kl_worst": [[0, "inf"]]},
    })  # fmt: skip
    assert isinstance(logits_row.logits, LogitsMetrics) and logits_row.logits.kl_max == float("inf")
    assert logits_row.to_json()["logits"]["kl_worst"] == [[0, "inf"]]


def test_tensor_figures_with_non_finite_values_are_read_back_as_written() -> None:
    """A tensor's figures with a NaN and an infinity in the candidate ("inf" and "-inf" in the JSON)
    read back as `TensorMetrics` that write the same JSON, and the summary reads them by name."""
    from pytest_moe_parity.judge.tensors import TensorMetrics, compare_tensors
    from pytest_moe_parity.report.summary import short_metrics

    golden = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    candidate = golden.clone()
    candidate[1, 2], candidate[3, 0] = float("nan"), float("inf")
    metrics = compare_tensors(golden, candidate)
    data = json.loads(json.dumps(metrics.to_dict()))
    assert {"inf", "-inf"} <= {v for v in data.values() if isinstance(v, str)} and data["first_nonfinite"] == [1, 2]
    back = TensorMetrics.from_dict(data)
    assert back.to_dict() == data and back.first_nonfinite == (1, 2) and back.shape_golden == (4, 8)
    row = Row.from_json({**point_row(_judged(broken=False)).to_json(), "metrics": {"out": data}})
    assert isinstance(row.main_metrics, TensorMetrics)
    assert short_metrics(row) == ("0", "inf", "inf") and figure(row, "snr_db") == float("-inf")


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


def test_each_kind_of_row_is_its_own_class_and_is_read_back_as_it() -> None:
    """One class per kind (as pytest's reports): a kind's own figures live on its class alone, and a
    report's row is read back as the class that wrote it."""
    from pytest_moe_parity.report.rows import DrillRow, PointRow, UnjudgedRow, WeightsRow, drill_row

    class Entry:  # a drill item as the drill's checker hands it
        id, order, layer, component = "layer_1.experts::mul", 7.5, 1, "experts"

    rows = {
        PointRow: point_row(_judged(broken=True)),
        UnjudgedRow: unjudged_row(Point("experts", 2, order=9), "skipped", "not in the dump"),
        WeightsRow: weights_row("layer_0.weights", 0, 0.5, ["layer 0: q_proj.weight differs"]),
        DrillRow: drill_row(Entry(), "failed", {"verdict": "introduced"}, None),
    }
    for cls, row in rows.items():
        back = Row.from_json(json.loads(json.dumps(row.to_json())))
        assert type(row) is cls and type(back) is cls and back == row
        assert (row.main_metrics is not None) == (cls is PointRow)
    assert {cls.kind for cls in rows} == {"point", "unjudged", "weights", "op"}
    assert not hasattr(rows[WeightsRow], "metrics") and not hasattr(rows[PointRow], "findings")
    assert rows[WeightsRow].verdict("isolated") == "failed" and rows[UnjudgedRow].verdict("isolated") is None
