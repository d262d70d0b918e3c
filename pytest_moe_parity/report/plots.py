"""The report's pictures, drawn from the JSON rows alone (so `moe-parity report DIR` redraws them):

- `heatmap.png`: layer x item kind (config and weight items included), each cell in report.html's grid
  colour (the verdict's hue, shaded by the noise ratio where the golden has noise figures in the
  candidate's dtype, else rel_l2, on one fixed log scale), with the figure that failed a failed item;
- `layers.png`: per layer, the error of its `output` point isolated and chained, coloured by verdict,
  with its limits drawn and the reference's own error up to `noise_factor` times it as a band;
- with decode steps, `heatmap.step_K.png` and `layers.step_K.png` for step K beside the prefill's;
- `tokens_<point>.png` per failed point: each token's own error against the token limit, tokens left
  out in grey.

matplotlib is an optional extra (`pip install 'pytest-moe-parity[plots]'`), drawn through its
object API with the Agg canvas: no pyplot, no global state touched in the user's process."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..errors import ParityError
from ..judge.tolerances import TOKEN_LIMIT
from ..points import COMPONENTS, CONFIG, OUTPUT, WEIGHTS
from .cells import SCALES, face, grid_noise, rgb, tone
from .rows import DIFFERENTIALS, PointRow, Row, number
from .summary import figure

HEATMAP = "heatmap.png"
LAYERS = "layers.png"
TOKENS_PREFIX = "tokens_"
PLOTS_HINT = "plots need matplotlib: pip install 'pytest-moe-parity[plots]'"
MAX_TOKEN_PLOTS = 20  # per-token plots of the first failed points; the rest are counted


class PlotsUnavailable(ParityError, RuntimeError):
    """matplotlib is not installed."""


def _canvas():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(PLOTS_HINT) from None

    def new(width: float, height: float):
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        return fig

    return new


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _safe_name(pid: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in pid)


def render_plots(rows: list[Row], directory: Path) -> list[Path]:
    """Draw every picture of a run's rows into `directory`; returns the paths written. Raises
    PlotsUnavailable without matplotlib. Old pictures of failed points that no longer fail are removed,
    so the directory shows one run."""
    # a differential's item runs its point again, a drill's op is a step inside one: not the pictures' points
    rows = [r for r in rows if r.kind != "op" and r.kind not in DIFFERENTIALS]
    new = _canvas()
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{TOKENS_PREFIX}*.png"):
        stale.unlink()
    for stale in (*directory.glob("heatmap.step_*.png"), *directory.glob("layers.step_*.png")):
        stale.unlink()
    written = []
    steps = sorted({r.step for r in rows}, key=lambda s: -1 if s is None else s)
    noise = grid_noise(rows)  # the page's figure for the whole run: every step's picture on its scale
    for step in steps:  # the prefill, then each decode step apart: one step's colours never hide another's
        these = [r for r in rows if r.step == step]
        suffix = "" if step is None else f".step_{step}"
        picture = heatmap(these, new, noise, step)
        written.append(_save(picture, directory / HEATMAP.replace(".png", f"{suffix}.png")))
        if any(r.layer is not None for r in these):
            picture = layer_errors(these, new, step)
            written.append(_save(picture, directory / LAYERS.replace(".png", f"{suffix}.png")))
    failed = [
        (mode, r)
        for row in rows
        for mode, r in row.by_mode().items()
        if r.status != "skipped" and row.verdict(mode) == "failed" and isinstance(r, PointRow) and r.token_errors
    ]
    for mode, r in failed[:MAX_TOKEN_PLOTS]:
        written.append(_save(token_errors(r, mode, new), directory / token_plot_name(r.id, mode)))
    return written


def token_plot_name(point: str, mode: str) -> str:
    """The file name of a failed point's per-token picture in `mode` (report.html finds it by it)."""
    suffix = "" if mode == "isolated" else f".{mode}"
    return f"{TOKENS_PREFIX}{_safe_name(point)}{suffix}.png"


def step_name(step: int | None) -> str:
    """A picture's step in its title: the prefill, or decode step N."""
    return "prefill" if step is None else f"decode step {step}"


def heatmap(rows: list[Row], new, noise: bool | None = None, step: int | None = None) -> Any:
    """Layer x item kind, one panel per mode, each cell in the colour report.html's grid gives it
    (:func:`~.cells.face`: its verdict's hue, shaded by its figure on the fixed scale of
    :data:`~.cells.SCALES`, never rescaled to the run), config and weight items included; `noise`: the
    grid's figure is the noise ratio (None: where some row has one), as the page decides it over
    the whole run."""
    import numpy as np

    rows = [r for r in rows if r.component in (CONFIG, WEIGHTS, *COMPONENTS)]
    noise = grid_noise(rows) if noise is None else noise
    modes = sorted({m for r in rows for m in r.by_mode()}, key=("isolated", "chain").index) or ["isolated"]
    present = {r.component for r in rows}
    columns = [c for c in (CONFIG, WEIGHTS, *COMPONENTS) if c in present]
    layers = sorted({r.layer for r in rows if r.layer is not None})
    labels = ["model"] * any(r.layer is None for r in rows) + [f"layer {i}" for i in layers]
    row_of = {None: 0, **{layer: labels.index(f"layer {layer}") for layer in layers}}
    label = "noise ratio" if noise else "rel_l2"
    written = len(labels) * len(columns) <= 400  # a small grid says each cell's figure, as the page does
    fig = new(2.6 + (0.95 if written else 0.5) * len(columns) * len(modes), 1.6 + 0.3 * len(labels))
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    for ax, mode in zip(axes, modes, strict=True):
        image = np.full((len(labels), len(columns), 3), EMPTY)
        for r in rows:
            if r.kind == "point" and mode not in r.by_mode():
                continue
            y, x = row_of[r.layer], columns.index(r.component)
            cell = face(r, mode, noise)
            image[y, x] = cell.rgb
            text = cell.text if written else cell.text[:1] if cell.verdict in ("failed", "error", "skipped") else ""
            light = tone(cell.verdict, cell.value, cell.noise)[2]
            short = text if len(text) <= 16 else text.split(":")[0]  # a config field: its name
            short = short if len(short) <= 16 else short[:15] + "…"
            ax.text(x, y, short, ha="center", va="center", fontsize=6.5, color="white" if light < 58 else "#1b1f24")
        ax.imshow(image, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(f"{step_name(step)}, {mode}: {label} (red: failed)", fontsize=9)
    for verdict in ("failed", "passed"):  # the fixed scale, as the page's legend shows it
        fig.colorbar(scale_bar(verdict, noise), ax=list(axes), label=f"{verdict}: {label}", fraction=0.04, pad=0.02)
    return fig


EMPTY = (0.96, 0.96, 0.96)  # a layer without that item


def scale_bar(verdict: str, noise: bool) -> Any:
    """The colours of `verdict` on the grid's fixed scale, as a colour bar's mappable."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, LogNorm

    lo, hi = SCALES[noise]
    colours = [rgb(verdict, 10 ** (lo + (hi - lo) * i / 63), noise) for i in range(64)]
    return ScalarMappable(norm=LogNorm(vmin=10**lo, vmax=10**hi), cmap=ListedColormap(colours))


def layer_errors(rows: list[Row], new, step: int | None = None) -> Any:
    """The error of each layer's `output` point (its last point where it has none), isolated and
    chained: each point coloured by its verdict (green passed, red failed), each kind of point's limit
    drawn (its rel_l2 limit; with noise figures the reference's own error and that times noise_factor),
    on a log axis that spans at least two decades around what it shows, so that a small spread does
    not read as a cliff and a point just past its limit reads as past it."""
    last: dict[int, Row] = {}
    for r in sorted(rows, key=lambda r: r.order):
        if r.layer is None or r.status not in ("passed", "failed"):
            continue
        if r.component == OUTPUT or r.layer not in last or last[r.layer].component != OUTPUT:
            last[r.layer] = r
    layers = sorted(last)
    fig = new(7, 4)
    ax = fig.subplots()
    shown: list[float] = []
    limits: dict[tuple[str, ...], list[tuple[int, float]]] = {}
    for mode, (colour, style) in {"isolated": ("tab:blue", "-"), "chain": ("tab:purple", "--")}.items():
        points = [(i, last[i].by_mode().get(mode)) for i in layers]
        points = [(i, m) for i, m in points if m is not None and figure(m, "rel_l2") is not None]
        if not points:
            continue
        ys = [max(figure(m, "rel_l2"), 1e-12) for _, m in points]
        shown += ys
        ax.plot([i for i, _ in points], ys, color=colour, linestyle=style, linewidth=1, label=f"{mode}")
        for verdict, (marker, dot) in VERDICT_MARKS.items():
            at = [(i, y) for (i, _), y in zip(points, ys, strict=True) if last[i].verdict(mode) == verdict]
            if at:
                ax.plot(*zip(*at, strict=True), linestyle="none", marker=marker, color=dot, markersize=8,
                        label=f"{mode}: {verdict}")  # fmt: skip
        band = [(i, m) for i, m in points if isinstance(m, PointRow) and (m.noise or {}).get("targets")]
        if band:  # the reference's own error in the candidate's dtype, up to noise_factor times it
            ref = [_reference(m) for _, m in band]
            factor = [number(m.limits.get("noise_factor")) or 1.0 for _, m in band]
            top = [a * b for a, b in zip(ref, factor, strict=True)]
            ax.fill_between([i for i, _ in band], ref, top, color=colour, alpha=0.12, label=f"{mode}: noise band")
            shown += ref
        for i, m in points:
            for key, value in _limits(m, last[i].component, mode):
                limits.setdefault(key, []).append((i, value))
    for (name, *_), series in sorted(limits.items()):
        xs, ys = zip(*series, strict=True)
        shown += ys
        style = ":" if name.startswith("noise") else "--"
        ax.plot(xs, ys, color="black", linestyle=style, linewidth=1.2, drawstyle="steps-mid", label=name)
    ax.set_yscale("log")
    if shown:
        ax.set_ylim(*y_range(shown))
    ax.set_xlabel("layer")
    ax.set_ylabel("rel_l2 of the layer's output")
    ax.set_xticks(layers)
    ax.set_title(f"{step_name(step)}: each layer's error against its limits", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


VERDICT_MARKS = {"passed": ("o", "#2e7d32"), "failed": ("X", "#c62828")}
MIN_DECADES = 2.0  # the y-axis spans at least this many decades


def y_range(values: list[float]) -> tuple[float, float]:
    """The log axis's range over `values` (the errors and limits shown): at least MIN_DECADES
    decades, centred on them, with a margin."""
    lo, hi = min(values), max(values)
    span = math.log10(hi / lo)
    if span < MIN_DECADES:
        pad = (MIN_DECADES - span) / 2
        lo, hi = lo / 10**pad, hi * 10**pad
    return lo / 1.5, hi * 1.5


def _limits(row: Row, component: str, mode: str) -> list[tuple[tuple[str, ...], float]]:
    """The limits a point's rel_l2 is judged by, as (the line's name, value): its rel_l2 limit, and
    with noise figures the reference's own error times noise_factor."""
    out = []
    if not isinstance(row, PointRow):
        return out
    main = row.shown or "out"
    rel = next((c.limit for c in row.checks if c.name == "rel_l2" and c.target == main and c.limit), None)
    if rel is not None:
        out.append(((f"{component}: rel_l2 limit",), float(rel)))
    factor = number(row.limits.get("noise_factor"))
    if (row.noise or {}).get("targets") and factor:
        out.append(((f"noise limit ({mode}): the reference's error x {factor:g}",), _reference(row) * factor))
    return out


def _reference(row: PointRow) -> float:
    targets = (row.noise or {})["targets"]
    first = next(iter(targets.values()))
    return max(number(first.get("reference_rel_l2")) or 0.0, 1e-12)


def token_errors(row: PointRow, mode: str, new) -> Any:
    """Each token's error of a failed point, the token limit as a line, left-out tokens in grey."""
    values = row.token_errors or []
    fig = new(max(5.0, min(14.0, 0.12 * len(values) + 2)), 3.2)
    ax = fig.subplots()
    kept = [(t, number(v)) for t, v in enumerate(values) if v is not None]
    finite = [v for _, v in kept if v is not None and math.isfinite(v)]
    top = max(finite) if finite else 1.0
    heights = [v if v is not None and math.isfinite(v) else top * 1.2 for _, v in kept]
    ax.bar([t for t, _ in kept], heights, color="tab:red", width=0.8, label="token rel_l2")
    left_out = [t for t, v in enumerate(values) if v is None]
    if left_out:
        ax.bar(left_out, [top] * len(left_out), color="lightgrey", width=0.8, label="left out (routed elsewhere)")
    # the token limit where it was judged (a chained point under the noise verdict has none)
    limit = next((c.limit for c in row.checks if c.name == TOKEN_LIMIT.check_name), None)
    if limit is not None:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"token_rel_l2 limit {limit:g}")
    ax.set_xlabel("token")
    ax.set_ylabel("rel_l2 of the token")
    ax.set_title(f"{row.id} ({mode})", fontsize=10)
    ax.legend(fontsize=8)
    return fig
