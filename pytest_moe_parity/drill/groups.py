"""Culprits by group, and rows that differ as sets.

**Groups.** A bug in a conversion or a kernel that every expert shares (gate and up swapped in the
fused weights, the experts' order reversed) introduces error at the same op of many experts: the first
of them (`expert[0].gate_up_proj`) is one expert of eight, and substituting it alone recovers an
eighth. The culprit is then the group, `gate_up_proj in all 8 experts`, and its recovery the
substitution of every one of them; where the same experts' other ops introduced error too (the
reversed experts' `down_proj`, a zeroed expert's every matmul) and the op alone recovers under
`GROUP_ENOUGH`, the group takes them in (`gate_up_proj, down_proj in expert 3`) where that recovers
more. Where one expert alone introduced it, that expert's op is the culprit, with its own recovery.
Ops are grouped by their names with the expert taken out (`capture.name_ops`: `expert[5].down_proj`).
A static cache's write of the keys and of the values (`cache.CACHE_WRITE`) is one group too where
both introduced the error (a write one slot early, a past never joined): each alone leaves the other's
error in place, so the write is the culprit as one, `the cache write (keys and values)`.

**Row sets.** Where a reference expert's gather of its tokens has no candidate gather of the same
tokens, but one that shares most of them (`rows.row_sets`: a capacity dispatch drops an expert's
overflowing tokens; a token sent twice, or to the wrong expert), the drill says which tokens: "expert
0 ran on 5 of its 7 tokens: tokens 12, 31 were dropped". The gather is the op that introduced the
divergence, with no recovery (the candidate's rows are other rows than the reference's, so the
reference's cannot take their place), and that expert's ops with no counterpart inherit it."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ..report.drill import OpRow
from .cache import CACHE_WRITE
from .capture import OpGraph
from .rows import row_sets

EXPERT = re.compile(r"expert\[(\d+)\]\.?")
# A group's op alone recovering at least this much is the culprit as it is; under it, the same
# experts' other introduced ops join the group where that recovers more.
GROUP_ENOUGH = 0.9
LISTED = 8  # experts or tokens named in a sentence; beyond, a count


@dataclass
class Group:
    """The culprit's group: what it is in words, its ops (rows' names), what substituting them recovers."""

    label: str
    ops: list[str]
    recovery: float | None


def split(name: str) -> tuple[str, int] | None:
    """An expert's op name as (the op without the expert, the expert): `expert[3].down_proj` ->
    (`down_proj`, 3); None for an op of no expert."""
    found = EXPERT.search(name)
    if found is None:
        return None
    return (name[: found.start()] + name[found.end() :]).rstrip("."), int(found.group(1))


def listed(values: list[int], noun: str) -> str:
    """`expert 3`, `experts 1, 4, 6`, `tokens 0, 2, ... (12)`."""
    shown = ", ".join(str(v) for v in values[:LISTED])
    more = f", ... ({len(values)})" if len(values) > LISTED else ""
    return f"{noun}{'s' * (len(values) != 1)} {shown}{more}"


def _where(experts: list[int], ran: set[int]) -> str:
    if len(experts) > 1 and set(experts) == ran:
        return f"all {len(experts)} experts"
    return listed(experts, "expert")


def culprit_group(
    rows: list[OpRow], culprit: OpRow, recovery: float | None, substitute: Callable[[list[str]], float | None]
) -> Group | None:
    """The culprit's group among the introduced rows (see the module's docstring), or None where the
    culprit stands alone (no expert's, or one expert's one op). `substitute(names)` gives the
    recovery of substituting several ops."""
    own = split(culprit.name)
    if own is None:
        return _cache_write(rows, culprit, substitute)
    ran = {p[1] for r in rows if r.verdict != "extra" and (p := split(r.name)) is not None}  # the reference's
    by_op: dict[str, dict[int, str]] = {}
    for r in rows:
        if r.verdict == "introduced" and (p := split(r.name)) is not None:
            by_op.setdefault(p[0], {})[p[1]] = r.name
    experts = sorted(by_op[own[0]])
    ops = [by_op[own[0]][e] for e in experts]
    # the same experts' other ops that introduced error, in forward order
    joined_ops = [op for op, at in by_op.items() if sorted(at) == experts]
    joined = [
        r.name for r in rows
        if r.verdict == "introduced" and (p := split(r.name)) is not None and p[0] in joined_ops and p[1] in experts
    ]  # fmt: skip
    group: Group | None = None
    if len(ops) > 1:
        got = substitute(ops)
        group = Group(f"{own[0]} in {_where(experts, ran)}", ops, got)
        recovery = got
    if len(joined) > len(ops) and (recovery is None or recovery < GROUP_ENOUGH):
        got = substitute(joined)
        if got is not None and (recovery is None or got > recovery):
            group = Group(f"{', '.join(joined_ops)} in {_where(experts, ran)}", joined, got)
    return group


def _cache_write(rows: list[OpRow], culprit: OpRow, substitute: Callable[[list[str]], float | None]) -> Group | None:
    """A static cache's writes (keys, values) that both introduced error: the culprit as one."""
    if culprit.how != CACHE_WRITE:
        return None
    writes = [r.name for r in rows if r.verdict == "introduced" and r.how == CACHE_WRITE]
    if len(writes) < 2:
        return None
    label = "the cache write (keys and values)" if len(writes) == 2 else f"the cache writes ({len(writes)} of them)"
    return Group(label, writes, substitute(writes))


@dataclass
class OtherRows:
    """A reference gather whose rows the candidate holds only in part: its row, the expert whose
    tokens it takes (None: not an expert's), and the sentence that says which."""

    row: str
    expert: int | None
    sentence: str


def differing_rows(reference: OpGraph, candidate: OpGraph, rows: list[OpRow]) -> list[OtherRows]:
    """Marks the reference's gathers whose rows the candidate holds only in part (`rows.row_sets`)
    introduced, with the sentence that says which tokens, and the ops that go on from them with no
    counterpart on either side inherited (they run on other rows); in forward order. Not where a
    top-k selects other experts: the rows differ then because the routing does, and the top-k's row
    says so."""
    if any(r.kind == "topk" and "select other experts" in r.note for r in rows):
        return []
    ref_rows = {r.name: r for r in rows if r.verdict != "extra"}  # a candidate op may share a name
    extra = {r.name: r for r in rows if r.verdict == "extra"}
    out = []
    for found in row_sets(reference, candidate):
        node = reference.nodes[found.ref]
        row = ref_rows.get(node.name)
        if row is None or row.how is not None:
            continue
        expert = _served(reference, found.ref)
        source = node.args[0] if node.args else None
        noun = "token" if getattr(source, "kind", "") == "input" else "row"
        who = f"expert {expert}" if expert is not None else f"the reference's {node.name}"
        sentence = rows_sentence(who, noun, found.ref_rows, found.cand_rows)
        row.verdict, row.note = "introduced", sentence
        out.append(OtherRows(row.name, expert, sentence))
        note = f"on other rows than the reference's: {sentence}"
        _inherit(reference, found.ref, ref_rows, "missing", expert, note)
        _inherit(candidate, found.cand, extra, "extra", None, note)
    return out


def _served(graph: OpGraph, index: int) -> int | None:
    """The expert whose weights the first ops that read a gather's rows read (a loop's gather of the
    next expert's tokens runs before that expert's weights are first read, under the last one's name)."""
    consumers = graph.consumers()
    todo, seen = [index], set()
    while todo:
        at = todo.pop(0)
        for c in sorted(consumers.get(at, ())):
            node = graph.nodes[c]
            if node.param is not None and node.expert is not None and not node.layout:
                return node.expert
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return graph.nodes[index].expert


def _inherit(
    graph: OpGraph, index: int, by_name: dict[str, OpRow], verdict: str, expert: int | None, note: str
) -> None:
    """The rows of `verdict` (ops with no counterpart) that go on from op `index`, through views and
    each other (of `expert` or of none where given), marked inherited with `note`."""
    consumers = graph.consumers()
    todo, seen = list(consumers.get(index, ()) if not graph.nodes[index].layout else _readers(graph, index)), set()
    while todo:
        at = todo.pop()
        if at in seen:
            continue
        seen.add(at)
        op = graph.nodes[at]
        row = by_name.get(op.name)
        if row is not None and row.verdict == verdict and (expert is None or op.expert in (None, expert)):
            row.verdict, row.note = "inherited", note
            todo.extend(consumers.get(at, ()))


def _readers(graph: OpGraph, view: int) -> list[int]:
    """The computing ops that read a view (through other views)."""
    out = []
    for node in graph.compute():
        todo = list(node.inputs())
        while todo:
            producer = graph.producer(todo.pop())
            if producer is not None and producer.index == view:
                out.append(node.index)
                break
            if producer is not None and producer.layout:
                todo.extend(producer.inputs())
    return out


def rows_group(found: list[OtherRows], culprit: OpRow, ran: list[OpRow]) -> Group | None:
    """The culprit's group where it is a gather whose rows differ: the experts whose rows differ
    (no recovery: the candidate's rows are other rows than the reference's)."""
    experts = sorted({f.expert for f in found if f.expert is not None})
    if not experts:
        return None
    served = {p[1] for r in ran if r.verdict != "extra" and (p := split(r.name)) is not None}
    return Group(f"the dispatch of {_where(experts, served)}", [f.row for f in found], None)


def rows_sentence(who: str, noun: str, ref_rows: list[int], cand_rows: list[int]) -> str:
    """`expert 0 ran on 5 of its 7 tokens: tokens 12, 31 were dropped` (duplicated and misrouted
    rows likewise)."""
    ref, cand = Counter(ref_rows), Counter(cand_rows)
    held = sum(1 for t in ref if cand[t])
    text = f"{who} ran on {held} of its {len(ref)} {noun}s"
    parts = []
    for rows, what in (
        (sorted(t for t in ref if cand[t] < ref[t]), "dropped"),
        (sorted(t for t in cand if cand[t] > ref[t] > 0), "taken more than once (duplicated)"),
        (sorted(t for t in cand if not ref[t]), f"not routed to {who} (misrouted to it)"),
    ):
        if rows:
            parts.append(f"{listed(rows, noun)} {'was' if len(rows) == 1 else 'were'} {what}")
    return f"{text}: {'; '.join(parts)}" if parts else text
