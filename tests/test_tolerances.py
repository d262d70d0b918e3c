"""Tolerance parsing and resolution, and the verdicts built on them."""

from __future__ import annotations

import pytest
import torch

from pytest_moe_parity.judge.result import Custom
from pytest_moe_parity.judge.tolerances import NOISE_FLOOR_EPS, default_tolerance, noise_floor, parse_override, resolve
from pytest_moe_parity.judge.verdict import Case, judge_point
from pytest_moe_parity.points import Point
from pytest_moe_parity.report.rows import Row, point_row
from pytest_moe_parity.report.summary import summary_lines, summary_table
from pytest_moe_parity.report.text import failure_text


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
    r = judge_point(Case(point, g, c, tol, torch.float32))
    assert not r.passed and [ch.name for ch in r.failed_checks] == ["cosine", "rel_l2", "within"]


POINT = Point("attention", 1, order=3)


def test_shape_mismatch_fails_with_both_shapes() -> None:
    tol = default_tolerance(torch.bfloat16, "attention")
    r = judge_point(Case(POINT, torch.zeros(1, 4, 8), torch.zeros(1, 3, 8), tol, torch.bfloat16))
    assert not r.passed
    text = failure_text(r)
    assert "shape mismatch: golden (1, 4, 8) vs candidate (1, 3, 8)" in text


def test_nan_says_where() -> None:
    tol = default_tolerance(torch.bfloat16, "attention")
    g = torch.randn(1, 6, 8)
    c = g.clone()
    c[0, 4, 2] = float("nan")
    r = judge_point(Case(POINT, g, c, tol, torch.bfloat16))
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
    r = judge_point(Case(point, golden, tie, tol, torch.bfloat16))
    assert r.passed, failure_text(r)
    assert r.routing is not None and [f.token for f in r.routing.ties] == [1] and r.routing.flips == []
    assert r.excluded_tokens == [1]
    flip = (logits, weights, torch.tensor([[0, 3], [0, 1]]))  # token 0: expert 3 instead of 1, gap 3.0
    r = judge_point(Case(point, golden, flip, tol, torch.bfloat16))
    assert not r.passed and r.routing is not None and [f.token for f in r.routing.flips] == [0]
    assert "flip_share" in [c.name for c in r.failed_checks]


def test_sigmoid_router_ties_use_the_golden_score_bias() -> None:
    point = Point("router", 0, router_kind="sigmoid_bias")
    tol = default_tolerance(torch.bfloat16, "router")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.3, 0.0, 0.6])  # the bias alone decides: experts 3 and 1
    w = torch.tensor([[0.5, 0.5]])
    golden = (logits, w, torch.tensor([[3, 1]]))
    lost_bias = (logits, w, torch.tensor([[0, 1]]))  # a port without the bias picks by logits only
    r = judge_point(Case(point, golden, lost_bias, tol, torch.bfloat16, score_bias=bias))
    assert not r.passed and r.routing is not None and r.routing.flips[0].gap == pytest.approx(0.6)


def test_a_sigmoid_run_in_bf16_swaps_scores_closer_than_its_rounding_and_no_more() -> None:
    """LFM2-MoE's router takes the sigmoid of its logits in the module's dtype: in a bf16 model two
    experts whose golden scores are closer than a bf16 unit at their magnitude swap by rounding. Its
    weights come back in bf16, which says so; float32 weights (DeepSeek-V3, MiniMax-M2) do not."""
    point = Point("router", 0, router_kind="sigmoid_bias")
    tol = default_tolerance(torch.bfloat16, "router")
    gap = 0.0016  # the golden score gap of the flip found on LFM2-MoE: under bf16's 2**-8 at 0.5-1
    s = torch.tensor([[0.53, 0.51, 0.51 - gap, 0.49]], dtype=torch.float64)  # small logits, as a tiny model's
    logits = torch.logit(s).float()
    golden = (logits, s[:, :2].float(), torch.tensor([[0, 1]]))
    swapped = torch.tensor([[0, 2]])
    bf16 = (logits.bfloat16(), s[:, [0, 2]].bfloat16(), swapped)
    r = judge_point(Case(point, golden, bf16, tol, torch.bfloat16))
    assert r.passed, failure_text(r)
    assert r.routing is not None and [f.token for f in r.routing.ties] == [0] and r.routing.flips == []
    fp32 = (logits.bfloat16(), s[:, [0, 2]].float(), swapped)  # the sigmoid ran in float32: a real flip
    r = judge_point(Case(point, golden, fp32, tol, torch.bfloat16))
    assert not r.passed and r.routing is not None and [f.token for f in r.routing.flips] == [0]
    # beyond a bf16 unit at that magnitude (2**-8 between 0.5 and 1, plus the logits' own share): a flip
    far = s.clone()
    far[0, 2] = 0.51 - 0.008
    golden_far = (torch.logit(far).float(), far[:, :2].float(), torch.tensor([[0, 1]]))
    r = judge_point(Case(point, golden_far, bf16, tol, torch.bfloat16))
    assert not r.passed and r.routing is not None and [f.token for f in r.routing.flips] == [0]


def test_ulp_is_one_unit_in_the_last_place_at_each_magnitude() -> None:
    from pytest_moe_parity.judge.routing import ulp

    values = torch.tensor([1.0, 0.75, 0.5, 0.3, -3.0, 0.0])
    bf16 = ulp(values, torch.bfloat16)
    assert bf16.tolist() == [2**-7, 2**-8, 2**-8, 2**-9, 2**-6, torch.finfo(torch.bfloat16).tiny * 2**-7]
    for v, u in zip(values[:5].tolist(), bf16[:5].tolist(), strict=True):  # the next bf16 number up is v + u
        x = torch.tensor(v, dtype=torch.bfloat16)
        assert float(torch.nextafter(x, torch.tensor(float("inf"), dtype=torch.bfloat16))) - float(x) == u
    assert ulp(torch.tensor([1.0]), torch.float32).item() == torch.finfo(torch.float32).eps


def test_summary_table_is_compact_for_big_runs() -> None:
    rows = [
        {"id": f"layer_{i}.moe", "order": i, "layer": i, "component": "moe", "status": "passed", "metrics": {}}
        for i in range(100)
    ]
    rows[57]["status"] = "failed"
    rows = [Row.from_json(row) for row in rows]
    lines = summary_table(rows, full_limit=40)
    assert len(lines) < 10
    assert any(line.startswith("layer_57.moe") and "failed" in line for line in lines)
    assert any("passing points" in line for line in lines)


def test_a_count_of_one_takes_the_singular() -> None:
    """Failures at the third point and the third from last fold one passing point before the first and
    after the last: '(1 passing point)', never '(1 passing points)'; a run with one error, '1 error'."""
    from pytest_moe_parity.words import counted, noun

    rows = [
        {"id": f"layer_{i}.moe", "order": i, "layer": i, "component": "moe", "status": "passed", "metrics": {}}
        for i in range(50)
    ]
    rows[2]["status"] = rows[47]["status"] = "failed"
    lines = summary_table([Row.from_json(row) for row in rows], full_limit=40)
    folded = [line.split(None, 1)[1] for line in lines if line.startswith("...")]
    assert folded == ["(1 passing point)", "(42 passing points)", "(1 passing point)"], lines
    rows[47]["status"], rows[48]["status"] = "passed", "error"
    said = summary_lines([Row.from_json(row) for row in rows[:3]] + [Row.from_json(rows[48])])
    assert said[0][0].startswith("4 points: 2 passed, 1 failed, 1 error"), said
    assert [counted(n, "point") for n in (0, 1, 2)] == ["0 points", "1 point", "2 points"]
    assert counted(1, "entry", "entries") == "1 entry" and noun(3, "entry", "entries") == "entries"


def test_a_router_returning_logits_only_is_compared_as_a_tensor() -> None:
    point = Point("router", 0, router_kind="softmax")
    tol = default_tolerance(torch.bfloat16, "router")
    logits = torch.randn(5, 4)
    assert judge_point(Case(point, logits, logits.clone(), tol, torch.bfloat16)).passed
    r = judge_point(Case(point, logits, logits.roll(1, dims=1), tol, torch.bfloat16))
    assert not r.passed and list(r.metrics) == ["out"]


def test_failure_text_counts_worst_elements_and_remedy() -> None:
    tol = default_tolerance(torch.bfloat16, "attention")
    g = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0))
    c = g.clone()
    c[0, 3, 5] = -g[0, 3, 5] * 2  # one element wrong
    c[0, 6] *= 1.2  # one token 20% off
    r = judge_point(Case(POINT, g, c, tol, torch.bfloat16))
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
    assert judge_point(Case(POINT, g, c, relaxed, torch.bfloat16)).passed


def test_remedy_rounds_outward_and_refuses_the_unacceptable() -> None:
    from pytest_moe_parity.judge.result import _accepting

    assert _accepting(0.0867, "<=") == pytest.approx(0.087)
    assert _accepting(0.75, "<=") == pytest.approx(0.75)
    assert _accepting(0.99734, ">=") == pytest.approx(0.9973)
    assert _accepting(0.5, ">=") == pytest.approx(0.5)
    tol = default_tolerance(torch.bfloat16, "attention")
    g = torch.randn(4, 8)
    assert judge_point(Case(POINT, g, -g, tol, torch.bfloat16)).remedy() is None  # cosine -1: nothing accepts it
    assert judge_point(Case(POINT, g, g[:, :4], tol, torch.bfloat16)).remedy() is None  # a shape
    nan = g.clone()
    nan[0, 0] = float("nan")
    assert judge_point(Case(POINT, g, nan, tol, torch.bfloat16)).remedy() is None


# -- per-token damage, experts that follow the candidate's routing, per-expert breakdown, logits --------


def test_a_dropped_token_fails_the_token_check_though_the_whole_tensor_passes() -> None:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(1, 1024, 16, generator=gen)
    c = g + 2e-3 * torch.randn(g.shape, generator=gen)
    c[0, 700] = 0.0  # one token of 1024 lost: diluted to rel_l2 0.03 in the whole
    r = judge_point(Case(POINT, g, c, default_tolerance(torch.bfloat16, "input_norm"), torch.bfloat16))
    assert not r.passed
    assert [(ch.target, ch.name) for ch in r.failed_checks] == [("out", "max_token_rel_l2")]
    assert r.metrics["out"].max_token_rel_l2 == pytest.approx(1.0) and r.metrics["out"].worst_token == 700
    assert r.worst[0] == (700, pytest.approx(1.0))
    assert r.remedy() == "--parity-tol 'layer_1.attention:token_rel_l2=1'"
    text = failure_text(r)
    assert "worst tokens (position, rel error): 700 (1)" in text
    # a near-zero golden token (sin at position 0) is measured against half the median token
    small = g.clone()
    small[0, 3] = 1e-6
    noisy = small + 2e-3 * torch.randn(g.shape, generator=gen)
    tol = default_tolerance(torch.bfloat16, "input_norm")
    assert judge_point(Case(POINT, small, noisy, tol, torch.bfloat16)).passed


def _routing(num_tokens: int, num_experts: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 3
    weights, index = torch.softmax(logits, -1).topk(k, dim=-1)
    return logits, weights, index


def test_experts_leave_out_the_tokens_the_candidate_routed_elsewhere() -> None:
    """A dumped or chained candidate computed its own routing: a token it routed to other experts
    has a different experts output by design, which must neither fail nor be blamed on the experts."""
    point = Point("experts", 0)
    golden_router = _routing(24, 8, 2)
    g = torch.randn(24, 16, generator=torch.Generator().manual_seed(2))
    c = g.clone()
    c[5] = torch.randn(16)  # token 5 went to other experts
    cand_index = golden_router[2].clone()
    cand_index[5] = torch.tensor([x for x in range(8) if x not in golden_router[2][5].tolist()][:2])
    cand_router = (golden_router[0], golden_router[1], cand_index)
    tol = default_tolerance(torch.bfloat16, "experts")
    r = judge_point(Case(point, g, c, tol, torch.bfloat16, golden_router=golden_router, candidate_router=cand_router))
    assert r.passed, failure_text(r)
    assert r.excluded_tokens == [5] and "1 token(s) whose routing flipped are excluded" in r.notes[0]
    # without the candidate's routing (an isolated replay takes the golden's), token 5 is a failure
    r = judge_point(Case(point, g, c, tol, torch.bfloat16, golden_router=golden_router))
    assert not r.passed and r.worst[0][0] == 5 and not r.notes
    assert "max_token_rel_l2" in [ch.name for ch in r.failed_checks]


def test_one_broken_expert_of_64_is_named() -> None:
    point = Point("experts", 3)
    logits, weights, index = _routing(256, 64, 8, seed=3)
    counts = index.flatten().bincount(minlength=64)
    rare = int(torch.where(counts > 0, counts, 10**6).argmin())  # the used expert with the fewest tokens
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(256, 32, generator=gen)
    c = g + 2e-3 * torch.randn(g.shape, generator=gen)
    served = (index == rare).any(dim=-1)
    c[served] = 0.4 * g[served]  # its tokens lose most of their output
    r = judge_point(Case(point, g, c, default_tolerance(torch.bfloat16, "experts"), torch.bfloat16,
                    golden_router=(logits, weights, index)))  # fmt: skip
    assert not r.passed
    expert, tokens, err, share = r.worst_experts[0]
    assert (expert, tokens) == (rare, int(counts[rare])) and err == pytest.approx(0.6, rel=0.05)
    assert all(e != rare and s < share for e, _, _, s in r.worst_experts[1:])
    text = failure_text(r)
    assert f"worst experts (each one's own share of the error; rel error over its tokens): #{rare} " in text
    assert f"(rel 0.6 over {tokens} tokens)" in text.split("worst experts")[1].replace("\n    ", " ")
    row = point_row(r).to_json()
    assert row["worst_experts"][0][:2] == [rare, int(counts[rare])]


def test_logits_fail_on_a_real_top1_flip_and_report_a_tie() -> None:
    point = Point("logits")
    tol = default_tolerance(torch.bfloat16, "logits")
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(1, 12, 256, generator=gen)
    top = g[0].topk(2, dim=-1)
    c = g.clone()
    # token 4: the runner-up is raised just above the top-1 while the golden gap is within rounding
    g[0, 4, top.indices[4, 1]] = top.values[4, 0] - 1e-3
    c[0, 4, top.indices[4, 1]] = top.values[4, 0] + 1e-3
    r = judge_point(Case(point, g, c, tol, torch.bfloat16))
    assert r.passed, failure_text(r)
    assert r.logits is not None and [f.token for f in r.logits.top1.ties] == [4] and not r.logits.top1.flips
    assert r.logits.top1_agreement == pytest.approx(11 / 12)
    # token 7: the candidate's choice lost by a clear margin in the golden: a real flip
    c[0, 7, top.indices[7, 1]] = top.values[7, 0] + 1.0
    r = judge_point(Case(point, g, c, tol, torch.bfloat16))
    assert not r.passed and [(ch.target, ch.name) for ch in r.failed_checks] == [("top1", "flip_share")]
    assert [f.token for f in r.logits.top1.flips] == [7]
    text = failure_text(r)
    assert "next token: top-1 agreement 83.3% of 12 tokens (real flips 1, ties 1)" in text
    assert f"token 7: golden top-1 {int(top.indices[7, 0])}, candidate {int(top.indices[7, 1])}" in text
    assert point_row(r).to_json()["logits"]["top1"]["flipped_tokens"] == [7]


def test_the_remedy_is_one_line_that_pastes_as_it_stands() -> None:
    """However long the point id and however many keys, the `--parity-tol` suggestion is one line,
    never cut inside a token (it was `max_fl ip_share`), and what it says parses."""
    point = Point.parse("step_3.layer_57.router", module="m", order=0, router_kind="softmax")
    tol = default_tolerance(torch.bfloat16, "router")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen)
    weights, index = logits.softmax(-1).topk(2)
    bad = logits + torch.randn(64, 8, generator=gen)
    bad_weights, bad_index = bad.softmax(-1).topk(2)
    r = judge_point(Case(point, (logits, weights, index), (bad, bad_weights, bad_index), tol, torch.bfloat16))
    remedy = r.remedy()
    assert not r.passed and remedy is not None and len(remedy) > 60
    text = failure_text(r)
    line = next(li for li in text.splitlines() if "to accept this result" in li)
    assert line == f"  to accept this result: {remedy}"
    pattern, values = parse_override(remedy.removeprefix("--parity-tol ").strip("'"))
    assert pattern == "step_3.layer_57.router" and len(values) >= 2  # e.g. max_flip_share and rel_l2


def test_the_noise_floor_is_an_eighth_of_the_dtypes_epsilon() -> None:
    """A noise ratio counts the reference's own error as at least eps(dtype) / NOISE_FLOOR_EPS; a dtype
    without rounding has the caller's default (0.0 unless given)."""
    assert NOISE_FLOOR_EPS == 8.0
    assert noise_floor(torch.bfloat16) == torch.finfo(torch.bfloat16).eps / 8.0 == 2.0**-10
    assert noise_floor(torch.float32) == 2.0**-26
    assert noise_floor(torch.float16, default=1e-6) == torch.finfo(torch.float16).eps / 8.0
    assert noise_floor(torch.int64) == 0.0
    assert noise_floor(torch.bool, default=1e-6) == 1e-6
