"""Quantized weights against the reference's: every value within its format's own rounding at its
block's scale, the tensor and the block named where not, and the classic scale bugs told from the
numbers (a scale used where its inverse is meant, a block size off, transposed scales, one expert's
scale read for every expert, a scale never applied, a weight quantized twice).

A weight stored as values `v` (e4m3, int8 or e2m1) times a scale `s` per block dequantizes to
`c = v * s`. Quantizing the reference's `r` at that scale rounds `r / s` to the nearest value of the
format, so a clean candidate holds, at every element,

    |c - r| <= s * (h(v) + |v| * EPS) + |r| * EPS

- `h(v)`: half the format's spacing at `v`: e4m3 2^(e-4) in the binade [2^e, 2^(e+1)), 2^-10 below
  the normals; int8 1/2; e2m1 1/4 below 2, 1/2 below 4, 1 at 4, and 2 at 6 (OCP MX's shared exponent
  leaves a group's largest values up to 8, which round down to 6). A value that rounded up into the
  next binade is allowed that binade's half step: more than its error, never less.
- `EPS` = 2^-8: the scale's own rounding (computed in float32 and stored in bf16, or its reciprocal
  taken: the values were rounded at a scale a relative 2^-9 away from the one stored) and a reference
  stored narrower than the weights the candidate was quantized from.
A tie rounds either way and stays within the bound. Where the reference is quantized too, its own
allowance is added (the weight was rounded twice, once by each side); in the same layout (method,
scheme and block) the two sides' scales must also agree, to SCALE_TOL (a bf16 rounding and a half),
and one checkpoint and its copy agree bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..formats import E2M1_MAX, FP4_VALUES, FP8, FP8_MAX, INT8_MAX, expand_blocks, nearest_e2m1, per_block

EPS = 2.0**-8
SCALE_TOL = 2.0**-7
# A reading of the stored values that fits the reference within this many allowances is the bug's.
FITS = 1.0
# Per-block factors within this of 1: the scales fit the values (a quarter of e4m3's smallest half step).
RATIO_FITS = 2.0**-6
# A twice-rounded weight is off by two roundings at most: beyond this many allowances it is something else.
TWICE_AT_MOST = 4.0
SHOWN = 3  # blocks listed by name in a finding
FORMAT_NAMES = {"e4m3": "e4m3", "int8": "int8", "e2m1": "e2m1 (MXFP4)"}


@dataclass(frozen=True)
class Stored:
    """A quantized weight as its checkpoint stores it: the format's values (less any zero point) and
    one scale per block, the weight being `values * scale` over each block."""

    values: torch.Tensor  # [..., rows, cols] float32
    scale: torch.Tensor  # [..., R, C] float32: per block (R = ceil(rows / block[0]), ...)
    block: tuple[int, int]  # the rows and columns one scale covers (per channel: 1, cols; per tensor: the shape)
    fmt: str  # e4m3 | int8 | e2m1
    scale_name: str = "scale"  # as the checkpoint names it: weight_scale_inv, weight_scale, _scales
    scheme: str = ""  # the layout's scheme, for words: fp8-block:128, fp8-channel, mxfp4

    def full_scale(self, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
        return expand_blocks(self.scale if scale is None else scale, block or self.block, tuple(self.values.shape))

    def dequantized(self) -> torch.Tensor:
        return self.values * self.full_scale()

    def allowance(self, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
        """Per element, the rounding of one quantization at the block's scale: s * (h(v) + |v| * EPS)."""
        return self.full_scale(scale, block) * (half_step(self.values, self.fmt) + self.values.abs() * EPS)

    def transposed(self) -> Stored:
        """The same weight in the other orientation (MXFP4 stores [out, in] for an [in, out] parameter)."""
        t = self.scale.transpose(-1, -2)
        return Stored(self.values.transpose(-1, -2), t, self.block[::-1], self.fmt, self.scale_name, self.scheme)


@dataclass
class QuantVerdict:
    """One quantized tensor judged: what is wrong in words ([]: nothing), the bug's name where the
    numbers tell it (`cause`), its scales and the factor each block's values are off by (for the
    grouping of per-expert tensors, `shared_scale`)."""

    name: str
    findings: list[str] = field(default_factory=list)
    cause: str | None = None
    scale: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    scale_name: str = "scale"


def half_step(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half the format's spacing at each value (see the module): the most that rounding to the
    nearest value of the format moves a value that lands on it."""
    a = values.abs()
    if fmt == "int8":
        return torch.full_like(a, 0.5)
    if fmt == "e2m1":
        return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, torch.where(a < E2M1_MAX, 1.0, 2.0)))
    return torch.exp2(torch.floor(torch.log2(a.clamp(min=2.0**-6))) - 4)


def round_to(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` rounded to the nearest value of the format (float32 out)."""
    if fmt == "int8":
        return x.round().clamp(-INT8_MAX, INT8_MAX)
    if fmt == "e2m1":
        mag = torch.tensor(FP4_VALUES[:8])[nearest_e2m1(x)]
        return torch.where(x < 0, -mag, mag)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()


def judge_quantized(
    name: str,
    ref: torch.Tensor,
    cand: torch.Tensor,
    stored: Stored,
    ref_stored: Stored | None = None,
    *,
    same_layout: bool = False,
    reason: bool = True,
) -> QuantVerdict:
    """The candidate's dequantized `cand` (stored as `stored`) against the reference's `ref` (stored
    as `ref_stored` where it is quantized too; `same_layout`: in the candidate's layout), all in the
    stored orientation: within the format's rounding at each block's scale, or findings naming the
    tensor, the blocks and, where the numbers tell it (`reason`), the bug."""
    ref, cand = ref.detach().float().cpu(), cand.detach().float().cpu()
    verdict = QuantVerdict(name, scale=stored.scale, scale_name=stored.scale_name)
    if cand.shape != ref.shape or stored.values.shape != ref.shape:
        verdict.findings.append(f"{name}: shape {list(cand.shape)}, the reference's {list(ref.shape)}")
        return verdict
    if torch.equal(cand, ref):
        return verdict
    err = (cand - ref).abs()
    others = _reference_allowance(ref, ref_stored)
    allowed = stored.allowance() + others
    over = ~(err <= allowed)  # a NaN is over
    scale_off = _scale_off(stored, ref_stored) if same_layout and ref_stored is not None else None
    if not bool(over.any()) and (scale_off is None or not bool(scale_off.any())):
        return verdict
    grid = tuple(stored.scale.shape)
    ratio = _block_ratio(cand, ref, stored)
    verdict.ratio = ratio
    # the readings a bug would make fit the reference as a clean candidate does: within the candidate's
    # rounding alone where the reference shares its layout (its values then lie on the same grid)
    fit = ref.abs() * EPS if same_layout else others
    cause, words = (None, "")
    if reason:
        cause, words = _cause(ref, cand, stored, ref_stored, fit, ratio, scales_only=not bool(over.any()))
    verdict.cause = cause
    bad = per_block(over.float(), grid, stored.block) > 0
    if scale_off is not None:
        bad = bad | scale_off
    times = err / allowed
    worst = _worst(per_block(times, grid, stored.block, "amax"), bad)
    count = int(over.sum())
    what = (
        f"{count} of {over.numel()} values beyond {FORMAT_NAMES.get(stored.fmt, stored.fmt)}'s rounding at their "
        f"block's scale (up to {float(times.max()):.3g} times it, at {_block_name(worst, stored)})"
        if count
        else f"its {stored.scale_name} differs from the reference's ({_scale_ratio(stored, ref_stored, scale_off)})"
    )
    verdict.findings.append(f"{name}: {_blocks_named(bad, stored)}: {what}" + (f": {words}" if words else ""))
    return verdict


def _reference_allowance(ref: torch.Tensor, ref_stored: Stored | None) -> torch.Tensor:
    """What the reference's side adds to the bound: its storage (|r| * EPS) and its own rounding where
    it is quantized."""
    out = ref.abs() * EPS
    if ref_stored is not None and ref_stored.values.shape == ref.shape:
        out = out + ref_stored.allowance()
    return out


def _scale_off(stored: Stored, ref_stored: Stored) -> torch.Tensor | None:
    """Per block, whether the candidate's scale leaves the reference's (same layout: same grid)."""
    if stored.scale.shape != ref_stored.scale.shape or stored.block != ref_stored.block:
        return None
    return (stored.scale - ref_stored.scale).abs() > SCALE_TOL * ref_stored.scale.abs()


def _block_ratio(cand: torch.Tensor, ref: torch.Tensor, stored: Stored) -> torch.Tensor:
    """Per block, the factor k with cand ~ k * ref (least squares; 1 where the reference's block is 0)."""
    grid = tuple(stored.scale.shape)
    dot = per_block((cand * ref).double(), grid, stored.block)
    norm = per_block((ref * ref).double(), grid, stored.block)
    k = torch.where(norm > 0, dot / norm.clamp(min=1e-300), torch.ones_like(dot))
    return k.float()


def _score(ref: torch.Tensor, stored: Stored, others: torch.Tensor, scale: torch.Tensor, block=None) -> float:
    """How far the stored values read with another scale grid (or block) land from the reference, in
    allowances of that reading (<= 1: as a clean candidate's would)."""
    full = stored.full_scale(scale, block)
    allowed = full * (half_step(stored.values, stored.fmt) + stored.values.abs() * EPS) + others
    return float(((stored.values * full - ref).abs() / allowed).max())


def _cause(
    ref: torch.Tensor,
    cand: torch.Tensor,
    stored: Stored,
    ref_stored: Stored | None,
    others: torch.Tensor,
    ratio: torch.Tensor,
    *,
    scales_only: bool = False,
) -> tuple[str | None, str]:
    """The bug, told by which reading of the stored values fits the reference: (its name, words).
    `scales_only`: the values are within the rounding and the scales are not the reference's: no
    other reading of the scales is looked for, only a second rounding."""
    s, name = stored.scale, stored.scale_name
    if scales_only:
        return _twice(ref, cand, stored, ref_stored, others, ratio)
    if not bool((s == 1).all()) and _score(ref, stored, others, 1.0 / s) <= FITS:
        return "inverse", (
            f"the scale used where its inverse is meant: read as 1/{name} its values fit the reference "
            "(each block is off by its scale squared)"
        )
    flipped = s.transpose(-1, -2)
    if _square(stored) and not torch.equal(s, flipped) and _score(ref, stored, others, flipped) <= FITS:
        return "transposed", (
            f"its {name} is transposed: block (i, j) holds block (j, i)'s scale, and read transposed "
            "its values fit the reference"
        )
    for b in _other_blocks(stored):
        if _score(ref, stored, others, s, b) <= FITS:
            b0, b1 = stored.block
            return "block", (
                f"a block size off: its {name} fits blocks of {b[0]}x{b[1]}, where the layout says {b0}x{b1} "
                "(weight_block_size)"
            )
    if not bool(((ratio - 1).abs() <= RATIO_FITS).all()):  # some block's values off by a factor
        implied = torch.where(ratio.abs() > 0, s / ratio, s)
        if stored.fmt == "e2m1":  # e8m0 scales are powers of two
            implied = torch.exp2(torch.log2(implied.clamp(min=2.0**-127)).round())
        if _score(ref, stored, others, implied) <= FITS:
            return _scale_cause(stored, ratio)
    return _twice(ref, cand, stored, ref_stored, others, ratio)


def _scale_cause(stored: Stored, ratio: torch.Tensor) -> tuple[str, str]:
    """The values are right and the scales wrong: how (never applied, one expert's for all, or by a factor)."""
    s, name, fmt = stored.scale, stored.scale_name, FORMAT_NAMES.get(stored.fmt, stored.fmt)
    if bool((s == 1).all()):
        return "unapplied", (
            f"a scale not applied: its {name} is 1 everywhere, so its values are the raw {fmt} numbers "
            "(each block off by 1/scale)"
        )
    if s.dim() > 2 and s.shape[0] > 1 and all(torch.equal(s[e], s[0]) for e in range(s.shape[0])):
        own = [e for e in range(s.shape[0]) if bool(((ratio[e] - 1).abs() <= RATIO_FITS).all())]
        return "shared", _shared_words(own[0] if own else 0, name)
    worst = _worst((ratio - 1).abs(), torch.ones_like(ratio, dtype=torch.bool))
    return "scale", (
        f"its {fmt} values are right and its {name} is not: at {_block_name(worst, stored)} the values "
        f"need {1 / float(ratio[worst]):.4g} times the stored scale"
    )


def _shared_words(j: int, name: str) -> str:
    return (
        f"one expert's scale read for every expert: every expert holds expert {j}'s {name}, so each "
        f"expert's values are off by the ratio of its own scale to expert {j}'s"
    )


def _twice(
    ref: torch.Tensor,
    cand: torch.Tensor,
    stored: Stored,
    ref_stored: Stored | None,
    others: torch.Tensor,
    ratio: torch.Tensor,
) -> tuple[str | None, str]:
    """Rounded twice: the values on the candidate's grid, each block's scale fitting them, off by up to
    two roundings; where the reference is quantized, its values rounded once more at the candidate's
    scale."""
    full = stored.full_scale()
    if ref_stored is not None:
        again = round_to(ref / full, stored.fmt) * full
        if float((again == cand).float().mean()) >= 0.99:
            return "twice", (
                "quantized twice: its values are the reference's, quantized already, rounded again at its own scale"
            )
        return None, ""
    times = float(((cand - ref).abs() / (stored.allowance() + others)).max())
    if stored.fmt != "e2m1" and bool(((ratio - 1).abs() <= RATIO_FITS).all()) and times <= TWICE_AT_MOST:
        return "twice", (
            f"rounded twice? every block's scale fits its values, yet they are off by up to {times:.3g} "
            "roundings of one quantization (quantized from an already quantized copy?)"
        )
    return None, ""


def _square(stored: Stored) -> bool:
    grid = stored.scale.shape
    return stored.scale.dim() >= 2 and grid[-1] == grid[-2] > 1 and stored.block[0] == stored.block[1]


def _other_blocks(stored: Stored, most: int = 64) -> list[tuple[int, int]]:
    """Square block sizes other than the layout's that give the same scale grid (a block-scaled weight
    only): powers of two first, then multiples of 16, then the rest."""
    rows, cols = stored.values.shape[-2:]
    r, c = stored.scale.shape[-2:]
    if stored.fmt != "e4m3" or stored.block in ((1, cols), (rows, cols)) or (r, c) == (1, 1):
        return []
    fits = [
        b
        for b in range(1, max(rows, cols) + 1)
        if math.ceil(rows / b) == r and math.ceil(cols / b) == c and (b, b) != stored.block
    ]
    fits.sort(key=lambda b: (b & (b - 1) != 0, b % 16 != 0, b))
    return [(b, b) for b in fits[:most]]


def shared_scale(experts: dict[int, QuantVerdict]) -> tuple[int, list[int]] | None:
    """Per-expert tensors of one projection (expert number -> verdict): where every expert holds one
    expert's scales (bitwise) and the others fail with their values right and their scales wrong, that
    expert and the failing ones; else None."""
    failing = sorted(e for e, v in experts.items() if v.findings)
    if len(experts) < 2 or not failing or any(experts[e].cause not in ("scale", "shared") for e in failing):
        return None
    scales = {e: v.scale for e, v in experts.items()}
    for j in sorted(scales):
        if j not in failing and all(s is not None and torch.equal(s, scales[j]) for s in scales.values()):
            return j, failing
    return None


def shared_finding(pattern: str, j: int, failing: list[int], total: int, scale_name: str) -> str:
    """The finding of `shared_scale`, one line for the projection's experts."""
    listed = ", ".join(map(str, failing[:8])) + (" ..." if len(failing) > 8 else "")
    return f"{pattern}: experts {listed} ({len(failing)} of {total}) fail: {_shared_words(j, scale_name)}"


def _worst(values: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    """The grid index of the largest value where `mask` holds."""
    masked = torch.where(mask, values.float(), torch.full_like(values.float(), -math.inf))
    flat = int(masked.flatten().argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), values.shape))


def _block_name(index: tuple[int, ...], stored: Stored) -> str:
    """A grid index in words: `block (1, 0)`, `channel 5`, `row 3, inputs 32-63`, with `expert e, ` in
    front for a tensor of stacked experts."""
    rows, cols = stored.values.shape[-2:]
    b0, b1 = stored.block
    *lead, i, j = index
    front = "".join(f"expert {e}, " if k == 0 else f"[{e}], " for k, e in enumerate(lead))
    if (b0, b1) == (rows, cols):
        return f"{front}its one scale"
    if b0 == 1 and b1 == cols:
        return f"{front}channel {i}"
    if b0 == 1:
        return f"{front}row {i} (inputs {j * b1}-{min((j + 1) * b1, cols) - 1})"
    return f"{front}block ({i}, {j})"


def _blocks_named(bad: torch.Tensor, stored: Stored) -> str:
    """The blocks at fault in words: every one, or the first few and how many more."""
    total, n = bad.numel(), int(bad.sum())
    rows, cols = stored.values.shape[-2:]
    if stored.block == (rows, cols):
        unit = "scale"
        if total == 1:
            return "its one scale"
    else:
        unit = "channel" if stored.block == (1, cols) else "group" if stored.block[0] == 1 else "block"
    grid = "x".join(map(str, bad.shape[-2:]))
    if bad.dim() == 3 and n < total:  # stacked experts: which, then where in each
        experts = [e for e in range(bad.shape[0]) if bool(bad[e].any())]
        named = "; ".join(f"expert {e}: {_blocks_named(bad[e], stored)}" for e in experts[:SHOWN])
        more = f"; and {len(experts) - SHOWN} more experts" if len(experts) > SHOWN else ""
        return f"{named}{more} (of {bad.shape[0]} experts)"
    if n == total:
        return f"every {unit} ({total}, a {grid} grid{' per expert' if bad.dim() > 2 else ''})"
    found = [tuple(int(i) for i in ix) for ix in bad.nonzero()[:SHOWN]]
    named = ", ".join(_block_name(ix, stored) for ix in found)
    more = f" and {n - len(found)} more" if n > len(found) else ""
    return f"{named}{more} (of {total} {unit}s)"


def _scale_ratio(stored: Stored, ref_stored: Stored | None, off: torch.Tensor | None) -> str:
    """The candidate's scale over the reference's where they differ most, in words."""
    if ref_stored is None or off is None or not bool(off.any()):
        return "no figure"
    ratio = stored.scale / ref_stored.scale.clamp(min=torch.finfo(torch.float32).tiny)
    worst = _worst((ratio - 1).abs(), off)
    return f"{float(ratio[worst]):.4g} times it at {_block_name(worst, stored)}"
