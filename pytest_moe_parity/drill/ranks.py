"""Tensor-parallel ranks' captures joined into one graph, as if one process ran them all: what the
drill matches to the reference (which runs unsharded) and replays.

The ranks run the same code (SPMD), so their captures hold the same ops in the same order. Per op:
- where every rank reads the same values and computes the same outputs (replicated: norms, the
  router, what follows an all-reduce), it is one op of the joined graph;
- else each rank's op is an op of its own (`name@rank1`), reading that rank's values and weight
  shards: the heads a column-parallel projection splits across ranks are then pieces the matcher
  joins (`value (split: one in N)`);
- a collective becomes one op over the ranks' inputs, computed in process: an all-reduce sums them,
  an all-gather concatenates them along the first dim (what gloo does for NxD on the CPU). What
  the ranks compute only to be reduced (a row-parallel projection's partial sums) matches no
  reference op by construction: it is marked `partial` (a row of its own, not an extra one).

Tensor-parallel reductions are sums (NxD's); a collective of another kind is not joined."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import BadInput
from .capture import OpGraph, OpNode, Ref, op_name

# c10d's ops (and the functional ones) -> how the joined graph computes them
REDUCE = {"c10d.allreduce_.default", "_c10d_functional.all_reduce.default"}
GATHER = {"c10d._allgather_base_.default", "_c10d_functional.all_gather_into_tensor.default"}


class JoinError(BadInput, ValueError):
    """Ranks' captures that cannot be joined (other ops on some rank, a collective not built)."""


def _sum(*parts: torch.Tensor) -> torch.Tensor:
    return functools.reduce(torch.add, parts)


def _gather(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=0)


_sum.__name__, _gather.__name__ = "all_reduce", "all_gather"


def _data(node: OpNode) -> list[Ref]:
    """The refs a collective reduces or gathers: its (first) input tensors."""
    name = op_name(node.func)
    first = node.args[1] if name == "c10d._allgather_base_.default" else node.args[0]
    leaves, _ = tree_flatten(first)
    return [x for x in leaves if isinstance(x, Ref)]


def _same(values: list[Any]) -> bool:
    first = values[0]
    for v in values[1:]:
        if isinstance(first, torch.Tensor) != isinstance(v, torch.Tensor):
            return False
        if isinstance(first, torch.Tensor):
            if first.shape != v.shape or first.dtype != v.dtype or not torch.equal(first, v):
                return False
        elif first != v:
            return False
    return True


def join_ranks(graphs: list[OpGraph]) -> OpGraph:
    """One graph of every rank's ops (see the module docstring); one rank's graph as it is."""
    if len(graphs) == 1:
        return graphs[0]
    first = graphs[0]
    for r, g in enumerate(graphs[1:], 1):
        if [op_name(n.func) for n in g.nodes] != [op_name(n.func) for n in first.nodes]:
            raise JoinError(
                f"rank {r} ran other ops than rank 0 ({len(g.nodes)} and {len(first.nodes)}): not one SPMD program"
            )
    ranks = range(len(graphs))
    params: dict[str, torch.Tensor] = {}
    param_of: list[dict[str, str]] = [{} for _ in ranks]
    for name in first.params:
        shared = _same([g.params[name] for g in graphs])
        for r, g in enumerate(graphs):
            key = name if shared else f"{name}@rank{r}"
            param_of[r][name] = key
            params[key] = g.params[name]
    consts: list[torch.Tensor] = []
    const_at = []
    for g in graphs:
        const_at.append(len(consts))
        consts.extend(g.consts)
    op_of: list[dict[int, int]] = [{} for _ in ranks]
    nodes: list[OpNode] = []

    def remap(r: int, x: Any) -> Any:
        if not isinstance(x, Ref):
            return x
        if x.kind == "op":
            return Ref("op", op_of[r][x.at], x.out)
        if x.kind == "param":
            return Ref("param", param_of[r][x.at])
        if x.kind == "const":
            return Ref("const", const_at[r] + x.at)
        return x  # the call's inputs: every rank is given the same

    def add(template: OpNode, func: Any, args: Any, kwargs: Any, outputs: list, name: str, collective: str = "") -> int:
        """A joined op like `template` (a collective's: computed in process, writing nothing)."""
        index = len(nodes)
        kind, mutates = (collective, ()) if collective else (template.kind, template.mutates)
        node = OpNode(
            index, func, kind, args, kwargs, outputs, template.scope, template.function, template.expert,
            template.param, mutates, name, template.constant, made=template.made,
        )  # fmt: skip
        nodes.append(node)
        return index

    for i, per in enumerate(zip(*(g.nodes for g in graphs), strict=True)):
        name = op_name(per[0].func)
        if name in REDUCE or name in GATHER:
            data = [[remap(r, ref) for ref in _data(node)] for r, node in enumerate(per)]
            if any(len(d) != 1 for d in data):
                raise JoinError(f"{per[0].name}: a collective over {len(data[0])} tensors per rank is not joined")
            func = _sum if name in REDUCE else _gather
            index = add(per[0], func, tuple(d[0] for d in data), {}, per[0].outputs[:1], per[0].name, func.__name__)
            for r in ranks:
                op_of[r][i] = index
            if func is _sum:
                _mark_partial(nodes, [d[0] for d in data], per[0].name)
            continue
        args = [tree_map(functools.partial(remap, r), (n.args, n.kwargs)) for r, n in enumerate(per)]
        if all(a == args[0] for a in args[1:]) and all(
            _same(list(out)) for out in zip(*(n.outputs for n in per), strict=True)
        ):
            index = add(per[0], per[0].func, *args[0], per[0].outputs, per[0].name)
            for r in ranks:
                op_of[r][i] = index
            continue
        for r, n in enumerate(per):
            op_of[r][i] = add(n, n.func, *args[r], n.outputs, f"{n.name}@rank{r}")
    output = tree_map(functools.partial(remap, 0), first.output)
    return OpGraph(nodes, first.inputs, params, consts, output)


def _mark_partial(nodes: list[OpNode], refs: list[Ref], collective: str) -> None:
    """The ranks' ops whose values reach the reference only through this reduction: each rank's
    computing ops upstream of its input, up to (not into) what every rank shares."""
    todo = [r.at for r in refs if r.kind == "op"]
    while todo:
        node = nodes[todo.pop()]
        if node.partial or "@rank" not in node.name:
            continue
        node.partial = collective
        todo.extend(x.at for x in node.inputs() if x.kind == "op")
