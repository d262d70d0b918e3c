"""The drill's findings at one point, in words: the culprit (the first op the table marks
introduced) and its recovery by substitution, the structural differences (reference ops with no
counterpart, candidate ops that match none) with the ops their values go into, and, where no op
explains the divergence, why (`engine.Drilling` judges the ops; this module says what the table
means)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..report.drill import Drill, OpRow
from ..words import counted
from .capture import OpGraph
from .engine import BOOKKEEPING, Drilling, Execute, Reference
from .explain import label
from .groups import OtherRows, culprit_group, differing_rows, rows_group
from .made import Made, made_found, said


def run_drill(
    point: str,
    reference: Reference,
    candidate: OpGraph,
    *,
    dtype: torch.dtype,
    factor: float,
    floor: float,
    execute: Execute | None = None,
    replay_chained: bool = False,
    same_code: bool = True,
    point_passed: bool | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
) -> Drill:
    started = time.perf_counter()
    d = Drilling(
        point, reference, candidate, execute=execute, replay_chained=replay_chained,
        factor=factor, floor=floor, same_code=same_code, point_passed=point_passed, dtype=dtype,
    )  # fmt: skip
    rows = d.rows()
    error, noise, _ = d.component
    other_rows = [] if same_code else differing_rows(d.ref, d.cand, rows)
    unmatched = _unmatched(rows)
    found = _culprit(d, rows, other_rows) if unmatched is None else {}
    culprit = found.get("culprit")
    structure = _structure(d, rows, culprit) if unmatched is None else []
    accumulation = None
    # the component diverges with no op to blame: its point failed, or, not judged in this run, its
    # error here is beyond the factor
    beyond = error > factor * max(noise, floor)
    diverges = (point_passed is False and error > noise) or (point_passed is None and beyond)
    made = made_found(d, inputs)  # a value made inside the call that differs from the golden's
    if culprit is None and not structure and unmatched is None and diverges:
        accumulation = _accumulation(d, rows, made)
    result = Drill(
        point, rows, culprit, found.get("recovery"), error, noise, factor, str(dtype).removeprefix("torch."),
        same_code, time.perf_counter() - started, found.get("substituted", []), found.get("recovery_all"),
        structure=structure, partial=found.get("partial"), accumulation=accumulation, unmatched=unmatched,
        culprit_op=found.get("culprit_op", ""), evidence=found.get("evidence", []),
        row_sets=[o.sentence for o in other_rows],
        made=said(d, made),
        **found.get("group", {}),
    )  # fmt: skip
    result.state = d  # for a repro file; not part of the JSON
    return result


def _culprit(d: Drilling, rows: list[OpRow], other_rows: list[OtherRows]) -> dict[str, Any]:
    """The culprit (the first introduced row), its recovery, its group's (`groups.culprit_group`),
    every introduced op's together, the next op that explains more, and what its op was given. A
    gather whose rows differ as a set (`groups.differing_rows`) is not substituted: the candidate's
    rows are other rows than the reference's, so the reference's cannot take their place."""
    introduced = [r for r in rows if r.verdict == "introduced"]
    if not introduced:
        return {}
    row = introduced[0]
    found: dict[str, Any] = {"culprit": row.name, "culprit_op": label(row.name, row.kind)}
    on_other_rows = row.name in {o.row for o in other_rows}
    recovery, substituted = (None, []) if on_other_rows else d.substitute(row.name)
    row.recovery = recovery
    found.update(recovery=recovery, substituted=substituted, evidence=d.evidence(row.name))
    if on_other_rows:
        group = rows_group(other_rows, row, rows)
    else:
        group = culprit_group(rows, row, recovery, lambda names: d.substitute(names)[0])
    if group is not None:
        found["group"] = {"culprit_group": group.label, "group_ops": group.ops, "group_recovery": group.recovery}
    matched = [r.name for r in introduced if r.how is not None]
    if len(matched) > 1:
        same = group is not None and set(group.ops) == set(matched)
        found["recovery_all"] = group.recovery if same else d.substitute(matched)[0]
    best = group.recovery if group is not None and group.recovery is not None else recovery
    if best is not None and best < 0.5:  # part of the error: which other op explains more
        found["partial"] = _explains_more(d, rows, row, best, group.ops if group is not None else [])
    return found


# structure sentences whose recovery a substitution measures (a replay each): as many as the text shows
MEASURED_SENTENCES = 5


def _structure(d: Drilling, rows: list[OpRow], culprit: str | None) -> list[str]:
    """A sentence per run of adjacent missing ops and per extra op, with the judged ops their values
    go into (and, for missing ops where no op introduced the divergence, what their reference value
    in the candidate's run recovers: the last of the run that can be substituted)."""

    def listed(names: list[str]) -> str:
        names = [f"{n}, the culprit" if n == culprit else n for n in names]
        return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"

    out: list[str] = []
    runs: list[list[OpRow]] = []
    at: dict[int, int] = {}  # a run of missing ops -> where its sentence goes (the table's order)
    measured = 0  # substitutions cost a replay each: for the first MEASURED_SENTENCES sentences
    for i, row in enumerate(rows):
        if row.verdict == "extra":
            text = f"the candidate's own op {label(row.name, row.kind)} matches no reference op"
            fed = d.feeds(row)
            if fed:  # it has no reference output; the ops it feeds have
                text += f" and feeds {listed(fed)}"
                measured += 1
                recovery = d.substitute(fed)[0] if measured <= MEASURED_SENTENCES else None
                if recovery is not None:
                    text += f" (the reference's values of the ops it feeds recover {100 * recovery:.0f}%)"
            out.append(text)
        elif row.verdict == "missing":
            if runs and rows[i - 1] is runs[-1][-1]:
                runs[-1].append(row)
            else:
                runs.append([row])
                at[len(runs) - 1] = len(out)
                out.append("")
    for k, run in enumerate(runs):
        names = [r.name for r in run]
        fed = [n for r in run for n in d.feeds(r) if n not in names]
        verb = "has" if len(run) == 1 else "have"
        text = f"the reference's {', '.join(label(r.name, r.kind) for r in run)} {verb} no counterpart in the candidate"
        if fed:
            text += f", which feed{'s' * (len(run) == 1)} {listed(list(dict.fromkeys(fed)))}"
        measured += 1
        if culprit is None and measured <= MEASURED_SENTENCES:
            for row in reversed(run):
                row.recovery = d.substitute(row.name)[0]
                if row.recovery is not None:
                    text += f" (the reference's value of {row.name} in the candidate's run recovers "
                    text += f"{100 * row.recovery:.0f}%)"
                    break
        out[at[k]] = text
    return out


def _explains_more(
    d: Drilling, rows: list[OpRow], culprit: OpRow, recovery: float, group: list[str]
) -> dict[str, Any] | None:
    """Where substituting the culprit (its group) recovers under half of the error: the other
    introduced or missing op (the first five after it, out of its group) whose substitution recovers
    most, if it recovers more."""
    others = [r for r in rows if r is not culprit and r.name not in group and r.verdict in ("introduced", "missing")]
    others = others[:5]
    best = None
    for row in others:
        got = d.substitute(row.name)[0]
        if got is not None and got > recovery and (best is None or got > best["recovery"]):
            best = {"op": row.name, "recovery": got}
    return best


def _accumulation(d: Drilling, rows: list[OpRow], made: Made | None = None) -> str:
    """The component diverges and no op leaves its floor: how many ops were compared, how many are
    above the reference's own error (the error builds up over them, each within its floor), the largest
    ratios to their floors (below 1 too), and the ops that ran in another dtype than the reference's
    (usually the finding: a softmax in bfloat16, a table made in bfloat16)."""
    compared = [r for r in rows if r.error is not None and r.ratio is not None]
    above = [r for r in compared if r.error > (r.noise or 0.0)]
    ranked = sorted(compared, key=lambda r: -r.ratio)[:3]
    largest = ", ".join(f"{r.name} {r.ratio:.2f}x" for r in ranked)
    if not compared:
        text = "no op leaves its dtype's floor: the drill compared no op's values (no row of the table has an error)"
    elif above:
        text = (
            f"no single op leaves its dtype's floor: the error accumulates over {len(above)} of the "
            f"{counted(len(compared), 'op')} compared, above the reference's own error (the largest ratios: "
            f"{largest} of their floor)"
        )
    else:
        text = (
            f"no single op leaves its dtype's floor, and none of the {counted(len(compared), 'op')} compared is "
            f"above the reference's own error: the largest ratios are {largest} of their floor"
        )
    dtypes = d.other_dtypes()
    if made is not None and made.dtype:
        dtypes.append(made.dtype)
    if dtypes:
        text += f"; ran in another dtype than the reference's: {', '.join(dtypes[:5])}"
    return text


def _unmatched(rows: list[OpRow]) -> str | None:
    """Where most of the reference's floating-point ops match no candidate op, matching failed: no
    op's verdict means anything, and no culprit is named."""
    judged = [r for r in rows if r.note != BOOKKEEPING and r.verdict != "extra"]
    missing = [r for r in judged if r.verdict == "missing"]
    if len(judged) < 4 or 2 * len(missing) <= len(judged):
        return None
    names = ", ".join(r.name for r in missing[:3])
    return (
        f"{len(missing)} of {len(judged)} reference ops match no candidate op ({names}, ...): the two sides' "
        f"ops could not be matched, so no culprit is named. Values the candidate builds inside the component "
        f"(positions, masks, rotary tables) where the reference is given them, or another order of its "
        f"rows, are the usual cause"
    )
