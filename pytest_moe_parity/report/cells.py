"""What a cell of the layer × component grid says, for `report.html`'s grid and `heatmap.png` alike:
its verdict, its colour, and its figure.

The colour comes from the verdict, the shade from the figure: a failed item is a strong red whatever
its figure (a config field, a weight, a router's flip share, a point at twice its limit), a passed one
green, an error amber, a skip grey; within a verdict, darker the larger the figure on one fixed scale
(:data:`SCALES`: a noise ratio from 1 to 1000, a rel_l2 from 1e-4 to 1), so one night's grid and
picture read as the next's. A failed cell shows the figure that failed it (the flip share, the field
that differs, the tensors found wrong), not the grid's figure where that one is within its limit."""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

from ..judge.result import Check
from ..words import counted
from .rows import BatchInvarianceRow, ConfigRow, ParallelRow, PointRow, RoutingRow, Row, StateRow, WeightsRow, number
from .summary import figure
from .text import fmt

# the grid's scale: a noise ratio from 1 to 1000, a rel_l2 from 1e-4 to 1 (log10 of each end)
SCALES = {True: (0.0, 3.0), False: (-4.0, 0.0)}
# each verdict's (hue, saturation %, lightness % at the scale's low end, at its high end): passed a pale
# to mid green, failed a strong to deep red (never pale), an error amber, a skip or no verdict grey
TONES = {
    "passed": (142, 45, 93, 62),
    "failed": (0, 78, 46, 30),
    "error": (38, 92, 72, 72),
    "skipped": (220, 8, 90, 90),
    "none": (220, 8, 90, 90),
}
MARKS = {"failed": "✗ ", "error": "E ", "skipped": "s "}


def grid_noise(rows: list[Row]) -> bool:
    """Whether the grid's figure is the noise ratio (some point has one), else rel_l2."""
    return any(figure(m, "noise_ratio") is not None for r in rows for m in r.by_mode().values())


def scale_position(value: float | None, noise: bool) -> float:
    """Where `value` stands on the grid's fixed scale, 0 (its low end or below) to 1 (its top or above)."""
    if value is None or math.isnan(value):
        return 0.0
    if math.isinf(value) or value <= 0:
        return 1.0 if value > 0 else 0.0
    lo, hi = SCALES[noise]
    return min(1.0, max(0.0, (math.log10(value) - lo) / (hi - lo)))


def tone(verdict: str, value: float | None, noise: bool) -> tuple[int, int, int]:
    """(hue, saturation %, lightness %) of a cell: the hue and the range of lightness its verdict's."""
    hue, sat, light, dark = TONES.get(verdict, TONES["none"])
    return hue, sat, round(light + (dark - light) * scale_position(value, noise))


def shade(verdict: str, value: float | None, noise: bool) -> tuple[str, str]:
    """A cell's CSS (background, ink)."""
    hue, sat, light = tone(verdict, value, noise)
    return f"hsl({hue} {sat}% {light}%)", "#fff" if light < 58 else "#1b1f24"


def rgb(verdict: str, value: float | None, noise: bool) -> tuple[float, float, float]:
    """A cell's background as (r, g, b) in 0..1: the page's colour, for the pictures."""
    hue, sat, light = tone(verdict, value, noise)
    return colorsys.hls_to_rgb(hue / 360, light / 100, sat / 100)


@dataclass
class Face:
    """A cell as drawn: its verdict, the grid's figure (its shade; `noise`: a noise ratio, else
    rel_l2), the text it shows, and its tooltip."""

    verdict: str
    value: float | None
    noise: bool
    text: str
    tip: str

    @property
    def colours(self) -> tuple[str, str]:
        return shade(self.verdict, self.value, self.noise)

    @property
    def rgb(self) -> tuple[float, float, float]:
        return rgb(self.verdict, self.value, self.noise)


def face(row: Row, mode: str, noise: bool) -> Face:
    """The cell of `row` in `mode` on a grid of noise ratios (`noise`) or of rel_l2."""
    if isinstance(row, PointRow):
        judged = row.by_mode().get(mode)
        verdict = row.verdict(mode) if judged is not None else None
    else:  # a weight or config item, an item not judged, a differential: one verdict whatever the mode
        judged, verdict = row, row.status
    if row.status in ("error", "skipped"):
        verdict = row.status
    verdict = verdict or "none"
    value = figure(judged, "noise_ratio" if noise else "rel_l2") if judged is not None else None
    if noise and value is None and judged is not None:  # a point without noise figures: its rel_l2
        value, noise = figure(judged, "rel_l2"), False
    named = "noise ratio" if noise else "rel_l2"
    tip = f"{row.id}: {verdict}"
    said = failed_by(judged, noise) if verdict == "failed" and judged is not None else None
    if said is not None:
        text, why = said
        tip += f", {why}"
    else:
        bare = "ok" if verdict == "passed" else "" if verdict in MARKS else "-"  # a weight item: no figure
        text = compact(value) if value is not None else bare
    if value is not None:
        tip += f"; {named} {fmt(value, 4)}"
    return Face(verdict, value, noise, (MARKS.get(verdict, "") + text).strip(), tip)


def failed_by(row: Row, noise: bool) -> tuple[str, str] | None:
    """What failed a failed item, as (the cell's words, the tooltip's): the config's first field that
    differs, the count of tensors found wrong, or a point's failed check (the grid's own figure where
    that failed, else the first that did: a flip share, a cosine). None: nothing to name beyond the
    grid's figure (a differential: its figure is its run's rel_l2)."""
    if isinstance(row, ConfigRow):
        if not row.findings:
            return None
        first = row.findings[0]
        more = f" (+{len(row.findings) - 1} more)" if len(row.findings) > 1 else ""
        short = first if len(first) <= 40 else first[:39] + "…"
        return short + more, f"config field differs: {first}{more}"
    if isinstance(row, WeightsRow):
        if not row.findings:
            return None
        n = len(row.findings)
        return counted(n, "tensor"), f"{counted(n, 'tensor')} differ: {row.findings[0]}"
    if isinstance(row, RoutingRow | BatchInvarianceRow | ParallelRow | StateRow):
        return _differential(row)
    if not isinstance(row, PointRow):
        return None
    failed = [c for c in row.checks if not c.passed]
    if not failed:
        return None
    own = "noise_ratio" if noise else "rel_l2"
    check = next((c for c in failed if c.name == own), failed[0])
    limit = f" (limit {check.op} {fmt(check.limit, 3)})" if check.limit is not None else ""
    why = f"failed {check.target}.{check.name} {fmt(check.value, 4)}{limit}"
    if check.name == own:
        return compact(check.value), why
    return check_words(check), why


def _differential(row: Row) -> tuple[str, str] | None:
    """What failed a differential: its own routing's error (a routing item), the rows batching changes
    (a batch item), plan B's error against plan A (a parallel item)."""
    if isinstance(row, RoutingRow):
        own = next((level for level in row.levels if level.get("level") == "own"), None)
        value = number(own.get("rel_l2")) if own else None
        if value is None:
            return None
        recovered = f"; forcing the golden's {row.recovered} recovers it" if row.recovered else ""
        return f"own {compact(value)}", f"its own routing's rel_l2 {fmt(value, 4)}{recovered}"
    if isinstance(row, BatchInvarianceRow):
        if not row.changed_rows:
            return None
        shown = ", ".join(map(str, row.changed_rows[:4])) + ("…" if len(row.changed_rows) > 4 else "")
        return f"rows {shown}", f"rows {', '.join(map(str, row.changed_rows))} change in the batch ({row.condition})"
    if isinstance(row, ParallelRow):
        value = number(row.figures.get("b_vs_a"))
        plans = " vs ".join(reversed(row.plans)) or "B vs A"
        return (f"B/A {compact(value)}", f"{plans}: rel_l2 {fmt(value, 4)}") if value is not None else None
    if isinstance(row, StateRow):
        value = number(row.figures.get("state_vs_clean"))
        if value is not None:
            return f"state {compact(value)}", f"{row.said or row.serving_state}: rel_l2 {fmt(value, 4)} to clean"
    return None


def check_words(check: Check) -> str:
    """A failed check in a few characters: `flip 75%`, `cos 0.9973`, `tok 0.57`, `2 NaN/Inf`."""
    v = check.value
    if check.name == "flip_share":
        return f"{'top-1 flip' if check.target == 'top1' else 'flip'} {_pct(v)}"
    if check.name == "within":
        return f"within {_pct(v)}"
    if check.name == "cosine":
        return f"cos {v:.4f}" if math.isfinite(v) else f"cos {compact(v)}"
    if check.name in ("shape", "type"):
        return check.name
    if check.name == "finite":
        return f"{int(v)} NaN/Inf" if math.isfinite(v) else "NaN/Inf"
    short = {"max_token_rel_l2": "tok", "rel_l2": "rel", "noise_ratio": "R"}.get(check.name, check.name)
    return f"{short} {compact(v)}"


def _pct(v: float) -> str:
    if not math.isfinite(v):
        return compact(v)
    return f"{100 * v:.0f}%" if v >= 0.01 or v == 0 else f"{100 * v:.1g}%"


def compact(x: float | None) -> str:
    """A figure in a grid cell: two significant digits (three from 100 to 999), no `+` in exponents."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 999.5 or a < 0.01:
        mantissa, _, exponent = f"{x:.1e}".partition("e")
        return f"{mantissa}e{int(exponent)}"
    if a < 0.995:
        return f"{x:.2f}"
    return f"{x:.2g}" if a < 9.95 else f"{x:.0f}"
