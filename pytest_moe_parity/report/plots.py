"""The report's pictures, drawn from the JSON rows alone (so `moe-parity report DIR` redraws them):

- `heatmap.png`: layer x component, colour = the noise ratio where the golden has noise figures in the
  candidate's dtype, else rel_l2 (log scale); failed points crossed, errors and skips marked;
- `layers.png`: per layer, the error of its `output` point isolated and chained, with the reference's
  own error up to `noise_factor` times it as a band;
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
from ..points import COMPONENTS, OUTPUT
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
    for step in steps:  # the prefill, then each decode step apart: one step's colours never hide another's
        these = [r for r in rows if r.step == step]
        suffix = "" if step is None else f".step_{step}"
        written.append(_save(heatmap(these, new), directory / HEATMAP.replace(".png", f"{suffix}.png")))
        if any(r.layer is not None for r in these):
            written.append(_save(layer_errors(these, new), directory / LAYERS.replace(".png", f"{suffix}.png")))
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


def heatmap(rows: list[Row], new) -> Any:
    """Layer x component; one panel per mode."""
    import numpy as np
    from matplotlib.colors import LogNorm

    rows = [r for r in rows if r.component in COMPONENTS]  # weight items have no activation figures
    modes = sorted({m for r in rows for m in r.by_mode()}, key=("isolated", "chain").index)
    present = {r.component for r in rows}
    columns = [c for c in COMPONENTS if c in present]
    layers = sorted({r.layer for r in rows if r.layer is not None})
    labels = (
        ["model", *(f"layer {i}" for i in layers)]
        if any(r.layer is None for r in rows)
        else [f"layer {i}" for i in layers]
    )
    row_of = {None: 0, **{layer: labels.index(f"layer {layer}") for layer in layers}}
    noise = any(figure(m, "noise_ratio") is not None for r in rows for m in r.by_mode().values())
    shown = "noise_ratio" if noise else "rel_l2"
    label = "noise ratio" if noise else "rel_l2"
    fig = new(1.6 + 0.75 * len(columns) * len(modes), 1.4 + 0.28 * len(labels))
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    for ax, mode in zip(axes, modes, strict=True):
        grid = np.full((len(labels), len(columns)), np.nan)
        for r in rows:
            m = r.by_mode().get(mode)
            if m is None:
                continue
            y, x = row_of[r.layer], columns.index(r.component)
            value = figure(m, shown)
            verdict = r.verdict(mode)
            status = r.status
            if value is not None and math.isfinite(value):
                grid[y, x] = max(value, 1e-9)
            if status in ("error", "skipped"):
                ax.text(x, y, "E" if status == "error" else "s", ha="center", va="center", fontsize=8)
            elif verdict == "failed":
                ax.plot(x, y, marker="x", color="black", markersize=9, markeredgewidth=2)
        finite = grid[np.isfinite(grid)]
        norm = LogNorm(vmin=max(finite.min(), 1e-9), vmax=max(finite.max(), finite.min() * 10)) if finite.size else None
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", norm=norm)
        ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(f"{mode}: {label} (x failed)", fontsize=9)
        if finite.size:
            fig.colorbar(image, ax=ax, label=label)
    return fig


def layer_errors(rows: list[Row], new) -> Any:
    """The error of each layer's `output` point (its last point where it has none), isolated and
    chained, with the band of the reference's own error up to noise_factor times it."""
    last: dict[int, Row] = {}
    for r in sorted(rows, key=lambda r: r.order):
        if r.layer is None or r.status not in ("passed", "failed"):
            continue
        if r.component == OUTPUT or r.layer not in last or last[r.layer].component != OUTPUT:
            last[r.layer] = r
    layers = sorted(last)
    fig = new(7, 4)
    ax = fig.subplots()
    styles = {"isolated": ("tab:blue", "o"), "chain": ("tab:red", "s")}
    for mode, (colour, marker) in styles.items():
        points = [(i, last[i].by_mode().get(mode)) for i in layers]
        points = [(i, m) for i, m in points if m is not None and figure(m, "rel_l2") is not None]
        if not points:
            continue
        xs = [i for i, _ in points]
        ax.plot(xs, [max(figure(m, "rel_l2"), 1e-12) for _, m in points], color=colour, marker=marker, label=mode)
        band = [(i, m) for i, m in points if isinstance(m, PointRow) and (m.noise or {}).get("targets")]
        if band:
            ref = [_reference(m) for _, m in band]
            factor = [number(m.limits.get("noise_factor")) or 1.0 for _, m in band]
            ax.fill_between(
                [i for i, _ in band],
                ref,
                [a * b for a, b in zip(ref, factor, strict=True)],
                color=colour,
                alpha=0.15,
                label=f"{mode}: the reference's own error .. x noise_factor",
            )
        failed = [(i, m) for i, m in points if last[i].verdict(mode) == "failed"]
        if failed:
            ax.plot(
                [i for i, _ in failed],
                [max(figure(m, "rel_l2"), 1e-12) for _, m in failed],
                linestyle="none",
                marker="x",
                markersize=10,
                color="black",
            )
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("rel_l2 of the layer's output")
    ax.set_xticks(layers)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


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
