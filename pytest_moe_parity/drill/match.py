"""Which of the candidate's ops compute which of the reference's: many-to-many.

In three passes over the ops that compute (views and factories are followed through, not matched):
1. **by path and op**: the two sequences of (module path, op, expert) aligned (difflib): the same
   code, or a port that kept the reference's module names (or wraps them: the path's last part);
2. **by value**, between two aligned stretches: a top-k by the experts it selects; an op whose
   output equals a reference op's up to a reshape or a permutation of its dims (a transposed
   layout), the concatenation of several (gate and up fused into one matmul, experts stacked), or
   whose pieces concatenate to one (heads split across ranks); a reference expert's op against the
   rows of a dense op that runs every expert on every token; a value the reference is given and the
   port computes (NxDI's rotary cos and sin), with the steps toward it; a value the port computes
   twice; a cast the port added (an fp32 upcast) or left out goes with the op it casts;
3. **by op and order**: what is left in a stretch, the same ops in the same order (a port's own
   code that computes something else there: its error is then the op's own); in a port's own code
   only where what the two read corresponds, then **by place** (`_by_place`): an op whose value
   goes into a matched op where the reference op's goes, reading what it reads, whatever its kind.
The passes for a port's own structure are left out when both sides run the same code.

**Rows by identity** (`rows`): where a port gathers each expert's rows in another order than the
reference's, they are put in the reference's order first (`Match.frames`). **Static caches** (`cache`):
a port's write into a cache sized to a bucket is the reference's join of the past and the new keys, and
it and the ops that go on with the cache's slots are compared on their live slots (`Match.frames` too).

Whatever is left is unmatched, and the drill lists it and fails."""

from __future__ import annotations

import difflib
import functools
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..judge.distance import MASKED, mask_figures, rel_l2
from .cache import CACHE_WRITE, CacheWrites, Slots, cache_slots, take
from .capture import OpGraph, OpNode
from .fused import fused_siblings, shape_perm
from .rows import VALUE_TOL, RowIdentity, row_frames

NORM_MARGIN = 2**-7  # what `_Norms.close` allows a norm for its rounding to a 16-bit dtype
CAST = "a cast the candidate adds"  # matched to no reference op: seen through, as views are
TOWARD_INPUT = "a step toward the reference's input"  # judged where it arrives (see match)
SAME_SELECTION = "value (the same experts selected)"  # a top-k judged by what it selects
ORDER, PLACE = "op and order", "place (what it reads and what reads it)"  # passes 5 and 6 (`_by_place`)


@dataclass
class Match:
    """Reference ops `ref` computed by candidate ops `cand` (indices into each graph's nodes)."""

    ref: tuple[int, ...]
    cand: tuple[int, ...]
    how: str
    dim: int | None = None  # fused / split: the dim the pieces are joined along
    perm: tuple[int, ...] | None = None  # one to one: the candidate's dims in the reference's order
    input: int | None = None  # no reference op: the candidate computes this input of the reference's call
    rows: tuple[int | None, torch.Tensor] | None = None  # a dense op: (its expert's slice, the rows it holds)
    # per candidate op: the order that puts its rows (dim 0) in the reference's (rows by identity), or
    # its live slots of a static cache (`cache.Slots`), or None
    frames: tuple[torch.Tensor | Slots | None, ...] | None = None
    # one to one by value: the candidate's output's relative L2 error to the reference's, as compared
    # (its rows in the reference's order, its dims permuted): the drill's chained error where the
    # candidate's values are its capture's own
    error: float | None = None
    split: tuple[int, ...] | None = None  # one to one: the shape the candidate's dims are split into before `perm`
    as_set: bool = False  # its rows paired with the reference's as a set (`_rows_as_sets`): no index traced them

    def to_reference(self, cand_values: list[torch.Tensor], ref_shapes: list[torch.Size]) -> list[torch.Tensor]:
        """The candidate's primary outputs as the reference's ops' (one per reference op)."""
        if self.frames is not None:
            cand_values = [take(v, f) for v, f in zip(cand_values, self.frames, strict=True)]
        if self.rows is not None:
            return [_dense_rows(cand_values[0], self.rows).reshape(ref_shapes[0])]
        if len(self.ref) <= 1 and len(self.cand) == 1:  # one to one (or to an input of the call)
            value = cand_values[0]
            if self.perm is not None:
                value = (value.reshape(self.split) if self.split is not None else value).permute(self.perm)
            return [value.reshape(ref_shapes[0])]
        if len(self.cand) == 1:  # fused: the candidate's output holds several of the reference's
            sizes = [_size_along(s, self.dim) for s in ref_shapes]
            return [p.reshape(s) for p, s in zip(cand_values[0].split(sizes, dim=self.dim), ref_shapes, strict=True)]
        return [torch.cat(cand_values, dim=self.dim).reshape(ref_shapes[0])]  # split

    def to_candidate(
        self, ref_values: list[torch.Tensor], cand_shapes: list[torch.Size], own: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The reference's primary outputs as the candidate's ops' (one per candidate op), contiguous
        (the candidate's ops after it may `view` them). `own`: the candidate's values, for the slots of
        a static cache that are not live."""
        frames = self.frames or (None,) * len(cand_shapes)
        shapes = [f.shape(s) if isinstance(f, Slots) else s for s, f in zip(cand_shapes, frames, strict=True)]
        values = [v.contiguous() for v in self._to_candidate(ref_values, shapes)]
        if self.frames is None:
            return values
        out = []
        for i, (v, f) in enumerate(zip(values, self.frames, strict=True)):
            if isinstance(f, Slots):
                v = f.put(v, own[i] if own is not None else None)
            elif f is not None:  # back in the candidate's row order
                back = torch.empty_like(v)
                back[f.to(v.device)] = v
                v = back
            out.append(v)
        return out

    def _to_candidate(self, ref_values: list[torch.Tensor], cand_shapes: list[torch.Size]) -> list[torch.Tensor]:
        if self.rows is not None:  # a few rows of the candidate's: the rest is not the reference's to give
            raise ValueError("the reference holds only some rows of this dense op")
        if len(self.ref) <= 1 and len(self.cand) == 1:  # one to one (or to an input of the call)
            value = ref_values[0]
            if self.perm is not None:
                inverse = [0] * len(self.perm)
                for i, p in enumerate(self.perm):
                    inverse[p] = i
                shape = [(self.split or cand_shapes[0])[i] for i in self.perm]
                return [value.reshape(shape).permute(inverse).reshape(cand_shapes[0])]
            return [value.reshape(cand_shapes[0])]
        if len(self.cand) == 1:
            return [torch.cat(ref_values, dim=self.dim).reshape(cand_shapes[0])]
        sizes = [_size_along(s, self.dim) for s in cand_shapes]
        joined = list(cand_shapes[0])
        joined[self.dim if self.dim is not None else -1] = sum(sizes)
        whole = ref_values[0].reshape(joined)
        return [p.reshape(s) for p, s in zip(whole.split(sizes, dim=self.dim), cand_shapes, strict=True)]


def _size_along(shape: torch.Size, dim: int | None) -> int:
    return shape[dim if dim is not None else -1]


# op kinds that compute the same thing in other forms: one kind for matching
SAME_KIND = {"bmm": "mm", "addmm": "mm", "baddbmm": "mm", "matmul": "mm", "onednn_mm": "mm", "_softmax": "softmax",
             "_safe_softmax": "softmax", "masked_fill": "where"}  # fmt: skip


def _kind(node: OpNode) -> str:
    return SAME_KIND.get(node.kind, node.kind)


def _key(node: OpNode) -> tuple:
    return (node.scope, _kind(node), node.expert)


def _leaf_key(node: OpNode) -> tuple:
    """A port that wraps the reference's modules (NxDI's `o_proj.o_proj`, `qkv_proj.q_proj`): the
    last part of the module path."""
    return (node.scope.rsplit(".", 1)[-1], _kind(node), node.expert)


def _experts_agree(r: OpNode, c: OpNode) -> bool:
    """Two ops of expert loops are one op only on one expert (a zeroed expert's running sum equals
    the one before it: equal values on other experts are not a match)."""
    return r.expert is None or c.expert is None or r.expert == c.expert


class _Norms:
    """||value|| of the outputs one matching compares, over their entries that are not masks, and
    how many masks of each sign they hold, each computed once (by identity: the graphs keep them
    alive). Equal values up to layout have equal norms and the same masks, and pieces joined the
    root of their squares summed and their masks added: a cheap test before the dearer ones
    (`_same`, `_joined`, `_equal`)."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[float, int, int]] = {}

    def of(self, t: torch.Tensor) -> tuple[float, int, int]:
        """(||t|| over its entries of magnitude under MASKED, its masks below 0, above 0)."""
        key = id(t)
        if key not in self._of:
            # in its own dtype (a float32 copy costs more than the norm): see `close`'s margin
            norm = float(torch.linalg.vector_norm(t.detach()))
            # masks (or NaNs: a norm that is not finite, which `close` leaves to the dearer tests)
            self._of[key] = (norm, 0, 0) if math.isfinite(norm) and norm < MASKED else mask_figures(t)
        return self._of[key]

    def close(self, parts: list[torch.Tensor | None], whole: torch.Tensor | None) -> bool:
        """False where `parts` (joined) cannot hold `whole`'s values within VALUE_TOL: their masks
        differ, or their norms by more than that (||c - r|| >= | ||c|| - ||r|| |); True where that
        cannot be told (NaNs, integers): the dearer test decides."""
        if whole is None or any(p is None for p in parts) or not whole.is_floating_point():
            return True
        if not all(p.is_floating_point() for p in parts):
            return True
        nr, low, high = self.of(whole)
        figures = [self.of(p) for p in parts]
        nc = math.sqrt(sum(f[0] ** 2 for f in figures))
        if not (math.isfinite(nc) and math.isfinite(nr)):
            return True
        if (sum(f[1] for f in figures), sum(f[2] for f in figures)) != (low, high):
            return False
        # norms of a 16-bit dtype are rounded to it (the sum runs in float32): 2^-8 of each, and more
        return abs(nc - nr) <= VALUE_TOL * nr + NORM_MARGIN * (nc + nr)


def _same(c: torch.Tensor | None, r: torch.Tensor | None) -> tuple | None:
    """How candidate output `c` equals reference output `r`: (how, a permutation, its relative L2 error so,
    and where its dims are split first: `_split_permuted`), or None."""
    if c is None or r is None or c.numel() != r.numel() or c.numel() == 0:
        return None
    if c.is_floating_point() != r.is_floating_point():
        return None
    if c.shape == r.shape and (error := rel_l2(c, r)) <= VALUE_TOL:
        return "value", None, error
    if c.dim() == r.dim() and 1 < c.dim() <= 5:
        for perm in itertools.permutations(range(c.dim())):
            moved = c.permute(perm)
            if perm != tuple(range(c.dim())) and moved.shape == r.shape and (error := rel_l2(moved, r)) <= VALUE_TOL:
                return "value (dims permuted)", perm, error
    if c.shape != r.shape and (error := rel_l2(c.reshape(r.shape), r)) <= VALUE_TOL:
        return "value (reshaped)", None, error
    return _split_permuted(c, r)


def _split_permuted(c: torch.Tensor, r: torch.Tensor) -> tuple[str, tuple[int, ...], float, tuple[int, ...]] | None:
    """`c` with its dims split into the reference's, then permuted (a port's flat [tokens, heads x dim] query
    against the reference's [batch, heads, tokens, dim]): how, the permutation, the error and the split shape."""
    if c.dim() == r.dim() or not 1 < r.dim() <= 5:
        return None
    for perm in itertools.permutations(range(r.dim())):
        split = [0] * r.dim()
        for i, p in enumerate(perm):
            split[p] = r.shape[i]
        if perm == tuple(range(r.dim())) or not _splits(c.shape, split):
            continue
        if (error := rel_l2(c.reshape(split).permute(perm), r)) <= VALUE_TOL:
            return "value (dims split and permuted)", perm, error, tuple(split)
    return None


def _splits(shape: torch.Size, split: list[int]) -> bool:
    """Whether each dim of `shape` is the product of consecutive dims of `split` (dims of 1 aside)."""
    dims, parts = [d for d in shape if d != 1], [d for d in split if d != 1]
    at = 0
    for d in dims:
        product = 1
        while product < d and at < len(parts):
            product *= parts[at]
            at += 1
        if product != d:
            return False
    return at == len(parts)


def _equal(c: torch.Tensor | None, r: torch.Tensor | None) -> bool:
    """The same values in the same order (up to a reshape)."""
    if c is None or r is None or c.numel() != r.numel() or c.numel() == 0 or not c.is_floating_point():
        return False
    return r.is_floating_point() and rel_l2(c.reshape(r.shape), r) <= VALUE_TOL


def _joined(parts: list[torch.Tensor | None], whole: torch.Tensor | None, norms: _Norms | None = None) -> int | None:
    """The dim along which `parts` concatenate to `whole`, if they do."""
    if whole is None or any(p is None for p in parts) or sum(p.numel() for p in parts) != whole.numel():
        return None
    if norms is not None and not norms.close(parts, whole):
        return None
    rank = parts[0].dim()
    if rank != whole.dim() and all(p.dim() == rank for p in parts):  # [1, T, h] pieces of a [T, H] whole
        for dim in range(rank):
            shape = list(parts[0].shape)
            shape[dim] = sum(p.shape[dim] for p in parts)
            same = all(
                p.shape[:dim] + p.shape[dim + 1 :] == parts[0].shape[:dim] + parts[0].shape[dim + 1 :] for p in parts
            )
            if (
                same
                and math.prod(shape) == whole.numel()
                and rel_l2(torch.cat(parts, dim), whole.reshape(shape)) <= VALUE_TOL
            ):
                return dim
        return None
    for dim in _cat_dims([p.shape for p in parts], whole.shape):
        if rel_l2(torch.cat(parts, dim=dim), whole) <= VALUE_TOL:
            return dim
    return None


def _joined_rows(pair: _Pair, joined: set[int], matches: list[Match], add, free_r, free_c, val) -> bool:
    """Rows by identity joined from pieces (a sorted dispatch weights every expert's rows at once):
    a candidate op whose rows join several experts' is the reference's ops of its kind, one per
    expert in the experts' order, that read the counterparts of what it reads. Whether any was."""
    found = False
    reference = pair.reference
    flow = _Flow(pair, matches, {})
    for c in [c for c in free_c() if c.index in joined]:
        reads = {r for kind, at in flow.upstream_of(c) if kind == "op" for r in flow.to_ref[at]}
        pieces = [
            r for r in free_r()
            if r.expert is not None and _kind(r) == _kind(c) and r.value is not None
            and set(reference.sources(r)) & reads
        ]  # fmt: skip
        hit = _run_of(pieces, range(len(pieces), 1, -1), val(c), lambda group, c=c: _expert_rows(group, val(c)))
        if hit:
            how = f"rows (joined: {len(hit[0])} experts' in one)"
            add(Match(tuple(r.index for r in hit[0]), (c.index,), how, dim=0))
            flow.add(matches[-1])
            found = True
    return found


def _expert_rows(group: list[OpNode], whole: torch.Tensor | None) -> int | None:
    """0 where `group` is one op per expert, in the experts' order, whose rows joined are `whole`'s
    (by shape: which rows they are is known, so their values may differ)."""
    experts = [r.expert for r in group]
    if whole is None or experts != sorted(set(experts)):
        return None
    return 0 if 0 in _cat_dims([r.value.shape for r in group], whole.shape) else None


def _cat_dims(shapes: list[torch.Size], whole: torch.Size) -> list[int]:
    """The dims along which tensors of `shapes` concatenate to a tensor of shape `whole`."""
    return [
        dim for dim in range(len(whole))
        if all(len(s) == len(whole) and s[:dim] + s[dim + 1 :] == whole[:dim] + whole[dim + 1 :] for s in shapes)
        and sum(s[dim] for s in shapes) == whole[dim]
    ]  # fmt: skip


def _joined_shape(parts: list[torch.Tensor], whole: torch.Tensor) -> int | None:
    """The dim along which tensors of `parts`' shapes concatenate to `whole`'s shape (values aside)."""
    return next(iter(_cat_dims([p.shape for p in parts], whole.shape)), None)


def match(
    reference: OpGraph, candidate: OpGraph, *, same_code: bool = False
) -> tuple[list[Match], list[int], list[int]]:
    """The matches, the reference ops left unmatched and the candidate's (node indices). With
    `same_code` (the candidate runs the reference's own modules), the passes for a port's own
    structure (fused and split ops, dense experts' rows, inputs it computes, values it computes
    twice) are left out: what they would pair there is a near-tie routing flip's, not a port's."""
    matching = _Matching(reference, candidate, same_code)
    for step in (
        matching.by_path, matching.cache_writes, matching.by_value, matching.dense_rows, matching.computed_inputs,
        matching.computed_again, matching.passed_on, matching.pieces, matching.by_order_or_place,
    ):  # fmt: skip
        step()
    return matching.result()


class _Matching:
    """One matching's state: both graphs, the matches so far and each side's free ops, the candidate's
    values with their rows in the reference's order where those are known (`val`); its passes are
    its methods, run in order by `match`."""

    def __init__(self, reference: OpGraph, candidate: OpGraph, same_code: bool):
        self.reference, self.candidate, self.same_code = reference, candidate, same_code
        self.ref_ops, self.cand_ops = reference.compute(), candidate.compute()
        self.identity = RowIdentity({}, {}, set()) if same_code else row_frames(reference, candidate)
        self.cache = CacheWrites({}, []) if same_code else cache_slots(reference, candidate)
        self.frames: dict[int, torch.Tensor | Slots] = {**self.identity.frames, **self.cache.slots}
        self.norms = _Norms()
        self.framed = {c: take(candidate.nodes[c].value, f) for c, f in self.frames.items()}
        self.matches: list[Match] = []
        self.matched_ref: set[int] = set()
        self.matched_cand: set[int] = set()
        self.runs: dict[str, _Runs] = {}  # each side's free ops' runs, while no match is added or dropped

    def val(self, c: OpNode) -> torch.Tensor | None:
        """A candidate op's output, its rows in the reference's order where they are known."""
        return self.framed.get(c.index, c.value)

    def add(self, m: Match) -> None:
        if any(c in self.frames for c in m.cand) and m.rows is None:
            m.frames = tuple(self.frames.get(c) for c in m.cand)
            m.as_set = any(c in self.identity.sets for c in m.cand)
        self.matches.append(m)
        self.matched_ref.update(m.ref)
        self.matched_cand.update(m.cand)
        self.runs.clear()

    def drop(self, m: Match) -> None:
        self.matches.remove(m)
        self.matched_ref.difference_update(m.ref)
        self.matched_cand.difference_update(m.cand)
        self.runs.clear()

    def free_r(self) -> list[OpNode]:
        return [r for r in self.ref_ops if r.index not in self.matched_ref]

    def free_c(self) -> list[OpNode]:
        return [c for c in self.cand_ops if c.index not in self.matched_cand]

    def free_runs(self, side: str) -> _Runs:
        if side not in self.runs:
            self.runs[side] = _Runs(self.free_r() if side == "ref" else self.free_c())
        return self.runs[side]

    def by_path(self) -> None:
        """1. by path and op: the same code; a port's own code by the module paths it shares with the
        reference (its ops in the drilled module's own forward share no path: they go by value first)"""
        if self.same_code:
            pairs = _in_order(self.ref_ops, self.cand_ops, _key)
        else:
            pairs = [(r, c) for r, c in _in_order(self.ref_ops, self.cand_ops, _key) if r.scope and c.scope]
        for r, c in pairs:
            self.add(Match((r.index,), (c.index,), "path and op"))
        if not self.same_code:
            for r, c in _in_order(self.free_r(), self.free_c(), _leaf_key):
                if r.scope and c.scope:  # a module's own op under a wrapper of the port's
                    self.add(Match((r.index,), (c.index,), "path and op"))

    def cache_writes(self) -> None:
        """a static cache's write (`index_copy_`, `scatter_`, `index_put_`) is the reference's join of the past and the
        new keys (`cache.cache_slots`), compared on its live slots whatever its values"""
        for r, c, perm in self.cache.pairs:
            if r not in self.matched_ref and c not in self.matched_cand:
                self.add(Match((r,), (c,), CACHE_WRITE, perm=perm))

    def by_value(self) -> None:
        """2. by value: a top-k by the experts it selects (its values may be other scores: logits); several
        in one (fused), one in several (split), one to one up to layout"""
        for r in [r for r in self.free_r() if r.kind == "topk"]:
            c = next((c for c in self.free_c() if c.kind == "topk" and _same_selection(c, r)), None)
            if c is not None:
                self.add(Match((r.index,), (c.index,), SAME_SELECTION))
        for c in [] if self.same_code else self.free_c():  # the same code fuses and splits nothing
            fused = functools.partial(lambda group, c: _joined([r.value for r in group], self.val(c), self.norms), c=c)
            hit = self.free_runs("ref").of((2, 3, 4), self.val(c), fused)
            hit = hit or fused_siblings(self.reference, self.candidate, c, self.free_r(), fused)  # apart, one input
            if hit:
                self.add(
                    Match(
                        tuple(r.index for r in hit[0]), (c.index,), f"value (fused: {len(hit[0])} in one)", dim=hit[1]
                    )
                )
        for r in [] if self.same_code else self.free_r():
            sizes = range(2, min(65, len(self.cand_ops) + 1))
            hit = self.free_runs("cand").of(
                sizes, r.value, lambda group, r=r: _joined([self.val(c) for c in group], r.value, self.norms)
            )
            if hit:
                self.add(
                    Match(
                        (r.index,), tuple(c.index for c in hit[0]), f"value (split: one in {len(hit[0])})", dim=hit[1]
                    )
                )
        for c in self.free_c():
            for r in self.free_r():
                if not _experts_agree(r, c) or not self.norms.close([self.val(c)], r.value):
                    continue
                found = _same(self.val(c), r.value)
                if found is not None:
                    split = found[3] if len(found) > 3 else None
                    self.add(Match((r.index,), (c.index,), found[0], perm=found[1], error=found[2], split=split))
                    break

    def dense_rows(self) -> None:
        """The reference's per-expert ops where the candidate runs every expert on every token (dense,
        experts stacked: NxDI's forward_all_experts): the rows of the dense op that are the expert's tokens;
        not where the candidate gathers each expert's rows (rows by identity): it runs no dense op"""
        for r in [] if self.same_code or self.identity.gathers else self.free_r():
            if r.expert is None or r.value is None or r.value.dim() < 2 or not r.value.is_floating_point():
                continue
            for c in (c for c in self.cand_ops if c.expert is None):  # not an expert loop's own op: a dense one
                rows = _rows_in(c.value, r.value, r.expert)
                if rows is not None:
                    self.add(
                        Match(
                            (r.index,), (c.index,), f"value (rows: expert {r.expert}'s tokens of a dense op)", rows=rows
                        )
                    )
                    break

    def computed_inputs(self) -> None:
        """What the reference is given and the candidate computes (NxDI's rotary cos and sin, inside its
        attention): matched to that input of the reference's call, and what leads to it with it"""
        inputs = [
            (i, t) for i, t in enumerate(self.reference.inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        for c in [] if self.same_code else self.free_c():
            for i, t in inputs:
                found = _same(c.value, t)
                if found is not None:
                    split = found[3] if len(found) > 3 else None
                    self.add(
                        Match((), (c.index,), f"value (the reference's input {i})", perm=found[1], input=i, split=split)
                    )
                    break
        toward = _leading_to(
            self.candidate, {c for m in self.matches if m.input is not None for c in m.cand}, self.matched_cand
        )
        for c in toward:
            self.add(Match((), (c,), TOWARD_INPUT))

    def computed_again(self) -> None:
        """A value the candidate computes twice (NxDI's router's top-k over logits, its weights gathered
        from the affinities): the second op goes with the reference op it equals"""
        by_cand = {c: m for m in self.matches for c in m.cand}
        for c in [] if self.same_code else self.free_c():
            r = _cast_of_matched(
                self.candidate, c, by_cand, self.frames, self.reference
            )  # its values known: not compared again
            r = r or next(
                (
                    r for r in self.ref_ops
                    if r.index in self.matched_ref and _experts_agree(r, c) and self.norms.close([self.val(c)], r.value)
                    and _equal(self.val(c), r.value)
                ),
                None,
            )  # fmt: skip
            if r is not None:
                self.add(
                    Match((r.index,), (c.index,), "value (computed again: a second op of the candidate's gives it)")
                )

    def passed_on(self) -> None:
        """3. a cast or a join on one side only goes with the op whose value it passes on"""
        for c in self.free_c():
            if c.kind == "_to_copy" and self.candidate.passes_on(c, VALUE_TOL):  # a cast the reference does not make
                self.add(Match((), (c.index,), CAST))
                continue
            owners = {m.ref for s in self.candidate.sources(c) for m in self.matches if s in m.cand}
            if len(owners) == 1:
                (owner,) = owners
                value = self.reference.nodes[owner[0]].value if len(owner) == 1 else None
                # (not another expert's: a zeroed expert's running sum passes the last one's on)
                if value is not None and not _experts_agree(self.reference.nodes[owner[0]], c):
                    continue
                if value is not None and self.norms.close([self.val(c)], value) and _same(self.val(c), value):
                    self.add(Match(owner, (c.index,), "value (passed on: an op the candidate adds)"))
        read_by = self.candidate.consumers()
        for r in self.free_r():
            owners = {m.cand for s in self.reference.sources(r) for m in self.matches if s in m.ref}
            if len(owners) == 1:
                (owner,) = owners
                if owner[0] in self.cache.slots and read_by.get(owner[0], set()) - self.matched_cand:
                    continue  # over a static cache the candidate acts there (its mask): paired by place
                value = self.val(self.candidate.nodes[owner[0]]) if len(owner) == 1 else None
                if value is not None and not _experts_agree(r, self.candidate.nodes[owner[0]]):
                    continue
                if value is not None and self.norms.close([value], r.value) and _same(value, r.value):
                    self.add(Match((r.index,), owner, "value (passed on: an op the candidate leaves out)"))

    def pieces(self) -> None:
        """4. an expert's op the candidate computes in pieces from the same inputs (gate and up apart) whose
        values differ (the fault may be there): by shape, kind and inputs"""
        for r in [] if self.same_code else self.free_r():
            inputs = {c for s in self.reference.sources(r) for m in self.matches if s in m.ref for c in m.cand}
            if r.value is None or r.expert is None or not inputs:
                continue
            pieces = [
                c for c in self.free_c()
                if _kind(c) == _kind(r) and c.value is not None and set(self.candidate.sources(c)) & inputs
                and _experts_agree(r, c)
            ]  # fmt: skip
            hit = _run_of(
                pieces, (2, 3, 4), r.value, lambda group, r=r: _joined_shape([c.value for c in group], r.value)
            )
            if hit:
                self.add(
                    Match(
                        (r.index,), tuple(c.index for c in hit[0]), f"shape (split: one in {len(hit[0])})", dim=hit[1]
                    )
                )

    def by_order_or_place(self) -> None:
        """5. what is left: the same ops in the same order (not a rank's partial sums: no reference op is
        one); in a port's own code only where what they read corresponds (two ops of one kind and size on
        other paths are not one op)"""
        if self.same_code:
            for r, c in _in_order(self.free_r(), [c for c in self.free_c() if not c.partial], _kind):
                self.add(Match((r.index,), (c.index,), ORDER))
        else:
            pair = _Pair(self.reference, self.candidate, self.framed)
            _by_place(pair, self.matches, self.add, self.drop, self.free_r, self.free_c, self.identity.gathers)
            if _joined_rows(pair, self.identity.joined, self.matches, self.add, self.free_r, self.free_c, self.val):
                _by_place(pair, self.matches, self.add, self.drop, self.free_r, self.free_c, self.identity.gathers)

    def result(self) -> tuple[list[Match], list[int], list[int]]:
        self.matches.sort(key=lambda m: min(m.ref, default=-1))
        left_ref = [n.index for n in self.ref_ops if n.index not in self.matched_ref]
        left_cand = [n.index for n in self.cand_ops if n.index not in self.matched_cand]
        return self.matches, left_ref, left_cand


def _dense_rows(value: torch.Tensor, rows: tuple[int | None, torch.Tensor]) -> torch.Tensor:
    at, index = rows
    flat = value[at] if at is not None else value
    return flat.reshape(-1, flat.shape[-1])[index]


def _rows_in(dense: torch.Tensor | None, part: torch.Tensor, expert: int) -> tuple[int | None, torch.Tensor] | None:
    """Where `part` [n, D] is rows of `dense` (of expert `expert`'s slice where dense stacks experts
    [E, T, D], else of dense as [N, D]): (the slice, the row indices), or None."""
    if dense is None or not dense.is_floating_point() or dense.shape[-1] != part.shape[-1]:
        return None
    if dense.numel() <= part.numel():
        return None
    rows = part.reshape(-1, part.shape[-1]).float()
    for at in ([expert] if dense.dim() == 3 and expert < dense.shape[0] else []) + [None]:
        flat = (dense[at] if at is not None else dense).reshape(-1, dense.shape[-1]).float()
        if flat.shape[0] < rows.shape[0]:
            continue
        index = torch.cdist(rows, flat).argmin(dim=1)
        if rel_l2(flat[index], rows) <= VALUE_TOL and index.unique().numel() == index.numel():
            return at, index
    return None


def _leading_to(graph: OpGraph, targets: set[int], matched: set[int]) -> list[int]:
    """The unmatched computing ops whose values go only into `targets` (through views, and through
    each other): the steps by which the candidate computes a reference input."""
    read_by = graph.consumers()
    found: set[int] = set()
    for node in reversed(graph.compute()):
        users = read_by.get(node.index)
        if node.index not in matched and users and users <= (targets | found):
            found.add(node.index)
    return sorted(found)


def _same_selection(c: OpNode, r: OpNode) -> bool:
    """Two top-k ops that select the same experts (in nine rows of ten at least)."""
    a, b = (c.outputs[1] if len(c.outputs) > 1 else None), (r.outputs[1] if len(r.outputs) > 1 else None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.numel() != b.numel():
        return False
    a, b = a.reshape(b.shape).sort(-1).values, b.sort(-1).values
    return bool((a == b).all(-1).float().mean() >= 0.9)  # near ties may flip a few rows


def _in_order(refs: list[OpNode], cands: list[OpNode], key) -> list[tuple[OpNode, OpNode]]:
    """The pairs the two sequences share, aligned by `key` (difflib), where their sizes agree."""
    sm = difflib.SequenceMatcher(None, [key(n) for n in refs], [key(n) for n in cands], autojunk=False)
    return [
        (r, c)
        for tag, i1, i2, j1, j2 in sm.get_opcodes()
        if tag == "equal"
        for r, c in zip(refs[i1:i2], cands[j1:j2], strict=True)
        if r.value is None or c.value is None or r.value.numel() == c.value.numel()
    ]


def _run_of(
    nodes: list[OpNode], sizes: Iterable[int], whole: torch.Tensor | None, joined
) -> tuple[list[OpNode], int] | None:
    """For the first of `sizes` that has one: the first run of that many consecutive nodes, as many
    elements as `whole` together, that `joined` accepts, and the dim it returns."""
    return _Runs(nodes).of(sizes, whole, joined)


class _Runs:
    """Runs of consecutive nodes by the elements they hold together: their running sums, and where
    each sum is first reached, worked out once for a list of nodes that many wholes are tried on."""

    BARRIER = 1 << 62  # a node without a value: no run goes through it

    def __init__(self, nodes: list[OpNode]):
        self.nodes = nodes
        self.prefix = list(itertools.accumulate((self._size(n) for n in nodes), initial=0))
        self.first: dict[int, int] = {}
        for j, total in enumerate(self.prefix):
            self.first.setdefault(total, j)

    def _size(self, node: OpNode) -> int:
        value = node.value
        return value.numel() if value is not None else self.BARRIER

    def of(self, sizes: Iterable[int], whole: torch.Tensor | None, joined) -> tuple[list[OpNode], int] | None:
        """`_run_of` on these nodes."""
        if whole is None or whole.numel() == 0:
            return None
        want, first = whole.numel(), self.first
        runs: dict[int, list[int]] = {}  # size -> the starts of the runs of that many nodes that sum to `want`
        for k, total in enumerate(self.prefix[:-1]):
            j = first.get(total + want)  # past k: want > 0
            if j is not None:
                runs.setdefault(j - k, []).append(k)
        for size in sizes:
            for k in runs.get(size, ()):
                group = self.nodes[k : k + size]
                dim = joined(group)
                if dim is not None:
                    return group, dim
        return None


def _by_place(pair: _Pair, matches: list[Match], add, drop, free_r, free_c, gathers: dict[int, int]) -> None:
    """Passes 5 and 6 on a port's own code: an op of the reference's kind, in forward order, where
    what it reads corresponds (two ops of one kind and size on other paths are not one op); then,
    between matched ops, the op whose value goes into a matched op where the reference's goes, reading
    what it reads (the rotated query of another rotation; a mask applied with `where` where the
    reference adds it), whatever its kind. A pair that a later match shows out of place (read by
    other ops than its counterpart is) is undone, and the passes run again without it. `gathers`:
    the candidate's gathers and slices of them holding a reference gather's rows (`row_frames`)."""
    flow = _Flow(pair, matches, gathers)
    reference, candidate = pair.reference, pair.candidate
    banned: set[tuple[int, int]] = set()
    for _ in range(4):
        for r in free_r():  # in forward order: what an op reads is matched first
            c = next(
                (c for c in free_c()
                 if not c.partial and (r.index, c.index) not in banned and _kind(c) == _kind(r)
                 and flow.alike(r, c, both_ways=True)),
                None,
            )  # fmt: skip
            if c is not None:
                add(Match((r.index,), (c.index,), ORDER, perm=shape_perm(c, r)))
                flow.add(matches[-1])
        while True:
            taken_r: set[int] = set()
            taken_c: set[int] = set()
            for r in free_r():
                for c in free_c():
                    if c.partial or c.index in taken_c or (r.index, c.index) in banned or not flow.in_place_of(r, c):
                        continue
                    taken_r.add(r.index)
                    taken_c.add(c.index)
                    add(Match((r.index,), (c.index,), PLACE, perm=shape_perm(c, r)))
                    flow.add(matches[-1])
                    break
            if not taken_r:
                break
        wrong = [
            m for m in matches
            if m.how in (ORDER, PLACE)
            and not flow.alike(reference.nodes[m.ref[0]], candidate.nodes[m.cand[0]])
        ]  # fmt: skip
        if not wrong:
            return
        for m in wrong:
            banned.add((m.ref[0], m.cand[0]))
            drop(m)
            flow.remove(m)


def _same_input(t: Any, u: Any) -> bool:
    """Two floating tensors of one shape holding the same values (a call's inputs)."""
    if not isinstance(t, torch.Tensor) or not isinstance(u, torch.Tensor) or t.shape != u.shape:
        return False
    return t.is_floating_point() and u.is_floating_point() and rel_l2(t, u) <= VALUE_TOL


class _Pair:
    """What a flow reads of the two graphs, worked out once per matching: the candidate's call
    inputs that are the reference's (by value), and each graph's consumers."""

    def __init__(self, reference: OpGraph, candidate: OpGraph, framed: dict[int, torch.Tensor] | None = None):
        self.reference, self.candidate = reference, candidate
        self.framed = framed or {}  # candidate ops' values in the reference's frame (rows, live slots)
        self.inputs: dict[int, int] = {}
        for j, t in enumerate(candidate.inputs):
            i = next((i for i, u in enumerate(reference.inputs) if _same_input(t, u)), None)
            if i is not None:
                self.inputs[j] = i
        self.ref_users, self.cand_users = reference.consumers(), candidate.consumers()


class _Flow:
    """Where the ops of a port's own code sit between matched ops: what each reads (the nearest
    matched ops and call inputs upstream, through unmatched ops) and what reads it directly."""

    def __init__(self, pair: _Pair, matches: list[Match], gathers: dict[int, int]):
        self.reference, self.candidate = pair.reference, pair.candidate
        self.to_ref: dict[int, set[int]] = {c: {r} for c, r in gathers.items()}
        self._matched: set[int] | None = None
        for m in matches:
            self.add(m)
        self.inputs, self.ref_users, self.cand_users = pair.inputs, pair.ref_users, pair.cand_users
        self.framed = pair.framed

    def add(self, m: Match) -> None:
        for c in m.cand:
            self.to_ref.setdefault(c, set()).update(m.ref)
        self._matched = None

    def remove(self, m: Match) -> None:
        for c in m.cand:
            self.to_ref.pop(c, None)
        self._matched = None

    def _matched_ref(self) -> set[int]:
        """The reference ops matched so far (made again only after a match is added or removed)."""
        if self._matched is None:
            self._matched = {r for refs in self.to_ref.values() for r in refs}
        return self._matched

    def _upstream(self, graph: OpGraph, node: OpNode, matched) -> set[tuple[str, int]]:
        """The nearest matched ops and call inputs `node` reads, through unmatched ops and views."""
        out: set[tuple[str, int]] = set()
        todo, seen = list(node.inputs()), set()
        while todo:
            ref = todo.pop()
            if ref.kind == "input":
                out.add(("input", ref.at))
                continue
            producer = graph.producer(ref)
            if producer is None or producer.index in seen:
                continue
            seen.add(producer.index)
            if matched(producer.index):  # a gather's slice too (`row_frames`)
                out.add(("op", producer.index))
            else:
                todo.extend(producer.inputs())
        return out

    def upstream_of(self, c: OpNode) -> set[tuple[str, int]]:
        """The nearest matched ops and call inputs candidate op `c` reads (through casts)."""
        return self._upstream(self.candidate, c, lambda i: bool(self.to_ref.get(i)))

    def reads_alike(self, r: OpNode, c: OpNode, both_ways: bool = False) -> bool:
        """Whether what `c` reads (the nearest matched ops and call inputs upstream) is what `r`
        reads: each of them the counterpart (or one of the counterparts, where one candidate op
        holds several reference ops: experts' rows gathered at once) of one `r` reads. `both_ways`:
        and each matched op `r` reads is one of theirs or upstream of one."""
        matched_ref = self._matched_ref()
        up_r = self._upstream(self.reference, r, lambda i: i in matched_ref)
        up_c = self.upstream_of(c)
        found = False
        for kind, at in up_c:
            if kind == "input":
                if at not in self.inputs:
                    continue  # a value of the candidate's own (its static cache)
                counterparts = {("input", self.inputs[at])}
            else:
                counterparts = {("op", x) for x in self.to_ref[at]}
            if not counterparts & up_r:
                return False
            found = True
        if not both_ways:
            return found
        # and the other way: each matched op `r` reads is one `c` reads, or upstream of one (the
        # scores and the attention's output both read q and k; only the output reads v)
        reached = {x for kind, at in up_c if kind == "op" for x in self.to_ref[at]}
        return found and {at for kind, at in up_r if kind == "op"} <= self._with_ancestors(reached)

    def _with_ancestors(self, ops: set[int]) -> set[int]:
        """Reference ops `ops` and every reference op upstream of them."""
        out, todo = set(ops), list(ops)
        while todo:
            for s in self.reference.sources(self.reference.nodes[todo.pop()]):
                if s not in out:
                    out.add(s)
                    todo.append(s)
        return out

    def _read_by(self, r: OpNode, c: OpNode) -> tuple[set[int], set[int]]:
        """The matched ops that read `r` directly, and the counterparts of those that read `c`."""
        matched_ref = self._matched_ref()
        users = self.ref_users.get(r.index, set()) & matched_ref
        cand_users: set[int] = set()
        todo, seen = list(self.cand_users.get(c.index, ())), set()
        while todo:  # through the casts the candidate adds and its joins of rows (matched to nothing)
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            passes_on = u in self.to_ref and not self.to_ref[u]
            if passes_on or (u not in self.to_ref and self.candidate.nodes[u].kind == "cat"):
                todo.extend(self.cand_users.get(u, ()))
            else:
                cand_users.update(self.to_ref.get(u, ()))
        return users, cand_users

    def alike(self, r: OpNode, c: OpNode, both_ways: bool = False) -> bool:
        """Of one size, `c` reading (upstream) only what `r` reads and something of it (`both_ways`:
        see `reads_alike`), and read directly by the counterparts of the matched ops that read `r`
        directly (by none where none reads `r`)."""
        value = self.framed.get(c.index, c.value)
        if r.value is None or value is None or r.value.numel() != value.numel():
            return False
        if not _experts_agree(r, c) or not self.reads_alike(r, c, both_ways):
            return False
        users, cand_users = self._read_by(r, c)
        # (one candidate op may hold several reference ops: each expert's rows of a joined op)
        return users <= cand_users and (bool(users) or not cand_users)

    def in_place_of(self, r: OpNode, c: OpNode) -> bool:
        """`alike`, and read directly by the counterpart of an op that reads `r` directly."""
        users, _ = self._read_by(r, c)
        return bool(users) and self.alike(r, c)


def _cast_of_matched(
    candidate: OpGraph, c: OpNode, by_cand: dict[int, Match], frames: dict, reference: OpGraph
) -> OpNode | None:
    """The reference op a cast `c` equals because the op it casts does, one to one and value for
    value, or None: a cast between floating dtypes holds its input's values (`OpGraph.passes_on`) up to a
    rounding far under VALUE_TOL where the dtype is float32, float64 or bfloat16 (float16 can
    overflow, float8 rounds coarser)."""
    if c.kind != "_to_copy" or c.value is None or c.value.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return None
    source = candidate.producer(c.inputs()[0]) if c.inputs() else None
    if source is None or c.index in frames or source.index in frames or not candidate.passes_on(c, VALUE_TOL):
        return None
    m = by_cand.get(source.index)
    if m is None or len(m.ref) != 1 or m.cand != (source.index,) or m.perm is not None or m.rows is not None:
        return None
    if m.how not in ("value", "value (reshaped)", "path and op"):
        return None
    r = reference.nodes[m.ref[0]]
    return r if r.value is not None and r.value.numel() == c.value.numel() else None
