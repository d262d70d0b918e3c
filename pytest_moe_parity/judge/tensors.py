"""Tensors compared element by element: cosine, Pearson, rel_l2, SNR, max/mean abs, max_rel, the share within
atol/rtol and NaN/Inf counts (`compare_tensors`), and the elements that differ most (`worst_elements`).

`compare_tensors` runs at close to memory speed: tensors are walked once, in cache-sized chunks; each
chunk's sums are taken in the chunk's float precision (float32 for float32/bfloat16/float16 inputs,
float64 otherwise) and accumulated across chunks in float64. Cosine and Pearson are computed from the
squared norm of the difference (law of cosines), so they stay accurate where they matter, near 1:
their absolute error is about 1e-6 times (1 - value) plus 1e-6 times rel_l2 (see the tests against a
float64 reference). Beside busy processes the pass runs on the cores they leave free
(`host.fitted_threads`): its dozen operations per chunk would otherwise each wait for a descheduled
thread's time slice.

Where a pass's time goes (two 256 MB float32 tensors, AMD EPYC, one thread): the golden's peak (one
`aminmax`, 0.5 of a read of the pair), the pair read once by the chunk's first dots (1 read), then
some thirteen operations on each chunk while it sits in the cache (2^18 elements: a sum 15-17 us, a
dot 23, an abs 23, a sub or an add 42) and ~45 us of calls per chunk. So the work left out counts:
a chunk whose max|d| / floor cannot raise max_rel is not divided (three operations; 190 of 256
chunks of the benchmark's pair), a chunk after one with elements outside atol/rtol is counted without
a max first, and the peak is one reduction, not two; -19 % on the benchmark's pair, -24 % on one all
within tolerance, with every figure bit for bit as before. Measured and left: sums as BLAS (a `mv` of
three rows against ones 90 us, three sums 47; a dot with ones slower than a sum), a bool mask (`le`
into bool and its sum 177 us, `le_` in place and a float sum 34), `var_mean` (2 ms), `vector_norm`
(0.2-0.7 ms), chunks that fit L2 (2^15-2^17: 6-70 % slower, the calls outgrow what the cache saves)
or larger ones (2^19: 8 % slower). Those figures are one and two threads'; with more, each of the
dozen operations per chunk is a parallel region whose fork and join do not shrink with the chunk, so
the chunk grows with the threads (`_PER_THREAD`). An AVX2-only EPYC measured 11.6x a read at its full
thread count and 9.8-11.2x with fewer threads beside a busy process; its vector width alone is not it
(this host's AVX2 kernels, forced: 4.6x). Not measured on a many-core host here."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..dtypes import dtype_name, json_safe
from ..host import fitted_threads

__all__ = ["TensorMetrics", "compare_tensors", "worst_elements"]

# -- inputs: checked, walked in chunks, viewed as [tokens, X] (shared by tokens, routing, logits) ---------

F64 = torch.float64
INF = math.inf


def check_tensor(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (dtype {t.dtype})")
    return t.detach()


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major multi-dimensional index of flat position ``flat`` in a tensor of ``shape``."""
    index: list[int] = []
    for size in reversed(shape):
        flat, rem = divmod(flat, size)
        index.append(rem)
    return tuple(reversed(index))


def blocks(shape: tuple[int, ...], chunk_elems: int) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """Row-major blocks ``t[prefix][start:stop]`` of a non-empty tensor (ndim >= 1), each <= chunk_elems."""
    inner = math.prod(shape[1:])
    if len(shape) == 1 or inner <= chunk_elems:
        rows = max(1, chunk_elems // inner)
        for start in range(0, shape[0], rows):
            yield (), start, min(start + rows, shape[0])
        return
    for i in range(shape[0]):
        for prefix, start, stop in blocks(shape[1:], chunk_elems):
            yield (i, *prefix), start, stop


def chunks(tensors: Sequence[torch.Tensor], chunk_elems: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Yield ``(flat_offset, [1-D chunk of each tensor])`` in row-major order; all tensors share one shape.

    Contiguous inputs are sliced as flat views (no copy). Otherwise blocks along the leading dimensions
    are reshaped one at a time, so a non-contiguous tensor is never copied as a whole.
    """
    numel = tensors[0].numel()
    if numel == 0:
        return
    if tensors[0].ndim == 0:
        yield 0, [t.reshape(1) for t in tensors]
        return
    if all(t.is_contiguous() for t in tensors):
        flats = [t.reshape(-1) for t in tensors]
        for start in range(0, numel, chunk_elems):
            yield start, [f[start : start + chunk_elems] for f in flats]
        return
    offset = 0
    for prefix, start, stop in blocks(tuple(tensors[0].shape), chunk_elems):
        parts = [t[prefix][start:stop].reshape(-1) for t in tensors]
        yield offset, parts
        offset += parts[0].numel()


def as_token_matrix(t: torch.Tensor, name: str) -> torch.Tensor:
    """[..., X] -> [T, X] (leading dims flattened); a 1-D tensor is a single token."""
    if t.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if t.ndim == 1:
        return t.reshape(1, -1)
    return t.reshape(-1, t.shape[-1])


def as_index_matrix(t: Any, name: str, num_experts: int) -> torch.Tensor:
    t = check_tensor(t, name)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer expert ids, got dtype {t.dtype}")
    ids = as_token_matrix(t, name).long()
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= num_experts).any())):
        raise ValueError(f"{name} holds expert ids outside [0, {num_experts})")
    return ids


# Elements per chunk: the chunk and its three scratch buffers stay in the CPU caches (L3: 5 MB; the
# 1 MB of L2 would need 2^15, whose calls cost more than the cache saves) while about a dozen
# operations run over them, and the per-call overhead stays small.
_DEFAULT_CHUNK = 1 << 18
# Each operation on a chunk is one parallel region of torch's threads, whose fork and join cost the
# same whatever the chunk, while a thread's share of the chunk shrinks as the threads grow (at 16
# threads, 16K elements: a few microseconds of work per region). So `compare_tensors`' chunk grows
# with its threads beyond two, each thread's share staying what it is at two, where it was measured,
# up to 16 threads (a chunk of 2^21: 8 MB a buffer, the pass's scratch 40 MB).
_PER_THREAD = 1 << 17
_MAX_CHUNK = 1 << 21
# max_rel measures elements against max(|g|, _REL_FLOOR * max|g|), i.e. 0.1 % of the golden peak.
_REL_FLOOR = 1e-3
_DOT_SPAN = 1 << 18
# Pearson: when a mean exceeds this many standard deviations, centred sums are taken on shifted
# values (sum of squares minus squared sum would cancel catastrophically).
_SHIFT_RATIO = 1.0


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 when every input is a float of at most 32 bits, else float64 (integers stay exact)."""
    if all(t.is_floating_point() and t.dtype != F64 for t in tensors):
        return torch.float32
    return F64


def _count_nonfinite(t: torch.Tensor, chunk_elems: int) -> tuple[int, int]:
    """(number of NaN, number of +-Inf) elements of ``t``, chunk by chunk."""
    if not t.is_floating_point():
        return 0, 0
    nans = infs = 0
    for _, (chunk,) in chunks((t,), chunk_elems):
        nans += int(torch.isnan(chunk).sum())
        infs += int(torch.isinf(chunk).sum())
    return nans, infs


def _finite_abs_max(t: torch.Tensor, chunk_elems: int) -> float:
    """max |t| over the finite elements of ``t`` (0.0 if there are none), without a copy: one `aminmax`
    (one read) over the whole tensor when it is contiguous, else over each chunk; the finite elements of a
    span holding NaN/Inf are then looked at a chunk at a time. An amin and an amax per chunk took 0.60 of
    a read of the pair (256 MB, one thread), one aminmax over the whole tensor 0.51."""
    peak = 0.0
    span = t.numel() if t.is_contiguous() else chunk_elems
    for _, (part,) in chunks((t,), max(span, 1)):
        lo, hi = torch.aminmax(part)
        low, high = float(lo), float(hi)
        if math.isfinite(low) and math.isfinite(high):
            peak = max(peak, abs(low), abs(high))
            continue
        for chunk in part.split(chunk_elems):  # NaN or Inf inside: look at the finite ones
            chunk = chunk[torch.isfinite(chunk)]
            if chunk.numel():
                lo, hi = torch.aminmax(chunk)
                peak = max(peak, abs(float(lo)), abs(float(hi)))
    return peak


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
    mismatched: int  # elements outside atol/rtol (numel - the elements within)
    atol: float
    rtol: float
    nan_golden: int
    nan_candidate: int
    inf_golden: int
    inf_candidate: int
    first_nonfinite: tuple[int, ...] | None
    # per token (rows of the last dimension), where the judge looked: the worst one's error and position
    max_token_rel_l2: float | None = None
    worst_token: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: non-finite floats become "inf" / "-inf" / "nan", tuples become lists."""
        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorMetrics:
        """The metrics as a report holds them (`to_dict`): "inf" / "nan" as floats, lists as tuples; a
        figure a report lacks is NaN (a count 0, a shape empty)."""
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            value = data.get(name)
            if name in _SHAPES:
                value = tuple(value) if value is not None else (None if name == "first_nonfinite" else ())
            elif name in _COUNTS:
                value = int(value) if value is not None else (None if name == "worst_token" else 0)
            elif name in ("dtype_golden", "dtype_candidate"):
                value = str(value or "")
            elif name == "shape_match":
                value = bool(value)
            elif value is not None or name != "max_token_rel_l2":
                value = float(value) if value is not None else math.nan
            values[name] = value
        return cls(**values)


_SHAPES = ("shape_golden", "shape_candidate", "first_nonfinite")
_COUNTS = ("numel", "mismatched", "nan_golden", "nan_candidate", "inf_golden", "inf_candidate", "worst_token")


class _Accumulator:
    """One pass of float64 accumulation over aligned 1-D chunks of golden and candidate.

    Each chunk is compared in its compute dtype with three scratch buffers of chunk size (five when
    inputs must be converted), reused for every chunk; the sums of a chunk are added to float64
    totals. A chunk whose float32 sums overflow is redone in float64. Finite sums of squares say the
    chunk holds no NaN/Inf, so the non-finite bookkeeping runs only where there are some; max_rel's
    division and the count within tolerance run only where they can change a figure.
    """

    def __init__(self, atol: float, rtol: float, rel_floor: float, chunk_elems: int, device: torch.device) -> None:
        self.atol = atol
        self.rtol = rtol
        self.rel_floor = rel_floor  # 0.0 when the finite golden is all zero: max_rel is then not accumulated
        self.chunk_elems = chunk_elems
        self.device = device
        self._scratch: dict[torch.dtype, list[torch.Tensor]] = {}
        self.nan_g = self.nan_c = self.inf_g = self.inf_c = 0
        self.poisoned = False  # a NaN, or a non-finite value not matched by the same Inf on the other side
        self.first_nonfinite: int | None = None
        self.within = 0
        self.n = 0  # elements finite on both sides
        self.sum_g2 = self.sum_c2 = self.sum_d2 = self.sum_abs = 0.0
        self.max_abs = self.max_rel = 0.0
        # Pearson: sums of (shifted) values; the shift is set from the first chunk when means dominate.
        self.shift: tuple[float, float] | None = None
        self.s_g = self.s_c = self.s_gg = self.s_cc = self.s_d = self.s_dd = 0.0
        # Whether every finite value seen so far equals the first one (Pearson's degenerate cases).
        self.g_const: float | bool | None = None  # None: nothing seen; a float: the constant; False: not constant
        self.c_const: float | bool | None = None
        # the floor as a float32 chunk's clamp holds it (rounded to float32)
        self.floor32 = float(torch.tensor(rel_floor, dtype=torch.float32))
        # count the elements within at once (no max first): the chunk before had some outside
        self.count_first = False

    def _buffers(self, dtype: torch.dtype, n: int, count: int) -> list[torch.Tensor]:
        """Views of length n of `count` reusable scratch buffers of `dtype`."""
        bufs = self._scratch.setdefault(dtype, [])
        size = max(n, self.chunk_elems)
        while len(bufs) < count:
            bufs.append(torch.empty(size, dtype=dtype, device=self.device))
        for i in range(count):
            if bufs[i].numel() < n:
                bufs[i] = torch.empty(n, dtype=dtype, device=self.device)
        return [b[:n] for b in bufs[:count]]

    def update(self, offset: int, g_raw: torch.Tensor, c_raw: torch.Tensor) -> None:
        n = g_raw.numel()
        dtype = _compute_dtype(g_raw, c_raw)
        # buffers 0-2: difference and two temporaries; 3-4: the inputs converted to the compute dtype
        d, t, u, gb, cb = self._buffers(dtype, n, 5) if dtype != g_raw.dtype or dtype != c_raw.dtype else (
            *self._buffers(dtype, n, 3), None, None)  # fmt: skip
        g = g_raw if g_raw.dtype == dtype else gb.copy_(g_raw)
        c = c_raw if c_raw.dtype == dtype else cb.copy_(c_raw)
        gg, cc = _sum_sq(g), _sum_sq(c)
        if not (math.isfinite(gg) and math.isfinite(cc)):  # NaN/Inf present, or the sums overflowed
            fin_g, fin_c = torch.isfinite(g), torch.isfinite(c)
            if not (bool(fin_g.all()) and bool(fin_c.all())):
                g, c = self._split_nonfinite(offset, g, c, fin_g, fin_c)
            g, c = g.to(F64), c.to(F64)  # rare path: exact float64 on the (finite) rest
            d, t, u = self._buffers(F64, g.numel(), 3)
            gg, cc = _sum_sq(g), _sum_sq(c)
        self._accumulate_finite(g, c, gg, cc, d, t, u)

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

    @staticmethod
    def _constancy(state: float | bool | None, x: torch.Tensor) -> float | bool | None:
        """Track whether every value seen equals the first one (a pass only until one differs)."""
        if state is False or x.numel() == 0:
            return state
        lo, hi = torch.aminmax(x)
        low, high = float(lo), float(hi)
        first = low if state is None else state
        return low if low == high == first else False

    def _accumulate_finite(
        self,
        g: torch.Tensor,
        c: torch.Tensor,
        gg: float,
        cc: float,
        d: torch.Tensor,
        t: torch.Tensor,
        u: torch.Tensor,
    ) -> None:
        n = g.numel()
        if n == 0:
            return
        sum_g = float(g.sum())
        torch.sub(c, g, out=d)
        dd = _sum_sq(d)
        sum_d = float(d.sum())
        if self.shift is None:
            mean_g, mean_c = sum_g / n, (sum_g + sum_d) / n
            var_g, var_c = max(gg / n - mean_g * mean_g, 0.0), max(cc / n - mean_c * mean_c, 0.0)
            big = abs(mean_g) > _SHIFT_RATIO * math.sqrt(var_g) or abs(mean_c) > _SHIFT_RATIO * math.sqrt(var_c)
            self.shift = (mean_g, mean_c) if big else (0.0, 0.0)
        self.n += n
        self.sum_g2 += gg
        self.sum_c2 += cc
        self.sum_d2 += dd
        shift_g, shift_c = self.shift
        if shift_g == 0.0 and shift_c == 0.0:
            self.s_g += sum_g
            self.s_c += sum_g + sum_d
            self.s_gg += gg
            self.s_cc += cc
            self.s_d += sum_d
            self.s_dd += dd
        else:  # the difference of the shifted values is d shifted by (shift_c - shift_g)
            s, ss = _shifted_sums(g, shift_g, t)
            self.s_g += s
            self.s_gg += ss
            s, ss = _shifted_sums(c, shift_c, t)
            self.s_c += s
            self.s_cc += ss
            s, ss = _shifted_sums(d, shift_c - shift_g, t)
            self.s_d += s
            self.s_dd += ss
        self.g_const = self._constancy(self.g_const, g)
        self.c_const = self._constancy(self.c_const, c)

        d.abs_()
        self.sum_abs += float(d.sum())
        chunk_max = float(d.amax())
        self.max_abs = max(self.max_abs, chunk_max)
        rel = self._rel_needed(chunk_max, d.dtype)
        within = chunk_max > self.atol  # else every element is within atol
        if not within:
            self.within += n
        if not (rel or within):
            return
        torch.abs(g, out=t)
        if within:
            torch.add(d, t, alpha=-self.rtol, out=u)  # |d| - rtol |g| <= atol  <=>  within
            self.within += self._count_within(u)
        if rel:
            t.clamp_(min=self.rel_floor)
            torch.div(d, t, out=t)
            self.max_rel = max(self.max_rel, float(t.amax()))

    def _count_within(self, excess: torch.Tensor) -> int:
        """The elements of ``excess`` (|d| - rtol |g|, overwritten) that are <= atol. A max first (one
        read) settles a chunk with none outside; after a chunk with some outside, the next is counted at
        once (two passes, not three)."""
        if not self.count_first and float(excess.amax()) <= self.atol:
            return excess.numel()
        inside = int(excess.le_(self.atol).sum())
        self.count_first = inside < excess.numel()
        return inside

    def _rel_needed(self, chunk_max: float, dtype: torch.dtype) -> bool:
        """Whether this chunk's max_rel can exceed the largest seen: its elements are |d| / max(|g|,
        floor) <= chunk_max / floor (the floor as the chunk's dtype holds it; the 1e-6 margin covers
        the division's rounding), so once the largest is found most chunks need not divide."""
        if self.rel_floor <= 0.0:
            return False
        floor = self.floor32 if dtype == torch.float32 else self.rel_floor
        return floor == 0.0 or chunk_max * (1.0 + 1e-6) > self.max_rel * floor


def _shifted_sums(x: torch.Tensor, shift: float, scratch: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) of x - shift. The squares are summed, not dotted: a dot took as long
    (254 vs 256 ms for a 256 MB pair with an offset) and was 50x less accurate (Pearson 7.7e-11 off its
    float64 definition, against 1.4e-12)."""
    torch.sub(x, shift, out=scratch)
    total = float(scratch.sum())
    return total, float(scratch.square_().sum())


def _sum_sq(x: torch.Tensor) -> float:
    """Sum of squares of x: BLAS dots over spans of at most _DOT_SPAN elements, added in float64. A dot
    reads its input once and writes nothing; its float32 error grows with its length (~2e-7 at 2^18
    elements, ~3e-6 at 2^20), so long chunks are cut into spans."""
    if x.numel() <= _DOT_SPAN:
        return float(torch.dot(x, x))
    return math.fsum(float(torch.dot(span, span)) for span in x.split(_DOT_SPAN))


def _one_minus_cos(sq_diff: float, sq_a: float, sq_b: float) -> float:
    """1 - <a,b>/(|a||b|) from |a-b|^2, |a|^2 and |b|^2 (law of cosines): accurate near 1."""
    norm_a, norm_b = math.sqrt(sq_a), math.sqrt(sq_b)
    return (sq_diff - (norm_a - norm_b) ** 2) / (2.0 * norm_a * norm_b)


def _cosine(acc: _Accumulator) -> float:
    if acc.sum_g2 == 0.0 and acc.sum_c2 == 0.0:
        return 1.0
    if acc.sum_g2 == 0.0 or acc.sum_c2 == 0.0:
        return 0.0
    return min(1.0, max(-1.0, 1.0 - _one_minus_cos(acc.sum_d2, acc.sum_g2, acc.sum_c2)))


def _pearson(acc: _Accumulator, all_within: bool) -> float:
    g_const = acc.n == 0 or acc.g_const is not False
    c_const = acc.n == 0 or acc.c_const is not False
    if g_const and c_const:
        return 1.0 if all_within else 0.0
    if g_const or c_const:
        return 0.0
    n = acc.n
    var_g = acc.s_gg - acc.s_g * acc.s_g / n  # n times the variances
    var_c = acc.s_cc - acc.s_c * acc.s_c / n
    var_d = acc.s_dd - acc.s_d * acc.s_d / n
    if not (var_g > 0.0 and var_c > 0.0):
        return 0.0
    return min(1.0, max(-1.0, 1.0 - _one_minus_cos(max(var_d, 0.0), var_g, var_c)))


def _rel_l2(acc: _Accumulator) -> float:
    if acc.sum_d2 == 0.0:
        return 0.0
    if acc.sum_g2 == 0.0:
        return INF
    return math.sqrt(acc.sum_d2) / math.sqrt(acc.sum_g2)


def _snr_db(acc: _Accumulator) -> float:
    if acc.sum_d2 == 0.0:
        return INF
    if acc.sum_g2 == 0.0:
        return -INF
    return 10.0 * (math.log10(acc.sum_g2) - math.log10(acc.sum_d2))


def compare_tensors(
    golden: torch.Tensor,
    candidate: torch.Tensor,
    *,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    chunk_elems: int | None = None,
) -> TensorMetrics:
    """Compare ``candidate`` against ``golden`` element-wise and return :class:`TensorMetrics`.

    The tensors may differ in dtype (bool/int/float16/bfloat16/float32/float64). They are walked once,
    ``chunk_elems`` elements at a time (default: 2^18; 2^17 per thread from 2 to 16 threads); each
    chunk is compared in float32 (float64 when an input is float64 or not floating) and its sums are
    accumulated in float64, so the memory overhead is a few chunk-sized buffers regardless of tensor
    size. (Only ``max|golden|``, needed for the ``max_rel``
    floor, is obtained by a cheap golden-only pre-scan in the native dtype.)

    Definitions (``g`` golden, ``c`` candidate, ``d = c - g``; sums over elements finite on both sides):

    * ``cosine = <g, c> / (||g|| ||c||)``; ``pearson`` = correlation coefficient; ``rel_l2 = ||d|| / ||g||``;
      ``snr_db = 10 log10(||g||^2 / ||d||^2)``; ``max_abs`` / ``mean_abs`` of ``|d|``;
      ``max_rel = max |d| / max(|g|, 1e-3 * max|g|)``; ``within_tol`` = share of *all* elements with
      ``|d| <= atol + rtol * |g|`` and ``mismatched`` the number of the others.
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
    * Accuracy: sums are exact to float32 rounding per chunk (relative error ~1e-6), float64 across chunks;
      cosine and pearson are derived from ``||d||^2`` and the norms, which keeps their absolute error near
      1e-6 * (1 - value) + 1e-6 * rel_l2; ``within_tol`` compares ``|d| - rtol |g|`` with ``atol`` in the
      chunk's precision.
    """
    golden = check_tensor(golden, "golden")
    candidate = check_tensor(candidate, "candidate")
    if chunk_elems is not None and chunk_elems < 1:
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
        return _shapes_differ(base, golden, candidate, chunk_elems or _DEFAULT_CHUNK)
    acc, rel_floor = _accumulate(golden, candidate, atol, rtol, chunk_elems)
    return _metrics(base, acc, rel_floor, golden.shape)


def _shapes_differ(
    base: dict[str, Any], golden: torch.Tensor, candidate: torch.Tensor, chunk_elems: int
) -> TensorMetrics:
    """The metrics of two tensors of other shapes: fail-safe figures, each side's NaN/Inf counts."""
    nan_g, inf_g = _count_nonfinite(golden, chunk_elems)
    nan_c, inf_c = _count_nonfinite(candidate, chunk_elems)
    return TensorMetrics(
        **base,
        numel=0,
        shape_match=False,
        cosine=0.0,
        pearson=0.0,
        rel_l2=INF,
        snr_db=-INF,
        max_abs=INF,
        mean_abs=INF,
        max_rel=INF,
        within_tol=0.0,
        mismatched=max(golden.numel(), candidate.numel()),
        nan_golden=nan_g,
        nan_candidate=nan_c,
        inf_golden=inf_g,
        inf_candidate=inf_c,
        first_nonfinite=None,
    )


def _accumulate(
    golden: torch.Tensor, candidate: torch.Tensor, atol: float, rtol: float, chunk_elems: int | None
) -> tuple[_Accumulator, float]:
    """One walk over two tensors of one shape, a chunk at a time: their sums, and the max_rel floor."""
    numel = golden.numel()
    with fitted_threads(numel if golden.device.type == "cpu" else 0) as threads:
        chunk_elems = chunk_elems or min(max(_DEFAULT_CHUNK, _PER_THREAD * threads), _MAX_CHUNK)
        rel_floor = _REL_FLOOR * _finite_abs_max(golden, chunk_elems)
        acc = _Accumulator(atol, rtol, rel_floor, min(chunk_elems, max(numel, 1)), golden.device)
        for offset, (g_chunk, c_chunk) in chunks((golden, candidate), chunk_elems):
            acc.update(offset, g_chunk, c_chunk)
    return acc, rel_floor


def _metrics(base: dict[str, Any], acc: _Accumulator, rel_floor: float, shape: torch.Size) -> TensorMetrics:
    """The metrics of two tensors of one shape from their accumulated sums."""
    numel = shape.numel()
    within_tol = acc.within / numel if numel else 1.0
    max_rel = acc.max_rel if rel_floor > 0.0 else (0.0 if acc.max_abs == 0.0 else INF)
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
        stats.update(cosine=0.0, pearson=0.0, rel_l2=INF, snr_db=-INF, max_abs=INF, mean_abs=INF, max_rel=INF)
    first = None if acc.first_nonfinite is None else unravel(acc.first_nonfinite, shape)
    return TensorMetrics(
        **base,
        numel=numel,
        shape_match=True,
        **stats,
        within_tol=within_tol,
        mismatched=numel - acc.within,
        nan_golden=acc.nan_g,
        nan_candidate=acc.nan_c,
        inf_golden=acc.inf_g,
        inf_candidate=acc.inf_c,
        first_nonfinite=first,
    )


def worst_elements(
    golden: torch.Tensor, candidate: torch.Tensor, n: int = 5, *, chunk_elems: int = _DEFAULT_CHUNK
) -> list[tuple[tuple[int, ...], float, float, float]]:
    """The ``n`` elements with the largest ``|candidate - golden|`` as (index, golden, candidate,
    difference), largest first; an element that is NaN on either side, or an Inf not matched by the same
    Inf, ranks first. Raw values show what a metric hides: a sign flip, a factor 2, a transpose."""
    golden = check_tensor(golden, "golden")
    candidate = check_tensor(candidate, "candidate")
    if golden.shape != candidate.shape:
        raise ValueError(f"shape mismatch: golden {tuple(golden.shape)} vs candidate {tuple(candidate.shape)}")
    best: list[tuple[float, int]] = []  # (rank key, flat index)
    for offset, (g, c) in chunks((golden, candidate), chunk_elems):
        g64, c64 = g.to(F64), c.to(F64)
        diff = torch.where(g64 == c64, 0.0, (c64 - g64).abs())  # equal Infs -> 0
        key = torch.where(torch.isnan(diff), INF, diff)
        k = min(n, key.numel())
        values, index = key.topk(k)
        best.extend((float(v), offset + int(i)) for v, i in zip(values, index, strict=True))
        best = sorted(best, key=lambda item: (-item[0], item[1]))[:n]
    flat_g, flat_c = golden.reshape(-1), candidate.reshape(-1)
    out = []
    for _, flat in best:
        gv, cv = float(flat_g[flat]), float(flat_c[flat])
        out.append((unravel(flat, golden.shape), gv, cv, 0.0 if gv == cv else cv - gv))
    return out
