"""The pictures' scales and limits, read from the figures' own data (no pixels): `heatmap.png` in the
page's grid colours on one fixed scale (a clean run's healthy cell is the same colour in a failing
run), with the config and weight items, a title per step; `layers.png` with each point kind's limit
drawn and a y-range that does not make a small spread a cliff."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pytest_moe_parity.report import plots
from pytest_moe_parity.report.cells import SCALES, rgb
from pytest_moe_parity.report.rows import Row

pytest.importorskip("matplotlib")
LIMIT = 0.04  # the rel_l2 limit of every point below


def point(
    layer: int | None, component: str, rel: float, *, ratio: float | None = None, ref: float | None = None,
    step: int | None = None, order: float = 0, failed: bool | None = None, flip: float | None = None,
) -> Row:  # fmt: skip
    """A judged point as a report holds it: its rel_l2 judged against LIMIT (and, with `ratio`, the
    reference's own error `ref` times 1.5), a router's flip share against 0.05."""
    checks = [{"name": "rel_l2", "target": "out", "value": rel, "limit": LIMIT, "op": "<=", "passed": rel <= LIMIT}]
    if flip is not None:
        checks.append({"name": "flip_share", "target": "top_k", "value": flip, "limit": 0.05, "op": "<=",
                       "passed": flip <= 0.05})  # fmt: skip
    status = "failed" if (failed if failed is not None else not all(c["passed"] for c in checks)) else "passed"
    where = f"layer_{layer}.{component}" if layer is not None else component
    data = {
        "id": where if step is None else f"step_{step}.{where}", "order": order, "layer": layer, "step": step,
        "component": component, "status": status, "mode": "isolated", "verdicts": {"isolated": status},
        "metrics": {"out": {"rel_l2": rel, "cosine": 1.0}}, "checks": checks,
        "limits": {"rel_l2": LIMIT, "noise_factor": 1.5},
    }  # fmt: skip
    if ratio is not None:
        data["noise"] = {"ratio": ratio, "targets": {"out": {"reference_rel_l2": ref or rel / ratio}}}
    return Row.from_json(data)


def config(failed: bool) -> Row:
    return Row.from_json({"id": "config", "order": -2, "layer": None, "step": None, "component": "config",
                          "status": "failed" if failed else "passed",
                          "findings": ["rms_norm_eps: 1e-06 → 0.001"] if failed else []})  # fmt: skip


def weights(layer: int) -> Row:
    return Row.from_json({"id": f"layer_{layer}.weights", "order": layer * 10 - 1, "layer": layer, "step": None,
                          "component": "weights", "status": "passed", "findings": []})  # fmt: skip


def outputs(errors: list[float], **kw) -> list[Row]:
    return [point(i, "output", e, order=i * 10 + 5, **kw) for i, e in enumerate(errors)]


def cell_colour(fig, row: int, column: str) -> tuple[float, ...]:
    ax = fig.axes[0]
    columns = [t.get_text() for t in ax.get_xticklabels()]
    return tuple(float(v) for v in ax.images[0].get_array()[row, columns.index(column)])


# -- heatmap.png ----------------------------------------------------------------------------------
def test_the_heatmap_is_on_the_page_s_fixed_scale_whatever_the_run() -> None:
    """A healthy attention (noise ratio 1.2) has one colour in a clean run and in a run whose other
    points fail at ratios of 500: the page's (`cells.rgb`), not a scale stretched to the run."""
    new = plots._canvas()
    clean = [*outputs([4e-3, 5e-3], ratio=1.0), point(0, "attention", 3e-3, ratio=1.2, order=1)]
    failing = [*outputs([0.5, 0.6], ratio=500.0, failed=True), point(0, "attention", 3e-3, ratio=1.2, order=1)]
    colours = [cell_colour(plots.heatmap(rows, new), 0, "attention") for rows in (clean, failing)]
    assert colours[0] == colours[1] == pytest.approx(rgb("passed", 1.2, True))
    red = cell_colour(plots.heatmap(failing, new), 0, "output")
    assert red == pytest.approx(rgb("failed", 500.0, True)) and red[0] > 0.4 and red[0] - max(red[1:]) > 0.3
    # the colour bars: the fixed scale of each verdict (noise ratio 1 to 1000)
    fig = plots.heatmap(failing, new)
    bars = [a._colorbar for a in fig.axes if getattr(a, "_colorbar", None) is not None]
    lo, hi = SCALES[True]
    assert sorted(b.mappable.norm.vmin for b in bars) == [10**lo] * 2
    assert [b.mappable.norm.vmax for b in bars] == [10**hi] * 2


def test_the_heatmap_has_the_config_and_weight_items_and_a_flip_share() -> None:
    new = plots._canvas()
    rows = [config(True), weights(0), point(0, "router", 2e-3, ratio=1.0, flip=0.25, order=3), *outputs([4e-3])]
    fig = plots.heatmap(rows, new)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["config", "weights"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["model", "layer 0"]
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    columns = [t.get_text() for t in ax.get_xticklabels()]
    assert texts[(0, columns.index("config"))] == "✗ rms_norm_eps"  # the field, not a blank
    assert texts[(1, columns.index("router"))] == "✗ flip 25%"  # not its noise ratio of 1
    assert texts[(1, columns.index("weights"))] == "ok"
    assert cell_colour(fig, 0, "config") == pytest.approx(rgb("failed", None, True))
    assert cell_colour(fig, 1, "router") == pytest.approx(rgb("failed", 1.0, True))


def test_each_step_s_pictures_have_their_own_title(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    titles: list[str] = []
    for name in ("heatmap", "layer_errors"):
        drawn = getattr(plots, name)

        def keep(*args, drawn=drawn):
            fig = drawn(*args)
            titles.append(fig.axes[0].get_title())
            return fig

        monkeypatch.setattr(plots, name, keep)
    rows = [*outputs([4e-3, 5e-3]), *(point(i, "output", 6e-3, step=1, order=100 + i) for i in range(2))]
    plots.render_plots(rows, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "heatmap.png", "heatmap.step_1.png", "layers.png", "layers.step_1.png"
    ]  # fmt: skip
    assert len(set(titles)) == 4
    assert [t.split(",")[0].split(":")[0] for t in titles] == ["prefill", "prefill", "decode step 1", "decode step 1"]


# -- layers.png -----------------------------------------------------------------------------------
def lines(fig) -> dict[str, tuple[list[float], str]]:
    """The figure's lines by label: their y values and colour."""
    from matplotlib.colors import to_hex

    return {ln.get_label(): (list(ln.get_ydata()), to_hex(ln.get_color())) for ln in fig.axes[0].get_lines()}


def test_a_small_spread_is_drawn_flat_under_its_limit() -> None:
    """3.9e-3 to 5.3e-3 under a limit of 0.04: the axis spans at least two decades with the limit
    drawn in it, so the spread takes a small part of the height instead of all of it."""
    fig = plots.layer_errors(outputs([3.9e-3, 5.3e-3, 4.4e-3, 4.1e-3]), plots._canvas())
    drawn = lines(fig)
    assert drawn["output: rel_l2 limit"][0] == [LIMIT] * 4
    lo, hi = fig.axes[0].get_ylim()
    assert math.log10(hi / lo) >= plots.MIN_DECADES and lo < 3.9e-3 and hi > LIMIT
    share = math.log10(5.3e-3 / 3.9e-3) / math.log10(hi / lo)
    assert share < 0.1, share
    assert drawn["isolated: passed"][1] == "#2e7d32" and "isolated: failed" not in drawn


def test_just_past_the_limit_reads_apart_from_just_under_it() -> None:
    """0.041 failed and 0.037 passed: the limit line between them, the one red, the other green."""
    fig = plots.layer_errors(outputs([0.037, 0.041]), plots._canvas())
    drawn = lines(fig)
    assert drawn["isolated: failed"] == ([0.041], "#c62828")
    assert drawn["isolated: passed"] == ([0.037], "#2e7d32")
    assert drawn["output: rel_l2 limit"][0] == [LIMIT, LIMIT]
    lo, hi = fig.axes[0].get_ylim()
    assert lo < 0.037 < LIMIT < 0.041 < hi


def test_the_noise_limit_is_drawn_where_the_golden_has_noise_figures() -> None:
    rows = outputs([4e-3, 5e-3], ratio=1.1, ref=4e-3)
    drawn = lines(plots.layer_errors(rows, plots._canvas()))
    (noise,) = [label for label in drawn if label.startswith("noise limit")]
    assert drawn[noise][0] == pytest.approx([4e-3 * 1.5, 4e-3 * 1.5])


def test_the_y_range_spans_two_decades_at_least() -> None:
    lo, hi = plots.y_range([1e-3, 1.1e-3])
    assert math.log10(hi / lo) >= 2 and lo < 1e-3 and hi > 1.1e-3
    lo, hi = plots.y_range([1e-6, 1.0])  # wider already: kept, with a margin
    assert lo == pytest.approx(1e-6 / 1.5) and hi == pytest.approx(1.5)
