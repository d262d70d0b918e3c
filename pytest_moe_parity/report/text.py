"""Reports: the failure text of one point, the terminal summary table, and the JSON files
`comparison_report.json` / `comparison_summary.json` (written atomically). No pytest here."""

from __future__ import annotations

import math
from typing import Any

from ..judge.verdict import PointResult


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}" if abs(x) < 0.99 else f"{x:.{digits + 2}g}"
    return f"{x:.{digits - 1}e}"


def failure_text(r: PointResult) -> str:
    """pytest-regressions style: shapes, a metrics table with limits, worst tokens, flips, a hint."""
    lines = [f"{r.id}: candidate ({r.candidate_dtype}) diverges from the golden ({r.golden_dtype})"]
    for target, m in r.metrics.items():
        lines.append(
            f"  {target}: golden {tuple(m.shape_golden)} {m.dtype_golden}, "
            f"candidate {tuple(m.shape_candidate)} {m.dtype_candidate}"
        )
    lines.append("")
    lines.append(f"  {'tensor':<9}{'metric':<16}{'value':>14}{'limit':>14}  verdict")
    for c in r.checks:
        limit = "-" if c.limit is None else f"{c.op} {_fmt(c.limit)}"
        lines.append(f"  {c.target:<9}{c.name:<16}{_fmt(c.value):>14}{limit:>14}  {'ok' if c.passed else 'FAIL'}")
    for target, m in r.metrics.items():
        extra = (
            f"snr {_fmt(m.snr_db)} dB, pearson {_fmt(m.pearson, 6)}, max_abs {_fmt(m.max_abs)}, "
            f"mean_abs {_fmt(m.mean_abs)}, max_rel {_fmt(m.max_rel)}, "
            f"within atol={_fmt(m.atol)}/rtol={_fmt(m.rtol)}: {m.within_tol * 100:.1f}%"
        )
        lines.append(f"  {target:<9}{extra}")
        if m.nan_candidate or m.inf_candidate or m.nan_golden or m.inf_golden:
            lines.append(
                f"  {'':<9}NaN/Inf: candidate {m.nan_candidate}/{m.inf_candidate}, "
                f"golden {m.nan_golden}/{m.inf_golden}, first non-finite at {m.first_nonfinite}"
            )
    if r.worst:
        worst = ", ".join(f"{t} ({_fmt(e, 3)})" for t, e in r.worst)
        lines.append(f"  worst tokens (position, rel error): {worst}")
    if r.routing:
        rt = r.routing
        lines.append(
            f"  routing: {rt['num_tokens']} tokens, top-{rt['top_k']} of {rt['num_experts']} experts, "
            f"set agreement {rt['set_agreement'] * 100:.1f}%, real flips {len(rt['flips'])}, ties {len(rt['ties'])}"
        )
        shown = rt["flips"][:8] or rt["ties"][:4]
        if shown:
            lines.append(f"    {'token':>6}  {'golden experts':<20}{'candidate experts':<20}{'score gap':>10}  kind")
            for f in shown:
                lines.append(
                    f"    {f['token']:>6}  {f['golden_experts']!s:<20}{f['candidate_experts']!s:<20}"
                    f"{_fmt(f['gap'], 3):>10}  {'tie' if f['is_tie'] else 'flip'}"
                )
            more = len(rt["flips"]) - len(rt["flips"][:8])
            if more > 0:
                lines.append(f"    ... and {more} more flips")
    for note in r.notes:
        lines.append(f"  note: {note}")
    if r.hint:
        lines.append(f"  hint: {r.hint}")
    lines.append(f"  tolerance from: {' < '.join(r.tolerance_sources)}")
    return "\n".join(lines)


def short_metrics(row: dict[str, Any]) -> tuple[str, str, str]:
    metrics = row.get("metrics") or {}
    main = metrics.get("out") or metrics.get("logits") or next(iter(metrics.values()), None)
    if not main:
        return "-", "-", "-"
    cos = main.get("cosine")
    rel = main.get("rel_l2")
    mx = main.get("max_abs")
    return (
        _fmt(cos, 6) if isinstance(cos, float) else str(cos),
        _fmt(rel) if isinstance(rel, float) else str(rel),
        _fmt(mx) if isinstance(mx, float) else str(mx),
    )


def row_note(row: dict[str, Any]) -> str:
    parts = []
    routing = row.get("routing")
    if routing and (routing.get("flips") or routing.get("ties")):
        parts.append(f"flips {len(routing['flips'])} ties {len(routing['ties'])}")
    if row.get("excluded_tokens"):
        parts.append(f"{len(row['excluded_tokens'])} tok excluded")
    if row.get("status") != "passed":
        failed = [f"{c['target']}.{c['name']}" for c in row.get("checks", []) if not c.get("passed")]
        if failed:
            parts.append("failed " + ", ".join(failed))
        if row.get("error"):
            parts.append(row["error"][:60])
        if row.get("reason"):
            parts.append(row["reason"][:60])
    return "; ".join(parts)


def first_divergence(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    bad = [r for r in rows if r["status"] in ("failed", "error")]
    return min(bad, key=lambda r: r["order"]) if bad else None


def summary_table(rows: list[dict[str, Any]], *, full_limit: int = 40, context: int = 1) -> list[str]:
    """Every row for small runs; for big ones the failures with `context` rows around them."""
    ordered = sorted(rows, key=lambda r: r["order"])
    if len(ordered) <= full_limit:
        shown = set(range(len(ordered)))
    else:
        shown = set()
        for i, r in enumerate(ordered):
            if r["status"] in ("failed", "error"):
                shown.update(range(max(0, i - context), min(len(ordered), i + context + 1)))
    lines = [f"{'point':<26}{'status':<8}{'cosine':>12}{'rel_l2':>11}{'max_abs':>11}  notes"]
    last = -1
    for i, r in enumerate(ordered):
        if i not in shown:
            continue
        if i != last + 1:
            lines.append(f"{'...':<26}({i - last - 1} passing points)")
        cos, rel, mx = short_metrics(r)
        lines.append(f"{r['id']:<26}{r['status']:<8}{cos:>12}{rel:>11}{mx:>11}  {row_note(r)}")
        last = i
    if not shown:
        lines.append(f"(all {len(ordered)} points passed)")
    elif last != len(ordered) - 1:
        lines.append(f"{'...':<26}({len(ordered) - 1 - last} passing points)")
    return lines
