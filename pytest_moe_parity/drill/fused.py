"""A port's fused op whose pieces the reference computes apart and not one after the other (vLLM's packed
`qkv_proj`: one GEMM for the query, key and value projections the reference runs with their norms in
between): the reference's free ops that read the same input of the call as the candidate's op, joined."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .capture import OpGraph, OpNode, Ref

MOST = 4  # pieces of one fused op


def call_inputs(graph: OpGraph, node: OpNode) -> list[torch.Tensor]:
    """The call's input tensors `node` reads, through views."""
    out: list[torch.Tensor] = []
    todo, seen = list(node.inputs()), set()
    while todo:
        ref: Ref = todo.pop()
        if ref.kind == "input":
            out.append(graph.inputs[ref.at])
            continue
        producer = graph.producer(ref)
        if producer is not None and producer.layout and producer.index not in seen:
            seen.add(producer.index)
            todo.extend(producer.inputs())
    return out


def fused_siblings(
    reference: OpGraph, candidate: OpGraph, c: OpNode, free: list[OpNode], joined: Callable[[list[OpNode]], int | None]
) -> tuple[list[OpNode], int] | None:
    """The reference's free ops (in forward order) that read an input of the call `c` reads, 2 to `MOST` of
    them in order, that `c`'s output joins (`joined(group)`: the dim, or None); with that dim."""
    read = call_inputs(candidate, c)
    if not read or c.value is None:
        return None
    siblings = [
        r for r in free
        if r.value is not None and r.value.numel() < c.value.numel()
        and any(_same_tensor(a, b) for a in call_inputs(reference, r) for b in read)
    ]  # fmt: skip
    for size in range(2, min(MOST, len(siblings)) + 1):
        for start in range(len(siblings) - size + 1):
            group = siblings[start : start + size]
            if sum(r.value.numel() for r in group) == c.value.numel() and (dim := joined(group)) is not None:
                return group, dim
    return None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return a.numel() == b.numel() and a.is_floating_point() and b.is_floating_point() and _close(a, b)
    return _close(a, b)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.reshape(-1).float(), b.reshape(-1).float()
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6)) if a.is_floating_point() else bool(torch.equal(a, b))


def shape_perm(c: OpNode, r: OpNode) -> tuple[int, ...] | None:
    """How a candidate op's dims are the reference op's, where two ops paired by their place (not by value)
    hold their dims in another order and only one permutation orders them so (vLLM's attention kernel's
    [tokens, heads, dim] against the reference's [heads, tokens, dim]); None: as they are, or reshaped."""
    a, b = c.value, r.value
    if a is None or b is None or a.dim() != b.dim() or a.shape == b.shape or sorted(a.shape) != sorted(b.shape):
        return None
    if len(set(a.shape)) != a.dim():  # a repeated size: more than one permutation would do
        return None
    return tuple(list(a.shape).index(size) for size in b.shape)
