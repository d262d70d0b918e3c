"""Static caches, found before `match`'s passes. A port's decode attention (NxDI's layout) writes the
new keys and values into a cache preallocated to a bucket (`index_copy_`, `scatter_`, `index_put_`)
and takes its scores over every slot of it, the slots not live (left padding, not yet written)
masked; transformers joins the past and the new keys (`torch.cat` in `DynamicCache.update`) and
scores over the live length. The write is the join's counterpart: its *live slots* hold the join's
positions, in order (the past where the cache held it before the write, found by value, or else
just before the slots the write is given; the new positions right after the past). Every candidate
op that goes on from the write with the cache's slots along a dim (the transposed keys, the scores,
the masked scores, the probabilities) is compared, isolated and substituted on its live slots
(`Slots`); its other slots are masks, the candidate's own in a substitution. Where the slots are
contracted (the probabilities times the values) the frame ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..judge.distance import MASKED, rel_l2
from .capture import OpGraph, OpNode, Ref
from .explain import label
from .rows import VALUE_TOL

CACHE_WRITE = "cache write (its live slots by position)"
WRITES = frozenset(["index_copy", "scatter", "index_put"])  # a write into a preallocated cache
MATMULS = frozenset(["mm", "bmm", "matmul"])


@dataclass(frozen=True)
class Slots:
    """A candidate op's live slots along `dim`: `index[i]` holds the reference's position i."""

    dim: int
    index: torch.Tensor
    by_value: bool = True  # a write's: the past found in the cache as it was before the write (else by its index)

    def take(self, value: torch.Tensor) -> torch.Tensor:
        """The live slots of `value`, in the reference's order."""
        return value.index_select(self.dim, self.index.to(value.device))

    def shape(self, shape: torch.Size) -> torch.Size:
        """`shape` (the candidate's) with only its live slots."""
        out = list(shape)
        out[self.dim] = self.index.numel()
        return torch.Size(out)

    def put(self, live: torch.Tensor, own: torch.Tensor | None) -> torch.Tensor:
        """`own` (the candidate's value) with `live` in its live slots (its other slots are masks or
        slots nothing reads: the candidate's own)."""
        if own is None:
            raise ValueError("the candidate's own value is needed for the slots that are not live")
        return own.to(live.dtype).index_copy(self.dim, self.index.to(own.device), live.to(own.device))


def take(value: torch.Tensor, frame: torch.Tensor | Slots | None) -> torch.Tensor:
    """A candidate's value in the reference's frame: its rows in the reference's order (`rows`), or
    its live slots (`Slots`)."""
    if frame is None:
        return value
    return frame.take(value) if isinstance(frame, Slots) else value[frame.to(value.device)]


@dataclass(frozen=True)
class CacheWrites:
    """`cache_slots`: per candidate op with the cache's slots, its live slots; the writes paired with
    the reference's joins (reference op, candidate op)."""

    slots: dict[int, Slots]
    pairs: list[tuple[int, int, tuple[int, ...] | None]]  # (the join, the write, the write's dims permuted)


def _joins(graph: OpGraph) -> list[tuple[OpNode, int, int]]:
    """The reference's cache updates: a `cat` of a past the call holds (no op of the module made it)
    and new values an op made, as (the op, its dim, the past's length)."""
    out = []
    for node in graph.compute():
        if node.kind != "cat" or not node.args or not isinstance(node.args[0], list | tuple) or len(node.args[0]) != 2:
            continue
        past, new = node.args[0]
        if not (isinstance(past, Ref) and isinstance(new, Ref)) or past.kind == "op" or new.kind != "op":
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        value = graph.value_of(past)
        if isinstance(value, torch.Tensor) and node.value is not None and value.is_floating_point():
            out.append((node, dim % node.value.dim(), value.shape[dim]))
    return out


def _slot_dim(write: torch.Tensor, joined: torch.Tensor, dim: int) -> int | None:
    """The write's dim that holds the cache's slots: the others are the join's, in order."""
    if write.dim() != joined.dim() or write.shape == joined.shape:
        return None
    rest = joined.shape[:dim] + joined.shape[dim + 1 :]
    for d in [dim, *range(write.dim())]:
        if write.shape[d] >= joined.shape[dim] and write.shape[:d] + write.shape[d + 1 :] == rest:
            return d
    return None


def _by_value(before: torch.Tensor, past: torch.Tensor, d: int, dim: int) -> torch.Tensor | None:
    """The slots of the cache as it was before the write (`before`) that hold the past, by value."""
    if past.shape[dim] == 0:
        return None
    rows = past.movedim(dim, 0).reshape(past.shape[dim], -1).float()
    slots = before.movedim(d, 0).reshape(before.shape[d], -1).float().to(rows.device)
    first = int(torch.cdist(rows[:1], slots).argmin())  # a run of slots from the first's, as caches hold them
    index = torch.arange(first, first + rows.shape[0], device=rows.device)
    if index[-1] >= slots.shape[0] or rel_l2(slots[index], rows) > VALUE_TOL:
        index = torch.cdist(rows, slots).argmin(dim=1)
    if index.unique().numel() != index.numel() or rel_l2(slots[index], rows) > VALUE_TOL:
        return None
    return index


def _written(graph: OpGraph, write: OpNode, d: int) -> torch.Tensor | None:
    """The slots a write is given (sorted), where its index says them."""
    args = write.args
    index = graph.value_of(args[2]) if len(args) > 2 and isinstance(args[2], Ref) else None
    if write.kind == "index_put" and len(args) > 1 and isinstance(args[1], list | tuple) and len(args[1]) > d:
        at = args[1][d]
        index = graph.value_of(at) if isinstance(at, Ref) else None
    if not isinstance(index, torch.Tensor) or index.is_floating_point() or index.dtype == torch.bool:
        return None
    return index.reshape(-1).unique()


def _live(reference: OpGraph, graph: OpGraph, join: tuple[OpNode, int, int], write: OpNode) -> Slots | None:
    """The write's live slots for the join (see the module's docstring), or None."""
    r, dim, past = join
    value, joined = write.value, r.value
    if value is None or joined is None or not isinstance(write.args[0], Ref):
        return None
    d = _slot_dim(value, joined, dim)
    if d is None:
        return None
    new = joined.shape[dim] - past
    before, given = graph.value_of(write.args[0]), reference.value_of(r.args[0][0])
    index = _by_value(before, given, d, dim) if isinstance(before, torch.Tensor) else None
    by_value = index is not None
    if by_value:
        first = int(index[-1]) + 1
    else:  # the past just before the slots the write is given
        written = _written(graph, write, d)
        if written is None or written.numel() != new:
            return None
        first = int(written[0])
        index = torch.arange(first - past, first)
    index = torch.cat([index.cpu(), torch.arange(first, first + new)])
    if int(index.min()) < 0 or int(index.max()) >= value.shape[d]:
        return None
    return Slots(d, index, by_value)


def cache_slots(reference: OpGraph, candidate: OpGraph) -> CacheWrites:
    """The candidate's cache writes paired with the reference's joins, and the live slots of every op
    that goes on from them with the cache's slots (see the module's docstring)."""
    joins = _joins(reference)
    writes = [n for n in candidate.compute() if n.kind in WRITES]
    if not joins or not writes:
        return CacheWrites({}, [])
    slots: dict[int, Slots] = {}
    pairs: list[tuple[int, int, tuple[int, ...] | None]] = []
    for r, dim, past in joins:
        found = [
            (w, s) for w in writes if w.index not in slots and (s := _live(reference, candidate, (r, dim, past), w))
        ]
        if not found:
            continue
        w, s = min(found, key=lambda f: rel_l2(f[1].take(f[0].value).movedim(f[1].dim, dim), r.value))  # K's, V's
        slots[w.index] = s
        perm = list(range(r.value.dim()))
        perm.insert(dim, perm.pop(s.dim))
        pairs.append((r.index, w.index, tuple(perm) if s.dim != dim else None))
    _follow(candidate, slots)
    return CacheWrites(slots, [p for p in pairs if p[1] in slots])


def _follow(graph: OpGraph, slots: dict[int, Slots]) -> None:
    """Each op after a write that reads an op with live slots and keeps the cache's slots along a dim
    takes them along that dim (a slice along them that keeps every live slot, those it keeps); a
    matmul that contracts them ends the frame. A write whose slots reach no computing op (its cache
    read back narrower than the live positions) is no counterpart of the join: unpaired."""
    if not slots:
        return
    origin = {w: w for w in slots}
    reached: set[int] = set()
    for node in graph.nodes[min(slots) + 1 :]:
        value = node.value
        if value is None or node.index in slots:
            continue
        framed = []  # (argument position among the refs, its rank, its slots, the cache's size)
        for i, ref in enumerate(node.inputs()):
            if ref.kind == "op" and ref.at in slots:
                t = graph.value_of(ref)
                framed.append((i, t.dim(), slots[ref.at], t.shape[slots[ref.at].dim], ref.at))
        if not framed:
            continue
        if not node.layout:  # a computing op reads the write's slots (or contracts them)
            reached.update(origin[f[4]] for f in framed)
        if node.kind == "slice":
            kept = _sliced(node, framed[0][2])
        else:
            dim = _kept_dim(node, [f[:4] for f in framed], value)
            kept = Slots(dim, framed[0][2].index) if dim is not None else None
        if kept is not None:
            slots[node.index] = kept
            origin[node.index] = origin[framed[0][4]]
    for n in [n for n in slots if origin[n] not in reached]:
        del slots[n]


def _sliced(node: OpNode, s: Slots) -> Slots | None:
    """A slice (`x[:, :, a:b]`) of an op with live slots: along another dim, the same; along theirs,
    those it keeps where it keeps all of them."""
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1 :]
    dim, start, stop, step = args[1:5]
    if not all(isinstance(x, int | None) for x in (dim, start, stop, step)) or step != 1:
        return None
    if dim is None or dim % node.value.dim() != s.dim:  # rows or heads sliced: the slots stay
        return s
    start = start or 0
    if start < 0 or int(s.index.min()) < start or (stop is not None and int(s.index.max()) >= stop):
        return None
    return Slots(s.dim, s.index - start, s.by_value)


def _kept_dim(node: OpNode, framed: list[tuple[int, int, Slots, int]], value: torch.Tensor) -> int | None:
    """The dim of `node`'s output that holds the slots its framed inputs hold, or None: a matmul's
    from which operand's dim it comes; another op's at the same place from the end, or else the
    last of the cache's size."""
    if node.kind in MATMULS:
        dims = {
            value.dim() - 2 if i == 0 else value.dim() - 1
            for i, rank, s, _ in framed
            if (i, s.dim - rank) in ((0, -2), (1, -1))
        }
        contracted = any((i, s.dim - rank) in ((0, -1), (1, -2)) for i, rank, s, _ in framed)
        return dims.pop() if len(dims) == 1 and not contracted else None
    _, rank, s, size = framed[0]
    at = value.dim() + s.dim - rank
    if 0 <= at < value.dim() and value.shape[at] == size:
        return at
    same = [d for d in range(value.dim()) if value.shape[d] == size]
    return same[-1] if same else None


def _spans(positions: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2, 5`."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def write_evidence(reference: OpGraph, r: OpNode, candidate: OpGraph, c: OpNode, frame: Any) -> list[str]:
    """What a cache write that is the culprit did: the slots it was given, where the reference's
    positions are taken from, and which of them differ."""
    if not isinstance(frame, Slots) or r.value is None or c.value is None:
        return []
    dim = (r.args[1] if len(r.args) > 1 and isinstance(r.args[1], int) else 0) % r.value.dim()  # the join's
    live = frame.take(c.value).movedim(frame.dim, 0).float()
    ref = r.value.movedim(dim, 0).float().to(live.device).reshape(live.shape)
    wrong = [i for i in range(ref.shape[0]) if rel_l2(live[i], ref[i]) > VALUE_TOL]
    written = _written(candidate, c, frame.dim)
    aten = getattr(c.func, "__name__", c.kind)
    said = f"the candidate's cache write ({aten}, {c.value.shape[frame.dim]} slots)"
    if written is not None:
        said += f" writes slot {_spans(written.tolist())}"
    said += f"; the reference's positions 0-{ref.shape[0] - 1} ({label(r.name, r.kind)}) are its slots"
    said += f" {_spans(frame.index.tolist())} " + (
        "(the past where the cache held it before the write, the new positions after it)"
        if frame.by_value
        else "(the cache held no past of the reference's before the write: the past taken as the slots just"
        " before the new positions, which the write is given)"
    )
    if wrong:
        said += f"; {_positions(wrong)} {'differs' if len(wrong) == 1 else 'differ'} there"
    return [said]


def _positions(at: list[int]) -> str:
    return f"position{'s' if len(at) > 1 else ''} {_spans(at)}"


def mask_evidence(r: OpNode, m: Any, own: torch.Tensor | None) -> list[str]:
    """An op over a static cache's live slots (match `m`, the candidate's value `own`) that masks
    positions the reference does not: which, and at which of the cache's slots."""
    slots = next((f for f in m.frames or () if isinstance(f, Slots)), None)
    value = r.value
    if slots is None or own is None or value is None or not value.is_floating_point() or len(m.cand) != 1:
        return []
    try:
        live = m.to_reference([own], [value.shape])[0]
    except (RuntimeError, ValueError):
        return []
    dim = value.dim() + slots.dim - own.dim()  # the slots' dim, from the end, in the reference's shape
    if not 0 <= dim < value.dim() or value.shape[dim] != slots.index.numel():
        return []
    hidden = (live.abs() >= MASKED) & (value.abs() < MASKED).to(live.device)
    at = hidden.movedim(dim, 0).reshape(hidden.shape[dim], -1).any(1).nonzero().flatten().tolist()
    if not at:
        return []
    where = _spans(slots.index[at].tolist())
    return [
        f"the candidate masks the reference's {_positions(at)} (the cache's slot {where}), which the reference"
        " does not mask"
    ]
