"""The JSON reports `comparison_report.json` and `comparison_summary.json`, written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..golden.writer import atomic_write_text
from .text import counts, first_divergence, first_error, graph_summary, modes

REPORT_SCHEMA_VERSION = 1
REPORT_FILE = "comparison_report.json"
SUMMARY_FILE = "comparison_summary.json"


def summary(rows: list[dict[str, Any]], *, meta: dict[str, Any], interrupted: bool) -> dict[str, Any]:
    first = first_divergence(rows)
    error = first_error(rows)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "total": len(rows),
        **counts(rows),
        "first_divergence": first["id"] if first else None,
        "first_divergence_layer": first["layer"] if first else None,
        "first_divergence_component": first["component"] if first else None,
        "hint": first.get("hint") if first else None,
        "remedy": first.get("remedy") if first else None,
        **{
            f"first_{m}_divergence": (found["id"] if (found := first_divergence(rows, m)) else None)
            for m in modes(rows)
        },
        "first_error": error["id"] if error else None,
        "first_error_message": error.get("error") if error else None,
        "graphs": graph_summary(rows),
        "complete": not interrupted,
        **meta,
    }


def write_reports(directory: Path, rows: list[dict[str, Any]], *, meta: dict[str, Any], interrupted: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ordered = sorted(rows, key=lambda r: r["order"])
    report = {"schema_version": REPORT_SCHEMA_VERSION, **meta, "complete": not interrupted, "points": ordered}
    atomic_write_text(directory / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    atomic_write_text(
        directory / SUMMARY_FILE, json.dumps(summary(ordered, meta=meta, interrupted=interrupted), indent=1) + "\n"
    )
