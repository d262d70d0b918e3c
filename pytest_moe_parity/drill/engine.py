"""The drill's verdicts: every op of one component judged against the reference, the op that
introduced the divergence named, and how much of the component's error substituting its golden
output takes away.

Per reference op (in forward order):
- **error**: the candidate's output, as the candidate runs (each op on its own earlier outputs:
  chained), against the reference's in float32 (relative L2);
- **noise**: the reference's own error at that op when it runs in the candidate's dtype; the
  **ratio** is error / noise (noise counted as at least eps(dtype) / NOISE_FLOOR_EPS, as points are);
- **isolated**: the candidate's op fed the reference's values of its inputs (through the views the
  candidate takes of them), against the reference op run the same way in the candidate's dtype:
  what the op itself adds;
- **verdict**: `introduced` where the op's own error exceeds the noise factor (isolated; where it
  cannot be isolated, its chained ratio exceeds its inputs' by the factor), `inherited` where its
  error is above the factor only because its inputs' are, `missing` for a reference op the candidate
  has no counterpart for, `extra` for a candidate op matched to nothing; else `ok`.
The culprit is the first op the table marks `introduced`; its recovery is measured by substituting
the reference's output for it in the candidate's run. Missing and extra ops are structural
differences, said with the ops their values go into ("the candidate's own op `repeat` matches no
reference op and feeds `bmm`, the culprit"), never given a recovery they cannot have. Where no op
introduces the divergence the drill says why: the differences are structural, the error accumulates
over many ops each within its floor (and which ops ran in another dtype than the reference's), or
the two sides' ops could not be matched.

A port's own code (`same_code=False`) is judged on its own terms: integer bookkeeping and gathers of
the call's input it computes otherwise are not rows that fail, nor an op whose values reach nothing,
nor a rank's partial sum (judged at its all-reduce), nor a step on one side whose values arrive at
matched ops that agree; where its point passed (or the component stays within its noise), an op
above its own noise is noted, not failed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..judge.distance import rel_l2, unmasked_norm
from ..report.drill import OpRow
from .cache import CACHE_WRITE, mask_evidence, write_evidence
from .capture import OpGraph, OpNode, Ref
from .explain import culprit_evidence
from .match import (
    CAST,
    SAME_SELECTION,
    TOWARD_INPUT,
    VALUE_TOL,
    Match,
    match,
)

Execute = Callable[[OpNode, list, dict], Any]
AS_SET = "rows as a set (no index says which token each holds: paired by value)"  # `rows._rows_as_sets`
# A chained ratio at most this (the reference's own error, up to float rounding): the op is not run alone.
WITHIN_NOISE = 1.0 + 1e-6


def _primary(values: list[Any]) -> torch.Tensor | None:
    return next((t for t in values if isinstance(t, torch.Tensor)), None)


def _like(value: torch.Tensor, model: torch.Tensor | None) -> torch.Tensor:
    """`value` in `model`'s dtype and device, contiguous (the ops after it may `view` it)."""
    if model is None:
        return value.contiguous()
    return value.to(dtype=model.dtype, device=model.device).contiguous()


@dataclass
class Reference:
    """The reference's side of a drill at one point, prepared once (whatever the candidate): its
    ops in float32 and in the candidate's dtype, which op of the one is which of the other, and
    each op's noise (the error of its run in the candidate's dtype)."""

    graph: OpGraph
    low: OpGraph
    low_of: dict[int, OpNode | None]
    noise: dict[int, float | None]
    norm: dict[int, float]  # each floating op's ||output|| in float32, masks left out (what its errors divide by)

    @classmethod
    def of(cls, graph: OpGraph, low: OpGraph, figures: tuple[dict, dict, dict] | None = None) -> Reference:
        """`figures`: which low op is each op's, each op's noise and norm, as `store` kept them
        (else worked out here)."""
        if figures is not None:
            low_at, noise, norm = figures
            return cls(graph, low, {r: low.nodes[i] if i is not None else None for r, i in low_at.items()}, noise, norm)
        # the reference's own run in the candidate's dtype: the same code, matched as a candidate is
        # (its names can differ where casts come in), by name where that leaves an op out
        low_names = low.by_name()
        low_of = {n.index: low_names.get(n.name) for n in graph.nodes}
        for m in match(graph, low, same_code=True)[0]:
            if len(m.ref) == 1 and len(m.cand) == 1:
                low_of[m.ref[0]] = low.nodes[m.cand[0]]
        noise, norm = {}, {}
        for r in graph.compute():
            a, b = r.value, low_of[r.index].value if low_of.get(r.index) is not None else None
            if a is not None and a.is_floating_point():
                norm[r.index] = unmasked_norm(a)
            same = a is not None and b is not None and a.numel() == b.numel()
            noise[r.index] = rel_l2(b.reshape(a.shape), a, norm.get(r.index)) if same else None
        return cls(graph, low, low_of, noise, norm)


class Drilling:
    """The state of one drill: the reference in float32 and in the candidate's dtype, the candidate,
    their matches, and the candidate's values as it computes them."""

    def __init__(
        self,
        point: str,
        reference: Reference,
        candidate: OpGraph,
        *,
        execute: Execute | None = None,
        replay_chained: bool = False,
        factor: float = 1.5,
        floor: float = 1e-6,
        same_code: bool = True,
        point_passed: bool | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.point = point
        self.point_passed = point_passed
        self.dtype = dtype  # the candidate's
        self.ref, self.low, self.cand = reference.graph, reference.low, candidate
        self.reference = reference
        self.execute = execute
        self.factor, self.floor, self.same_code = factor, floor, same_code
        self.low_of = reference.low_of
        self.ref_of_low = {low.index: self.ref.nodes[r] for r, low in self.low_of.items() if low is not None}
        self._ref_names = self.ref.by_name()
        self._equal: dict[tuple, bool] = {}  # (kind, candidate's, reference's) -> the same values
        self.matches, self.left_ref, self.left_cand = match(self.ref, candidate, same_code=same_code)
        self.by_ref: dict[int, Match] = {}
        self.by_cand: dict[int, Match] = {}
        for m in self.matches:
            for r in m.ref:
                self.by_ref.setdefault(r, m)
            for c in m.cand:
                self.by_cand.setdefault(c, m)
        self.replayed = replay_chained
        if replay_chained:  # each op through the candidate's compiler, on its own earlier outputs
            values = candidate.replay(execute)
            self.chained = {
                n.index: [values.get(Ref("op", n.index, i), o) for i, o in enumerate(n.outputs)]
                for n in candidate.nodes
            }
        else:
            self.chained = {n.index: n.outputs for n in candidate.nodes}

    # -- values ---------------------------------------------------------------------------------
    def _cand_as_ref(self, m: Match, ref_index: int, values: dict[int, list[Any]]) -> torch.Tensor | None:
        cand_values = [_primary(values[c]) for c in m.cand]
        if any(v is None for v in cand_values):
            return None
        shapes = [self.ref.nodes[r].value.shape for r in m.ref]
        try:
            converted = m.to_reference(cand_values, shapes)
        except (RuntimeError, ValueError):
            return None
        return converted[m.ref.index(ref_index)]

    def _ref_for_cand(self, cand_index: int) -> list[torch.Tensor] | None:
        """The reference's outputs in the candidate op's place (shapes, dtype, device), or None."""
        m = self.by_cand.get(cand_index)
        node = self.cand.nodes[cand_index]
        gathers_input = node.kind in GATHERS and node.args and getattr(node.args[0], "kind", "") == "input"
        if gathers_input and (m is None or m.rows is not None):
            # rows of the call's input gathered at once (a sorted dispatch): the reference holds some
            # of them in its gathers, the input all of them, the same on both sides
            return list(node.outputs)
        if m is None:
            return None
        if m.input is not None:  # the reference's input the candidate computes
            value = self.ref.inputs[m.input]
            return [_like(m.to_candidate([value], [node.value.shape])[0], node.value), *node.outputs[1:]]
        refs = [self.ref.nodes[r] for r in m.ref]
        one_to_one = len(m.ref) == 1 and len(m.cand) == 1 and m.perm is None and m.frames is None
        if one_to_one and len(refs[0].outputs) == len(node.outputs):
            out = []
            for r_val, c_val in zip(refs[0].outputs, node.outputs, strict=True):
                if isinstance(r_val, torch.Tensor) and isinstance(c_val, torch.Tensor):
                    if r_val.numel() != c_val.numel():
                        return None
                    out.append(_like(r_val.reshape(c_val.shape), c_val))
                else:
                    out.append(c_val)
            return out
        shapes = [self.cand.nodes[c].value.shape for c in m.cand]
        own = [_primary(self.chained[c]) for c in m.cand]
        try:
            converted = m.to_candidate([r.value for r in refs], shapes, own)
        except (RuntimeError, ValueError):
            return None
        value = converted[m.cand.index(cand_index)]
        return [_like(value, node.value), *node.outputs[1:]]

    def _isolate(
        self,
        graph: OpGraph,
        node: OpNode,
        substitute: Callable[[int], list | None],
        execute: Execute | None,
        call: list | None = None,
        through: Callable[[OpNode], bool] = lambda node: False,
    ) -> torch.Tensor | None:
        """`node` run on substituted values of the computing ops it reads (through its views); the
        arguments it was called with are appended to `call` where given."""
        if call is not None:
            inner = execute or (lambda n, a, k: n.func(*a, **k))

            def execute(n: OpNode, a: list, k: dict) -> Any:
                if n.index == node.index:
                    call.append((n, a, k))
                return inner(n, a, k)

        views: set[int] = set()
        replace: dict[Ref, Any] = {}
        todo = list(node.inputs())
        while todo:
            ref = todo.pop()
            producer = graph.producer(ref)
            if producer is None or producer.index in views:
                continue
            if producer.layout or through(producer):  # views, and casts only one side makes
                views.add(producer.index)
                todo.extend(producer.inputs())
                continue
            values = substitute(producer.index)
            if values is None:
                return None  # an input the other side has no value for: not isolated
            for i, v in enumerate(values):
                replace[Ref("op", producer.index, i)] = v
        try:
            values = graph.replay(execute, replace=replace, only=views | {node.index}, stop=node.index + 1)
        except Exception:  # an op that cannot run on the other side's values (shapes): not isolated
            return None
        return _primary([values.get(Ref("op", node.index, i)) for i in range(len(node.outputs))])

    def _low_from_ref(self, low_index: int) -> list | None:
        """The reference's float32 outputs in place of the reference's own op in the candidate's dtype."""
        low = self.low.nodes[low_index]
        ref = self.ref_of_low.get(low_index)
        if ref is None:
            return None
        return [
            _like(r, c) if isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor) else c
            for r, c in zip(ref.outputs, low.outputs, strict=False)
        ]

    def _same_call(self, cand: OpNode, low: OpNode) -> bool:
        """Whether the candidate's op runs exactly as the reference's own in the candidate's dtype
        (same code run eagerly on the same device: the same op and arguments, the same weights and
        constants read through the same views), so that its isolated run is the reference's too."""
        if not self.same_code or self.execute is not None:
            return False
        return _same_reads(self.cand, cand, self.low, low, self._equal)

    def _cand_through(self, node: OpNode) -> bool:
        m = self.by_cand.get(node.index)
        return m is not None and m.how == CAST

    def _low_through(self, node: OpNode) -> bool:
        """A cast only the reference's run in the candidate's dtype makes (an upcast): seen through."""
        return node.kind == "_to_copy" and node.index not in self.ref_of_low

    # -- verdicts -------------------------------------------------------------------------------
    def _input_rows(self) -> list[OpRow]:
        """The candidate's ops that compute what the reference is given (its call's inputs), judged
        against those inputs (their noise: the inputs in the candidate's dtype), and the steps
        toward them."""
        rows = []
        for m in self.matches:
            if m.input is None and m.how != TOWARD_INPUT:
                continue
            c = self.cand.nodes[m.cand[0]]
            row = OpRow(c.name, c.kind, list(c.value.shape) if c.value is not None else [], m.how, [c.name])
            rows.append(row)
            if m.input is None:
                row.note = "judged where it arrives: the reference's input it computes"
                continue
            given, low = self.ref.inputs[m.input], self.low.inputs[m.input]
            value = m.to_reference([_primary(self.chained[c.index])], [given.shape])[0]
            row.error = rel_l2(value, given)
            row.noise = rel_l2(low, given) if low.shape == given.shape else None
            row.ratio = row.error / max(row.noise or 0.0, self.floor)
            if row.ratio > self.factor:
                row.verdict = "introduced"
        return rows

    def rows(self) -> list[OpRow]:
        rows: list[OpRow] = self._input_rows()
        ratio_of: dict[int, float] = {}  # reference op -> its chained ratio
        for r in self.ref.compute():
            value = r.value
            row = OpRow(r.name, r.kind, list(value.shape) if value is not None else [], None)
            low = self.low_of.get(r.index)
            row.noise = self.reference.noise.get(r.index)
            m = self.by_ref.get(r.index)
            if m is None:
                if _bookkeeping(value):
                    row.note = BOOKKEEPING
                elif r.kind in GATHERS and all(_bookkeeping(self.ref.nodes[i].value) for i in self.ref.sources(r)):
                    row.note = "rows of the call's input, gathered: the candidate reads the input whole (dense)"
                else:
                    row.verdict = "missing"
                    row.note = "the candidate computes nothing that matches this op"
                rows.append(row)
                continue
            row.how = f"{m.how}, {AS_SET}" if m.as_set else m.how
            row.candidate = [self.cand.nodes[c].name for c in m.cand]
            if value is None:
                rows.append(row)
                continue
            if m.error is not None and not self.replayed:  # matching compared these very values
                row.error = m.error
            else:
                cand_value = self._cand_as_ref(m, r.index, self.chained)
                if cand_value is None:
                    row.note = self._shape_note(r, m)
                    row.verdict = "introduced"
                    rows.append(row)
                    ratio_of[r.index] = float("inf")
                    continue
                row.error = rel_l2(cand_value, value, self.reference.norm.get(r.index))
            row.ratio = row.error / max(row.noise or 0.0, self.floor)
            ratio_of[r.index] = row.ratio
            # within the reference's own error chained, an op is fine whatever it would add alone:
            # its isolated run (the drill's costliest part) is only for the ops that may be at fault
            if len(m.cand) == 1 and row.ratio > WITHIN_NOISE:
                c = self.cand.nodes[m.cand[0]]
                iso = self._isolate(self.cand, c, self._ref_for_cand, self.execute, through=self._cand_through)
                if iso is not None:
                    iso_as_ref = self._cand_as_ref(m, r.index, {c.index: [iso]})
                    if iso_as_ref is not None:
                        row.isolated = rel_l2(iso_as_ref, value)
                if row.isolated is not None and low is not None:
                    if self._same_call(c, low):  # the same op on the same values: the same result
                        row.isolated_noise = row.isolated
                    else:
                        low_iso = self._isolate(self.low, low, self._low_from_ref, None, through=self._low_through)
                        if low_iso is not None and low_iso.numel() == value.numel():
                            row.isolated_noise = rel_l2(low_iso.reshape(value.shape), value)
                    if row.isolated_noise is not None:
                        row.isolated_ratio = row.isolated / max(row.isolated_noise, self.floor)
            inputs = self._input_ratios(r, ratio_of)
            if row.isolated_ratio is not None:
                introduced = row.isolated_ratio > self.factor
            else:
                introduced = row.ratio > self.factor and row.ratio > self.factor * max(inputs, default=0.0)
            if introduced:
                row.verdict = "introduced"
            elif row.ratio > self.factor:
                row.verdict = "inherited"
            if r.kind == "topk":
                self._topk(row, r, m)
            rows.append(row)
        rows.extend(self._left_rows())
        self._within_component(rows)
        self._computed_otherwise(rows)
        self._near_tie_experts(rows)
        return rows

    def _topk(self, row: OpRow, r: OpNode, m: Match) -> None:
        """A top-k's row: how many rows select other experts; none, or each in a near tie, is ok."""
        differ = self._differ(r, m)
        flips = 0 if differ is None else int(differ.sum())
        row.note = f"{flips} of {differ.numel()} rows select other experts" if flips else ""
        ties = self._near_ties(r, m) if flips else None
        if row.failed and differ is not None and not flips:  # a top-k is there to select: it selects alike
            row.verdict = "ok"
            row.note = "selects the same experts (its values are other scores than the reference's)"
        elif row.failed and ties == flips:  # as the router point forgives them
            row.verdict = "ok"
            row.note = f"{flips} of {differ.numel()} rows select other experts, each in a near tie"

    def _left_rows(self) -> list[OpRow]:
        """The rows of the candidate's ops matched to nothing: extra, unless bookkeeping, unused or a
        rank's share."""
        rows = []
        for c in self.left_cand:
            node = self.cand.nodes[c]
            shape = list(node.value.shape) if node.value is not None else []
            if _bookkeeping(node.value):
                rows.append(OpRow(node.name, node.kind, shape, None, [node.name], note=BOOKKEEPING))
                continue
            if c in self._unused:  # computed and thrown away (NxDI's token generation: a max it never reads)
                rows.append(OpRow(node.name, node.kind, shape, None, [node.name], note=UNUSED))
                continue
            if node.partial:  # what ranks compute only to be reduced: judged where it is (the reduction's row)
                rows.append(OpRow(node.name, node.kind, shape, None, [node.name],
                                  note=f"a rank's share of what {node.partial} reduces"))  # fmt: skip
                continue
            rows.append(OpRow(node.name, node.kind, shape, None, [node.name], verdict="extra",
                              note="a candidate op that matches no reference op"))  # fmt: skip
        return rows

    @functools.cached_property
    def _unused(self) -> set[int]:
        """The candidate's computing ops whose values reach no other op and no output: whatever they
        compute, the component's values cannot depend on it."""
        read = {x.at for n in self.cand.nodes for x in n.inputs() if x.kind == "op"}
        read |= {x.at for x in self.cand.output_refs() if x.kind == "op"}
        return {n.index for n in self.cand.compute() if n.index not in read}

    def _within_component(self, rows: list[OpRow]) -> None:
        """Where the component's own error stays within the noise factor of the reference's (or
        its point passed), an op above its own noise (a port that rounds in bf16 where the
        reference keeps float32) is noted, not failed: the drill explains a divergence, and there
        is none to explain. A drill of the same code is exact: its ops are the reference's."""
        if self.same_code:
            return
        error, noise, _ = self.component
        if not (self.point_passed or error / max(noise, self.floor) <= self.factor):
            return
        for row in rows:
            if row.verdict in ("introduced", "inherited") and row.ratio is not None and row.note == "":
                row.note = f"{row.ratio:.2f}x the reference's own error here, but the component stays within its noise"
                row.verdict = "ok"

    def _computed_otherwise(self, rows: list[OpRow]) -> None:
        """An op on one side only whose values go on into matched ops that all agree (within the
        noise factor): a step the other side takes its own way (NxDI's experts run densely; its
        gate and up in one op), judged where its values arrive. Not a failure; an op whose values go
        nowhere, or into an op that fails, stays missing or extra."""
        if self.same_code:
            return
        by_name = {r.name: r for r in rows}
        # a reference op and a candidate op may share a name (`expert[7].mul#2`): by name and verdict
        unmatched = {(r.name, r.verdict): r for r in rows if r.verdict in ("missing", "extra")}
        for graph, verdict, matched, reached in (
            (self.ref, "missing", set(self.by_ref), _reached(self.ref, set(self.by_ref))),
            (self.cand, "extra", self._judged_cand(), self._cand_reached),
        ):
            for node in graph.compute():
                row = unmatched.get((node.name, verdict))
                if row is None or row.verdict != verdict or node.index in matched:
                    continue
                arrive = reached.get(node.index, set())
                arrive_rows = [by_name.get(self._row_name(graph, i)) for i in sorted(arrive)]
                if arrive_rows and all(r is not None and not r.failed for r in arrive_rows):
                    row.verdict = "ok"
                    names = ", ".join(r.name for r in arrive_rows[:3]) + (", ..." if len(arrive_rows) > 3 else "")
                    side = "the candidate" if verdict == "missing" else "the reference"
                    row.note = f"{side} computes this otherwise: judged where its values arrive ({names}), which agree"

    def _judged_cand(self) -> set[int]:
        """The candidate's ops judged in a row of their own match (not casts it adds: seen through)."""
        return {c for c, m in self.by_cand.items() if m.how != CAST}

    @functools.cached_property
    def _cand_reached(self) -> dict[int, set[int]]:
        """Per candidate op, the judged ops its values reach first (`_reached`)."""
        return _reached(self.cand, self._judged_cand())

    @functools.cached_property
    def _ref_reached(self) -> dict[int, set[int]]:
        """Per reference op, the matched reference ops its values reach first."""
        return _reached(self.ref, set(self.by_ref))

    def feeds(self, row: OpRow) -> list[str]:
        """The judged rows a missing (reference) or extra (candidate) op's values reach first."""
        if row.verdict == "missing":
            graph, reached = self.ref, self._ref_reached
        else:
            graph, reached = self.cand, self._cand_reached
        node = next((n for n in graph.nodes if n.name == row.name), None)
        if node is None:
            return []
        return list(dict.fromkeys(self._row_name(graph, i) for i in sorted(reached.get(node.index, ()))))

    def other_dtypes(self) -> list[str]:
        """The matched ops the candidate computes in another floating dtype than the reference's own
        run in the candidate's dtype (a softmax in bfloat16 where the reference upcasts to float32)."""
        out, listed = [], set()
        for r in self.ref.compute():
            m, low = self.by_ref.get(r.index), self.low_of.get(r.index)
            if m is None or low is None or len(m.cand) != 1:
                continue
            c = self.cand.nodes[m.cand[0]]
            a, b = c.value, low.value
            if a is None or b is None or not (a.is_floating_point() and b.is_floating_point()) or c.kind == "_to_copy":
                continue
            if a.dtype != b.dtype:
                if not listed & set(self.ref.sources(r)):  # the first of a run: the rest follow from it
                    out.append(f"{r.name} in {_dtype(a.dtype)} (the reference: {_dtype(b.dtype)})")
                listed.add(r.index)
        return out

    def _row_name(self, graph: OpGraph, index: int) -> str:
        """The row that judges a matched op of `graph`: the reference op's (of its match)."""
        if graph is self.ref:
            return self.ref.nodes[index].name
        m = self.by_cand[index]
        return self.ref.nodes[m.ref[0]].name if m.ref else self.cand.nodes[index].name

    def _near_tie_experts(self, rows: list[OpRow]) -> None:
        """An expert's ops on one side only, where the component routes inside and its top-k agrees
        up to near ties: the expert lost or gained tokens in a near-tie routing flip, as the router
        point forgives it. Not a failure."""
        topk = [r for r in rows if r.kind == "topk"]
        if not topk or any(r.failed for r in topk):
            return
        nodes = {n.name: n for n in self.ref.nodes} | {n.name: n for n in self.cand.nodes}
        for row in rows:
            node = nodes.get(row.name)
            in_loop = node is not None and (node.expert is not None or "expert" in node.scope)
            if row.verdict in ("missing", "extra") and in_loop:
                side = "the reference" if row.verdict == "missing" else "the candidate"
                row.verdict = "ok"
                row.note = f"only in {side}: an expert's tokens moved in a near-tie routing flip"

    def evidence(self, ref_name: str) -> list[str]:
        """What the candidate's op of `ref_name` was given that the reference's was not (`explain`)."""
        r = self._ref_names.get(ref_name)
        m = self.by_ref.get(r.index) if r is not None else None
        if r is None or m is None or len(m.cand) != 1:
            return []
        c = self.cand.nodes[m.cand[0]]
        if m.how == CACHE_WRITE and m.frames:
            return write_evidence(self.ref, r, self.cand, c, m.frames[0])
        return culprit_evidence(self.ref, r, self.cand, c) + mask_evidence(r, m, _primary(self.chained[c.index]))

    def isolated_calls(self, ref_name: str) -> tuple[tuple, tuple, OpNode, Match] | None:
        """The candidate's and the reference's (candidate dtype) calls of op `ref_name` on the
        reference's inputs, for a repro: ((node, args, kwargs), (node, args, kwargs), ref node, match)."""
        r = self._ref_names.get(ref_name)
        m = self.by_ref.get(r.index) if r is not None else None
        low = self.low_of.get(r.index) if r is not None else None
        if m is None or len(m.cand) != 1 or low is None:
            return None
        cand_call: list = []
        low_call: list = []
        self._isolate(self.cand, self.cand.nodes[m.cand[0]], self._ref_for_cand, self.execute, cand_call,
                      self._cand_through)  # fmt: skip
        self._isolate(self.low, low, self._low_from_ref, None, low_call, self._low_through)
        if not cand_call or not low_call:
            return None
        return cand_call[0], low_call[0], r, m

    def _input_ratios(self, node: OpNode, ratio_of: dict[int, float]) -> list[float]:
        """The chained ratios of the computing ops `node` reads (through views)."""
        return [ratio_of[i] for i in self.ref.sources(node) if i in ratio_of]

    def _shape_note(self, r: OpNode, m: Match) -> str:
        shapes = [list(self.cand.nodes[c].value.shape) for c in m.cand if self.cand.nodes[c].value is not None]
        if r.expert is not None and shapes and r.value is not None and len(shapes[0]) == r.value.dim():
            have, want = shapes[0][0], r.value.shape[0]
            if have < want:
                return f"expert {r.expert} serves {have} of its {want} tokens: {want - have} dropped (capacity?)"
            if have > want:
                return f"expert {r.expert} serves {have} tokens, the reference {want}: {have - want} sent to it wrongly"
        return f"shapes differ: the reference's {list(r.value.shape)}, the candidate's {shapes}"

    def _differ(self, r: OpNode, m: Match) -> torch.Tensor | None:
        """Per row of a top-k: whether the candidate selects other experts (None: not comparable)."""
        c = self.cand.nodes[m.cand[0]]
        if len(r.outputs) < 2 or len(c.outputs) < 2 or not isinstance(c.outputs[1], torch.Tensor):
            return None
        ref_idx, cand_idx = r.outputs[1], self.chained[c.index][1]
        if ref_idx.shape != cand_idx.shape:
            return None
        return (ref_idx.sort(-1).values != cand_idx.to(ref_idx.device).sort(-1).values).any(-1)

    def _near_ties(self, r: OpNode, m: Match) -> int | None:
        """How many of a top-k's rows that select other experts do so in a near tie of the scores the
        reference takes its top-k over (`judge.routing`'s tolerance in the candidate's dtype, as
        the router point judges them); None where not comparable."""
        from ..judge.routing import compare_routing, tie_tolerance

        refs = r.inputs()
        scores = self.ref.value_of(refs[0]) if refs else None
        cand_idx = self.chained[m.cand[0]][1] if len(self.chained[m.cand[0]]) > 1 else None
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or cand_idx is None:
            return None
        try:
            metrics = compare_routing(scores, r.outputs[1], cand_idx, tolerance=tie_tolerance(scores, self.dtype))
        except ValueError:
            return None
        return len(metrics.ties)

    # -- substitution ---------------------------------------------------------------------------
    def final(self, graph: OpGraph, at: int = 0) -> torch.Tensor | None:
        """A graph's output `at` (of its tensors): the candidate's as it computes it (chained)."""
        refs = graph.output_refs()
        if len(refs) <= at:
            return None
        ref = refs[at]
        if graph is self.cand and ref.kind == "op":
            return self.chained[ref.at][ref.out]
        return graph.value_of(ref)

    @functools.cached_property
    def component(self) -> tuple[float, float, int]:
        """The component's error and the reference's own, at the output the candidate misses most
        (a router's weights rather than its logits), and which output that is."""
        best = (float("-inf"), 0, float("nan"), 0.0)
        for at in range(len(self.ref.output_refs())):
            ref, cand, low = self.final(self.ref, at), self.final(self.cand, at), self.final(self.low, at)
            if not isinstance(ref, torch.Tensor) or not ref.is_floating_point() or not isinstance(cand, torch.Tensor):
                continue
            if cand.numel() != ref.numel():
                continue
            error = rel_l2(cand.reshape(ref.shape), ref)
            noise = rel_l2(low.reshape(ref.shape), ref) if isinstance(low, torch.Tensor) else 0.0
            if error - noise > best[0]:
                best = (error - noise, at, error, noise)
        return best[2], best[3], best[1]

    def substitute(self, ref_name: str | list[str]) -> tuple[float | None, list[str]]:
        """The share of the component's error that goes away when the candidate's op(s) computing
        reference op `ref_name` give the reference's output instead (for a missing op: the
        candidate's counterpart of its input gives the missing op's output)."""
        names = [ref_name] if isinstance(ref_name, str) else ref_name
        computed = self.computed_inputs
        nodes = [self._ref_names.get(n) or computed.get(n) for n in names]
        if not nodes or any(n is None for n in nodes):
            return None, []
        node = nodes[0]
        matched = [self.by_cand.get(n.index) if n.name in computed else self.by_ref.get(n.index) for n in nodes]
        replace: dict[Ref, Any] = {}
        if all(m is not None for m in matched):
            targets = sorted({c for m in matched for c in m.cand})
            for c in targets:
                values = self._ref_for_cand(c)
                if values is None:
                    return None, []
                for i, v in enumerate(values):
                    replace[Ref("op", c, i)] = v
        elif len(nodes) > 1:
            return None, []
        else:  # missing: its value in place of what the candidate has for the op it reads
            source = next(iter(self.ref.sources(node)), None)
            sm = self.by_ref.get(source) if source is not None else None
            if sm is None or len(sm.cand) != 1:
                return None, []
            c = self.cand.nodes[sm.cand[0]]
            if sm.how == SAME_SELECTION and not _same_values(c.value, self.ref.nodes[source].value):
                return None, []  # a top-k that selects alike over other scores (logits): no place for it
            if c.value is None or node.value is None or c.value.numel() != node.value.numel():
                return None, []
            targets = [c.index]
            replace[Ref("op", c.index, 0)] = _like(node.value.reshape(c.value.shape), c.value)
        names = [self.cand.nodes[c].name for c in targets]
        recovery = self.recovery(replace, min(targets))
        return (recovery, names) if recovery is not None or self.component[0] <= self.component[1] else (None, [])

    def recovery(self, replace: dict[Ref, Any], first: int) -> float | None:
        """The share of the component's excess error (over the reference's own) that goes away when the
        candidate's run takes the values `replace` gives (its ops from `first` on run again), or None."""
        replace = dict(replace)
        for n in self.cand.nodes[:first]:  # the ops before run as they did
            for i, v in enumerate(self.chained[n.index]):
                replace.setdefault(Ref("op", n.index, i), v)
        values = self.cand.replay(self.execute, replace=replace, only=self._after(first))
        error, noise, at = self.component
        ref_final, sub = self.final(self.ref, at), None
        refs = self.cand.output_refs()
        if len(refs) > at:
            ref = refs[at]
            sub = values.get(ref) if ref.kind == "op" else self.final(self.cand, at)
        if ref_final is None or sub is None or not error - noise > 0:
            return None
        remaining = rel_l2(sub.reshape(ref_final.shape), ref_final)
        return max(0.0, min(1.0, (error - remaining) / (error - noise)))

    @functools.cached_property
    def computed_inputs(self) -> dict[str, OpNode]:
        """The candidate's ops that compute an input of the reference's call, by name."""
        return {
            self.cand.nodes[m.cand[0]].name: self.cand.nodes[m.cand[0]] for m in self.matches if m.input is not None
        }

    def _after(self, first: int) -> set[int]:
        return {n.index for n in self.cand.nodes if n.index > first}


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


GATHERS = ("index", "index_select", "gather")
UNUSED = "computed and never used: its value reaches no op and no output"


def _reached(graph: OpGraph, matched: set[int]) -> dict[int, set[int]]:
    """Per computing op of `graph`, the matched ops its values reach first (through unmatched ops)."""
    read_by = graph.consumers()
    reached: dict[int, set[int]] = {}
    for node in reversed(graph.compute()):
        out: set[int] = set()
        for c in read_by.get(node.index, ()):
            out |= {c} if c in matched else reached.get(c, set())
        reached[node.index] = out
    return reached


BOOKKEEPING = "integer bookkeeping (indices, masks): judged through the values it routes"


def _same_values(c: torch.Tensor | None, r: torch.Tensor | None) -> bool:
    """Two outputs of one shape whose values agree (within matching's tolerance)."""
    return c is not None and r is not None and c.shape == r.shape and rel_l2(c, r) <= VALUE_TOL


def _bookkeeping(value: torch.Tensor | None) -> bool:
    """An op of integers or booleans (which tokens go where): a port computes them its own way
    (masks for index lists), so they are matched where they can be and otherwise not rows that fail:
    their effect is on the floating-point values they route, which are."""
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


def _same_reads(
    a_graph: OpGraph, a: OpNode, b_graph: OpGraph, b: OpNode, equal: dict[tuple, bool], depth: int = 0
) -> bool:
    """Same op, same plain arguments, inputs of the same dtype, device and shape, and the same
    weights and constants (by value), followed through views."""
    if a.func is not b.func or depth > 32:
        return False
    a_leaves, b_leaves = a.leaves(), b.leaves()
    if len(a_leaves) != len(b_leaves):
        return False
    for x, y in zip(a_leaves, b_leaves, strict=True):
        if isinstance(x, Ref) != isinstance(y, Ref):
            return False
        if not isinstance(x, Ref):
            if x != y:
                return False
            continue
        if x.kind != y.kind:
            return False
        u, v = a_graph.value_of(x), b_graph.value_of(y)
        if not isinstance(u, torch.Tensor) or not isinstance(v, torch.Tensor):
            return False
        if (u.dtype, u.device, u.shape) != (v.dtype, v.device, v.shape):
            return False
        if x.kind in ("param", "const"):
            key = (x.kind, x.at, y.at)
            if key not in equal:  # a weight is read by many ops: compared once
                equal[key] = torch.equal(u, v)
            if not equal[key]:
                return False
        if x.kind == "op":
            pa, pb = a_graph.nodes[x.at], b_graph.nodes[y.at]
            if pa.layout != pb.layout or (pa.layout and not _same_reads(a_graph, pa, b_graph, pb, equal, depth + 1)):
                return False
    return True
