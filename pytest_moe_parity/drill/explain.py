"""What a drill can say about its culprit beyond its name: the aten op on each side, the arguments and
constants that differ, and a weight that differs from the reference's (and whose reference weight it
holds, where it is another expert's or another layer's). The culprit was fed the reference's inputs
for its verdict, so what differs here is what the op itself was given."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..judge.distance import rel_l2_flat
from .capture import OpGraph, OpNode, Ref

# A weight (an input read from a parameter) counts as differing beyond this relative error: a bf16
# copy of the reference's weight is within 2^-8 of it.
WEIGHT_DIFFERS = 1e-2
# Constants (a tensor of one element) differ beyond this relative error: one in the candidate's dtype
# is the reference's rounded, within 2^-8 for bf16.
CONSTANT_DIFFERS = 1e-2
# The largest weight searched among the reference's parameters (elements of the parameter, all experts).
SEARCHED = 1 << 28


def label(name: str, kind: str) -> str:
    """An op's step name with its aten kind where the name does not say it: `renorm (sum)`,
    `expert[3].down_proj (mm)`, `add`."""
    last = name.rpartition(".")[2].partition("#")[0]
    return name if kind in (last, "") else f"{name} ({kind})"


def _aten(node: OpNode) -> str:
    return str(getattr(node.func, "__name__", None) or node.kind)


def _plain(graph: OpGraph, node: OpNode) -> list[tuple[str, Any]]:
    """The op's arguments, as (where, value): numbers, flags, dims, and constants of one element (given
    as such, or made in the call from constants alone) by their value; a value computed from the
    inputs as COMPUTED, so that both sides' arguments stay aligned."""
    out: list[tuple[str, Any]] = []
    for i, x in enumerate(node.args if isinstance(node.args, list | tuple) else [node.args]):
        out.extend(_plain_leaf(graph, f"argument {i}", x))
    for key, x in (node.kwargs or {}).items():
        out.extend(_plain_leaf(graph, key, x))
    return out


COMPUTED = "<computed>"  # an argument computed from the call's inputs: not a constant, never compared


def _plain_leaf(graph: OpGraph, where: str, x: Any) -> list[tuple[str, Any]]:
    if isinstance(x, Ref):
        made = x.kind == "op" and graph.nodes[x.at].constant  # made inside the call from constants alone
        value = graph.value_of(x) if x.kind == "const" or made else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return [(where, value.item())]
        return [(where, COMPUTED)]
    if isinstance(x, list | tuple):
        if any(isinstance(v, Ref) for v in x):
            return [leaf for i, v in enumerate(x) for leaf in _plain_leaf(graph, f"{where}[{i}]", v)]
        return [(where, list(x))]
    if isinstance(x, bool | int | float | str) or x is None:
        return [(where, x)]
    return []


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        if math.isnan(a) and math.isnan(b):
            return False
        return not math.isclose(float(a), float(b), rel_tol=CONSTANT_DIFFERS, abs_tol=0.0)
    return a != b


def _param_name(graph: OpGraph, node: OpNode, ref: Ref) -> str | None:
    """The parameter an input of `node` is read from (directly, or through views of it)."""
    if ref.kind == "param":
        return str(ref.at)
    if ref.kind == "op":
        source = graph.nodes[ref.at]
        if source.layout:
            inner = source.inputs()
            return _param_name(graph, source, inner[0]) if inner else None
    return None


def _holds(reference: OpGraph, value: torch.Tensor) -> str | None:
    """Which of the reference's weights `value` is (a parameter, or one expert's slice of a fused
    one, as it is or transposed), or None."""
    want = value.detach().to(torch.float32)
    for name, param in reference.params.items():
        if param.numel() > SEARCHED or not param.is_floating_point():
            continue
        p = param.detach().to(torch.float32)
        candidates: list[tuple[str, torch.Tensor]] = []
        if p.shape == want.shape:
            candidates.append((name, p))
        if p.dim() == want.dim() + 1:
            candidates += [(f"{name}[{e}] (expert {e}'s)", p[e]) for e in range(p.shape[0])]
        for where, piece in candidates:
            for form in (piece, piece.transpose(-1, -2) if piece.dim() >= 2 else None):
                if form is not None and form.shape == want.shape and rel_l2_flat(want, form) < WEIGHT_DIFFERS:
                    return where
    return None


def differing_constants(
    reference: OpGraph, ref_node: OpNode, candidate: OpGraph, cand_node: OpNode
) -> list[tuple[str, Any, Any]]:
    """The culprit's arguments that are constants (numbers, flags, dims, one-element tensors: values
    made, not computed from the call's inputs) and differ from the reference's op's: (where, the
    reference's value, the candidate's). None compared across two kinds of op (their arguments mean
    other things)."""
    ref_plain, cand_plain = _plain(reference, ref_node), _plain(candidate, cand_node)
    if len(ref_plain) != len(cand_plain) or ref_node.kind != cand_node.kind:
        return []
    pairs = zip(ref_plain, cand_plain, strict=True)
    return [(where, a, b) for (where, a), (_, b) in pairs if COMPUTED not in (a, b) and _differs(a, b)]


def constant_said(where: str, reference: Any, candidate: Any) -> str:
    """A constant that differs, in words: `argument 1: 1e-06 in the reference, 0.001 in the candidate`."""
    return f"{where}: {reference!r} in the reference, {candidate!r} in the candidate"


def culprit_evidence(reference: OpGraph, ref_node: OpNode, candidate: OpGraph, cand_node: OpNode) -> list[str]:
    """Sentences on what the candidate's culprit op was given that the reference's was not: another
    aten op, arguments and constants that differ, a weight that differs (and whose it is)."""
    said: list[str] = []
    if _aten(ref_node) != _aten(cand_node):
        said.append(f"the reference runs {_aten(ref_node)}, the candidate {_aten(cand_node)}")
    for where, a, b in differing_constants(reference, ref_node, candidate, cand_node):
        said.append(f"{constant_said(where, a, b)} (a constant, not a kernel, bug)")
    ref_in, cand_in = ref_node.inputs(), cand_node.inputs()
    if len(ref_in) == len(cand_in):
        for ref_x, cand_x in zip(ref_in, cand_in, strict=True):
            name = _param_name(candidate, cand_node, cand_x) or _param_name(reference, ref_node, ref_x)
            if name is None:
                continue
            a, b = reference.value_of(ref_x), candidate.value_of(cand_x)
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
                continue
            error = rel_l2_flat(b, a)
            if error > WEIGHT_DIFFERS:
                text = (
                    f"its weight {name} differs from the reference's (rel_l2 {error:.3g}): a weight, not a kernel, bug"
                )
                held = _holds(reference, b)
                if held is not None:
                    text += f"; it holds the reference's {held}"
                said.append(text)
    return said
