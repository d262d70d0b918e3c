"""The report's JSON schema (report schema 1): `comparison_report.json`, its rows read back
(:func:`read_report`, :func:`report_rows`), and `comparison_summary.json` as the rows say it
(:func:`summary`, a drill's figures in :func:`drills`). What the page and the files both read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .block import bug_report
from .neuron_terms import KEY as NEURON_KEY
from .neuron_terms import summarize as neuron_terms
from .ran import ran_counts
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
        "ran": ran_counts(rows),  # what the points ran (report.ran)
        "complete": not interrupted,
        "drills": drills(ops + rows),
        **({NEURON_KEY: said} if (said := neuron_terms(rows)) else {}),  # the vLLM Neuron plugin's own terms
        **meta,
        "bug_report": bug_report(ops + rows, meta),
    }


def drills(rows: list[Row]) -> dict[str, Any]:
    """Each drilled point's culprit, recovery and op counts: from its `POINT::drill` row, or from the
    failed point's own row where `--parity-drill auto` drilled it."""
    out: dict[str, Any] = {}
    for row in rows:
        if (d := row.drill) is None:  # an op item's figures: its drill's row has the rest
            continue
        out[d.point] = {
            "culprit": d.culprit,
            "recovery": d.recovery,
            "recovery_introduced": d.recovery_introduced,
            "culprit_group": d.culprit_group,
            "group_recovery": d.group_recovery,
            "row_sets": d.row_sets,
            "partial": d.partial,
            "structure": d.structure,
            "accumulation": d.accumulation,
            "unmatched": d.unmatched,
            "made": d.made,
            "ops": len(d.rows),
            "failed_ops": sum(r.verdict != "ok" for r in d.rows),
            "repro": d.repro,
            "repro_cause": d.repro_cause,
        }
    return out


def report_rows(report: dict[str, Any]) -> list[Row]:
    """The rows of a report read by :func:`read_report`."""
    return [Row.from_json(point) for point in report["points"]]


class ReportError(BadInput, ValueError):
    """A file that is not a report this version reads (missing, unreadable, another schema)."""


def read_report(path: Path) -> dict[str, Any]:
    """A comparison_report.json (or the directory holding one), checked enough to draw and diff;
    ReportError (a ValueError too) with one sentence when it is not one."""
    file = path / REPORT_FILE if path.is_dir() else path
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"no {REPORT_FILE} in {path} (write one with --parity-report DIR)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{file} is not a readable JSON report ({exc})") from None
    points = report.get("points") if isinstance(report, dict) else None
    if not isinstance(points, list) or not all(isinstance(p, dict) and "id" in p and "status" in p for p in points):
        raise ReportError(f"{file} is not a moe-parity comparison report (no 'points' rows)")
    version = report.get("schema_version")
    if version != REPORT_SCHEMA_VERSION:
        raise ReportError(
            f"{file} has report schema {version}; this moe-parity reads schema {REPORT_SCHEMA_VERSION} "
            "(rewrite it with this version's --parity-report)"
        )
    return report
