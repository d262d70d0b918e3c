"""The JSON reports `comparison_report.json` and `comparison_summary.json`, written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import atomic_write_text
from .block import bug_report
from .rows import Row
from .summary import counts, first_decode_difference, first_divergence, first_error, graph_summary, modes

REPORT_SCHEMA_VERSION = 1
REPORT_FILE = "comparison_report.json"
SUMMARY_FILE = "comparison_summary.json"


def summary(rows: list[Row], *, meta: dict[str, Any], interrupted: bool) -> dict[str, Any]:
    rows, ops = [r for r in rows if r.kind != "op"], [r for r in rows if r.kind == "op"]
    first = first_divergence(rows)
    error = first_error(rows)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "total": len(rows),
        **counts(rows),
        "first_divergence": first.id if first else None,
        "first_divergence_layer": first.layer if first else None,
        "first_divergence_component": first.component if first else None,
        "hint": first.hint if first else None,
        "remedy": first.remedy if first else None,
        **{f"first_{m}_divergence": (found.id if (found := first_divergence(rows, m)) else None) for m in modes(rows)},
        "first_decode_step_differing": decode[0].step if (decode := first_decode_difference(rows)) else None,
        "first_error": error.id if error else None,
        "first_error_message": error.error if error else None,
        "graphs": graph_summary(rows),
        "complete": not interrupted,
        "drills": drills(ops + rows),
        **meta,
        "bug_report": bug_report(ops + rows, meta),
    }


def drills(rows: list[Row]) -> dict[str, Any]:
    """Each drilled point's culprit, recovery and op counts: from its `POINT::drill` row, or from the
    failed point's own row where `--parity-drill auto` drilled it."""
    out: dict[str, Any] = {}
    for row in rows:
        if row.drill is None or "rows" not in row.drill:  # an op item's figures: its drill's row has the rest
            continue
        d = row.drill
        out[d["point"]] = {
            "culprit": d["culprit"],
            "recovery": d["recovery"],
            "recovery_introduced": d.get("recovery_introduced"),
            "partial": d.get("partial"),
            "structure": d.get("structure", []),
            "accumulation": d.get("accumulation"),
            "unmatched": d.get("unmatched"),
            "ops": len(d["rows"]),
            "failed_ops": sum(r["verdict"] != "ok" for r in d["rows"]),
            "repro": d.get("repro"),
        }
    return out


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
    from .plots import PlotsUnavailable, render_plots

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
    from .html import HTML_FILE, write_html

    try:
        write_html(directory, report, said, pictures=pictures)
    except Exception as exc:  # the page must never cost the reports
        return f"{HTML_FILE} not written: {type(exc).__name__}: {exc} (the JSON reports are written)"
    return None


def plots_line(written: list[Path], directory: Path) -> str:
    from .plots import TOKENS_PREFIX

    tokens = sum(1 for p in written if p.name.startswith(TOKENS_PREFIX))
    steps = sorted({p.name.split(".")[1] for p in written if ".step_" in p.name}, key=lambda s: int(s[5:]))
    named = [p.name for p in written if not p.name.startswith(TOKENS_PREFIX) and ".step_" not in p.name]
    if steps:
        named.append(f"the same for {steps[0]}" + (f" to {steps[-1]}" if len(steps) > 1 else ""))
    if tokens:
        named.append(f"{tokens} per-token plot{'s' if tokens > 1 else ''} of failed points")
    return f"plots in {directory}: {', '.join(named)}" if named else "plots: no point to draw"


def report_rows(report: dict[str, Any]) -> list[Row]:
    """The rows of a report read by :func:`read_report`."""
    return [Row.from_json(point) for point in report["points"]]


def read_report(path: Path) -> dict[str, Any]:
    """A comparison_report.json (or the directory holding one), checked enough to draw and diff;
    ValueError with one sentence when it is not one."""
    file = path / REPORT_FILE if path.is_dir() else path
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no {REPORT_FILE} in {path} (write one with --parity-report DIR)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a readable JSON report ({exc})") from None
    points = report.get("points") if isinstance(report, dict) else None
    if not isinstance(points, list) or not all(isinstance(p, dict) and "id" in p and "status" in p for p in points):
        raise ValueError(f"{file} is not a moe-parity comparison report (no 'points' rows)")
    version = report.get("schema_version")
    if version != REPORT_SCHEMA_VERSION:
        raise ValueError(
            f"{file} has report schema {version}; this moe-parity reads schema {REPORT_SCHEMA_VERSION} "
            "(rewrite it with this version's --parity-report)"
        )
    return report
