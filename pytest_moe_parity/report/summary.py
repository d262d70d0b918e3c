"""What a run prints after its items: the summary table and the closing lines (the counts, the first
divergence in each mode, the first decode step whose next token differs, the first backend error,
the graphs a compiled backend used). The plugin and `moe-parity compare` print the same lines; the
JSON summary reads the same figures. No pytest here."""

from __future__ import annotations

import math
from typing import Any

from ..judge.routing import RoutingFlip
from ..points import LOGITS, OUTPUT, describe_layers
from ..words import counted
from .drill import Drill, culprit_said
from .ran import ran_line
from .rows import (
    BatchInvarianceRow,
    ConfigRow,
    ParallelRow,
    PointRow,
    PrecisionRow,
    RoutingRow,
    Row,
    StateRow,
    WeightsRow,
    number,
)
from .text import fmt

STATUSES = ("passed", "failed", "error", "skipped")
STATUS_COLOURS = {"failed": "red", "error": "yellow"}  # a table row's colour by its status


def figure(row: Row, name: str) -> float | None:
    """`rel_l2` (or another figure) of a row's main tensor, or its `noise_ratio`; None when absent."""
    if name == "noise_ratio":
        return number(row.noise_ratio)
    main = row.main_metrics
    return number(getattr(main, name, None)) if main else None


def short_metrics(row: Row) -> tuple[str, str, str]:
    """cosine, rel_l2 and max_abs of a row's main tensor, as the table shows them."""
    main = row.main_metrics
    if not main:
        return "-", "-", "-"
    return fmt(main.cosine, 6), fmt(main.rel_l2), fmt(main.max_abs)


def row_note(row: Row) -> str:
    """The notes column of a row: a point's routing and failed checks, what was said of an item not
    judged, a weight or config item's first finding (or, passed, its first note)."""
    parts = _judged_notes(row) if isinstance(row, PointRow) else []
    if isinstance(row, RoutingRow) and row.levels:
        parts.append(_routing_note(row))
    if isinstance(row, ParallelRow) and len(row.plans) == 2 and row.status in ("passed", "failed"):
        verb = " agree" if row.status == "passed" else " raises" if "b_raised" in row.figures else " differ"
        parts.append(f"{row.plans[1]} vs {row.plans[0]}{verb}")
    if isinstance(row, StateRow) and row.status in ("passed", "failed"):
        rows = row.figures.get("rows")
        at = f" at tokens {describe_layers(rows)}" if rows else ""
        parts.append("state: as clean" if row.status == "passed" else f"state: differs{at}")
    if isinstance(row, BatchInvarianceRow) and row.batch_rows:
        changed = ", ".join(map(str, row.changed_rows))
        parts.append(f"rows {changed} change in the batch ({row.condition})" if changed else "every row as alone")
    if isinstance(row, PrecisionRow) and row.precision_verdict:
        parts.append(f"float32: {', '.join(row.raised)}" if row.raised else row.precision_verdict.replace("_", " "))
    if isinstance(row, WeightsRow) and row.status == "passed" and row.notes:  # a conversion, not a finding
        parts.append(row.notes[0][:60])
    if row.status != "passed":
        if row.error:
            parts.append(row.error[:60])
        if row.reason:
            parts.append(row.reason[:60])
        if isinstance(row, ConfigRow) and row.findings:  # the first field that differs
            more = len(row.findings) - 1
            parts.append(row.findings[0][:60] + (f" (+{more} more)" if more else ""))
        elif isinstance(row, WeightsRow) and row.findings:  # the first tensor found wrong
            more = len(row.findings) - 1
            parts.append(row.findings[0].rpartition(".")[2][:60] + (f" (+{more} more)" if more else ""))
    return "; ".join(parts)


def _routing_note(row: RoutingRow) -> str:
    """A routing item in a few words: the level that recovers the block, or why none had to."""
    figures = {level["level"]: fmt(level.get("rel_l2")) for level in row.levels}
    if row.recovered is not None:
        return f"recovered by {row.recovered} (rel_l2 {figures.get('own')} -> {figures[row.recovered]})"
    own = next((level for level in row.levels if level["level"] == "own"), {})
    if own.get("status") == "failed":
        forced_all = "ids+weights" in figures
        return "not the routing: no level recovers it" if forced_all else "the golden's ids do not recover it"
    flips = row.routing.flips if row.routing is not None else []
    weight = row.routing.flipped_weight if row.routing is not None else None
    carried = f": {len(flips)} flips carry {weight:.1%} of its weight" if flips and weight is not None else ""
    return f"own routing within limits{carried}"


def _judged_notes(row: PointRow) -> list[str]:
    if row.inherited is not None:  # folded under the point that introduced the divergence
        return [f"inherited from {row.inherited} (passes on the golden's inputs)"]
    parts = []
    if row.chained is not None and row.status == "failed":
        parts.append("introduced here" if row.verdict("isolated") == "failed" else "fails on its own inputs only")
        failed = [f"{c.target}.{c.name}" for c in row.chained.checks if not c.passed]
        if failed and row.verdict("isolated") == "passed":
            parts.append("chain failed " + ", ".join(failed))
    routing = row.routing
    if routing and (routing.flips or routing.ties):
        parts.append(f"flips {len(routing.flips)} ties {len(routing.ties)}")
    if row.excluded_tokens:
        parts.append(f"{len(row.excluded_tokens)} tok excluded")
    if row.status != "passed":
        failed = [f"{c.target}.{c.name}" for c in row.checks if not c.passed]
        if failed:
            parts.append("failed " + ", ".join(failed))
        batch = next((r.rows for r in (row, row.chained) if r is not None and any(x.failed for x in r.rows)), [])
        if batch:  # a batch of several prompts: the rows that fail alone
            parts.append(f"rows {', '.join(str(x.row) for x in batch if x.failed)} of {len(batch)}")
    return parts


def first_introduced(rows: list[Row], before: float) -> Row | None:
    """Both modes: the first point, before `before` in forward order, that failed on the golden's
    inputs (introduced a divergence), or None."""
    failed = [r for r in rows if isinstance(r, PointRow) and r.order < before and r.verdict("isolated") == "failed"]
    return min(failed, key=lambda r: r.order) if failed else None


def mark_inherited(rows: list[Row]) -> None:
    """Both modes: each point right on the golden's inputs and wrong on its own after an earlier
    point failed on the golden's inputs inherits from the first such point (`PointRow.inherited`).
    The session marks it as it judges; this marks it over every row of a run (under xdist a worker
    holds some layers' rows only)."""
    source = first_introduced(rows, math.inf)  # the source of every inherited failure after it
    if source is None:
        return
    for r in rows:
        only_chained = r.verdict("isolated") == "passed" and r.verdict("chain") == "failed"
        if isinstance(r, PointRow) and r.inherited is None and only_chained and r.order > source.order:
            r.inherited = source.id


def first_divergence(rows: list[Row], mode: str | None = None) -> Row | None:
    """The first failed point in forward order (with `mode`, the first whose verdict in that mode
    failed). Errors are the backend's, not divergences."""
    if mode is None:
        bad = [r for r in rows if r.status == "failed"]
    else:
        bad = [r for r in rows if r.verdict(mode) == "failed"]
    return min(bad, key=lambda r: r.order) if bad else None


def modes(rows: list[Row]) -> list[str]:
    """The modes the rows were judged in, isolated first."""
    seen = {m for r in rows if isinstance(r, PointRow) for m in r.verdicts}
    return [m for m in ("isolated", "chain") if m in seen]


def _decode_logits(rows: list[Row]) -> list[PointRow]:
    """The logits rows of the decode steps, by step."""
    steps = (r for r in rows if isinstance(r, PointRow) and r.component == LOGITS and r.step and r.logits)
    return sorted(steps, key=lambda r: r.step or 0)


def first_decode_difference(rows: list[Row]) -> tuple[PointRow, RoutingFlip] | None:
    """The first decode step whose next token (the logits' top-1) differs, with its flip or tie."""
    for r in _decode_logits(rows):
        assert r.logits is not None
        differing = sorted([*r.logits.top1.flips, *r.logits.top1.ties], key=lambda f: f.token)
        if differing:
            return r, differing[0]
    return None


def decode_line(rows: list[Row]) -> tuple[str, str | None] | None:
    """Over the decode steps: the first step whose next token differs, and whether the golden's
    logit gap there is within the dtype's rounding (a tie: reported, not failed)."""
    steps = _decode_logits(rows)
    if not steps:
        return None
    found = first_decode_difference(rows)
    if found is None:
        return (f"decode: the next token agrees with the golden at every step judged ({len(steps)})", "green")
    row, flip = found
    gap = fmt(flip.gap, 3)
    what = f"golden {flip.golden_experts[0]}, candidate {flip.candidate_experts[0]}, golden logit gap {gap}"
    if flip.is_tie:
        return (f"decode: the next token first differs at step_{row.step} ({what}): a tie within "
                f"{row.candidate_dtype} rounding, not a failure", None)  # fmt: skip
    return (f"decode: the next token first differs at step_{row.step} ({what})", "red")


def first_error(rows: list[Row]) -> Row | None:
    bad = [r for r in rows if r.status == "error"]
    return min(bad, key=lambda r: r.order) if bad else None


def counts(rows: list[Row]) -> dict[str, int]:
    """How many rows have each status."""
    return {s: sum(1 for r in rows if r.status == s) for s in STATUSES}


def graph_summary(rows: list[Row]) -> dict[str, Any] | None:
    """For compiled backends: how many graphs served the points, how many were compiled or loaded
    from the cache, and the graphs of the decoder layers (the kinds of layer: DeepSeek-V3 has two)."""
    info = [(r, r.backend) for r in rows if isinstance(r, PointRow) and r.backend.get("graph")]
    if not info:
        return None
    compiled = [b for _, b in info if b.get("origin") == "compiled"]
    return {
        "graphs": len({b["graph"] for _, b in info}),
        "points": len(info),
        "compiled": len(compiled),
        "from_cache": sum(b.get("origin") == "cache" for _, b in info),
        "compile_seconds": round(sum(b.get("compile_s", 0.0) for b in compiled), 3),
        "layers": len({r.layer for r, _ in info if r.layer is not None}),
        "layer_graphs": len({b["graph"] for r, b in info if r.component == OUTPUT}),
    }


def summary_lines(rows: list[Row], *, report_dir: Any = None) -> list[tuple[str, str | None]]:
    """The closing lines of a run, as (text, colour): counts, the first divergence, the first
    backend error, a line per drill. The plugin, `moe-parity compare` and `report` print the same
    lines. A drill's op rows are its table: they are not counted as points."""
    drilled = [r.drill for r in rows if r.drill is not None]  # auto's too
    drills = [drill_line(d) for d in drilled]
    rows = [r for r in rows if r.kind != "op"]
    if not rows:
        return drills
    proved = {d.point: found for d in drilled if (found := d.finding())}
    return _point_lines(rows, report_dir, proved) + drills


def _point_lines(rows: list[Row], report_dir: Any, proved: dict[str, str]) -> list[tuple[str, str | None]]:
    n = counts(rows)
    lines: list[tuple[str, str | None]] = [
        (
            f"{counted(len(rows), 'point')}: "
            f"{n['passed']} passed, {n['failed']} failed, {counted(n['error'], 'error')}"
            + (f", {n['skipped']} skipped" if n["skipped"] else "")
            + (f"; reports in {report_dir}" if report_dir else ""),
            None,
        )
    ]
    first = first_divergence(rows)
    if first is None:
        lines.append(("first divergence: none", "green"))
    else:
        said = proved.get(first.id) or first.hint  # what a drill of the point proved, over the usual causes
        hint = f"  ({said})" if said else ""
        lines.append((f"first divergence: {first.id}{hint}", "red"))
    if len(modes(rows)) > 1:  # both modes: where the error is introduced, and where it shows chained
        for mode in modes(rows):
            found = first_divergence(rows, mode)
            lines.append((f"first {mode} divergence: {found.id if found else 'none'}", "red" if found else None))
    inherited: dict[str, list[str]] = {}
    for r in rows:
        if isinstance(r, PointRow) and r.inherited:
            inherited.setdefault(r.inherited, []).append(r.id)
    if modes(rows) == ["chain"] and n["failed"] > 1:  # on its own inputs alone, a failure may be inherited
        lines.append((
            f"chain mode: {n['failed']} points failed on their own inputs; --parity-mode both tells those that fail "
            "on the golden's inputs too (introduced) from those that only inherit an earlier one's error", None,
        ))  # fmt: skip
    for source, ids in inherited.items():
        lines.append((
            f"inherited: {counted(len(ids), 'point')} fail{'s' * (len(ids) == 1)} only on their own inputs after "
            f"{source} (folded under it: each passes on the golden's inputs)", None,
        ))  # fmt: skip
    decode = decode_line(rows)
    if decode is not None:
        lines.append(decode)
    error = first_error(rows)
    if error is not None:
        lines.append((f"backend errors: {n['error']}, first at {error.id}: {error.error or ''}", "red"))
    graphs = graph_summary(rows)
    if graphs is not None:
        lines.append(
            (
                f"{counted(graphs['graphs'], 'graph')} for {counted(graphs['points'], 'point')} "
                f"({graphs['layer_graphs']} for the decoder layers of {counted(graphs['layers'], 'layer')}); "
                f"compiled {graphs['compiled']} in "
                f"{graphs['compile_seconds']:.1f} s, {graphs['from_cache']} from the cache",
                None,
            )
        )
    ran = ran_line(rows)
    if ran is not None:
        lines.append((ran, None))
    return lines


def _ratio(row: Row | None) -> str:
    ratio = row.noise_ratio if row is not None else None
    return fmt(ratio, 3) if ratio is not None else "-"


def _chained(row: Row) -> PointRow | None:
    return row.chained if isinstance(row, PointRow) else None


def _extra_columns(rows: list[Row]) -> list[tuple[str, int, Any]]:
    """Columns shown when some row has them: the noise ratio, the chained error (both modes)."""
    columns: list[tuple[str, int, Any]] = []
    if any(isinstance(r, PointRow) and r.noise for r in rows):
        columns.append(("noise R", 9, _ratio))
    chained = [c for r in rows if (c := _chained(r)) is not None]
    if chained:
        columns.append(("chain rel", 11, lambda r: short_metrics(c)[1] if (c := _chained(r)) else "-"))
        if any(c.noise for c in chained):
            columns.append(("chain R", 9, lambda r: _ratio(_chained(r))))
    return columns


def summary_table(rows: list[Row], *, full_limit: int = 40, context: int = 1) -> list[str]:
    """Every point's row for small runs; for big ones the failures with `context` rows around them
    (a drill's op rows are in its own table, not here)."""
    return [line for line, _ in coloured_table(rows, full_limit=full_limit, context=context)]


def coloured_table(rows: list[Row], *, full_limit: int = 40, context: int = 1) -> list[tuple[str, str | None]]:
    """`summary_table`'s lines with their colours: a failed row red, an errored one yellow."""
    ordered = sorted((r for r in rows if r.kind != "op"), key=lambda r: r.order)
    if not ordered:
        return []
    if len(ordered) <= full_limit:
        shown = set(range(len(ordered)))
    else:
        shown = set()
        for i, r in enumerate(ordered):  # an inherited failure is folded under the one it inherits
            if r.status in ("failed", "error") and not (isinstance(r, PointRow) and r.inherited):
                shown.update(range(max(0, i - context), min(len(ordered), i + context + 1)))
    width = max([26, *(len(r.id) + 2 for r in ordered)])
    extra = _extra_columns(ordered)
    head = "".join(f"{name:>{w}}" for name, w, _ in extra)
    lines: list[tuple[str, str | None]] = [
        (f"{'point':<{width}}{'status':<8}{'cosine':>12}{'rel_l2':>11}{head}{'max_abs':>11}  notes", None)
    ]
    last = -1
    for i, r in enumerate(ordered):
        if i not in shown:
            continue
        if i != last + 1:
            lines.append((f"{'...':<{width}}({counted(i - last - 1, 'passing point')})", None))
        cos, rel, mx = short_metrics(r)
        cells = "".join(f"{value(r):>{w}}" for _, w, value in extra)
        line = f"{r.id:<{width}}{r.status:<8}{cos:>12}{rel:>11}{cells}{mx:>11}  {row_note(r)}"
        lines.append((line, STATUS_COLOURS.get(r.status)))
        last = i
    if not shown:
        lines.append((f"({'all ' * (len(ordered) > 1)}{counted(len(ordered), 'point')} passed)", None))
    elif last != len(ordered) - 1:
        lines.append((f"{'...':<{width}}({counted(len(ordered) - 1 - last, 'passing point')})", None))
    return lines + [(line, None) for line in legend(ordered, [name for name, _, _ in extra])]


LEGEND = {
    "noise R": "noise R: the point's rel_l2 over the reference's own error in the candidate's dtype, or under its "
    "quantization (--noise-quant) (fails above its noise_factor)",
    "chain rel": "chain rel, chain R: the same figures on the candidate's own inputs (the chained run)",
    "flips": "flips, ties: tokens whose top-k experts differ from the golden's, beyond / within the dtype's rounding "
    "of the router's scores (ties never fail; flip_share: the share of flipped tokens)",
    "tok excluded": "tok excluded: tokens whose top-k experts the candidate chose unlike the golden at the point's "
    "own layer's router, left out of its verdict (they follow other experts; that router judges them)",
    "inherited": "inherited from P: right on the golden's inputs, wrong on its own after P failed on the golden's; "
    "introduced here: wrong on the golden's inputs",
}


# where a chained verdict past layer 0 leaves out tokens: those routed otherwise at an earlier layer too
EXCLUDED_EARLIER = (
    "tok excluded: tokens whose top-k experts the candidate chose unlike the golden at the point's own layer's "
    "router or, chained, at an earlier layer's, left out of the verdict from there on (they follow other experts; "
    "the router where they flipped judges them)"
)


def legend(rows: list[Row], columns: list[str]) -> list[str]:
    """What the table's columns and notes mean, once per run, for those it shows."""
    notes = " ".join(row_note(r) for r in rows)
    shown = [key for key in LEGEND if key in columns or key in notes]
    if "chain R" in columns and "chain rel" not in shown:
        shown.append("chain rel")
    said = dict(LEGEND)
    if any(_excluded_earlier(r) for r in rows):
        said["tok excluded"] = EXCLUDED_EARLIER
    return [f"legend: {said[key]}" for key in LEGEND if key in shown]


def _excluded_earlier(row: Row) -> bool:
    """Whether a row's excluded tokens may have been routed otherwise at an earlier layer: a chained
    verdict past the first layer (layer 0 has no earlier layer; its tokens flipped at its own router)."""
    chained = row.mode == "chain" and (row.layer is None or row.layer > 0)
    return chained and bool(getattr(row, "excluded_tokens", None))


def drill_line(drill: Drill) -> tuple[str, str | None]:
    """A drilled point's closing line: its culprit and what substituting it recovers."""
    rows = drill.rows
    failed = sum(r.verdict != "ok" for r in rows)
    head = f"drill {drill.point}: {counted(len(rows), 'op')}, {failed} failed"
    if not drill.culprit:
        why = drill.unmatched and "matching failed"
        why = why or (drill.structure and f"structure: {drill.structure[0]}")
        accumulates = drill.accumulation and " accumulates " in drill.accumulation
        why = why or (drill.accumulation and f"{'the error accumulates, ' * bool(accumulates)}no op leaves its floor")
        made = drill.made and "a value made inside the call differs from the golden's"
        why = f"{why}; {made}" if why and made else why or made
        return f"{head}; no culprit{f' ({why})' if why else ''}", "green" if not failed and not why else "red"
    said = culprit_said(drill.culprit, drill.recovery, drill.culprit_group, drill.group_recovery, drill.row_sets)
    shown = drill.group_recovery if drill.culprit_group else drill.recovery
    both = drill.recovery_introduced
    if both is not None and both != shown:
        said += f" ({100 * both:.0f}% with every op that introduced error)"
    row = drill.row(drill.culprit)
    if row is not None and row.candidate and drill.culprit not in row.candidate:  # a port's own op in its place
        said += f"; the candidate's op: {', '.join(row.candidate[:3])}"
    return f"{head}; culprit {said}", "red"
