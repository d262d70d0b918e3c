"""The page's markup (:func:`el`, which escapes every child and attribute value that is not
:class:`Safe`), its figures in a few characters, its colour scale and its per-token chart (inline
SVG): what `report.html` (:mod:`.html`) is drawn with. No report here."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

from .cells import SCALES, shade
from .rows import number
from .text import fmt


# -- markup ---------------------------------------------------------------------------------------
class Safe(str):
    """Markup: already escaped, or built by :func:`el` from escaped parts."""


def esc(value: Any) -> Safe:
    return value if isinstance(value, Safe) else Safe(html.escape(str(value), quote=True))


def _children(items: Iterable[Any]) -> Iterable[Safe]:
    for item in items:
        if item is None or item is False:
            continue
        if isinstance(item, list | tuple):
            yield from _children(item)
        else:
            yield esc(item)


def el(tag: str, /, *children: Any, attrs: dict[str, Any] | None = None, **kw: Any) -> Safe:
    """`<tag attrs>children</tag>`: every child not :class:`Safe` and every attribute value
    escaped. Keyword attributes: a trailing `_` is dropped (`class_`), `_` reads `-` (`data_point`);
    `attrs` for the names that are no Python keyword (`stroke-width`); None or False leaves the
    attribute out, True writes it bare."""
    every = {**{k.rstrip("_").replace("_", "-"): v for k, v in kw.items()}, **(attrs or {})}
    parts = [tag]
    for key, value in every.items():
        if value is None or value is False:
            continue
        parts.append(key if value is True else f'{key}="{esc(value)}"')
    head = " ".join(parts)
    if tag in _VOID:
        return Safe(f"<{head}>")
    return Safe(f"<{head}>{''.join(_children(children))}</{tag}>")


_VOID = {"img", "meta", "br", "hr"}


def join(*parts: Any) -> Safe:
    return Safe("".join(_children(parts)))


# -- figures ---------------------------------------------------------------------------------------
def sort_value(x: float | None) -> str:
    """A cell's sort key for the script ('' sorts last)."""
    if x is None or math.isnan(x):
        return ""
    return repr(float(x)) if math.isfinite(x) else ("1e400" if x > 0 else "-1e400")


# -- colours -------------------------------------------------------------------------------------
def legend(noise: bool) -> Safe:
    """The swatches of the grid's colours on its scale (noise ratios, or rel_l2 where the golden has
    no noise figures)."""
    lo, hi = SCALES[noise]
    ends = ("≤1", "30", "≥1000") if noise else ("≤1e-4", "1e-2", "≥1")

    def swatch(verdict: str, t: float, text: str) -> Safe:
        colour, ink = shade(verdict, 10 ** (lo + t * (hi - lo)), noise)
        return el("span", text, class_="sw", style=f"background:{colour};color:{ink}")

    items: list[Any] = [el("span", "passed", class_="lg")]
    items += [swatch("passed", t, text) for t, text in zip((0.0, 0.5, 1.0), ends, strict=True)]
    items.append(el("span", "failed", class_="lg"))
    items += [swatch("failed", t, f"✗ {text}") for t, text in zip((0.0, 0.5, 1.0), ends, strict=True)]
    items += [el("span", "error", class_="lg"), swatch("error", 0.0, "E")]
    items += [el("span", "skipped", class_="lg"), swatch("skipped", 0.0, "s")]
    items.append(el("span", "(noise ratio)" if noise else "(rel_l2)", class_="lg"))
    return el("div", items, class_="legend")


def token_chart(errors: list[Any], limit: float | None, width: int = 640, height: int = 130) -> Safe:
    """Each token's error as bars in inline SVG (tokens left out grey), the token limit dashed."""
    values = [number(v) for v in errors]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    top = max([*finite, limit or 0.0, 1e-12])
    n = max(1, len(values))
    pad_l, pad_b, pad_t = 48, 18, 8
    plot_w, plot_h = width - pad_l - 8, height - pad_b - pad_t
    step = plot_w / n
    shapes: list[Any] = []
    for i, v in enumerate(values):
        x = pad_l + i * step + step * 0.1
        if v is None:
            h, fill, tip = plot_h, "#d0d5dc", f"token {i}: left out (routed elsewhere)"
        else:
            shown = top if not math.isfinite(v) else v
            h, fill, tip = plot_h * shown / top, "#d9534f", f"token {i}: rel_l2 {fmt(v, 4)}"
            if limit is not None and v <= limit:
                fill = "#5cb85c"
        y = pad_t + plot_h - h
        shapes.append(
            el(
                "rect",
                el("title", tip),
                x=f"{x:.1f}",
                y=f"{y:.1f}",
                width=f"{max(step * 0.8, 0.5):.1f}",
                height=f"{h:.1f}",
                fill=fill,
            )
        )
    if limit is not None:
        y = pad_t + plot_h - plot_h * limit / top
        shapes.append(
            el(
                "line",
                x1=pad_l,
                x2=width - 8,
                y1=f"{y:.1f}",
                y2=f"{y:.1f}",
                stroke="#222",
                attrs={"stroke-dasharray": "4 3", "stroke-width": "1"},
            )
        )
        shapes.append(
            el(
                "text",
                f"limit {fmt(limit, 3)}",
                x=width - 10,
                y=f"{max(y - 3, 10):.1f}",
                attrs={"text-anchor": "end", "font-size": "10"},
            )
        )
    axis = [
        el("line", x1=pad_l, x2=pad_l, y1=pad_t, y2=pad_t + plot_h, stroke="#888"),
        el("line", x1=pad_l, x2=width - 8, y1=pad_t + plot_h, y2=pad_t + plot_h, stroke="#888"),
        el("text", fmt(top, 3), x=pad_l - 4, y=pad_t + 9, attrs={"text-anchor": "end", "font-size": "10"}),
        el("text", "0", x=pad_l - 4, y=pad_t + plot_h, attrs={"text-anchor": "end", "font-size": "10"}),
        el("text", f"token 0 … {n - 1}", x=pad_l, y=height - 4, attrs={"font-size": "10"}),
    ]
    return el(
        "svg",
        axis,
        shapes,
        viewBox=f"0 0 {width} {height}",
        width=width,
        height=height,
        role="img",
        attrs={"aria-label": "each token's rel_l2"},
        class_="tokchart",
    )
