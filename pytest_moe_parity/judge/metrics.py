"""Numerical parity metrics between golden and candidate tensors, and top-k expert-routing comparison."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..dtypes import dtype_name, json_safe

__all__ = [
    "RoutingFlip",
    "RoutingMetrics",
    "TensorMetrics",
    "compare_routing",
    "compare_tensors",
    "per_token_error",
    "scatter_topk",
    "tie_tolerance",
    "worst_tokens",
]

_F64 = torch.float64
_INF = math.inf
_DEFAULT_CHUNK = 1 << 22
# max_rel measures elements against max(|g|, _REL_FLOOR * max|g|), i.e. 0.1 % of the golden peak.
_REL_FLOOR = 1e-3


# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def _check_tensor(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (dtype {t.dtype})")
    return t.detach()


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major multi-dimensional index of flat position ``flat`` in a tensor of ``shape``."""
    index: list[int] = []
    for size in reversed(shape):
        flat, rem = divmod(flat, size)
        index.append(rem)
    return tuple(reversed(index))


def _blocks(shape: tuple[int, ...], chunk_elems: int) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """Row-major blocks ``t[prefix][start:stop]`` of a non-empty tensor (ndim >= 1), each <= chunk_elems."""
    inner = math.prod(shape[1:])
    if len(shape) == 1 or inner <= chunk_elems:
        rows = max(1, chunk_elems // inner)
        for start in range(0, shape[0], rows):
            yield (), start, min(start + rows, shape[0])
        return
    for i in range(shape[0]):
        for prefix, start, stop in _blocks(shape[1:], chunk_elems):
            yield (i, *prefix), start, stop


def _chunks(tensors: Sequence[torch.Tensor], chunk_elems: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Yield ``(flat_offset, [1-D chunk of each tensor])`` in row-major order; all tensors share one shape.

    Contiguous inputs are sliced as flat views (no copy). Otherwise blocks along the leading dimensions
    are reshaped one at a time, so a non-contiguous tensor is never copied as a whole.
    """
    numel = tensors[0].numel()
    if numel == 0:
        return
    if all(t.is_contiguous() for t in tensors):
        flats = [t.reshape(-1) for t in tensors]
        for start in range(0, numel, chunk_elems):
            yield start, [f[start : start + chunk_elems] for f in flats]
        return
    offset = 0
    for prefix, start, stop in _blocks(tuple(tensors[0].shape), chunk_elems):
        parts = [t[prefix][start:stop].reshape(-1) for t in tensors]
        yield offset, parts
        offset += parts[0].numel()


def _count_nonfinite(t: torch.Tensor, chunk_elems: int) -> tuple[int, int]:
    """(number of NaN, number of +-Inf) elements of ``t``, chunk by chunk."""
    if not t.is_floating_point():
        return 0, 0
    nans = infs = 0
    for _, (chunk,) in _chunks((t,), chunk_elems):
        nans += int(torch.isnan(chunk).sum())
        infs += int(torch.isinf(chunk).sum())
    return nans, infs


def _finite_abs_max(t: torch.Tensor, chunk_elems: int) -> float:
    """max |t| over the finite elements of ``t`` (0.0 if there are none), without a float64 copy."""
    peak = 0.0
    for _, (chunk,) in _chunks((t,), chunk_elems):
        if not chunk.is_floating_point():
            chunk = chunk.to(_F64)
        finite = torch.isfinite(chunk)
        if not bool(finite.all()):
            chunk = chunk[finite]
            if chunk.numel() == 0:
                continue
        peak = max(peak, float(chunk.abs().max()))
    return peak


def _as_token_matrix(t: torch.Tensor, name: str) -> torch.Tensor:
    """[..., X] -> [T, X] (leading dims flattened); a 1-D tensor is a single token."""
    if t.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if t.ndim == 1:
        return t.reshape(1, -1)
    return t.reshape(-1, t.shape[-1])


def _as_index_matrix(t: Any, name: str, num_experts: int) -> torch.Tensor:
    t = _check_tensor(t, name)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer expert ids, got dtype {t.dtype}")
    ids = _as_token_matrix(t, name).long()
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= num_experts).any())):
        raise ValueError(f"{name} holds expert ids outside [0, {num_experts})")
    return ids


# --------------------------------------------------------------------------------------------------------
# tensor comparison
# --------------------------------------------------------------------------------------------------------


@dataclass
class TensorMetrics:
    """Error statistics of ``candidate`` against ``golden`` (see :func:`compare_tensors`)."""

    shape_golden: tuple[int, ...]
    shape_candidate: tuple[int, ...]
    dtype_golden: str
    dtype_candidate: str
    numel: int
    shape_match: bool
    cosine: float
    pearson: float
    rel_l2: float
    snr_db: float
    max_abs: float
    mean_abs: float
    max_rel: float
    within_tol: float
    atol: float
    rtol: float
    nan_golden: int
    nan_candidate: int
    inf_golden: int
    inf_candidate: int
    first_nonfinite: tuple[int, ...] | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: non-finite floats become "inf" / "-inf" / "nan", tuples become lists."""
        return json_safe(asdict(self))


class _Accumulator:
    """Single-pass float64 accumulation of the comparison statistics over aligned 1-D chunks.

    Works in four float64 scratch buffers and one bool buffer of chunk size, allocated once and reused for
    every chunk, so the peak extra memory is about ``33 * chunk_elems`` bytes whatever the tensor size.
    """

    def __init__(self, atol: float, rtol: float, rel_floor: float, chunk_elems: int, device: torch.device) -> None:
        self.atol = atol
        self.rtol = rtol
        self.rel_floor = rel_floor  # 0.0 when the finite golden is all zero: max_rel is then not accumulated
        self.chunk_elems = chunk_elems
        self.device = device
        self._scratch: tuple[torch.Tensor, ...] | None = None
        self.nan_g = self.nan_c = self.inf_g = self.inf_c = 0
        self.poisoned = False  # a NaN, or a non-finite value not matched by the same Inf on the other side
        self.first_nonfinite: int | None = None
        self.within = 0
        self.n = 0  # elements finite on both sides
        self.sum_g2 = self.sum_c2 = self.sum_gc = self.sum_d2 = self.sum_abs = 0.0
        self.max_abs = self.max_rel = 0.0
        self.g_min = self.c_min = _INF
        self.g_max = self.c_max = -_INF
        # Pearson: sums of values shifted by the first chunk's means (avoids catastrophic cancellation).
        self.shift: tuple[float, float] | None = None
        self.s_g = self.s_c = self.s_gg = self.s_cc = self.s_gc = 0.0

    def _buffers(self, n: int) -> tuple[torch.Tensor, ...]:
        """Views of length n of the reusable scratch buffers (g64, c64, diff, buf, mask)."""
        if self._scratch is None:
            f64 = [torch.empty(self.chunk_elems, dtype=_F64, device=self.device) for _ in range(4)]
            mask = torch.empty(self.chunk_elems, dtype=torch.bool, device=self.device)
            self._scratch = (*f64, mask)
        return tuple(b[:n] for b in self._scratch)

    def update(self, offset: int, g_raw: torch.Tensor, c_raw: torch.Tensor) -> None:
        g_buf, c_buf, diff, buf, mask = self._buffers(g_raw.numel())
        # A float64 chunk is used as is (it may alias the caller's tensor: never modified in place).
        g = g_raw if g_raw.dtype == _F64 else g_buf.copy_(g_raw)
        c = c_raw if c_raw.dtype == _F64 else c_buf.copy_(c_raw)
        gg = float(torch.dot(g, g))
        cc = float(torch.dot(c, c))
        if not (math.isfinite(gg) and math.isfinite(cc)):  # NaN/Inf present (or float64 overflow)
            fin_g = torch.isfinite(g)
            fin_c = torch.isfinite(c)
            if not (bool(fin_g.all()) and bool(fin_c.all())):
                g, c = self._split_nonfinite(offset, g, c, fin_g, fin_c)
                diff, buf, mask = diff[: g.numel()], buf[: g.numel()], mask[: g.numel()]
                gg = float(torch.dot(g, g))
                cc = float(torch.dot(c, c))
        self._accumulate_finite(g, c, gg, cc, diff, buf, mask)

    def _split_nonfinite(
        self, offset: int, g: torch.Tensor, c: torch.Tensor, fin_g: torch.Tensor, fin_c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Count NaN/Inf, record poisoning and the first new non-finite; return the both-finite elements."""
        self.nan_g += int(torch.isnan(g).sum())
        self.nan_c += int(torch.isnan(c).sum())
        inf_g = torch.isinf(g)
        self.inf_g += int(inf_g.sum())
        self.inf_c += int(torch.isinf(c).sum())
        valid = fin_g & fin_c
        n_valid = int(valid.sum())
        n_same_inf = int((inf_g & (g == c)).sum())  # +inf vs +inf / -inf vs -inf count as equal
        self.within += n_same_inf
        if n_valid + n_same_inf < g.numel():
            self.poisoned = True
        if self.first_nonfinite is None:
            new_bad = fin_g & ~fin_c
            if bool(new_bad.any()):
                self.first_nonfinite = offset + int(new_bad.to(torch.uint8).argmax())
        return g[valid], c[valid]

    def _accumulate_finite(
        self,
        g: torch.Tensor,
        c: torch.Tensor,
        gg: float,
        cc: float,
        diff: torch.Tensor,
        buf: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        n = g.numel()
        if n == 0:
            return
        if self.shift is None:
            self.shift = (float(g.mean()), float(c.mean()))
        self.n += n
        self.sum_g2 += gg
        self.sum_c2 += cc
        self.sum_gc += float(torch.dot(g, c))
        lo, hi = torch.aminmax(g)
        self.g_min, self.g_max = min(self.g_min, float(lo)), max(self.g_max, float(hi))
        lo, hi = torch.aminmax(c)
        self.c_min, self.c_max = min(self.c_min, float(lo)), max(self.c_max, float(hi))

        torch.sub(c, g, out=diff)
        self.sum_d2 += float(torch.dot(diff, diff))
        diff.abs_()
        self.sum_abs += float(diff.sum())
        self.max_abs = max(self.max_abs, float(diff.max()))
        torch.abs(g, out=buf)
        buf.mul_(self.rtol).add_(self.atol)
        torch.le(diff, buf, out=mask)
        self.within += int(mask.sum())
        if self.rel_floor > 0.0:
            torch.abs(g, out=buf)
            buf.clamp_(min=self.rel_floor)
            diff.div_(buf)
            self.max_rel = max(self.max_rel, float(diff.max()))

        shift_g, shift_c = self.shift
        torch.sub(g, shift_g, out=buf)
        torch.sub(c, shift_c, out=diff)
        self.s_g += float(buf.sum())
        self.s_c += float(diff.sum())
        self.s_gg += float(torch.dot(buf, buf))
        self.s_cc += float(torch.dot(diff, diff))
        self.s_gc += float(torch.dot(buf, diff))


def _cosine(acc: _Accumulator) -> float:
    if acc.sum_g2 == 0.0 and acc.sum_c2 == 0.0:
        return 1.0
    if acc.sum_g2 == 0.0 or acc.sum_c2 == 0.0:
        return 0.0
    return min(1.0, max(-1.0, acc.sum_gc / (math.sqrt(acc.sum_g2) * math.sqrt(acc.sum_c2))))


def _pearson(acc: _Accumulator, all_within: bool) -> float:
    g_const = acc.n == 0 or acc.g_min == acc.g_max
    c_const = acc.n == 0 or acc.c_min == acc.c_max
    if g_const and c_const:
        return 1.0 if all_within else 0.0
    if g_const or c_const:
        return 0.0
    n = acc.n
    cov = acc.s_gc - acc.s_g * acc.s_c / n
    var_g = acc.s_gg - acc.s_g * acc.s_g / n
    var_c = acc.s_cc - acc.s_c * acc.s_c / n
    if not (var_g > 0.0 and var_c > 0.0):
        return 0.0
    return min(1.0, max(-1.0, cov / (math.sqrt(var_g) * math.sqrt(var_c))))


def _rel_l2(acc: _Accumulator) -> float:
    if acc.sum_d2 == 0.0:
        return 0.0
    if acc.sum_g2 == 0.0:
        return _INF
    return math.sqrt(acc.sum_d2) / math.sqrt(acc.sum_g2)


def _snr_db(acc: _Accumulator) -> float:
    if acc.sum_d2 == 0.0:
        return _INF
    if acc.sum_g2 == 0.0:
        return -_INF
    return 10.0 * (math.log10(acc.sum_g2) - math.log10(acc.sum_d2))


def compare_tensors(
    golden: torch.Tensor,
    candidate: torch.Tensor,
    *,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    chunk_elems: int = _DEFAULT_CHUNK,
) -> TensorMetrics:
    """Compare ``candidate`` against ``golden`` element-wise and return :class:`TensorMetrics`.

    The tensors may differ in dtype (bool/int/float16/bfloat16/float32/float64); every chunk of
    ``chunk_elems`` elements is cast to float64 and all statistics are accumulated in float64 in a single
    pass, so memory overhead is a few chunk-sized buffers regardless of tensor size. (Only ``max|golden|``,
    needed for the ``max_rel`` floor, is obtained by a cheap golden-only pre-scan in the native dtype.)

    Definitions (``g`` golden, ``c`` candidate, ``d = c - g``; sums over elements finite on both sides):

    * ``cosine = <g, c> / (||g|| ||c||)``; ``pearson`` = correlation coefficient; ``rel_l2 = ||d|| / ||g||``;
      ``snr_db = 10 log10(||g||^2 / ||d||^2)``; ``max_abs`` / ``mean_abs`` of ``|d|``;
      ``max_rel = max |d| / max(|g|, 1e-3 * max|g|)``; ``within_tol`` = share of *all* elements with
      ``|d| <= atol + rtol * |g|``.
    * Non-finite values: NaN/Inf are counted per side. Elements that are the same Inf on both sides count
      as equal (within tolerance, excluded from the sums). Any NaN (on either side) or any non-finite value
      not matched by the same Inf on the other side makes the result *fail-safe*: ``rel_l2``, ``max_abs``,
      ``mean_abs`` and ``max_rel`` become ``inf``, ``snr_db`` becomes ``-inf``, ``cosine`` and ``pearson``
      become 0.0, and such elements are not within tolerance. No metric is ever NaN, so a threshold check
      (``>=`` / ``<=``) can never silently pass. ``first_nonfinite`` is the row-major index of the first
      element that is NaN/Inf in the candidate but finite in the golden.
    * Degenerate cases: both all-zero (or empty) -> cosine 1, pearson 1, rel_l2 0, snr_db inf; golden zero
      and candidate non-zero -> cosine 0, rel_l2 inf, snr_db -inf; identical tensors -> snr_db inf and
      cosine = pearson = 1.0 exactly; pearson is 1.0 if both tensors are constant and every element is
      within tolerance, 0.0 if both are constant otherwise or if exactly one of them is constant;
      ``max_rel`` for an all-zero golden is 0.0 if the candidate equals it, else inf.
    * Shape mismatch does not raise: ``shape_match=False``, ``numel=0``, cosine/pearson 0.0, error metrics
      inf (``snr_db`` -inf), ``within_tol`` 0.0; NaN/Inf counts are still reported per side.
    """
    golden = _check_tensor(golden, "golden")
    candidate = _check_tensor(candidate, "candidate")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    if not (atol >= 0.0 and rtol >= 0.0):
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    atol, rtol = float(atol), float(rtol)
    base: dict[str, Any] = {
        "shape_golden": tuple(golden.shape),
        "shape_candidate": tuple(candidate.shape),
        "dtype_golden": dtype_name(golden.dtype),
        "dtype_candidate": dtype_name(candidate.dtype),
        "atol": atol,
        "rtol": rtol,
    }

    if golden.shape != candidate.shape:
        nan_g, inf_g = _count_nonfinite(golden, chunk_elems)
        nan_c, inf_c = _count_nonfinite(candidate, chunk_elems)
        return TensorMetrics(
            **base,
            numel=0,
            shape_match=False,
            cosine=0.0,
            pearson=0.0,
            rel_l2=_INF,
            snr_db=-_INF,
            max_abs=_INF,
            mean_abs=_INF,
            max_rel=_INF,
            within_tol=0.0,
            nan_golden=nan_g,
            nan_candidate=nan_c,
            inf_golden=inf_g,
            inf_candidate=inf_c,
            first_nonfinite=None,
        )

    numel = golden.numel()
    rel_floor = _REL_FLOOR * _finite_abs_max(golden, chunk_elems)
    acc = _Accumulator(atol, rtol, rel_floor, min(chunk_elems, max(numel, 1)), golden.device)
    for offset, (g_chunk, c_chunk) in _chunks((golden, candidate), chunk_elems):
        acc.update(offset, g_chunk, c_chunk)

    within_tol = acc.within / numel if numel else 1.0
    max_rel = acc.max_rel if rel_floor > 0.0 else (0.0 if acc.max_abs == 0.0 else _INF)
    identical = acc.sum_d2 == 0.0  # equal on all both-finite elements: exact 1.0, no rounding residue
    stats: dict[str, float] = {
        "cosine": 1.0 if identical else _cosine(acc),
        "pearson": 1.0 if identical else _pearson(acc, acc.within == numel),
        "rel_l2": _rel_l2(acc),
        "snr_db": _snr_db(acc),
        "max_abs": acc.max_abs,
        "mean_abs": acc.sum_abs / acc.n if acc.n else 0.0,
        "max_rel": max_rel,
    }
    # Float64 overflow (|values| ~ 1e154 and beyond) can still yield nan: fail safe, never return nan.
    if acc.poisoned or any(math.isnan(v) for v in stats.values()):
        stats.update(cosine=0.0, pearson=0.0, rel_l2=_INF, snr_db=-_INF, max_abs=_INF, mean_abs=_INF, max_rel=_INF)
    first = None if acc.first_nonfinite is None else _unravel(acc.first_nonfinite, golden.shape)
    return TensorMetrics(
        **base,
        numel=numel,
        shape_match=True,
        **stats,
        within_tol=within_tol,
        nan_golden=acc.nan_g,
        nan_candidate=acc.nan_c,
        inf_golden=acc.inf_g,
        inf_candidate=acc.inf_c,
        first_nonfinite=first,
    )


def per_token_error(golden: torch.Tensor, candidate: torch.Tensor, token_dim: int = -2) -> torch.Tensor:
    """Relative L2 error ``||c_t - g_t|| / ||g_t||`` of every slice ``t`` along ``token_dim``.

    All other dimensions are flattened. Returns float64 ``[T]``. A slice with ``||g_t|| = 0`` gives 0.0 if
    it is equal to the golden, else inf. Non-finite values never yield nan: equal Infs count as equal,
    ``||g_t||`` is taken over the finite golden values, and a NaN or unmatched Inf makes the error inf.
    Processed in blocks of tokens, so no float64 copy of the whole tensor is made.
    """
    golden = _check_tensor(golden, "golden")
    candidate = _check_tensor(candidate, "candidate")
    if golden.shape != candidate.shape:
        raise ValueError(f"shape mismatch: golden {tuple(golden.shape)} vs candidate {tuple(candidate.shape)}")
    if golden.ndim == 0:
        raise ValueError("per_token_error needs at least one dimension")
    if not -golden.ndim <= token_dim < golden.ndim:
        raise ValueError(f"token_dim {token_dim} out of range for a {golden.ndim}-d tensor")
    g_all = golden.movedim(token_dim, 0)
    c_all = candidate.movedim(token_dim, 0)
    num_tokens = g_all.shape[0]
    inner = math.prod(g_all.shape[1:])
    out = torch.zeros(num_tokens, dtype=_F64)
    if num_tokens == 0 or inner == 0:
        return out
    rows = max(1, (1 << 20) // inner)  # a few block-sized float64 temporaries, ~8 MB each
    for start in range(0, num_tokens, rows):
        stop = min(start + rows, num_tokens)
        g = g_all[start:stop].reshape(stop - start, inner).to(_F64)
        c = c_all[start:stop].reshape(stop - start, inner).to(_F64)
        diff = torch.where(g == c, 0.0, c - g)  # equal Infs -> 0; NaN / unmatched Inf -> nan or inf
        d2 = diff.square_().sum(dim=1)
        g2 = torch.where(torch.isfinite(g), g, 0.0).square_().sum(dim=1)
        err = torch.sqrt(d2) / torch.sqrt(g2)
        err = torch.where(d2 == 0.0, 0.0, torch.where(g2 == 0.0, _INF, err))
        out[start:stop] = torch.where(torch.isnan(err), _INF, err).cpu()
    return out


def worst_tokens(per_token: torch.Tensor, n: int = 5) -> list[tuple[int, float]]:
    """The ``n`` largest entries of a 1-D error vector as ``(position, error)``, largest first.

    Ties keep ascending position order; a NaN entry ranks as the worst.
    """
    per_token = _check_tensor(per_token, "per_token")
    if per_token.ndim != 1:
        raise ValueError(f"per_token must be 1-D, got shape {tuple(per_token.shape)}")
    if n <= 0 or per_token.numel() == 0:
        return []
    values = per_token.to(_F64).cpu()
    key = torch.where(torch.isnan(values), _INF, values)
    order = torch.sort(key, descending=True, stable=True).indices[:n]
    return [(int(i), float(values[i])) for i in order]


# --------------------------------------------------------------------------------------------------------
# routing comparison
# --------------------------------------------------------------------------------------------------------


@dataclass
class RoutingFlip:
    """A token whose candidate top-k expert set differs from the golden one."""

    token: int
    golden_experts: list[int]
    candidate_experts: list[int]
    gap: float
    is_tie: bool


@dataclass
class RoutingMetrics:
    """Top-k routing agreement between golden and candidate (see :func:`compare_routing`)."""

    num_tokens: int
    top_k: int
    num_experts: int
    set_agreement: float
    flips: list[RoutingFlip]
    ties: list[RoutingFlip]
    tie_tolerance: float

    @property
    def flipped_tokens(self) -> list[int]:
        """Tokens with a real flip (not explained by a near-tie of golden scores)."""
        return [flip.token for flip in self.flips]

    @property
    def disagreeing_tokens(self) -> list[int]:
        """All tokens whose top-k sets differ (real flips and ties), ascending."""
        return sorted(flip.token for flip in [*self.flips, *self.ties])

    @property
    def flip_share(self) -> float:
        """Share of tokens with a real flip."""
        return len(self.flips) / self.num_tokens if self.num_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict including the derived properties."""
        data = asdict(self)
        data["flip_share"] = self.flip_share
        data["flipped_tokens"] = self.flipped_tokens
        data["disagreeing_tokens"] = self.disagreeing_tokens
        return json_safe(data)


def tie_tolerance(scores: torch.Tensor, dtype: torch.dtype, factor: float = 8.0) -> torch.Tensor:
    """Per-token absolute tolerance ``[T]`` for calling a routing disagreement a tie.

    ``factor * eps(dtype) * rms_e(scores[t, e]) + factor * eps(dtype) * 1e-6``, computed in float64 with
    ``eps = torch.finfo(dtype).eps`` (``dtype`` is the precision the candidate computes its router scores
    in). The RMS is taken over the token's finite scores only, so masked (``-inf``) experts do not inflate
    it. Leading dims of ``scores [..., E]`` are flattened to T. Raises ValueError for non-float dtypes.
    """
    scores = _check_tensor(scores, "scores")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"tie_tolerance needs a floating-point dtype, got {dtype!r}")
    if not factor >= 0.0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    eps = torch.finfo(dtype).eps
    s = _as_token_matrix(scores, "scores").to(_F64)
    finite = torch.isfinite(s)
    sq_sum = torch.where(finite, s, 0.0).square_().sum(dim=1)
    rms = torch.sqrt(sq_sum / finite.sum(dim=1).clamp(min=1))
    return factor * eps * rms + factor * eps * 1e-6


def compare_routing(
    golden_scores: torch.Tensor,
    golden_topk: torch.Tensor,
    candidate_topk: torch.Tensor,
    *,
    tolerance: torch.Tensor | float,
) -> RoutingMetrics:
    """Compare golden and candidate top-k expert *sets* per token (order within top-k is ignored).

    ``golden_scores [..., E]`` are the golden selection scores (what top-k was taken over);
    ``golden_topk`` / ``candidate_topk [..., k]`` integer expert ids; leading dims are flattened to T.
    For a token whose sets differ, ``gap = min(golden_scores[t, G \\ C]) - max(golden_scores[t, C \\ G])``
    is the golden margin by which the candidate's choice lost; the disagreement is a tie when
    ``gap <= tolerance[t]`` (``tolerance`` a scalar or a per-token tensor, e.g. :func:`tie_tolerance`),
    otherwise a real flip. A gap that is NaN (NaN scores) is a real flip; a gap <= 0 (golden top-k not
    the best by ``golden_scores``) is a tie.
    """
    scores = _check_tensor(golden_scores, "golden_scores")
    s = _as_token_matrix(scores, "golden_scores").to(_F64)
    num_tokens, num_experts = s.shape
    g_ids = _as_index_matrix(golden_topk, "golden_topk", num_experts)
    c_ids = _as_index_matrix(candidate_topk, "candidate_topk", num_experts)
    if g_ids.shape[0] != num_tokens:
        raise ValueError(f"golden_topk has {g_ids.shape[0]} tokens, golden_scores has {num_tokens}")
    if c_ids.shape != g_ids.shape:
        raise ValueError(f"candidate_topk shape {tuple(c_ids.shape)} != golden_topk {tuple(g_ids.shape)}")
    top_k = g_ids.shape[1]

    if isinstance(tolerance, torch.Tensor):
        tol = tolerance.detach().to(device=s.device, dtype=_F64).reshape(-1)
        if tol.numel() == 1:
            tol = tol.expand(num_tokens)
        elif tol.numel() != num_tokens:
            raise ValueError(f"tolerance has {tol.numel()} entries, expected 1 or {num_tokens}")
        max_tol = float(tol.max()) if num_tokens else 0.0
    else:
        tol = torch.full((num_tokens,), float(tolerance), dtype=_F64, device=s.device)
        max_tol = float(tolerance)

    g_ids, c_ids = g_ids.to(s.device), c_ids.to(s.device)
    g_mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=s.device).scatter_(1, g_ids, True)
    c_mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=s.device).scatter_(1, c_ids, True)
    disagree = (g_mask != c_mask).any(dim=1).nonzero().flatten()
    flips: list[RoutingFlip] = []
    ties: list[RoutingFlip] = []
    if disagree.numel():
        g_sel, c_sel, s_sel = g_mask[disagree], c_mask[disagree], s[disagree]
        lost = torch.where(g_sel & ~c_sel, s_sel, _INF).amin(dim=1)
        gained = torch.where(c_sel & ~g_sel, s_sel, -_INF).amax(dim=1)
        gaps = lost - gained
        is_tie = gaps <= tol[disagree]
        g_sorted = torch.sort(g_ids[disagree], dim=1).values.tolist()
        c_sorted = torch.sort(c_ids[disagree], dim=1).values.tolist()
        for row, token in enumerate(disagree.tolist()):
            tie = bool(is_tie[row])
            flip = RoutingFlip(token, g_sorted[row], c_sorted[row], float(gaps[row]), tie)
            (ties if tie else flips).append(flip)
    set_agreement = 1.0 - disagree.numel() / num_tokens if num_tokens else 1.0
    return RoutingMetrics(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        set_agreement=set_agreement,
        flips=flips,
        ties=ties,
        tie_tolerance=max_tol,
    )


def scatter_topk(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dense ``[T, E]`` matrix with each top-k weight placed at its expert id (0 elsewhere).

    Lets routing weights be compared aligned by expert id instead of by top-k position. Leading dims are
    flattened to T; duplicate ids are summed, so rows sum to the weights' row sums. Floating weights keep
    their dtype, others become float32.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    ids = _as_index_matrix(top_k_index, "top_k_index", num_experts)
    weights = _as_token_matrix(_check_tensor(top_k_weights, "top_k_weights"), "top_k_weights")
    if weights.shape != ids.shape:
        raise ValueError(f"top_k_weights shape {tuple(weights.shape)} != top_k_index {tuple(ids.shape)}")
    dtype = weights.dtype if weights.is_floating_point() else torch.float32
    dense = torch.zeros(ids.shape[0], num_experts, dtype=dtype, device=weights.device)
    return dense.scatter_add_(1, ids.to(weights.device), weights.to(dtype))
