"""Tolerance parsing and resolution, and the verdicts built on them."""

from __future__ import annotations

import pytest
import torch

from pytest_moe_parity.judge.tolerances import default_tolerance, parse_override, resolve
from pytest_moe_parity.judge.verdict import Custom, judge_point
from pytest_moe_parity.points import Point
from pytest_moe_parity.report.text import failure_text, summary_table


def test_parse_override() -> None:
    assert parse_override("layer_*.router:max_flip_share=0.1,rel_l2=2e-2") == (
        "layer_*.router",
        {"max_flip_share": 0.1, "rel_l2": 0.02},
    )
    assert parse_override("cosine=0.99") == ("*", {"cosine": 0.99})


@pytest.mark.parametrize(
    "text, message",
    [
        ("layer_1:cosine", "malformed tolerance"),
        ("layer_1:", "no tolerance given"),
        ("layer_1:speed=2", "unknown tolerance key 'speed'"),
        ("rel_l2=-1", "non-negative"),
        ("within=2", "between 0 and 1"),
        ("atol=nan", "non-negative"),
        ("rtol=abc", "not a number"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_override(text)


def test_most_specific_wins() -> None:
    ini = [parse_override("layer_*:rel_l2=0.1,cosine=0.9"), parse_override("layer_3.*:rel_l2=0.2")]
    cli = [parse_override("layer_3.router:rel_l2=0.3")]
    tol, sources = resolve("layer_3.router", "router", torch.bfloat16, ini=ini, cli=cli)
    assert tol.rel_l2 == 0.3 and tol.cosine == 0.9
    assert sources == ["default for bfloat16", "ini layer_*", "ini layer_3.*", "command line layer_3.router"]
    tol, sources = resolve("layer_3.router", "router", torch.bfloat16, ini=ini, cli=cli, marker={"rel_l2": 0.5})
    assert tol.rel_l2 == 0.5 and sources[-1] == "parity marker"
    other, _ = resolve("layer_4.moe", "moe", torch.bfloat16, ini=ini, cli=cli)
    assert other.rel_l2 == 0.1
    assert default_tolerance(torch.float32, "moe").rel_l2 < default_tolerance(torch.bfloat16, "moe").rel_l2
    assert default_tolerance("bfloat16", "logits").rel_l2 > default_tolerance("bfloat16", "moe").rel_l2


def test_atol_alone_means_allclose() -> None:
    tol, _ = resolve("x", "custom", torch.float32, marker={"atol": 1e-3})
    assert tol.within == 1.0 and tol.atol == 1e-3
    point = Custom("x")
    g = torch.zeros(10)
    c = torch.zeros(10)
    c[3] = 0.01
    r = judge_point(point, g, c, tol, torch.float32)
    assert not r.passed and [ch.name for ch in r.failed_checks] == ["cosine", "rel_l2", "within"]


POINT = Point("attention", 1, order=3)


def test_shape_mismatch_fails_with_both_shapes() -> None:
    tol = default_tolerance(torch.bfloat16, "attention")
    r = judge_point(POINT, torch.zeros(1, 4, 8), torch.zeros(1, 3, 8), tol, torch.bfloat16)
    assert not r.passed
    text = failure_text(r)
    assert "shape mismatch: golden (1, 4, 8) vs candidate (1, 3, 8)" in text


def test_nan_says_where() -> None:
    tol = default_tolerance(torch.bfloat16, "attention")
    g = torch.randn(1, 6, 8)
    c = g.clone()
    c[0, 4, 2] = float("nan")
    r = judge_point(POINT, g, c, tol, torch.bfloat16)
    assert not r.passed
    assert "candidate has 1 NaN and 0 Inf (golden 0 / 0); first at index (0, 4, 2), token 4" in failure_text(r)
    assert "nan" not in " ".join(f"{c.value}" for c in r.checks if c.name in ("cosine", "rel_l2"))


def test_router_tie_is_not_a_failure_but_a_flip_is() -> None:
    point = Point("router", 0, router_kind="softmax")
    tol = default_tolerance(torch.bfloat16, "router")
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0], [2.0, 1.0, 0.9995, -1.0]])
    weights = torch.softmax(logits, -1).topk(2).values
    golden = (logits, weights, torch.tensor([[0, 1], [0, 1]]))
    swapped = weights.clone()
    swapped[0] = weights[0].flip(0)
    tie = (logits, swapped, torch.tensor([[1, 0], [0, 2]]))  # token 0: order only; token 1: near-tie swap
    r = judge_point(point, golden, tie, tol, torch.bfloat16)
    assert r.passed, failure_text(r)
    assert [f["token"] for f in r.routing["ties"]] == [1] and r.routing["flips"] == []
    assert r.excluded_tokens == [1]
    flip = (logits, weights, torch.tensor([[0, 3], [0, 1]]))  # token 0: expert 3 instead of 1, gap 3.0
    r = judge_point(point, golden, flip, tol, torch.bfloat16)
    assert not r.passed and [f["token"] for f in r.routing["flips"]] == [0]
    assert "flip_share" in [c.name for c in r.failed_checks]


def test_sigmoid_router_ties_use_the_golden_score_bias() -> None:
    point = Point("router", 0, router_kind="sigmoid_bias")
    tol = default_tolerance(torch.bfloat16, "router")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.3, 0.0, 0.6])  # the bias alone decides: experts 3 and 1
    w = torch.tensor([[0.5, 0.5]])
    golden = (logits, w, torch.tensor([[3, 1]]))
    lost_bias = (logits, w, torch.tensor([[0, 1]]))  # a port without the bias picks by logits only
    r = judge_point(point, golden, lost_bias, tol, torch.bfloat16, score_bias=bias)
    assert not r.passed and r.routing["flips"][0]["gap"] == pytest.approx(0.6)


def test_summary_table_is_compact_for_big_runs() -> None:
    rows = [
        {"id": f"layer_{i}.moe", "order": i, "layer": i, "component": "moe", "status": "passed", "metrics": {}}
        for i in range(100)
    ]
    rows[57]["status"] = "failed"
    lines = summary_table(rows, full_limit=40)
    assert len(lines) < 10
    assert any(line.startswith("layer_57.moe") and "failed" in line for line in lines)
    assert any("passing points" in line for line in lines)


def test_a_router_returning_logits_only_is_compared_as_a_tensor() -> None:
    point = Point("router", 0, router_kind="softmax")
    tol = default_tolerance(torch.bfloat16, "router")
    logits = torch.randn(5, 4)
    assert judge_point(point, logits, logits.clone(), tol, torch.bfloat16).passed
    r = judge_point(point, logits, logits.roll(1, dims=1), tol, torch.bfloat16)
    assert not r.passed and list(r.metrics) == ["out"]


def test_failure_text_counts_worst_elements_and_remedy() -> None:
    tol = default_tolerance(torch.bfloat16, "attention")
    g = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0))
    c = g.clone()
    c[0, 3, 5] = -g[0, 3, 5] * 2  # one element wrong
    c[0, 6] *= 1.2  # one token 20% off
    r = judge_point(POINT, g, c, tol, torch.bfloat16)
    assert not r.passed
    text = failure_text(r)
    m = r.metrics["out"]
    assert f"outside atol=0.01/rtol=0.016: {m.mismatched} / 128 ({m.mismatched / 1.28:.2f}%)" in text
    assert m.mismatched == round((1 - m.within_tol) * 128) and m.mismatched >= 1
    (index, golden, candidate, diff) = r.worst_elements["out"][0]
    assert index == (0, 3, 5) and candidate == pytest.approx(-2 * golden) and diff == pytest.approx(candidate - golden)
    assert r.worst[0][0] in (3, 6)
    remedy = r.remedy()
    assert remedy is not None and remedy.startswith("--parity-tol 'layer_1.attention:")
    assert f"to accept this result: {remedy}" in text
    assert all(len(line) <= 100 for line in text.splitlines()), max(text.splitlines(), key=len)
    # the remedy accepts: re-judged under it, the same result passes
    pattern, values = parse_override(remedy.removeprefix("--parity-tol ").strip("'"))
    relaxed, _ = resolve(POINT.id, "attention", torch.bfloat16, cli=[(pattern, values)])
    assert judge_point(POINT, g, c, relaxed, torch.bfloat16).passed


def test_remedy_rounds_outward_and_refuses_the_unacceptable() -> None:
    from pytest_moe_parity.judge.verdict import _accepting

    assert _accepting(0.0867, "<=") == pytest.approx(0.087)
    assert _accepting(0.75, "<=") == pytest.approx(0.75)
    assert _accepting(0.99734, ">=") == pytest.approx(0.9973)
    assert _accepting(0.5, ">=") == pytest.approx(0.5)
    tol = default_tolerance(torch.bfloat16, "attention")
    g = torch.randn(4, 8)
    assert judge_point(POINT, g, -g, tol, torch.bfloat16).remedy() is None  # cosine -1: nothing accepts it
    assert judge_point(POINT, g, g[:, :4], tol, torch.bfloat16).remedy() is None  # a shape
    nan = g.clone()
    nan[0, 0] = float("nan")
    assert judge_point(POINT, g, nan, tol, torch.bfloat16).remedy() is None
