"""Rows by identity, found before `match`'s passes. A port's expert loop may gather each expert's
tokens in another order than the reference's (by token where transformers goes by top-k slot, then
token; sorted or bucketed dispatch). Where a candidate gather takes the same rows of the same values
as a reference gather in another order (the same multiset of indices), its rows are put in the
reference's order, and so are those of every op that goes on row by row from it (same leading size),
up to a scatter back (`index_add`, `scatter`, `index_put`): the candidate's values are compared,
substituted and isolated row by row by which token (and top-k slot) each row holds, not by position
(`match.Match.frames`). Where a reference gather's rows are in no candidate gather, but most of them
are in one, `row_sets` says which rows each side took (`groups` says it in words)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..judge.distance import rel_l2
from .capture import OpGraph, OpNode, Ref

VALUE_TOL = 0.05  # relative L2 under which two outputs are "the same value" for matching (`match` too)


# ops that put rows back by index (an expert's outputs into the token order): a row frame ends there
SCATTERS = frozenset(["index_add", "index_copy", "index_put", "scatter", "scatter_add", "scatter_reduce"])
# gathers of rows along dim 0 (engine.GATHERS also counts `gather`, which takes along any dim)
ROW_GATHERS = frozenset(["index", "index_select"])


def _gathered(graph: OpGraph, node: OpNode) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A gather of rows along dim 0 (`x[i]`, `x[i, j]`, `x[mask]`, `index_select(x, 0, i)`): (the values
    it reads, one integer key per output row: the flat position of the row it took), or None."""
    if node.kind not in ROW_GATHERS or node.value is None or node.value.dim() == 0:
        return None
    args = node.args
    source = graph.value_of(args[0]) if args and isinstance(args[0], Ref) else None
    if not isinstance(source, torch.Tensor) or source.dim() == 0:
        return None
    if node.kind == "index_select":
        if len(args) < 3 or args[1] != 0 or not isinstance(args[2], Ref):
            return None
        indices = [graph.value_of(args[2])]
    else:
        raw = args[1] if len(args) > 1 else None
        if not isinstance(raw, list | tuple) or not raw or any(not isinstance(i, Ref) for i in raw):
            return None  # a None among the indices (a slice before them): not rows along dim 0
        indices = [graph.value_of(i) for i in raw]
    if len(indices) == 1 and isinstance(indices[0], torch.Tensor) and indices[0].dtype == torch.bool:
        mask = indices[0]  # `x[mask]`: the rows where the mask holds, in order
        if mask.dim() != 1 or mask.shape[0] != source.shape[0]:
            return None
        indices = [mask.nonzero().squeeze(1)]
    if any(not isinstance(i, torch.Tensor) or i.is_floating_point() or i.dtype == torch.bool for i in indices):
        return None
    try:
        indices = torch.broadcast_tensors(*indices)
    except RuntimeError:
        return None
    if indices[0].dim() != 1 or indices[0].shape[0] != node.value.shape[0] or len(indices) > source.dim():
        return None
    key = torch.zeros_like(indices[0], dtype=torch.int64)
    for i, size in zip(indices, source.shape, strict=False):
        key = key * size + i.long().remainder(size)
    return source, key


def _row_slice(graph: OpGraph, node: OpNode) -> tuple[int, int, int] | None:
    """A slice of rows (dim 0, step 1) of an earlier op's output: (that op, start, stop), or None."""
    args = node.args
    if node.kind != "slice" or len(args) < 4 or not isinstance(args[0], Ref) or args[0].kind != "op":
        return None
    dim, start, stop = args[1], args[2], args[3]
    step = args[4] if len(args) > 4 else 1
    if dim != 0 or step != 1 or not all(isinstance(x, int) for x in (start, stop)):
        return None
    return args[0].at, start, stop


@dataclass
class RowIdentity:
    """`row_frames`: per candidate op whose rows hold the reference's in another order, the index
    that puts them in the reference's order (`value[index]`); per candidate gather or slice of one,
    the reference gather whose rows it holds; the framed ops whose rows join several experts'."""

    frames: dict[int, torch.Tensor]
    gathers: dict[int, int]
    joined: set[int]
    sets: set[int] = field(default_factory=set)  # framed by `_rows_as_sets`, and what goes on from them


def row_frames(reference: OpGraph, candidate: OpGraph) -> RowIdentity:
    """Rows by identity (see the module's docstring and `RowIdentity`).

    A candidate gather is keyed by the rows it takes (`_gathered`), and so is a slice of rows of one
    (a sorted dispatch gathers every (token, slot) pair at once, each expert a slice of it); one whose
    keys are a reference gather's in another order takes its frame. Ops that go on row by row take
    their input's frame; a concatenation of framed ops along rows (each expert's results joined) the
    frames joined, in the reference's order of the same pieces."""
    refs = [(n, g) for n in reference.compute() if (g := _gathered(reference, n)) is not None]
    if not refs:
        return RowIdentity({}, {}, set())
    keyed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for node in candidate.nodes:
        got = _gathered(candidate, node) if not node.layout else None
        cut = _row_slice(candidate, node) if node.layout else None
        if cut is not None and cut[0] in keyed:
            source, key = keyed[cut[0]]
            got = source, key[cut[1] : cut[2]]
        if got is not None:
            keyed[node.index] = got
    frames: dict[int, torch.Tensor] = {}
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    same: dict[tuple[int, int], bool] = {}  # (source, reference's source) by identity: gathers share them

    def same_source(source: torch.Tensor, r_source: torch.Tensor) -> bool:
        key = id(source), id(r_source)  # both kept alive by the graphs
        if key not in same:
            same[key] = rel_l2(source, r_source) <= VALUE_TOL
        return same[key]

    for index, (source, key) in keyed.items():
        for r, (r_source, r_key) in refs:
            if r.index in taken or r_key.shape != key.shape:
                continue
            if r_source.shape != source.shape or not torch.equal(r_key.sort().values, key.sort().values):
                continue
            if r_key.unique().numel() != r_key.numel() or not same_source(source, r_source):
                continue
            order = torch.empty_like(key)  # the candidate's row holding the reference's row j
            order[r_key.argsort()] = key.argsort()
            frames[index] = order
            taken.add(r.index)
            pairs[index] = r.index
            break
    sets: set[int] = set()
    found = _rows_as_sets(candidate, [r for r, _ in refs if r.index not in taken], set(frames))
    if any(not torch.equal(order, torch.arange(order.numel())) for _, order in found.values()):
        for index, (r_index, order) in found.items():
            frames[index], pairs[index] = order, r_index
            sets.add(index)
    if all(torch.equal(f, torch.arange(f.numel())) for f in frames.values()):
        return RowIdentity({}, pairs, set())  # every row where the reference has it
    joined: set[int] = set()
    for node in candidate.nodes:  # row by row from a framed op: the same frame, to a scatter back
        if node.index in frames or node.kind in SCATTERS or node.value is None or node.value.dim() == 0:
            continue
        if node.layout and _row_slice(candidate, node) is None:
            continue
        reads = _framed_inputs(candidate, node.inputs(), frames)
        inherited = [frames[i] for i in reads if i is not None]
        if node.kind == "cat" and inherited:
            frame = _joined_frames(candidate, node, frames)
            if frame is not None:
                frames[node.index] = frame
                joined.add(node.index)
            continue
        one = inherited and all(torch.equal(f, inherited[0]) for f in inherited[1:])  # one order, or none
        if one and node.value.shape[0] == inherited[0].numel() and not node.layout:
            frames[node.index] = inherited[0]
            if any(i in joined for i in reads):
                joined.add(node.index)
        if node.index in frames and any(i in sets for i in reads):
            sets.add(node.index)
    return RowIdentity(frames, pairs, joined, sets)


SET_ROWS = 8192  # the most rows `_rows_as_sets` pairs (their distances: SET_ROWS^2 floats)


def _rows_as_sets(candidate: OpGraph, untaken: list[OpNode], keyed: set[int]) -> dict[int, tuple[int, torch.Tensor]]:
    """Where no index traces which token a row holds (rows made by a one-hot matmul, a scatter into
    a buffer): per candidate op (or slice of rows of one) holding the same rows as one of the
    reference's gathers in `untaken`, in another order, (that gather, the order that puts its rows
    in the reference's). The rows are paired as a set: each reference row with the candidate's
    nearest, one to one, and all of them then within VALUE_TOL; the first such op in forward order."""
    wanted = [
        r for r in untaken
        if r.value is not None and r.value.is_floating_point() and r.value.dim() >= 2
        and 1 <= r.value.shape[0] <= SET_ROWS
    ]  # fmt: skip
    found: dict[int, tuple[int, torch.Tensor]] = {}
    used: set[int] = set()
    for node in candidate.nodes if wanted else ():
        value = node.value
        if node.index in keyed or value is None or not value.is_floating_point():
            continue
        if node.layout and _row_slice(candidate, node) is None:  # of views, slices of rows only
            continue
        for r in wanted:
            if r.index in used or r.value.shape != value.shape:
                continue
            order = _set_order(value, r.value)
            if order is not None:
                found[node.index] = r.index, order
                used.add(r.index)
                break
    return found


def _set_order(value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """The order that puts `value`'s rows in `rows`' (`value[order]`), where each of `rows` has its
    own nearest among `value`'s and all are then within VALUE_TOL, else None."""
    n = rows.shape[0]
    a, b = value.detach().reshape(n, -1).float(), rows.detach().reshape(n, -1).float()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None
    order = torch.cdist(b, a).argmin(dim=1)
    if order.unique().numel() != n or rel_l2(a[order], b) > VALUE_TOL:
        return None
    return order


def _framed_inputs(graph: OpGraph, refs: list[Ref], frames: dict[int, torch.Tensor]) -> list[int | None]:
    """The framed ops `refs` come from, through views that are not framed themselves (None for an op
    that has no frame)."""
    out: list[int | None] = []
    todo, seen = list(refs), set()
    while todo:
        producer = graph.producer(todo.pop(0))
        if producer is None or producer.index in seen:
            continue
        seen.add(producer.index)
        if producer.index in frames:
            out.append(producer.index)
        elif producer.layout:
            todo.extend(producer.inputs())
        else:
            out.append(None)
    return out


def _joined_frames(graph: OpGraph, node: OpNode, frames: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The frame of a concatenation along rows whose every piece is framed: the pieces' frames,
    each shifted to where its rows are."""
    pieces = node.args[0] if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if dim != 0 or not isinstance(pieces, list | tuple) or not pieces:
        return None
    joined, offset = [], 0
    for piece in pieces:
        value = graph.value_of(piece) if isinstance(piece, Ref) else None
        got = _framed_inputs(graph, [piece], frames) if isinstance(piece, Ref) else []
        if len(got) != 1 or got[0] is None or not isinstance(value, torch.Tensor):
            return None
        frame = frames[got[0]]
        if value.shape[0] != frame.numel():
            return None
        joined.append(frame + offset)
        offset += frame.numel()
    return torch.cat(joined)


# A candidate gather holds a reference gather's rows, some dropped, duplicated or others in their place,
# where the two sets share at least this share of their rows (Jaccard, as multisets).
SAME_ROWS_SHARE = 0.5


@dataclass
class RowSet:
    """A reference gather whose rows the candidate's nearest gather (or slice of one) holds only in
    part: which of the source's rows each side took (one integer key each, `_gathered`)."""

    ref: int  # the reference gather
    cand: int  # the candidate's gather or slice of one
    ref_rows: list[int]
    cand_rows: list[int]


def row_sets(reference: OpGraph, candidate: OpGraph) -> list[RowSet]:
    """The reference's gathers of rows whose rows no candidate gather takes (not even in another
    order), each with the candidate gather or slice of one, from the same values, that shares the most
    of them (a capacity dispatch that drops an expert's overflowing tokens, a token sent to an expert
    twice or to the wrong one): `row_frames` pairs gathers whose rows are the same set."""
    refs = [(n, g) for n in reference.compute() if (g := _gathered(reference, n)) is not None]
    keyed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for node in candidate.nodes if refs else ():
        got = _gathered(candidate, node) if not node.layout else None
        cut = _row_slice(candidate, node) if node.layout else None
        if cut is not None and cut[0] in keyed:
            got = keyed[cut[0]][0], keyed[cut[0]][1][cut[1] : cut[2]]
        if got is not None:
            keyed[node.index] = got
    counted = {index: Counter(key.tolist()) for index, (_, key) in keyed.items()}
    exact = {(tuple(keyed[i][0].shape), tuple(sorted(c.elements()))) for i, c in counted.items()}
    holding: dict[int, set[int]] = {}  # a row -> the candidate gathers that take it
    for index, c in counted.items():
        for row in c:
            holding.setdefault(row, set()).add(index)
    same: dict[tuple[int, int], bool] = {}
    found: list[RowSet] = []
    for r, (r_source, r_key) in refs:
        rows = r_key.tolist()
        mine = Counter(rows)
        if (tuple(r_source.shape), tuple(sorted(rows))) in exact:
            continue  # the same rows: `row_frames` pairs them
        best, share = None, SAME_ROWS_SHARE
        for index in sorted({i for row in set(rows) for i in holding.get(row, ())}):
            source = keyed[index][0]
            if source.shape != r_source.shape:
                continue
            got = _shared(mine, counted[index])
            ids = id(source), id(r_source)
            better = got > share or (best is None and got == share)  # the first of equal shares
            if better and (same.get(ids) or same.setdefault(ids, rel_l2(source, r_source) <= VALUE_TOL)):
                best, share = index, got
        if best is not None:
            found.append(RowSet(r.index, best, rows, keyed[best][1].tolist()))
    return found


def _shared(ca: Counter, cb: Counter) -> float:
    """The share of rows two gathers have in common, as multisets (Jaccard)."""
    union = sum((ca | cb).values())
    return sum((ca & cb).values()) / union if union else 1.0
