"""The failure text of one judged point, shared by the pytest plugin and `moe-parity compare`, and the
figure formatting the summary shares (`fmt`). No pytest here."""

from __future__ import annotations

import math
import textwrap
from typing import Any

from ..judge.logits import LogitsMetrics
from ..judge.result import BatchRow, PointResult
from ..judge.routing import RoutingMetrics
from ..words import counted, noun
from .drill import Drill, OpRow, pct, repro_line
from .ran import ran_words

WIDTH = 100  # failure text: no line wider than this
STRUCTURE_SHOWN = 5  # structure sentences a drill's text shows (the report has them all)


def fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool | int):
        return str(x)
    if not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}" if abs(x) < 0.99 else f"{x:.{digits + 2}g}"
    return f"{x:.{digits - 1}e}"


def brief(x: float | None) -> str:
    """A figure in a sentence: three significant digits, "-" for none."""
    return "-" if x is None else f"{x:.3g}"


def _wrapped(prefix: str, text: str, indent: int = 4) -> list[str]:
    """`text` wrapped at spaces only: a token (a point id, a figure, a path) is never cut."""
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=prefix,
        subsequent_indent=" " * indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


def failure_text(r: PointResult) -> str:
    """pytest-regressions style: shapes, a check table with limits, the count and the worst elements
    of what differs, worst tokens and experts, routing flips, the noise ratio, a hint and the
    tolerance that would accept it. In both modes, the failing verdict in full and a line for the
    passing one."""
    if r.inherited is not None and r.chained is not None:
        return _inherited_text(r, r.chained)
    parts = [(r.mode, r), *((("chain", r.chained),) if r.chained is not None else ())]
    failing = [(mode, res) for mode, res in parts if res.verdicts.get(mode) == "failed"] or parts
    where = {"isolated": "", "chain": " on its own inputs"}
    inputs = " on the golden's inputs and on its own" if len(failing) > 1 else where[failing[0][0]]
    at = f" (pos {r.position})" if r.position is not None else ""
    lines = _wrapped(
        "", f"{r.id}{at}: candidate ({r.candidate_dtype}) diverges from the golden ({r.golden_dtype}){inputs}"
    )
    for mode, res in parts:
        if (mode, res) not in failing:
            main = res.main
            figures = f"rel_l2 {fmt(main.rel_l2)}" if main is not None else ""
            if res.noise_ratio is not None:
                figures += f", noise ratio {fmt(res.noise_ratio, 3)}"
            label = "golden inputs" if mode == "isolated" else "its own inputs"
            lines.append(f"  {mode} ({label}): passed ({figures})")
    for i, (mode, res) in enumerate(failing):
        if len(failing) > 1:
            lines += ([""] if i else []) + [f"  {mode}:"]
        lines += _verdict_lines(res)
    if r.ran:  # what the candidate ran for it (`backends.ran`), beside its verdict
        lines.extend(_wrapped("  ran: ", ran_words(r.ran)))
    hint = r.hint
    if r.chained is not None and r.verdicts.get("isolated") == "passed":
        hint = HINT_CHAIN_ONLY
    elif r.mode == "chain":
        hint = f"{hint}; or error accumulated from the points before (see their noise ratios)" if hint else hint
    if hint:
        lines.extend(_wrapped("  hint: ", hint))
        lines.append(f"  hints: {HINTS_DOC}")
    remedy = r.remedy()
    if remedy:  # one line, however long: it is pasted as it stands
        lines.append(f"  to accept this result: {remedy}")
    lines.extend(_wrapped("  tolerance from: ", " < ".join(r.tolerance_sources)))
    return "\n".join(lines)


def _inherited_text(r: PointResult, chained: PointResult) -> str:
    """A point whose failure is an earlier point's (`PointResult.inherited`): folded under it, in a
    few lines (its figures are in the reports)."""
    own = f"rel_l2 {fmt(r.main.rel_l2)}" if r.main is not None else "passed"
    theirs = f"rel_l2 {fmt(chained.main.rel_l2)}" if chained.main is not None else "failed"
    if chained.noise_ratio is not None:
        theirs += f", noise ratio {fmt(chained.noise_ratio, 3)}"
    failed = ", ".join(f"{c.target}.{c.name}" for c in chained.checks if not c.passed)
    lines = [
        f"{r.id}: inherited from {r.inherited}, which failed first on the golden's inputs",
        f"  isolated (golden inputs): passed ({own})",
        f"  chain (its own inputs): failed ({theirs}){f': {failed}' if failed else ''}",
        f"  hint: fix {r.inherited} first; this point computes right on the golden's inputs",
    ]
    return "\n".join(lines)


HINTS_DOC = "docs/plugin.md#hints"  # what each hint means, per component

HINT_CHAIN_ONLY = (
    "right on the golden's inputs, wrong on its own: what the candidate builds around its modules "
    "(attention mask, position ids, rotary, the cache), or error accumulated from the points before "
    "(see their noise ratios)"
)


def _noise_lines(noise: dict[str, Any]) -> list[str]:
    parts = [
        f"{target} {fmt(t['ratio'], 3)}x (reference rel_l2 {fmt(t.get('reference_rel_l2'), 3)})"
        for target, t in noise["targets"].items()
    ]
    own = f"under {noise['floor']}" if noise.get("floor") else "in this dtype"  # a quantization floor: its scheme
    return _wrapped(f"  noise ratio (error / the reference's own {own}): ", ", ".join(parts))


def _row_lines(rows: list[BatchRow]) -> list[str]:
    """A batch's rows that fail (over their real tokens), with their prompts: `rows 2, 5 of 8 fail:`."""
    failed = [row for row in rows if row.failed]
    if not failed:
        return [f"  rows: none of the {len(rows)} fails on its own (the error is spread over them)"] if rows else []
    names = ", ".join(str(row.row) for row in failed)
    lines = [f"  row{'s' * (len(failed) > 1)} {names} of {len(rows)} fail{'s' * (len(failed) == 1)}:"]
    for row in failed[:8]:
        prompt = f' prompt "{row.prompt}",' if row.prompt else ""
        lines.append(
            f"    row {row.row}:{prompt} {counted(row.tokens, 'token')}, rel_l2 {fmt(row.rel_l2, 3)}, "
            f"worst token {fmt(row.max_token_rel_l2, 3)}"
        )
    if len(failed) > 8:
        lines.append(f"    ... and {len(failed) - 8} more (the report's rows)")
    return lines


def _verdict_lines(r: PointResult) -> list[str]:
    lines = []
    for target, m in r.metrics.items():
        lines.append(
            f"  {target}: golden {tuple(m.shape_golden)} {m.dtype_golden}, "
            f"candidate {tuple(m.shape_candidate)} {m.dtype_candidate}"
        )
    lines.append("")
    w = max([9, *(len(t) + 1 for t in r.metrics), *(len(c.target) + 1 for c in r.checks)])  # the tensor column
    lines.append(f"  {'tensor':<{w}}{'metric':<16}{'value':>14}{'limit':>14}  verdict")
    for c in r.checks:
        limit = "-" if c.limit is None else f"{c.op} {fmt(c.limit)}"
        lines.append(f"  {c.target:<{w}}{c.name:<16}{fmt(c.value):>14}{limit:>14}  {'ok' if c.passed else 'FAIL'}")
    checked = {(c.target, c.name) for c in r.checks}
    for target, m in r.metrics.items():
        judged = "".join(
            f"{name} {fmt(getattr(m, name), 6)}, " for name in ("cosine", "rel_l2") if (target, name) not in checked
        )
        lines.extend(
            _wrapped(
                f"  {target:<{w}}",
                f"{judged}snr {fmt(m.snr_db)} dB, pearson {fmt(m.pearson, 6)}, "
                f"max_abs {fmt(m.max_abs)}, mean_abs {fmt(m.mean_abs)}, max_rel {fmt(m.max_rel)}",
                indent=w + 2,
            )
        )
        if m.shape_match:
            share = m.mismatched / m.numel * 100 if m.numel else 0.0
            lines.append(
                f"  {'':<{w}}outside atol={fmt(m.atol)}/rtol={fmt(m.rtol)}: {m.mismatched} / {m.numel} ({share:.2f}%)"
            )
        if m.nan_candidate or m.inf_candidate or m.nan_golden or m.inf_golden:
            lines.append(
                f"  {'':<{w}}NaN/Inf: candidate {m.nan_candidate}/{m.inf_candidate}, "
                f"golden {m.nan_golden}/{m.inf_golden}, first non-finite at {m.first_nonfinite}"
            )
    if r.noise:
        lines.extend(_noise_lines(r.noise))
    for target, rows in r.worst_elements.items():
        lines.append(f"  worst elements of {target}:")
        lines.append(f"    {'index':<22}{'golden':>14}{'candidate':>14}{'difference':>14}")
        for index, g, c, d in rows:
            lines.append(f"    {index!s:<22}{fmt(g):>14}{fmt(c):>14}{fmt(d):>14}")
    lines.extend(_row_lines(r.rows))
    if r.worst and r.rows and r.token_errors and len(r.token_errors) % len(r.rows) == 0:
        length = len(r.token_errors) // len(r.rows)  # token indices over the batch -> (row, position)
        worst = ", ".join(f"row {t // length} pos {t % length} ({fmt(e, 3)})" for t, e in r.worst)
        lines.extend(_wrapped("  worst tokens (rel error): ", worst))
    elif r.worst:
        worst = ", ".join(f"{t} ({fmt(e, 3)})" for t, e in r.worst)
        lines.extend(_wrapped("  worst tokens (position, rel error): ", worst))
    if r.worst_experts:
        experts = ", ".join(
            f"#{e} {100 * share:.0f}% (rel {fmt(err, 3)} over {counted(n, 'token')})"
            for e, n, err, share in r.worst_experts
        )
        lines.extend(
            _wrapped("  worst experts (each one's own share of the error; rel error over its tokens): ", experts)
        )
    if r.logits is not None:
        lines.extend(_logits_lines(r.logits))
    if r.routing:
        lines.extend(_routing_lines(r.routing))
    for note in r.notes:
        lines.extend(_wrapped("  note: ", note))
    return lines


def _routing_lines(rt: RoutingMetrics) -> list[str]:
    lines = [
        f"  routing: {counted(rt.num_tokens, 'token')}, top-{rt.top_k} of {rt.num_experts} experts, "
        f"set agreement {rt.set_agreement * 100:.1f}%, real flips {len(rt.flips)}, ties {len(rt.ties)}"
    ]
    shown = rt.flips[:8] or rt.ties[:4]
    if shown:
        lines.append(f"    {'token':>6}  {'golden only':<24}{'candidate only':<24}{'score gap':>10}  kind")
        for f in shown:
            lost = sorted(set(f.golden_experts) - set(f.candidate_experts))
            gained = sorted(set(f.candidate_experts) - set(f.golden_experts))
            lines.append(
                f"    {f.token:>6}  {lost!s:<24}{gained!s:<24}{fmt(f.gap, 3):>10}  {'tie' if f.is_tie else 'flip'}"
            )
        more = len(rt.flips) - len(rt.flips[:8])
        if more > 0:
            lines.append(f"    ... and {more} more flips")
    return lines


def _logits_lines(lg: LogitsMetrics) -> list[str]:
    top1 = lg.top1
    lines = _wrapped(
        "  next token: ",
        f"top-1 agreement {lg.top1_agreement * 100:.1f}% of {counted(lg.num_tokens, 'token')} "
        f"(real flips {len(top1.flips)}, ties {len(top1.ties)}), top-{lg.top_k} overlap "
        f"{lg.top_k_overlap * 100:.1f}%, KL mean {fmt(lg.kl_mean, 3)} max {fmt(lg.kl_max, 3)} nats",
    )
    for f in (top1.flips or top1.ties)[:5]:
        lines.append(
            f"    token {f.token}: golden top-1 {f.golden_experts[0]}, candidate {f.candidate_experts[0]}, "
            f"golden logit gap {fmt(f.gap, 3)} ({'tie' if f.is_tie else 'flip'})"
        )
    return lines


# -- drills -----------------------------------------------------------------------------------------


def _op_line(op: OpRow) -> str:
    figures = f"error {fmt(op.error, 3)}  ratio {fmt(op.ratio, 3)}"
    if op.isolated_ratio is not None:
        figures += f"  isolated ratio {fmt(op.isolated_ratio, 3)}"
    how = f"  [{op.how}]" if op.how and op.how != "path and op" else ""
    note = f"  ({op.note})" if op.note else ""
    return f"  {op.verdict.upper() if op.failed else 'ok':10} {op.name:34} {figures}{how}{note}"


def drill_text(drill: Drill, limit: int = 40) -> str:
    """A drill's op table: the culprit, its recovery, then the ops in forward order (the healthy
    ones before the first failure folded into a count)."""
    lines = [
        f"{drill.point}: drilled into {counted(len(drill.rows), 'op')} ({drill.dtype}, noise factor {drill.factor:g})"
    ]
    if drill.foreign_reference:
        lines.append(
            f"  the reference's rerun here does not reproduce the golden at {drill.point} (rel_l2 "
            f"{fmt(drill.reference_error, 3)}): the golden's model or transformers' code here differ from the "
            f"recording's, and the ops below are judged against this machine's run"
        )
    if drill.made:
        lines.append(f"  made inside the call: {drill.made}")
    if drill.unmatched:
        lines.append(f"  matching failed: {drill.unmatched}")
    elif drill.culprit:
        lines.extend(_culprit_lines(drill))
    elif drill.structure:
        lines.append("  no op introduced the divergence: it is structural (ops missing or extra, below)")
    elif drill.accumulation:
        lines.append(f"  {drill.accumulation}")
    else:
        lines.append("  no op introduced a divergence")
    lines.extend(f"  structure: {sentence}" for sentence in drill.structure[:STRUCTURE_SHOWN])
    if len(drill.structure) > STRUCTURE_SHOWN:
        more = len(drill.structure) - STRUCTURE_SHOWN
        lines.append(f"  structure: ... {more} more missing or extra {noun(more, 'op')} in the table")
    if drill.repro:
        lines.append(f"  {repro_line(drill.repro, drill.repro_cause)}")
    first = next((i for i, r in enumerate(drill.rows) if r.failed), len(drill.rows))
    if first:
        lines.append(f"  ok         {counted(first, 'op')} before the first failing one")
    shown = drill.rows[first : first + limit]
    lines.extend(_op_line(r) for r in shown)
    if len(drill.rows) > first + limit:
        lines.append(
            f"  ... {len(drill.rows) - first - limit} more {noun(len(drill.rows) - first - limit, 'op')} in the report"
        )
    return "\n".join(lines)


def _culprit_lines(drill: Drill) -> list[str]:
    """The culprit (its group's), what its op was given, the rows it ran on, and the recoveries."""
    group, own = drill.culprit_group, drill.culprit
    row = drill.row(own)
    rows_of = row is not None and row.note in drill.row_sets  # a gather of other rows: whose they are
    whose = f", {row.note.split(' ran on ')[0]}'s gather" if rows_of else ""  # the op's name may say another
    first = f" (the first: {own}{whose})" if group else ""
    lines = [f"  culprit: {group or own} introduced the divergence{first}"]
    if drill.culprit_op and drill.culprit_op != own:
        lines.append(f"  the culprit's op: {drill.culprit_op}")
    lines.extend(f"  {said}" for said in drill.differs())
    lines.extend(f"  rows differ: {said}" for said in drill.row_sets)
    error, noise = fmt(drill.component_error, 3), fmt(drill.component_noise, 3)
    if drill.recovery is not None:
        lines.append(
            f"  substituting the reference's output of {own} in the candidate's run recovers {pct(drill.recovery)} "
            f"of {drill.point}'s error ({error}; the reference's own: {noise})"
        )
    elif rows_of:
        lines.append(
            f"  nothing substituted: the candidate's counterpart of {own} holds other rows than it, so the "
            f"reference's values cannot take their place"
        )
    if group and drill.group_recovery is not None:
        lines.append(
            f"  substituting the reference's outputs of {group} ({counted(len(drill.group_ops), 'op')}) recovers "
            f"{pct(drill.group_recovery)} of {drill.point}'s error"
        )
    best = drill.group_recovery if group and drill.group_recovery is not None else drill.recovery
    if drill.partial:
        share, then = f"part of the error ({pct(best)})", "the next op that does"
        if best is not None and best < 0.005:  # another op's error hides its own
            share, then = "none of the error alone (0%)", "the next op that explains some"
        lines.append(
            f"  {group or own} explains {share}; {then}: {drill.partial['op']} (substituting it recovers "
            f"{pct(drill.partial['recovery'])})"
        )
    if drill.recovery_introduced is not None and drill.recovery_introduced not in (drill.recovery, best):
        lines.append(f"  substituting every op that introduced error recovers {pct(drill.recovery_introduced)}")
    return lines


def drill_op_text(point: str, op: OpRow, drill: Drill) -> str:
    """One drill item's failure."""
    head = {
        "introduced": "introduced the divergence: fed the reference's inputs, it differs beyond the reference's "
        "own rounding",
        "inherited": "inherited the divergence: its inputs already differ",
        "missing": "has no counterpart among the candidate's ops",
        "extra": "is a candidate op that matches no reference op",
    }[op.verdict]
    if op.verdict == "introduced" and op.note in drill.row_sets:
        head = "introduced the divergence: the candidate's counterpart holds other rows (tokens) than it"
    lines = [f"{point}::{op.name} {head}", _op_line(op)]
    if op.candidate:
        lines.append(f"  computed by the candidate's {', '.join(op.candidate)}")
    if op.recovery is not None:
        lines.append(f"  substituting its golden output recovers {pct(op.recovery)} of {point}'s error")
    if drill.culprit_group and op.name in drill.group_ops:
        lines.append(f"  part of the drill's culprit, {drill.culprit_group}")
    elif drill.culprit and drill.culprit != op.name:
        lines.append(f"  the drill's culprit: {drill.culprit_group or drill.culprit}")
    return "\n".join(lines)
