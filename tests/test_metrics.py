"""Tests for pytest_moe_parity.judge.metrics."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_within_rounding, rounding_bound

from pytest_moe_parity.judge.metrics import (
    RoutingMetrics,
    TensorMetrics,
    compare_logits,
    compare_routing,
    compare_tensors,
    per_token_error,
    row_sums,
    scatter_topk,
    tie_tolerance,
    worst_tokens,
)

FLOAT_FIELDS = ("cosine", "pearson", "rel_l2", "snr_db", "max_abs", "mean_abs", "max_rel", "within_tol")
REPO_ROOT = Path(__file__).resolve().parents[1]


def assert_failsafe(m: TensorMetrics) -> None:
    assert m.cosine == 0.0
    assert m.pearson == 0.0
    assert m.rel_l2 == math.inf
    assert m.max_abs == math.inf
    assert m.max_rel == math.inf
    assert m.mean_abs == math.inf
    assert m.snr_db == -math.inf


def assert_metrics_close(a: TensorMetrics, b: TensorMetrics, rel: float) -> None:
    for name in FLOAT_FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        assert va == pytest.approx(vb, rel=rel, abs=1e-300), name
    for name in ("numel", "nan_golden", "nan_candidate", "inf_golden", "inf_candidate", "first_nonfinite"):
        assert getattr(a, name) == getattr(b, name), name


def reference(g: torch.Tensor, c: torch.Tensor, atol: float = 1e-3, rtol: float = 1e-3) -> dict[str, float]:
    """The definitions of compare_tensors' docstring, computed directly in float64 on whole tensors."""
    g64, c64 = g.detach().double().flatten(), c.detach().double().flatten()
    d = c64 - g64
    gm, cm = g64 - g64.mean(), c64 - c64.mean()
    floor = 1e-3 * float(g64.abs().max())
    return {
        "cosine": float((g64 @ c64) / (g64.norm() * c64.norm())),
        "pearson": float((gm @ cm) / (gm.norm() * cm.norm())),
        "rel_l2": float(d.norm() / g64.norm()),
        "snr_db": float(10 * torch.log10((g64 @ g64) / (d @ d))),
        "max_abs": float(d.abs().max()),
        "mean_abs": float(d.abs().mean()),
        "max_rel": float((d.abs() / g64.abs().clamp(min=floor)).max()),
        "within_tol": float((d.abs() <= atol + rtol * g64.abs()).double().mean()),
    }


# The documented accuracy (compare_tensors' docstring): float32 sums per chunk, float64 across chunks.
# torch's CPU sums are cascaded in vector-wide lanes whose width and order depend on the CPU (AVX2,
# AVX-512, Arm), so float32 rounding grows with the log of a chunk's length: 22 steps for the largest
# chunk (1 << 22 elements). About 5e-6 relative, where one x86 machine gives under 1e-6.
SUM_REL = rounding_bound(torch.float32, 1.0, steps=22)
# one float32 subtraction, and a division for max_rel: each rounds once
ELEMENT_REL = rounding_bound(torch.float32, 1.0, steps=1)


def assert_accurate(m: TensorMetrics, ref: dict[str, float]) -> None:
    """The documented accuracy: float32 sums per chunk, float64 across chunks, cosine and pearson via
    the law of cosines (absolute error ~SUM_REL * (1 - value) + SUM_REL * rel_l2)."""
    for name in ("cosine", "pearson"):
        bound = SUM_REL * (1 - ref[name]) + SUM_REL * ref["rel_l2"] + 1e-12
        assert abs(getattr(m, name) - ref[name]) <= bound, (name, getattr(m, name), ref[name], bound)
    assert m.rel_l2 == pytest.approx(ref["rel_l2"], rel=SUM_REL)
    # 10 log10 of a ratio of two sums, each SUM_REL off: 10 / ln 10 dB per unit of relative error
    assert m.snr_db == pytest.approx(ref["snr_db"], abs=10 / math.log(10) * 2 * SUM_REL)
    for name, rel in (("max_abs", ELEMENT_REL), ("mean_abs", SUM_REL), ("max_rel", ELEMENT_REL)):
        assert getattr(m, name) == pytest.approx(ref[name], rel=rel), name
    # a share of elements, not a rounding: an element within rounding of atol + rtol|g| may count
    # either way (1e-6 of the 3M elements of the largest case: 3 elements)
    assert m.within_tol == pytest.approx(ref["within_tol"], abs=1e-6)


# ------------------------------------------------------------------------------------------ compare_tensors


def test_hand_computed_values() -> None:
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    c = torch.tensor([1.0, 2.0, 3.0, 5.0])
    m = compare_tensors(g, c, atol=0.5, rtol=0.1)

    # <g,c> = 1 + 4 + 9 + 20 = 34, ||g||^2 = 30, ||c||^2 = 39
    assert m.cosine == pytest.approx(34 / math.sqrt(30 * 39), rel=1e-12)
    # means 2.5 / 2.75; centred: g' = [-1.5, -.5, .5, 1.5], c' = [-1.75, -.75, .25, 2.25]
    cov = 1.5 * 1.75 + 0.5 * 0.75 + 0.5 * 0.25 + 1.5 * 2.25  # 6.5
    var_g = 2 * (1.5**2 + 0.5**2)  # 5
    var_c = 1.75**2 + 0.75**2 + 0.25**2 + 2.25**2  # 8.75
    assert m.pearson == pytest.approx(cov / math.sqrt(var_g * var_c), rel=1e-12)
    assert m.rel_l2 == pytest.approx(1 / math.sqrt(30), rel=1e-12)
    assert m.snr_db == pytest.approx(10 * math.log10(30 / 1), rel=1e-12)
    assert m.max_abs == 1.0
    assert m.mean_abs == 0.25
    assert m.max_rel == pytest.approx(1 / 4)  # floor 1e-3 * 4 does not bite
    # thresholds 0.5 + 0.1 * |g| = .6, .7, .8, .9 -> only the last element (|d| = 1) fails
    assert m.within_tol == 0.75
    assert compare_tensors(g, c, atol=0.5, rtol=0.2).within_tol == 1.0  # last threshold 0.5 + 0.8 = 1.3
    assert (m.numel, m.shape_match, m.atol, m.rtol) == (4, True, 0.5, 0.1)
    assert (m.shape_golden, m.dtype_golden, m.dtype_candidate) == ((4,), "float32", "float32")
    assert m.first_nonfinite is None
    assert (m.nan_golden, m.nan_candidate, m.inf_golden, m.inf_candidate) == (0, 0, 0, 0)


def test_max_rel_floor_near_zero() -> None:
    g = torch.tensor([1000.0, 1e-9, -500.0])
    c = torch.tensor([1000.0, 0.5, -500.0])
    # floor = 1e-3 * 1000 = 1 -> the near-zero element is measured against 1, not 1e-9 (the float32
    # difference 0.5 - 1e-9 rounds to 0.5)
    assert compare_tensors(g, c).max_rel == pytest.approx(0.5 - 1e-9, rel=1e-7)
    assert compare_tensors(g.double(), c.double()).max_rel == pytest.approx(0.5 - 1e-9, rel=1e-12)


def test_identical_tensors() -> None:
    x = torch.randn(5, 7)
    m = compare_tensors(x, x.clone())
    assert (m.cosine, m.rel_l2, m.snr_db, m.max_abs, m.max_rel, m.within_tol) == (1.0, 0.0, math.inf, 0, 0, 1)
    assert m.pearson == pytest.approx(1.0, abs=1e-12)


def test_both_all_zero() -> None:
    m = compare_tensors(torch.zeros(3, 4), torch.zeros(3, 4))
    assert (m.cosine, m.pearson, m.rel_l2, m.snr_db) == (1.0, 1.0, 0.0, math.inf)
    assert (m.max_abs, m.mean_abs, m.max_rel, m.within_tol) == (0.0, 0.0, 0.0, 1.0)


def test_golden_zero_candidate_nonzero() -> None:
    m = compare_tensors(torch.zeros(4), torch.tensor([0.0, 1.0, -2.0, 0.0]))
    assert (m.cosine, m.rel_l2, m.snr_db, m.max_rel) == (0.0, math.inf, -math.inf, math.inf)
    assert m.pearson == 0.0  # golden constant, candidate not
    assert m.max_abs == 2.0
    assert m.within_tol == 0.5


def test_constant_tensors_pearson() -> None:
    three = torch.full((6,), 3.0)
    assert compare_tensors(three, three.clone()).pearson == 1.0
    assert compare_tensors(three, three + 1e-4).pearson == 1.0  # constant and equal within atol
    assert compare_tensors(three, three + 0.5).pearson == 0.0  # constant, not equal
    assert compare_tensors(three, torch.arange(6.0)).pearson == 0.0  # exactly one constant
    assert compare_tensors(torch.arange(6.0), three).pearson == 0.0


def test_pearson_large_offset_no_cancellation() -> None:
    x = torch.randn(4096, dtype=torch.float64)
    assert compare_tensors(x, 2 * x + 1e6).pearson == pytest.approx(1.0, abs=1e-9)
    assert compare_tensors(x, 2 * x + 1e6, chunk_elems=100).pearson == pytest.approx(1.0, abs=1e-9)
    assert compare_tensors(x + 1e6, -x + 1e6).pearson == pytest.approx(-1.0, abs=1e-9)


def test_nan_in_candidate_3d() -> None:
    g = torch.randn(3, 4, 5)
    c = g.clone()
    c[1, 2, 3] = float("nan")
    c[2, 0, 1] = float("inf")
    m = compare_tensors(g, c)
    assert m.first_nonfinite == (1, 2, 3)
    assert (m.nan_golden, m.nan_candidate, m.inf_golden, m.inf_candidate) == (0, 1, 0, 1)
    assert_failsafe(m)
    assert m.within_tol == pytest.approx(58 / 60)
    # the NaN metrics can never silently pass a threshold check
    assert not m.rel_l2 <= 1e-2
    assert not m.cosine >= 0.99
    assert compare_tensors(g, c, chunk_elems=7).first_nonfinite == (1, 2, 3)


def test_nan_on_both_sides_still_fails() -> None:
    g = torch.tensor([1.0, float("nan"), 3.0])
    m = compare_tensors(g, g.clone())
    assert_failsafe(m)
    assert (m.nan_golden, m.nan_candidate) == (1, 1)
    assert m.first_nonfinite is None  # not finite in golden
    assert m.within_tol == pytest.approx(2 / 3)


def test_inf_both_sides_same_sign_is_equal() -> None:
    g = torch.tensor([1.0, math.inf, -math.inf, 4.0])
    m = compare_tensors(g, g.clone())
    assert (m.cosine, m.rel_l2, m.max_abs, m.max_rel, m.within_tol) == (1.0, 0.0, 0.0, 0.0, 1.0)
    assert m.snr_db == math.inf
    assert (m.inf_golden, m.inf_candidate, m.first_nonfinite) == (2, 2, None)


def test_inf_opposite_sign_fails() -> None:
    m = compare_tensors(torch.tensor([1.0, math.inf]), torch.tensor([1.0, -math.inf]))
    assert_failsafe(m)
    assert m.within_tol == 0.5
    assert m.first_nonfinite is None


def test_inf_one_side() -> None:
    m = compare_tensors(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, math.inf, 3.0]))
    assert_failsafe(m)
    assert m.first_nonfinite == (1,)
    assert m.within_tol == pytest.approx(2 / 3)
    m = compare_tensors(torch.tensor([1.0, math.inf, 3.0]), torch.tensor([1.0, 2.0, 3.0]))
    assert_failsafe(m)
    assert (m.inf_golden, m.inf_candidate, m.first_nonfinite) == (1, 0, None)


def test_bf16_candidate_vs_fp32_golden() -> None:
    torch.manual_seed(0)
    g = torch.randn(20_000)
    m = compare_tensors(g, g.to(torch.bfloat16))
    assert (m.dtype_golden, m.dtype_candidate) == ("float32", "bfloat16")
    assert 0 < m.rel_l2 < 4e-3  # bf16 has 8 mantissa bits: relative rounding <= 2^-9
    assert m.cosine > 0.99999
    m16 = compare_tensors(g.to(torch.float16), g)
    assert m16.dtype_golden == "float16"
    assert 0 < m16.rel_l2 < 5e-4


def test_int_bool_scalar_and_empty() -> None:
    m = compare_tensors(torch.tensor([True, False, True]), torch.tensor([1, 0, 1]))
    assert (m.dtype_golden, m.dtype_candidate, m.rel_l2, m.within_tol) == ("bool", "int64", 0.0, 1.0)
    m = compare_tensors(torch.tensor(2.0), torch.tensor(2.5))
    assert (m.shape_golden, m.numel, m.rel_l2, m.max_abs, m.cosine) == ((), 1, 0.25, 0.5, 1.0)
    assert m.pearson == 0.0  # both constant but not equal within tolerance
    m = compare_tensors(torch.tensor(2.0), torch.tensor(float("nan")))
    assert m.first_nonfinite == ()
    assert_failsafe(m)
    m = compare_tensors(torch.empty(0, 3), torch.empty(0, 3))
    assert (m.numel, m.cosine, m.pearson, m.rel_l2, m.within_tol) == (0, 1.0, 1.0, 0.0, 1.0)


def test_shape_mismatch() -> None:
    g = torch.randn(2, 3)
    c = torch.randn(3, 2)
    c[0, 0] = float("nan")
    c[1, 1] = math.inf
    m = compare_tensors(g, c)
    assert not m.shape_match
    assert (m.shape_golden, m.shape_candidate, m.numel) == ((2, 3), (3, 2), 0)
    assert_failsafe(m)
    assert m.within_tol == 0.0
    assert (m.nan_golden, m.nan_candidate, m.inf_golden, m.inf_candidate) == (0, 1, 0, 1)


def test_non_contiguous_matches_contiguous() -> None:
    torch.manual_seed(1)
    g = torch.randn(48, 64)
    c = g + 1e-3 * torch.randn(48, 64)
    c[5, 7] = float("nan")
    ref = compare_tensors(g.t().contiguous(), c.t().contiguous())
    assert ref.first_nonfinite == (7, 5)
    rel = rounding_bound(torch.float64, 1.0, steps=48 * 64)  # float64 sums of 3072 terms, chunked otherwise
    for chunk in (1 << 22, 100, 7):  # the NaN makes the rest an exact float64 path
        assert_metrics_close(compare_tensors(g.t(), c.t(), chunk_elems=chunk), ref, rel=rel)
    g3 = torch.randn(4, 5, 6)
    c3 = g3 + 1e-2 * torch.randn(4, 5, 6)
    expected = reference(g3.permute(2, 0, 1), c3.permute(2, 0, 1))
    assert_accurate(compare_tensors(g3.permute(2, 0, 1), c3.permute(2, 0, 1), chunk_elems=4), expected)
    assert_accurate(compare_tensors(g3.permute(2, 0, 1).contiguous(), c3.permute(2, 0, 1)), expected)
    # mixed: contiguous golden, non-contiguous candidate; and a stride-0 expanded tensor
    g2, c2 = torch.randn(48, 64), torch.randn(48, 64)
    assert_accurate(compare_tensors(g2.t().contiguous(), c2.t(), chunk_elems=33), reference(g2.t(), c2.t()))
    row = torch.randn(1, 300)
    m = compare_tensors(row.expand(5, 300), row.repeat(5, 1) * 1.01, chunk_elems=64)
    # 1.01 x rounds by half an ulp of x, which is 100 ulps of the 1 % difference
    assert (m.numel, m.rel_l2) == (1500, pytest.approx(0.01, rel=rounding_bound(torch.float32, 100, steps=1)))


def test_chunking_keeps_the_documented_accuracy() -> None:
    torch.manual_seed(2)
    g = torch.randn(3001) * 3 + 0.5
    c = (g + 0.01 * torch.randn(3001)).to(torch.bfloat16)
    expected = reference(g, c)
    for chunk in (1 << 22, 1000, 7):
        assert_accurate(compare_tensors(g, c, chunk_elems=chunk), expected)


@pytest.mark.parametrize("threads, chunk", [(1, 1 << 18), (2, 1 << 18), (16, 1 << 21), (64, 1 << 21)])
def test_the_chunk_grows_with_the_threads_and_keeps_the_accuracy(threads: int, chunk: int, monkeypatch) -> None:
    """Beyond two threads each keeps its share of a chunk (2^17 elements): fewer parallel regions of
    torch's threads, the figures as accurate (a 2^22-element pair in chunks of 2^21)."""
    from pytest_moe_parity.judge import tensors

    @contextlib.contextmanager
    def fitted(numel):
        yield threads

    walked = []
    chunks = tensors.chunks
    monkeypatch.setattr(tensors, "fitted_threads", fitted)
    monkeypatch.setattr(tensors, "chunks", lambda ts, n: walked.append(n) or chunks(ts, n))
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(1 << 22, generator=gen) * 2 + 0.25
    c = g + 1e-3 * torch.randn(1 << 22, generator=gen)
    assert_accurate(compare_tensors(g, c), reference(g, c))
    assert walked[-1] == chunk  # (the first walk: the golden's peak, in one piece)


@pytest.mark.parametrize(
    "case",
    ["fp32 close", "bf16 candidate", "fp32 vs fp32 rounding", "offset", "anti-correlated", "sparse", "float64"],
)
def test_accuracy_against_a_float64_reference(case: str) -> None:
    """Every figure against its float64 definition, over many chunks (3M elements, 12 chunks)."""
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(3_000_000, generator=gen)
    noise = torch.randn(3_000_000, generator=gen)
    c = {
        "fp32 close": lambda: g + 1e-3 * noise,
        "bf16 candidate": lambda: g.to(torch.bfloat16),
        "fp32 vs fp32 rounding": lambda: g + 1e-7 * g * noise,
        "offset": lambda: g + 40.0 + 1e-2 * noise,
        "anti-correlated": lambda: -g + 1e-2 * noise,
        "sparse": lambda: torch.where(noise > 1.5, g * 1.5, g),
        "float64": lambda: (g + 1e-3 * noise).double(),
    }[case]()
    golden = g + 40.0 if case == "offset" else g
    m = compare_tensors(golden, c, atol=1e-2, rtol=1.6e-2)
    assert_accurate(m, reference(golden, c, atol=1e-2, rtol=1.6e-2))


def test_no_metric_is_ever_nan() -> None:
    nan, inf = float("nan"), math.inf
    cases = [
        (torch.zeros(3), torch.zeros(3)),
        (torch.zeros(3), torch.ones(3)),
        (torch.full((3,), nan), torch.full((3,), nan)),
        (torch.full((3,), inf), torch.full((3,), -inf)),
        (torch.tensor([inf, 1.0]), torch.tensor([inf, 1.0])),
        (
            torch.tensor([1e300, -1e300], dtype=torch.float64),
            torch.tensor([1e300, 1e300], dtype=torch.float64),
        ),
        (torch.empty(0), torch.empty(0)),
    ]
    for g, c in cases:
        data = compare_tensors(g, c).to_dict()
        for name in FLOAT_FIELDS:
            assert data[name] != "nan", (name, g, c)


def test_to_dict_is_json_safe() -> None:
    g = torch.randn(2, 2)
    c = g.clone()
    c[1, 0] = float("nan")
    data = compare_tensors(g, c).to_dict()
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text) == data
    assert data["rel_l2"] == "inf"
    assert data["snr_db"] == "-inf"
    assert data["first_nonfinite"] == [1, 0]
    assert data["shape_golden"] == [2, 2]


def test_requires_grad_inputs() -> None:
    g = torch.randn(10, requires_grad=True)
    m = compare_tensors(g, g * 1.001)
    assert m.rel_l2 == pytest.approx(1e-3, rel=rounding_bound(torch.float32, 1000, steps=1))  # 1.001 x: see above


def test_invalid_arguments() -> None:
    with pytest.raises(TypeError):
        compare_tensors([1.0], torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        compare_tensors(torch.ones(1), torch.ones(1), chunk_elems=0)


def _skip_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Inputs of many 1000-element chunks for the work compare_tensors leaves out."""
    nan, inf = float("nan"), math.inf
    gen = torch.Generator().manual_seed(11)
    g = torch.randn(20_000, generator=gen)
    noise = torch.randn(20_000, generator=gen)
    close = g + 1e-3 * noise
    outlier = close.clone()
    small = int(g[:1000].abs().argmin())  # measured against the floor
    outlier[small] = g[small] + 0.05  # the largest max_rel, in the first chunk: the others need not divide
    # chunks alternately all within though max|d| > atol (|d| = 0.9 (atol + rtol g)) and some just outside
    # (|d| = 1.2 atol: outside where |g| < 0.2): a max settles the first kind, counting the second
    even = (torch.arange(20_000) // 1000) % 2 == 0
    alternating = g + torch.where(even, 0.9e-3 * g + 0.9e-3, torch.full_like(g, 1.2e-3))
    with_nan = close.clone()
    with_nan[12_345] = nan
    g_inf, c_inf = g.clone(), close.clone()
    g_inf[[10, 15_000]] = c_inf[[10, 15_000]] = torch.tensor([inf, -inf])  # the same Inf: not poisoned
    g_huge, c_huge = g.clone(), close.clone()
    g_huge[7000:7100] *= 1e20  # float32 squares overflow: that chunk is redone in float64
    c_huge[7000:7100] *= 1e20
    zeros = g.clone()
    zeros[:9000] = 0.0
    ints = torch.randint(-50, 50, (20_000,), generator=gen)
    return {
        "fp32 close": (g, close),
        "fp32 outlier": (g, outlier),
        "alternating": (g, alternating),
        "nan": (g, with_nan),
        "same inf": (g_inf, c_inf),
        "float64 chunk": (g_huge, c_huge),
        "zero chunks": (zeros, close),
        "all zero golden": (torch.zeros(20_000), close),
        "bf16": (g, outlier.bfloat16()),
        "fp16": (g.half(), outlier),
        "int": (ints, ints + (torch.arange(20_000) % 3 == 0)),
        "float64": (g.double(), outlier.double()),
    }


@pytest.mark.parametrize("case", list(_skip_cases()))
def test_skipped_work_changes_no_figure(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose max|d| / floor cannot raise max_rel is not divided, and after a chunk with elements
    outside the tolerance the next is counted without a max first: every figure equals the one of the
    pass that divides and counts every chunk, bit for bit."""
    from pytest_moe_parity.judge.tensors import _Accumulator

    g, c = _skip_cases()[case]
    decisions: list[bool] = []
    rel_needed = _Accumulator._rel_needed
    monkeypatch.setattr(
        _Accumulator, "_rel_needed", lambda self, *args: decisions.append(rel_needed(self, *args)) or decisions[-1]
    )
    skipping = compare_tensors(g, c, atol=1e-3, rtol=1e-3, chunk_elems=1000)
    monkeypatch.setattr(_Accumulator, "_rel_needed", lambda self, *args: self.rel_floor > 0.0)
    monkeypatch.setattr(_Accumulator, "_count_within", lambda self, excess: int(excess.le_(self.atol).sum()))
    every_chunk = compare_tensors(g, c, atol=1e-3, rtol=1e-3, chunk_elems=1000)
    assert skipping == every_chunk
    if case in ("fp32 outlier", "bf16", "fp16", "float64"):
        assert decisions.count(False) >= 10, decisions  # the skip is taken


def test_a_skipped_division_could_not_have_raised_max_rel() -> None:
    """The skip compares max|d| / floor with the largest max_rel seen, which a float64 chunk may have left
    between two float32 values: a float32 quotient that rounds up above it must still be taken."""
    from pytest_moe_parity.judge.tensors import _Accumulator

    floor32 = float(torch.tensor(0.3))  # the floor as a float32 chunk holds it
    for a in torch.arange(1, 200, dtype=torch.float32) / 7:
        q32, q64 = float(a / torch.tensor(floor32)), float(a) / floor32
        if q32 > q64:
            break
    else:
        pytest.fail("no float32 quotient rounds up")
    acc = _Accumulator(1e-3, 1e-3, 0.3, 4, torch.device("cpu"))
    acc.max_rel = q64  # as a float64 chunk before would leave it
    acc.update(0, torch.zeros(1), a.reshape(1))  # |g| = 0: measured against the floor
    assert acc.max_rel == q32


def test_the_golden_peak_takes_one_read_and_skips_nonfinite(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_moe_parity.judge.tensors import _finite_abs_max

    x = torch.randn(10_000)
    x[17] = -50.0
    reads: list[int] = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: reads.append(t.numel()) or aminmax(t))
    assert _finite_abs_max(x, 1000) == 50.0
    assert reads == [10_000]  # contiguous: one reduction over all of it, no copy
    x[5000], x[9000] = float("nan"), math.inf
    assert _finite_abs_max(x, 1000) == 50.0
    assert _finite_abs_max(x.reshape(100, 100).t(), 64) == 50.0  # non-contiguous: chunk by chunk
    assert _finite_abs_max(torch.tensor([float("nan"), -math.inf]), 1) == 0.0
    assert _finite_abs_max(torch.tensor([3, -7, 2]), 2) == 7.0
    assert _finite_abs_max(torch.tensor([True, False]), 2) == 1.0
    assert _finite_abs_max(torch.tensor([0.5, -2.0], dtype=torch.bfloat16), 1) == 2.0


def test_the_benchmark_names_the_cpu_its_features_and_torchs_kernels() -> None:
    """A ratio to one read moves with the CPU's vectors (5x on an AVX-512 EPYC, 11.6x on an AVX2-only
    one): bench_metrics.py's header says which CPU gave it."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    argv = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_metrics.py"), "--mb", "1", "--repeat", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert header.endswith(f"; torch kernels {torch.backends.cpu.get_cpu_capability()}"), header
    if os.path.exists("/proc/cpuinfo"):
        text = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
        assert model in header
        for feature in ("avx2", "avx512f", "amx_tile"):
            assert (f" {feature}" in header or f"({feature}" in header) == (feature in flags), (feature, header)


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    torch.set_num_threads(1)
    from pytest_moe_parity.judge.metrics import compare_tensors

    def peak():
        # VmHWM is this address space's high-water mark; ru_maxrss would carry the parent's peak
        # across fork and exec
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))

    def current():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()

    compare_tensors(torch.randn(1000), torch.randn(1000))  # warm up kernels and allocator
    n = int(sys.argv[1])
    before = current()
    g = torch.randn(n)
    c = torch.randn(n)
    c.mul_(1e-2).add_(g)  # in place: no temporaries while creating the inputs
    with_inputs = current()
    m = compare_tensors(g, c, chunk_elems=1 << 18)
    after = peak()
    print(before, with_inputs, after, m.rel_l2)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_stays_chunk_sized() -> None:
    n = 25_000_000  # 2 x 100 MB float32; one float64 copy of an input would add 200 MB
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(n)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    before, with_inputs, after, rel_l2 = (float(x) for x in proc.stdout.split())
    input_bytes = 2 * 4 * n
    assert with_inputs - before > 0.5 * input_bytes  # the measurement does see the inputs
    assert after - before < 1.5 * input_bytes, f"compare_tensors grew RSS by {(after - with_inputs) / 2**20:.0f} MiB"
    assert rel_l2 == pytest.approx(1e-2, rel=1e-2)  # the script's noise is random at 1e-2: a statistic, not rounding


# ------------------------------------------------------------------------------------------ per-token error


def test_per_token_error_finds_corrupted_token() -> None:
    torch.manual_seed(3)
    g = torch.randn(1, 16, 32)
    c = g + 1e-4 * torch.randn(1, 16, 32)
    c[0, 5] += 0.5 * torch.randn(32)
    err = per_token_error(g, c)
    assert err.shape == (16,)
    assert err.dtype == torch.float64
    expected_5 = (c[0, 5].double() - g[0, 5].double()).norm() / g[0, 5].double().norm()
    # per_token_error sums in float64 (32 terms): float64 rounding, in any order
    assert float(err[5]) == pytest.approx(float(expected_5), rel=rounding_bound(torch.float64, 1.0, steps=32))
    assert int(err.argmax()) == 5
    worst = worst_tokens(err, n=3)
    assert worst[0] == (5, float(err[5]))
    assert len(worst) == 3
    assert worst[1][1] >= worst[2][1]


def test_per_token_error_degenerate_and_token_dim() -> None:
    g = torch.zeros(3, 4)
    g[1] = 1.0
    c = g.clone()
    c[2, 0] = 1.0
    c[1, 3] = float("nan")
    err = per_token_error(g, c, token_dim=0)
    assert err.tolist() == [0.0, math.inf, math.inf]  # zero==zero, NaN, zero golden vs non-zero
    # token_dim selects the slicing axis; all other dims are flattened
    x = torch.randn(2, 3, 5)
    y = x.clone()
    y[:, 1, :] *= 1.1
    # 1.1 y rounds by half a float32 ulp of y, which is 10 ulps of the 10 % difference
    want = pytest.approx([0.0, 0.1, 0.0], abs=rounding_bound(torch.float32, 0.1 * 10, steps=1))
    assert per_token_error(x, y, token_dim=1).tolist() == want
    assert worst_tokens(torch.tensor([0.1, 0.3, 0.3, 0.0]), n=10) == [
        (1, pytest.approx(0.3)),
        (2, pytest.approx(0.3)),
        (0, pytest.approx(0.1)),
        (3, 0.0),
    ]
    with pytest.raises(ValueError):
        per_token_error(x, y[:1])


def test_row_sums_over_blocks_of_rows_take_the_careful_path_only_where_a_block_is_not_finite() -> None:
    """Rows of a vocabulary's width go a few at a time (2 rows of 2^19 here: three blocks); a block
    with a NaN or an Inf is summed with them set apart, the finite blocks beside it as they are."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(6, 1 << 19, generator=gen)
    c = g + 1e-3 * torch.randn(6, 1 << 19, generator=gen)
    g[2, 7] = c[2, 7] = float("inf")  # the same Inf on both sides: equal, left out of the sums
    c[3, 9] = float("nan")
    sums = row_sums(g, c, token_dim=0)
    assert sums.bad.tolist() == [False, False, False, True, False, False]
    finite = torch.isfinite(g) & torch.isfinite(c)
    diff = torch.where(finite, c.double() - g.double(), 0.0)
    assert torch.equal(sums.d2[[0, 1, 4, 5]], (diff * diff).sum(dim=1)[[0, 1, 4, 5]])
    assert sums.d2[2] == pytest.approx(float((diff[2] ** 2).sum()), rel=1e-12)
    assert sums.g2.tolist() == pytest.approx(
        torch.where(torch.isfinite(g), g.double(), 0.0).square().sum(dim=1).tolist()
    )


# ------------------------------------------------------------------------------------------ routing


def _routing_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = torch.tensor(
        [
            [0.9, 0.8, 0.1, 0.05],  # token 0: golden {0,1}, candidate {0,2}: gap 0.7 -> real flip
            [0.5, 0.3, 0.2999, 0.1],  # token 1: golden {0,1}, candidate {0,2}: gap 1e-4 -> near tie
            [0.1, 0.2, 0.6, 0.4],  # token 2: same set {2,3} in a different order
        ],
        dtype=torch.float64,
    )
    golden = torch.tensor([[0, 1], [1, 0], [2, 3]])
    candidate = torch.tensor([[2, 0], [0, 2], [3, 2]])
    return scores, golden, candidate


def test_compare_routing_flip_vs_tie() -> None:
    scores, golden, candidate = _routing_case()
    tol = tie_tolerance(scores, torch.bfloat16)
    r = compare_routing(scores, golden, candidate, tolerance=tol)
    assert isinstance(r, RoutingMetrics)
    assert (r.num_tokens, r.top_k, r.num_experts) == (3, 2, 4)
    assert r.flipped_tokens == [0]
    assert [t.token for t in r.ties] == [1]
    assert r.disagreeing_tokens == [0, 1]
    assert r.set_agreement == pytest.approx(1 / 3)
    assert r.flip_share == pytest.approx(1 / 3)
    flip = r.flips[0]
    assert (flip.golden_experts, flip.candidate_experts, flip.is_tie) == ([0, 1], [0, 2], False)
    assert flip.gap == pytest.approx(0.8 - 0.1)
    assert r.ties[0].gap == pytest.approx(1e-4)
    assert r.ties[0].is_tie
    assert r.tie_tolerance == pytest.approx(float(tol.max()))
    # with an fp32 tolerance the 1e-4 margin is far too large to be rounding: both are real flips
    strict = compare_routing(scores, golden, candidate, tolerance=tie_tolerance(scores, torch.float32))
    assert strict.flipped_tokens == [0, 1]
    assert strict.ties == []
    data = r.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["flipped_tokens"] == [0]


def test_compare_routing_order_ignored_and_leading_dims() -> None:
    scores = torch.rand(2, 3, 8)
    top = scores.topk(3, dim=-1).indices
    r = compare_routing(scores, top, top.flip(-1), tolerance=0.0)
    assert r.num_tokens == 6
    assert r.set_agreement == 1.0
    assert r.disagreeing_tokens == []
    assert r.flip_share == 0.0


def test_routing_over_a_vocabulary_is_judged_in_blocks_as_over_a_router(monkeypatch) -> None:
    """Logits are judged as a top-1 routing over the vocabulary: the tie tolerance and the gaps are
    taken a block of tokens at a time (no float64 copy of `[T, V]`), with the figures of the whole
    matrix at once: every token disagreeing, repeated ids, and blocks of one row."""
    from pytest_moe_parity.judge import routing

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(37, 3001, generator=gen)
    scores[5, :7] = -math.inf
    golden = scores.topk(3, dim=-1).indices
    candidate = golden.roll(1, dims=0)  # every token elsewhere
    candidate[4] = golden[4].flip(0)  # the same set in another order
    candidate[6] = golden[6, [0, 0, 1]]  # a repeated id: a set of two
    s64 = scores.to(torch.float64)
    rms = (torch.where(torch.isfinite(s64), s64, 0.0).square().sum(1) / torch.isfinite(s64).sum(1)).sqrt()
    eps = torch.finfo(torch.bfloat16).eps
    whole = 8 * eps * rms + 8 * eps * 1e-6
    assert torch.allclose(tie_tolerance(scores, torch.bfloat16), whole, rtol=1e-12, atol=0)
    g_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, golden, True)
    c_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, candidate, True)
    lost = torch.where(g_mask & ~c_mask, s64, math.inf).amin(1)
    gained = torch.where(c_mask & ~g_mask, s64, -math.inf).amax(1)
    expected = {t: float(lost[t] - gained[t]) for t in (g_mask != c_mask).any(1).nonzero().flatten().tolist()}
    original = routing.token_blocks
    for elements in (1, 5000, 1 << 20):  # a row a block, two rows, the whole matrix
        monkeypatch.setattr(routing, "token_blocks", lambda tokens, width, n=elements: original(tokens, width, n))
        r = compare_routing(scores, golden, candidate, tolerance=whole)
        got = {f.token: f.gap for f in r.flips + r.ties}
        assert got.keys() == expected.keys() and 4 not in got and 6 in got
        assert all(got[t] == pytest.approx(expected[t], rel=0, abs=0) for t in got)


def test_tie_tolerance_scales_with_dtype() -> None:
    scores = torch.tensor([[3.0, 4.0], [0.0, 0.0], [3.0, -math.inf]])
    bf16 = tie_tolerance(scores, torch.bfloat16)
    fp32 = tie_tolerance(scores, torch.float32)
    assert bf16.dtype == torch.float64
    assert bf16.shape == (3,)
    assert torch.all(bf16 > fp32)
    eps = torch.finfo(torch.bfloat16).eps
    rms = math.sqrt((9 + 16) / 2)
    assert float(bf16[0]) == pytest.approx(8 * eps * rms + 8 * eps * 1e-6)
    assert float(bf16[1]) == pytest.approx(8 * eps * 1e-6)  # floor
    assert float(bf16[2]) == pytest.approx(8 * eps * 3.0 + 8 * eps * 1e-6)  # -inf (masked) ignored
    assert float(tie_tolerance(scores, torch.bfloat16, factor=4.0)[0]) == pytest.approx(float(bf16[0]) / 2)
    with pytest.raises(ValueError):
        tie_tolerance(scores, torch.int32)


def test_scatter_topk() -> None:
    idx = torch.tensor([[2, 0], [1, 3]])
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    dense = scatter_topk(idx, w, 4)
    expected = torch.tensor([[0.3, 0.0, 0.7, 0.0], [0.0, 0.6, 0.0, 0.4]])
    assert torch.equal(dense, expected)
    assert_within_rounding(dense.sum(-1), w.sum(-1), steps=4, where="row sums")  # 4 entries, any order
    # same experts in another top-k order give the same dense matrix
    assert torch.equal(scatter_topk(idx.flip(-1), w.flip(-1), 4), dense)
    batched = scatter_topk(idx.unsqueeze(0), w.to(torch.bfloat16).unsqueeze(0), 4)
    assert batched.shape == (2, 4)
    assert batched.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        scatter_topk(torch.tensor([[4]]), torch.tensor([[1.0]]), 4)


def test_worst_elements() -> None:
    from pytest_moe_parity.judge.metrics import worst_elements

    g = torch.zeros(3, 4, 5)
    c = g.clone()
    c[1, 2, 3] = 5.0
    c[0, 0, 1] = -2.0
    c[2, 3, 4] = float("nan")
    rows = worst_elements(g, c, 3, chunk_elems=7)  # across chunks
    assert [r[0] for r in rows] == [(2, 3, 4), (1, 2, 3), (0, 0, 1)]
    assert rows[1][1:] == (0.0, 5.0, 5.0) and rows[2][3] == -2.0
    inf = torch.tensor([float("inf"), 1.0])
    assert worst_elements(inf, inf.clone(), 1)[0][3] == 0.0  # equal Infs are no difference
    with pytest.raises(ValueError, match="shape mismatch"):
        worst_elements(torch.zeros(2), torch.zeros(3))


# ------------------------------------------------------------------------ row sums, per expert, logits


def test_group_errors_are_the_rel_l2_over_each_groups_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    c = g + 0.01 * torch.randn(40, 8, generator=gen, dtype=torch.float64)
    groups = torch.randint(0, 6, (40, 2), generator=gen)
    groups[3, 1] = -1  # a row in one group only
    errors, counts = row_sums(g, c, token_dim=0).group_errors(groups, 7)
    for e in range(7):
        rows = (groups == e).any(dim=1)
        assert int(counts[e]) == int((groups == e).sum())
        if not rows.any():
            assert math.isnan(float(errors[e]))
            continue
        # a row listed twice for one group counts twice
        weight = (groups == e).sum(dim=1).to(torch.float64)
        d2 = ((c - g).square().sum(dim=1) * weight).sum()
        g2 = (g.square().sum(dim=1) * weight).sum()
        # float64 sums over the group's rows (40 at most) and their 8 columns, in another order
        assert float(errors[e]) == pytest.approx(float((d2 / g2).sqrt()), rel=rounding_bound(torch.float64, 1, 48))
    c[10, 0] = float("nan")
    errors, _ = row_sums(g, c, token_dim=0).group_errors(groups, 7)
    assert all(float(errors[e]) == math.inf for e in groups[10].tolist())


def test_row_sums_one_block_and_many_blocks_agree_with_float64() -> None:
    """Small tensors take a one-block path, large ones go block by block; both are the float64 sums,
    and a non-finite value or an overflowing sum takes the careful path in either."""
    gen = torch.Generator().manual_seed(11)
    for tokens, inner in ((6, 40), (5, 1 << 19)):  # one block; three blocks of two rows
        g = torch.randn(tokens, inner, generator=gen)
        c = (g + 0.01 * torch.randn(tokens, inner, generator=gen)).bfloat16()
        sums = row_sums(g, c, token_dim=0)
        d = c.double() - g.double()
        # float64 sums of `inner` squares in blocks, against one sum: float64 rounding, log2(inner) cascaded steps
        steps = max(1, inner.bit_length())
        assert_within_rounding(sums.d2, d.square().sum(dim=1), steps=steps, where="d2")
        assert_within_rounding(sums.g2, g.double().square().sum(dim=1), steps=steps, where="g2")
        assert not sums.bad.any()
    g = torch.ones(4, 3)
    c = g.clone()
    g[1, 2] = c[1, 2] = math.inf  # the same Inf on both sides is equal
    c[2, 0] = math.inf
    sums = row_sums(g, c, token_dim=0)
    assert sums.bad.tolist() == [False, False, True, False]
    assert sums.d2[1] == 0.0 and sums.g2[1] == 2.0
    huge = torch.full((3, 2), 1e200, dtype=torch.float64)
    errors = row_sums(huge, -huge, token_dim=0).errors()
    assert errors.tolist() == [math.inf] * 3  # no nan where the sums overflow


def test_floor_share_measures_small_rows_against_the_median() -> None:
    g = torch.ones(5, 4)
    g[0] = 1e-4
    c = g + 1e-3
    plain = per_token_error(g, c, token_dim=0)
    floored = per_token_error(g, c, token_dim=0, floor_share=0.5)
    assert float(plain[0]) == pytest.approx(10.0)
    assert float(floored[0]) == pytest.approx(1e-3 * 2 / 1.0)  # against half of the median norm 2
    assert torch.equal(plain[1:], floored[1:])  # rows above the floor: the same operations on the same values


def test_compare_logits_against_a_float64_reference() -> None:
    gen = torch.Generator().manual_seed(8)
    g = torch.randn(2, 9, 50, generator=gen)
    c = g + 0.3 * torch.randn(2, 9, 50, generator=gen)
    lm = compare_logits(g, c, torch.bfloat16, top_k=5)
    pg = torch.log_softmax(g.double().reshape(18, 50), -1)
    pc = torch.log_softmax(c.double().reshape(18, 50), -1)
    kl = (pg.exp() * (pg - pc)).sum(-1)
    # float64 log-softmax and sums over 50 logits (and the mean over 18 tokens) in another order;
    # KL is a difference of near-equal log-probabilities: 1e3 times their rounding at this 0.3 noise
    rel = rounding_bound(torch.float64, 1e3, steps=50 + 18)
    assert lm.num_tokens == 18 and lm.kl_mean == pytest.approx(float(kl.mean()), rel=rel)
    assert lm.kl_max == pytest.approx(float(kl.max()), rel=rel)
    assert lm.kl_worst[0][0] == int(kl.argmax())
    g5 = g.reshape(18, 50).topk(5).indices.tolist()
    c5 = c.reshape(18, 50).topk(5).indices.tolist()
    overlap = sum(len(set(a) & set(b)) for a, b in zip(g5, c5, strict=True)) / (18 * 5)
    assert lm.top_k_overlap == pytest.approx(overlap)
    agree = (g.reshape(18, 50).argmax(-1) == c.reshape(18, 50).argmax(-1)).double().mean()
    assert lm.top1_agreement == pytest.approx(float(agree))
    assert len(lm.top1.flips) + len(lm.top1.ties) == round((1 - float(agree)) * 18)
    same = compare_logits(g, g.clone(), torch.bfloat16)
    assert same.top1_agreement == 1.0 and same.kl_max == 0.0 and same.top_k_overlap == 1.0
    json.dumps(lm.to_dict())


def _kl_reference(g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    pg, pc = torch.log_softmax(g.double(), -1), torch.log_softmax(c.double(), -1)
    terms = torch.where(pg == -math.inf, 0.0, pg.exp() * (pg - pc))
    return torch.where(torch.isnan(terms.sum(-1)), math.inf, terms.sum(-1))


def test_compare_logits_finite_and_masked_blocks_agree_with_the_reference(monkeypatch) -> None:
    """A block of finite logits takes one exponential of each matrix, a block with a masked vocabulary
    (-inf) the log-softmax way: every token's KL is the float64 reference's either way, a token only
    the candidate rules out has an infinite KL, and a row whose largest value repeats has its first as
    its next token (as argmax), wherever topk put it."""
    from pytest_moe_parity.judge import logits

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(8, 40, generator=gen) * 4
    c = g + 0.05 * torch.randn(8, 40, generator=gen)
    g[2, 5:9] = c[2, 5:9] = -math.inf  # a masked vocabulary in both: rows 2-3's block
    g[6, [3, 11]] = c[6, [3, 11]] = 60.0  # the largest value twice, in both
    g[7, 4], c[7, [20, 4]] = 50.0, 50.0  # the candidate's largest twice: its first is the golden's
    original = logits.token_blocks
    monkeypatch.setattr(logits, "token_blocks", lambda tokens, width: original(tokens, width, 2 * width))
    lm = compare_logits(g, c, torch.float32, top_k=3)
    kl = _kl_reference(g, c)
    rel = rounding_bound(torch.float64, 1e3, steps=40)
    assert lm.kl_mean == pytest.approx(float(kl.mean()), rel=rel)
    assert [t for t, _ in lm.kl_worst] == kl.argsort(descending=True)[:5].tolist()
    assert all(v == pytest.approx(float(kl[t]), rel=rel) for t, v in lm.kl_worst)
    assert lm.top1_agreement == float((g.argmax(-1) == c.argmax(-1)).double().mean()) == 1.0
    same = compare_logits(g, g.clone(), torch.float32)
    assert same.kl_max == 0.0 and same.top1_agreement == 1.0
    c[5, 7] = -math.inf  # a token the candidate alone rules out
    ruled_out = compare_logits(g, c, torch.float32, top_k=3)
    assert ruled_out.kl_worst[0] == (5, math.inf) and ruled_out.kl_max == math.inf
    assert ruled_out.kl_worst[1:] == [(t, v) for t, v in lm.kl_worst if t != 5][:4]  # the other tokens as before


# ------------------------------------------------------------------------------------------ contention


def _spin(seconds: float) -> None:
    import time as clock

    end = clock.monotonic() + seconds
    while clock.monotonic() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads /proc/loadavg")
def test_free_cores_sees_other_processes_busy() -> None:
    """With a spinning process on every core, no core is free (at least one is reported)."""
    import multiprocessing
    import time

    from pytest_moe_parity.host import free_cores

    cores = len(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")
    busy = [ctx.Process(target=_spin, args=(20.0,), daemon=True) for _ in range(cores)]
    for proc in busy:
        proc.start()
    try:
        deadline = time.monotonic() + 10
        seen = []
        while time.monotonic() < deadline:  # the spinners need a moment to start
            seen.append(free_cores())
            if seen[-1] == 1:
                break
            time.sleep(0.05)
        assert seen[-1] == 1, seen
    finally:
        for proc in busy:
            proc.terminate()
            proc.join()


def test_fitted_threads_narrows_to_the_free_cores_and_puts_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_moe_parity import host as contention

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(contention, "_last", (-1.0, None))
        monkeypatch.setattr(contention, "free_cores", lambda: 1)
        with contention.fitted_threads(1 << 20) as used:
            assert used == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with contention.fitted_threads(1000) as used:  # too small to open a parallel region: left alone
            assert used == 2 and torch.get_num_threads() == 2
        monkeypatch.setattr(contention, "_last", (-1.0, None))
        monkeypatch.setattr(contention, "free_cores", lambda: None)  # the machine does not say
        with contention.fitted_threads(1 << 20) as used:
            assert used == 2
    finally:
        torch.set_num_threads(before)


def test_compare_tensors_runs_on_the_cores_left_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside busy processes the metric pass runs on one thread, with the same figures."""
    from pytest_moe_parity import host as contention

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    real_dot = torch.dot
    monkeypatch.setattr(torch, "dot", lambda a, b: (seen.append(torch.get_num_threads()), real_dot(a, b))[1])
    try:
        gen = torch.Generator().manual_seed(3)
        g = torch.randn(300_000, generator=gen)
        c = g + 1e-3 * torch.randn(300_000, generator=gen)
        monkeypatch.setattr(contention, "_last", (-1.0, None))
        monkeypatch.setattr(contention, "free_cores", lambda: 2)
        quiet = compare_tensors(g, c)
        assert seen and set(seen) == {2}
        seen.clear()
        monkeypatch.setattr(contention, "_last", (-1.0, None))
        monkeypatch.setattr(contention, "free_cores", lambda: 1)
        busy = compare_tensors(g, c)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        assert_metrics_close(busy, quiet, rel=SUM_REL)  # one thread's sums vs two threads' (another order)
    finally:
        torch.set_num_threads(before)


def test_a_quantization_floor_widens_next_token_ties_per_token() -> None:
    """Under a quantization floor, a next-token flip whose golden gap is within what the scheme's own error
    moves at that token (`tie_floor`) is a tie; a wider one stays a real flip; without the floor both flip."""
    golden = torch.zeros(3, 8)
    golden[:, 0], golden[:, 1] = 1.0, 0.97  # a gap of 0.03 at every token
    golden[2, 1] = 0.5  # token 2: a gap of 0.5
    candidate = golden.clone()
    candidate[:, 1] = 1.2  # every token's argmax moves to 1
    plain = compare_logits(golden, candidate, torch.float32)
    assert len(plain.top1.flips) == 3 and not plain.top1.ties
    floored = compare_logits(golden, candidate, torch.float32, tie_floor=torch.tensor([0.05, 0.01, 0.05]))
    assert [f.token for f in floored.top1.ties] == [0] and [f.token for f in floored.top1.flips] == [1, 2]
