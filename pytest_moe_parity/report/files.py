"""The JSON reports `comparison_report.json` and `comparison_summary.json` (:mod:`.schema`), written
atomically, then the pictures and the page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import atomic_write_text
from ..words import counted
from .html import HTML_FILE, write_html
from .plots import TOKENS_PREFIX, PlotsUnavailable, render_plots
from .rows import Row
from .schema import REPORT_FILE, REPORT_SCHEMA_VERSION, SUMMARY_FILE, read_report, report_rows, summary

__all__ = [  # the schema's names, where the writers and tests have always imported them
    "REPORT_FILE",
    "REPORT_SCHEMA_VERSION",
    "SUMMARY_FILE",
    "draw",
    "page_line",
    "plots_line",
    "read_report",
    "report_rows",
    "summary",
    "write_reports",
]


def write_reports(
    directory: Path, rows: list[Row], *, meta: dict[str, Any], interrupted: bool, plots: bool = True
) -> list[str]:
    """The two JSON reports, then the pictures (unless `plots` is off), then the page (report.html)
    that shows them; returns the line that says what was drawn, and one more where the page could not
    be written."""
    directory.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: r.order)
    points = [r.to_json() for r in ordered]
    report = {"schema_version": REPORT_SCHEMA_VERSION, **meta, "complete": not interrupted, "points": points}
    text = json.dumps(report, indent=1)
    atomic_write_text(directory / REPORT_FILE, text + "\n")
    said = summary(ordered, meta=meta, interrupted=interrupted)
    atomic_write_text(directory / SUMMARY_FILE, json.dumps(said, indent=1) + "\n")
    drawn = [r for r in ordered if r.kind != "op"]  # a drill's ops are its table, not the plots' points
    line, pictures = _draw(drawn, directory) if plots else ("plots: off (the JSON reports are written)", [])
    # the page from the report as written (as `moe-parity report DIR` reads it): the same page either way
    page = page_line(directory, json.loads(text), json.loads(json.dumps(said)), pictures)
    return [line, page] if page else [line]


def draw(rows: list[Row], directory: Path) -> str:
    """Draw the rows' pictures; one line saying which, or why none (the JSON stands either way)."""
    return _draw(rows, directory)[0]


def _draw(rows: list[Row], directory: Path) -> tuple[str, list[Path]]:
    """:func:`draw`'s line, and the pictures it drew (none where it drew none)."""
    try:
        written = render_plots(rows, directory)
    except PlotsUnavailable as exc:
        return f"{exc} (the JSON reports are written)", []
    except Exception as exc:  # a picture must never cost the reports
        return f"plots not drawn: {type(exc).__name__}: {exc} (the JSON reports are written)", []
    return plots_line(written, directory), written


def page_line(directory: Path, report: dict[str, Any], said: dict[str, Any], pictures: list[Path]) -> str | None:
    """Write report.html (the pictures embedded); None, or the one line that says why it is not
    written (the JSON stands either way)."""
    try:
        write_html(directory, report, said, pictures=pictures)
    except Exception as exc:  # the page must never cost the reports
        return f"{HTML_FILE} not written: {type(exc).__name__}: {exc} (the JSON reports are written)"
    return None


def plots_line(written: list[Path], directory: Path) -> str:
    tokens = sum(1 for p in written if p.name.startswith(TOKENS_PREFIX))
    steps = sorted({p.name.split(".")[1] for p in written if ".step_" in p.name}, key=lambda s: int(s[5:]))
    named = [p.name for p in written if not p.name.startswith(TOKENS_PREFIX) and ".step_" not in p.name]
    if steps:
        named.append(f"the same for {steps[0]}" + (f" to {steps[-1]}" if len(steps) > 1 else ""))
    if tokens:
        named.append(f"{counted(tokens, 'per-token plot')} of failed points")
    return f"plots in {directory}: {', '.join(named)}" if named else "plots: no point to draw"
