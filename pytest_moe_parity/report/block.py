"""One block to paste into a bug report: the versions, the golden (its fingerprint), the candidate and
the run's options, the first divergence with its failing figures and what is known of its cause, and
the drill's culprit with what it was given and its repro file. In `comparison_summary.json`
(`bug_report`) and printed by `moe-parity report`; built from the rows and the run's facts alone."""

from __future__ import annotations

from typing import Any

from ..dtypes import json_safe
from ..words import counted
from .drill import Drill, culprit_said, differs, repro_line
from .rows import PointRow, Row, WeightsRow
from .summary import counts, first_divergence
from .text import fmt

DRILL = (
    "point", "culprit", "culprit_op", "evidence", "recovery", "structure", "repro", "repro_cause", "culprit_group",
    "group_recovery", "row_sets",
)  # fmt: skip  # the block's drill
CANDIDATE = ("candidate_model", "candidate_source", "hw", "hw_options", "dtype", "mode", "layers")
BEGIN, END = "--- moe-parity bug report (paste this block) ---", "--- end of the bug report ---"


def _failing(row: Row) -> list[dict[str, Any]]:
    """A failed row's failing figures: a point's checks that failed, a weight or config item's findings."""
    if isinstance(row, PointRow):
        return [
            {"tensor": c.target, "check": c.name, "value": json_safe(c.value), "limit": json_safe(c.limit), "op": c.op}
            for c in row.checks
            if not c.passed
        ]
    if isinstance(row, WeightsRow):
        return [{"finding": f} for f in row.findings]
    return [{"finding": row.notes[0]}] if row.notes else []  # a differential's item: what the condition changed


def _drill_of(rows: list[Row], point: str | None) -> Drill | None:
    """The drill of `point` (where it was drilled), else the first drill that names a cause."""
    drills = [r.drill for r in rows if r.drill is not None]
    chosen = next((d for d in drills if d.point == point), None)
    return chosen or next((d for d in drills if d.culprit or d.structure), None)


def bug_report(rows: list[Row], meta: dict[str, Any]) -> dict[str, Any]:
    """The block as JSON."""
    points = [r for r in rows if r.kind != "op"]
    first = first_divergence(points)
    drill = _drill_of(rows, first.id if first else None)
    said = drill.finding() if drill is not None and first is not None else None
    return {
        "versions": meta.get("versions", {}),
        "golden": {k: meta.get(k) for k in ("golden_dir", "golden_fingerprint", "model_type")},
        "candidate": {k: meta.get(k) for k in CANDIDATE},
        "counts": {"total": len(points), **counts(points)},
        "first_divergence": None
        if first is None
        else {
            "id": first.id,
            "failing": _failing(first),
            "hint": first.hint,
            "proved": said,
        },
        "drill": None if drill is None else {k: getattr(drill, k) for k in DRILL},
    }


def bug_report_text(block: dict[str, Any]) -> list[str]:
    """The block as the lines `moe-parity report` prints."""
    versions = ", ".join(f"{k} {v}" for k, v in block["versions"].items()) or "versions not recorded"
    golden, cand, n = block["golden"], block["candidate"], block["counts"]
    options = ", ".join(f"{k}={v}" for k, v in (cand.get("hw_options") or {}).items()) or "none"
    lines = [
        BEGIN,
        versions,
        f"golden: {golden['golden_dir']} ({golden['model_type']}, fingerprint {golden['golden_fingerprint']})",
        f"candidate: {cand['candidate_model']} ({cand['candidate_source']}) on --hw {cand['hw']} in {cand['dtype']}, "
        f"{cand['mode']} mode; --hw-option: {options}" + (f"; layers {cand['layers']}" if cand.get("layers") else ""),
        f"result: {counted(n['total'], 'item')}: {n['passed']} passed, {n['failed']} failed, "
        f"{counted(n['error'], 'error')}, {n['skipped']} skipped",
    ]
    first = block["first_divergence"]
    if first is None:
        lines.append("first divergence: none")
    else:
        lines.append(f"first divergence: {first['id']}")
        for f in first["failing"]:
            if "finding" in f:
                lines.append(f"  {f['finding']}")
            else:
                limit = "" if f["limit"] is None else f" (limit {f['op']} {fmt(f['limit'])})"
                lines.append(f"  {f['tensor']}.{f['check']} {fmt(f['value'])}{limit}")
        if first["proved"]:
            lines.append(f"  {first['proved']}")
        elif first["hint"]:
            lines.append(f"  hint: {first['hint']}")
    drill = block["drill"]
    if drill is not None:
        if drill["culprit"]:
            culprit = drill["culprit_op"] or drill["culprit"]
            said = culprit_said(culprit, drill["recovery"], drill.get("culprit_group"), drill.get("group_recovery"),
                                drill.get("row_sets"))  # fmt: skip
            lines.append(f"drill {drill['point']}: culprit {said}")
            lines.extend(f"  {e}" for e in differs(drill["evidence"] or []))
        elif drill["structure"]:
            lines.append(f"drill {drill['point']}: {drill['structure'][0]}")
        if drill["repro"]:
            lines.append(f"  {repro_line(drill['repro'], drill.get('repro_cause'))}")
    lines.append(END)
    return lines
