"""A module's forward captured op by op: every ATen op it dispatches, in order, with where its
tensors came from (the call's inputs, the module's parameters, earlier ops), the module path and
Python function it ran in, and its outputs' values. The capture is a `TorchDispatchMode` over an
eager run: it sees what the module really computes (data-dependent expert loops included) below
autograd, after composite ops are decomposed (`linear` -> `t` + `mm`, `softmax` -> `_softmax`).

`OpGraph.replay` runs the captured ops again with some values replaced (the reference's inputs of
one op, the golden output of another) through any executor (eager, or each op compiled): the
isolated, chained and substituted runs of the drill."""

from __future__ import annotations

import functools
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..judge.distance import rel_l2
from ..tree import leaves, map_structure


@dataclass(frozen=True)
class Ref:
    """A value an op reads: Ref("op", node index, output index), Ref("input", position),
    Ref("param", name), Ref("const", index into OpGraph.consts). Not a tuple: pytrees leave it whole."""

    kind: str
    at: Any
    out: int = 0


# Ops that move or reinterpret values without computing: no row of their own (an op's row says
# what its inputs went through), but run like any other op.
LAYOUT_OPS = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "expand",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "clone",
        "contiguous",
        "alias",
        "detach",
        "lift_fresh",
        "lift",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "as_strided",
        "_reshape_alias",
        "unflatten",
        "flatten",
        "movedim",
        "narrow",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "empty_strided",
        "new_full",
        "new_ones",
        "zero",
        "zeros_like",
        "new_zeros",
        "ones_like",
        "full_like",
        "zeros",
        "ones",
        "full",
        "arange",
        "empty",
        "scalar_tensor",
        "_local_scalar_dense",
        "nonzero",
        "copy",
        "fill",
    ]
)
# Casts (`_to_copy`), joins (cat, stack) and gathers are rows: a cast in the wrong place, heads
# joined in the wrong order or tokens gathered wrongly are port bugs of their own.
FRIENDLY = {"_softmax": "softmax", "_log_softmax": "log_softmax", "addmm": "mm", "_safe_softmax": "softmax"}
_TORCH = str(Path(torch.__file__).parent)
_PACKAGE = str(Path(__file__).resolve().parents[1])
_SKIP_FUNCS = {"forward", "_call_impl", "_wrapped_call_impl", "__call__", "inner", "wrapper", "decorate_context"}


@functools.cache
def _frame_says(code: Any) -> str | None:
    """What a frame of this code tells `_OpRecorder._where`: None to look further up (torch's own
    code, a function mode's `__torch_function__`), "" to stop with no function (this package; a
    module's `forward`), or the model function's name. Once per code object: ops are many, the
    functions they run in few."""
    path, name = code.co_filename, code.co_name
    if name == "__torch_function__":  # a function mode's (as the NxDI CPU build's): not the caller
        return None
    if path.startswith(_PACKAGE):
        return ""
    if not path.startswith(_TORCH) and "<" not in path and not name.startswith("<"):
        return "" if name in _SKIP_FUNCS else name
    return None


def op_kind(func: Any) -> str:
    """`aten.mm.default` -> `mm`; in-place `index_add_` -> `index_add`."""
    name = getattr(func, "_opname", None) or str(func).split(".")[1]
    return name.rstrip("_") if not name.startswith("_") or name.endswith("__") else name


@dataclass
class OpNode:
    index: int
    func: Any  # an OpOverload
    kind: str  # op_kind(func)
    args: Any  # args and kwargs with every tensor replaced by a Ref
    kwargs: Any
    outputs: list[torch.Tensor | None]  # the outputs' values (tensors; None for non-tensor outputs)
    scope: str  # module path relative to the captured module ("" for itself)
    function: str  # the model code's function the op ran in (not `forward`)
    expert: int | None = None  # the expert whose weights the op (or its loop iteration) reads
    param: str | None = None  # the parameter it reads, where one is
    mutates: tuple[int, ...] = ()  # positions of args it writes in place
    name: str = ""
    constant: bool = False  # computed from constants alone (a port's own causal mask): not a row
    # a constant op whose value reaches the module's outputs through made values alone (rotary tables
    # from positions the module makes): a row, as nothing the call was given leads to what it returns
    made: bool = False
    partial: str = ""  # ranks joined: a rank's share of what this collective (its name) reduces
    # returns nothing: its output is the argument it writes at `mutates[void]` (one node per written argument)
    void: int | None = None
    part: int | None = None  # one of a fused kernel's results: its `part`-th (one node per result)
    _leaves: list[Any] | None = field(default=None, repr=False, compare=False)

    @property
    def layout(self) -> bool:
        return self.kind in LAYOUT_OPS or (self.constant and not self.made)

    def leaves(self) -> list[Any]:
        """Its arguments flattened: refs and plain values (computed once: they do not change)."""
        if self._leaves is None:
            self._leaves = leaves((self.args, self.kwargs))
        return self._leaves

    def inputs(self) -> list[Ref]:
        """The refs this op reads, in order."""
        return [x for x in self.leaves() if isinstance(x, Ref)]

    @property
    def value(self) -> torch.Tensor | None:
        """The primary output (the first tensor)."""
        outputs = self.outputs
        if outputs and isinstance(outputs[0], torch.Tensor):  # most ops: asked often, answered at once
            return outputs[0]
        return next((t for t in outputs if isinstance(t, torch.Tensor)), None)

    def __getstate__(self) -> dict[str, Any]:  # an OpOverload does not pickle: its name does
        args, kwargs, outputs = tree_map(_opaque, (self.args, self.kwargs, self.outputs))
        return {**self.__dict__, "func": op_name(self.func), "_leaves": None, "args": args, "kwargs": kwargs,
                "outputs": outputs}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, func=resolve_op(state["func"]))


@dataclass(frozen=True)
class Opaque:
    """An argument that does not leave its process (a collective's process group, its work handle)."""

    type: str


def _opaque(x: Any) -> Any:
    return Opaque(type(x).__name__) if isinstance(x, torch.ScriptObject) else x


def op_name(func: Any) -> str:
    """`aten.mm.default` for torch.ops.aten.mm.default."""
    return str(func)


def resolve_op(name: str) -> Any:
    """The op `op_name` named (a library op, e.g. `c10d.allreduce_.default`, included)."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


@dataclass
class OpGraph:
    nodes: list[OpNode]
    inputs: list[torch.Tensor]  # the call's tensors, in pytree order of (args, kwargs)
    params: dict[str, torch.Tensor]
    consts: list[torch.Tensor]
    output: Any  # the module's return with tensors replaced by refs

    def compute(self) -> list[OpNode]:
        return [n for n in self.nodes if not n.layout]

    def by_name(self) -> dict[str, OpNode]:
        return {n.name: n for n in self.nodes}

    def output_refs(self) -> list[Ref]:
        flat, _ = tree_flatten(self.output)
        return [x for x in flat if isinstance(x, Ref)]

    def value_of(self, ref: Ref) -> Any:
        kind = ref.kind
        if kind == "op":
            return self.nodes[ref.at].outputs[ref.out]
        if kind == "input":
            return self.inputs[ref.at]
        if kind == "param":
            return self.params[ref.at]
        return self.consts[ref.at]

    def output_values(self) -> Any:
        """The module's return as captured (its refs' values)."""
        return tree_map(lambda x: self.value_of(x) if isinstance(x, Ref) else x, self.output)

    def producer(self, ref: Ref) -> OpNode | None:
        return self.nodes[ref.at] if ref.kind == "op" else None

    def sources(self, node: OpNode) -> list[int]:
        """The computing ops a node reads, through views."""
        out, todo, seen = [], list(node.inputs()), set()
        while todo:
            producer = self.producer(todo.pop(0))
            if producer is None or producer.index in seen:
                continue
            seen.add(producer.index)
            if producer.layout:
                todo.extend(producer.inputs())
            else:
                out.append(producer.index)
        return out

    def consumers(self) -> dict[int, set[int]]:
        """Per computing op, the computing ops that read it (through views)."""
        consumers: dict[int, set[int]] = {}
        for node in self.compute():
            for s in self.sources(node):
                consumers.setdefault(s, set()).add(node.index)
        return consumers

    def passes_on(self, node: OpNode, tol: float) -> bool:
        """Whether a cast's output holds its input's values (up to the rounding of its dtype): one
        between floating dtypes does, by what a cast is; another, within relative L2 `tol`."""
        refs = node.inputs()
        value = self.value_of(refs[0]) if refs else None
        if not isinstance(value, torch.Tensor) or node.value is None or value.shape != node.value.shape:
            return False
        if value.is_floating_point() and node.value.is_floating_point():
            return True
        return rel_l2(node.value, value) <= tol

    def replay(
        self,
        execute: Callable[[OpNode, list, dict], Any] | None = None,
        *,
        replace: dict[Ref, torch.Tensor] | None = None,
        stop: int | None = None,
        only: set[int] | None = None,
    ) -> dict[Ref, Any]:
        """Run the ops again: each reads the values computed in this replay (or `replace[ref]`),
        through `execute(node, args, kwargs)` (default: eager). `only`: run these nodes
        and take every other op's value from the capture. Returns every ref's new value."""
        execute = execute or (lambda node, a, k: node.func(*a, **k))
        values: dict[Ref, Any] = dict(replace or {})

        def value(ref: Any) -> Any:
            if not isinstance(ref, Ref):
                return ref
            return values[ref] if ref in values else self.value_of(ref)

        with torch.no_grad():
            self._run(execute, values, value, stop, only, replace or {})
        return values

    def _run(self, execute, values, value, stop, only, replace) -> None:
        nodes = self.nodes[:stop] if only is None else [self.nodes[i] for i in sorted(only) if stop is None or i < stop]
        for node in nodes:
            if all(Ref("op", node.index, i) in replace for i in range(len(node.outputs))):
                continue
            args, kwargs = map_structure(node.args, value), map_structure(node.kwargs, value)
            for pos in node.mutates:  # in place: on a copy, so the captured values stay as they were
                args = list(args)
                args[pos] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args[pos])
            out = execute(node, list(args), dict(kwargs))
            flat = leaves(out)
            if node.void is not None and node.mutates[node.void] < len(args):
                flat = [args[node.mutates[node.void]]]
            elif node.part is not None:
                flat = [flat[node.part]]
            for i, t in enumerate(flat):
                values.setdefault(Ref("op", node.index, i), t)


@functools.cache
@functools.cache
def _op_info(func: Any) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """An op's kind, and the positions and names of the arguments it writes in place."""
    arguments = func._schema.arguments
    written = [(i, a.name) for i, a in enumerate(arguments) if a.alias_info and a.alias_info.is_write]
    if func.namespace == "c10d" and func._opname.endswith("_") and not written:
        written = [(0, arguments[0].name)]  # c10d's collectives write their first argument, undeclared
    return op_kind(func), tuple(i for i, _ in written), tuple(n for _, n in written)


class _OpRecorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """torch (2.10 on) wraps a mode's `__torch_dispatch__` to keep Dynamo out of it, which imports
        Dynamo at the first op (about a second: a fresh process's drill paid it) and adds a call per
        op. The drill captures eager modules only (`drill_call` refuses compiled ones), as torch's
        modes ran before."""
        return False

    def __init__(self, root: nn.Module, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.nodes: list[OpNode] = []
        self.refs: dict[int, Ref] = {}  # id(tensor) -> where it came from
        self.keep: list[torch.Tensor] = []  # every tensor seen stays alive: ids are not reused
        self.by_storage: dict[int, list[tuple[list, int]]] = {}  # storage -> the kept values in it
        self.input_names: list[str | None] = []  # the call's tensors that are weights, by name
        self.consts: list[torch.Tensor] = []
        self.expert_params = {
            id(p): (name, p.shape[0]) for name, p in root.named_parameters() if p.dim() == 3
        }  # stacked experts: [E, ...]
        self.expert: dict[str, int | None] = {}  # scope -> the expert its loop is on

    def ref_of(self, t: torch.Tensor) -> Ref:
        ref = self.refs.get(id(t))
        if ref is None:
            ref = Ref("const", len(self.consts))
            self.consts.append(t.detach().clone())
            self.refs[id(t)] = ref
            self.keep.append(t)
        return ref

    def _as_refs(self, obj: Any, flat: list[Any], as_refs: list[Any]) -> Any:
        """`obj` (an op's arguments: tuples, lists, dicts of tensors and plain values) with each tensor
        as its Ref; its leaves appended to `flat`, and with their Refs to `as_refs` (as `leaves`)."""
        if isinstance(obj, torch.Tensor):
            ref = self.ref_of(obj)
            flat.append(obj)
            as_refs.append(ref)
            return ref
        if isinstance(obj, tuple):
            return tuple([self._as_refs(x, flat, as_refs) for x in obj])
        if isinstance(obj, list):
            return [self._as_refs(x, flat, as_refs) for x in obj]
        if isinstance(obj, dict):
            return {k: self._as_refs(v, flat, as_refs) for k, v in obj.items()}
        flat.append(obj)
        as_refs.append(obj)
        return obj

    def _where(self) -> str:
        """The model code's function the op runs in: the first frame up the stack outside torch; ""
        for a module's own `forward`, or where the stack reaches this package (the op is torch's own,
        called by a torch module)."""
        frame = sys._getframe(2)
        while frame is not None:
            found = _frame_says(frame.f_code)
            if found is not None:
                return found
            frame = frame.f_back
        return ""

    def _input_name(self, i: int) -> str | None:
        return self.input_names[i] if i < len(self.input_names) else None

    def watch(self, values: list, i: int) -> None:
        """Values are kept as the ops left them, not copied: an op that later writes into their
        storage (in place) copies them first (`_before_write`)."""
        t = values[i]
        self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((values, i))

    def _before_write(self, t: torch.Tensor) -> None:
        for values, i in self.by_storage.pop(t.untyped_storage().data_ptr(), []):
            values[i] = values[i].clone()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, mutates, names = _op_info(func)
        written = [args[i] if i < len(args) else kwargs.get(name) for i, name in zip(mutates, names, strict=True)]
        for t in leaves(written):  # a collective writes a list of tensors
            if isinstance(t, torch.Tensor):
                self._before_write(t)
                self.ref_of(t)  # a constant written in place (a static cache) is kept as it was before
        out = func(*args, **kwargs)
        scope = self.stack[-1] if self.stack else ""
        param = expert = None
        # the arguments with each tensor as its Ref (one it has not been seen with: a constant), in one
        # walk: the tensors and plain values in order, and the same with the tensors' Refs
        flat_in: list[Any] = []
        as_refs: list[Any] = []
        node_args, node_kwargs = self._as_refs((args, kwargs), flat_in, as_refs)
        for t in flat_in:
            if isinstance(t, torch.Tensor):
                ref = self.refs.get(id(t))
                if ref is not None and ref.kind == "param":
                    param = ref.at
                elif ref is not None and ref.kind == "input" and self._input_name(ref.at):
                    param = self._input_name(ref.at)
                elif ref is not None and ref.kind == "op" and self.nodes[ref.at].param is not None and param is None:
                    source = self.nodes[ref.at]
                    if source.layout:  # a view of a weight (t, select): the op reads that weight
                        param, expert = source.param, source.expert
        if kind == "select" and flat_in and isinstance(flat_in[0], torch.Tensor):
            known = self.expert_params.get(id(flat_in[0]))
            if known is not None and len(args) >= 3 and isinstance(args[2], int):
                expert = args[2] if args[2] >= 0 else args[2] + known[1]
                self.expert[scope] = expert
        if expert is None and param is None:
            expert = self.expert.get(scope)
        flat_out = leaves(out)
        where = self._where()
        # a library's fused kernel (not ATen's) computes several results: a node per result, each matched and
        # judged on its own (vLLM's `fused_add_rms_norm` returns the norm and the residual's sum); one that
        # returns nothing writes them into its arguments (vLLM's CPU `rotary_embedding` rotates the query and
        # the key in place): a node per tensor it writes, that tensor its output
        outs: list[tuple[int | None, int | None, list]] = [(None, None, flat_out)]
        tensors = sum(isinstance(t, torch.Tensor) for t in flat_out)
        if mutates and not tensors:
            outs = [(i, None, [t]) for i, t in enumerate(written) if isinstance(t, torch.Tensor)]
        elif tensors > 1 and tensors == len(flat_out) and func.namespace != "aten":
            outs = [(None, i, [t]) for i, t in enumerate(flat_out)]
        for void, part, flat in outs:
            node = OpNode(len(self.nodes), func, kind, node_args, node_kwargs, [], scope, where, expert, param, mutates)
            node.void, node.part, node._leaves = void, part, as_refs
            self._add(node, flat, args)
        return out

    def _add(self, node: OpNode, flat_out: list, args: Any) -> None:
        """`node` appended with its outputs `flat_out`: the tensors it returns (or writes) now come from it."""
        index = node.index
        for i, t in enumerate(flat_out):
            if isinstance(t, torch.Tensor):
                self.refs[id(t)] = Ref("op", index, i)
                self.keep.append(t)
                node.outputs.append(t.detach())
                self.watch(node.outputs, i)
            else:
                node.outputs.append(t)
        if node.void is None:
            for pos in node.mutates:  # the written tensor now holds this op's output
                if pos < len(args) and isinstance(args[pos], torch.Tensor):
                    self.refs[id(args[pos])] = Ref("op", index, 0)
        # from constants alone (factories included): the same whatever the inputs
        node.constant = all(r.kind == "const" or (r.kind == "op" and self.nodes[r.at].constant) for r in node.inputs())
        self.nodes.append(node)
        if node.constant:  # a constant written through a view (`mask[:, i] = False`): its base as written
            for pos in node.mutates:
                base = getattr(args[pos], "_base", None) if pos < len(args) else None
                if isinstance(base, torch.Tensor) and id(base) in self.refs:
                    del self.refs[id(base)]
                    self.ref_of(base)


def capture_ops(
    module: nn.Module,
    args: list | tuple,
    kwargs: dict[str, Any],
    input_names: list[str | None] | None = None,
    router: bool | None = None,
    root: nn.Module | None = None,
) -> tuple[OpGraph, Any]:
    """Run `module(*args, **kwargs)` once, recording every op. Returns the graph and the output.
    `input_names`: per tensor of the call (in pytree order), the weight it is where it is one (a
    score bias passed as an argument), so that ops reading it are named by it as by a parameter.
    `router`: the module is a router, its ops named by step (see `name_ops`). `root`: the submodule
    the module paths are taken from (a wrapper's inner module; ops outside it have the scope "")."""
    names = {id(m): name for name, m in (root or module).named_modules()}
    stack: list[str] = []

    def pre(mod: nn.Module, _args: Any) -> None:
        if id(mod) in names:
            stack.append(names[id(mod)])

    def post(mod: nn.Module, _args: Any, _out: Any) -> None:
        if id(mod) in names and stack:
            stack.pop()

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post),
    ]
    recorder = _OpRecorder(module, stack)
    flat, _ = tree_flatten((list(args), dict(kwargs)))
    inputs = [t for t in flat if isinstance(t, torch.Tensor)]
    kept_inputs = [t.detach() for t in inputs]
    for i, t in enumerate(inputs):
        recorder.refs[id(t)] = Ref("input", i)
        recorder.watch(kept_inputs, i)
    if input_names is not None and len(input_names) == len(inputs):
        recorder.input_names = list(input_names)
    prefix = next((f"{n}." for n, m in module.named_modules() if m is root and n), "")
    params = {n.removeprefix(prefix): p for n, p in [*module.named_parameters(), *module.named_buffers()]}
    for name, p in params.items():
        recorder.refs.setdefault(id(p), Ref("param", name))
    try:
        with torch.no_grad(), recorder:
            output = module(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    out_refs = tree_map(lambda x: recorder.refs.get(id(x), x) if isinstance(x, torch.Tensor) else x, output)
    graph = OpGraph(recorder.nodes, kept_inputs, params, recorder.consts, out_refs)
    made_outputs(graph)
    name_ops(graph, router)
    return graph, output


def made_outputs(graph: OpGraph) -> None:
    """The ops of values made inside the call (positions, tables, masks) are followed, not judged, up
    to the first op that mixes them with what the call was given. An output made from them alone (a
    wrapper's rotary tables from the positions it makes) has no such op: the made ops it comes from
    are rows (`OpNode.made`), judged against the reference's as any op."""
    todo = [r.at for r in graph.output_refs() if r.kind == "op" and graph.nodes[r.at].constant]
    while todo:
        node = graph.nodes[todo.pop()]
        if node.made:
            continue
        node.made = True
        todo.extend(r.at for r in node.inputs() if r.kind == "op" and graph.nodes[r.at].constant)


class _Call(nn.Module):
    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *values: Any) -> Any:
        return self.fn(*values)


def extend(graph: OpGraph, fn: Callable[..., Any], scope: str = "") -> OpGraph:
    """`graph` with `fn`'s ops appended, run on the graph's output tensors (in pytree order); its
    output becomes fn's. How a candidate's outputs are read as the reference's (NxDI's router's
    affinities as top-k weights), captured as ops of the candidate's like any other."""
    refs = graph.output_refs()
    tail, _ = capture_ops(_Call(fn), [graph.value_of(r) for r in refs], {})
    offset, consts = len(graph.nodes), len(graph.consts)

    def remap(x: Any) -> Any:
        if not isinstance(x, Ref):
            return x
        if x.kind == "input":
            return refs[x.at]
        if x.kind == "op":
            return Ref("op", x.at + offset, x.out)
        if x.kind == "const":
            return Ref("const", x.at + consts)
        raise ValueError(f"an appended op reads a parameter of its own ({x.at})")

    for node in tail.nodes:
        node.index += offset
        node.args, node.kwargs = tree_map(remap, node.args), tree_map(remap, node.kwargs)
        node._leaves = None
        node.scope = ".".join(p for p in (scope, node.scope) if p)
        graph.nodes.append(node)
    graph.consts.extend(tail.consts)
    graph.output = tree_map(remap, tail.output)
    return graph


_ROUTER_STEPS = {
    "mm": "logits",
    "softmax": "score",
    "sigmoid": "score",
    "topk": "topk",
    "sum": "renorm",
    "div": "renorm",
}


def name_ops(graph: OpGraph, router: bool | None = None) -> None:
    """Names stable across runs of the same code: the module path, the model function, the expert
    and weight read, and the op (`q_norm.rsqrt`, `apply_rotary_pos_emb.mul#2`,
    `expert[5].down_proj`); a scope with one computing op is named by the scope alone (`q_proj`).
    A router's ops are named by step: logits, score, bias, topk, renorm, scaling."""
    # casts are left out of the count: a scope's casts come and go with the dtype (bf16 upcasts)
    compute_by_scope = Counter(n.scope for n in graph.nodes if not n.layout and not n.function and n.kind != "_to_copy")
    seen: Counter[str] = Counter()
    for node in graph.nodes:
        kind = FRIENDLY.get(node.kind, node.kind)
        parts = [node.scope] if node.scope else []
        if node.function:
            parts.append(node.function)
        is_router = router if router is not None else bool(re.search(r"(^|\.)(gate|router)$", node.scope))
        if node.expert is not None:
            parts.append(f"expert[{node.expert}]")
        if is_router and not node.layout and not node.function:
            label = _ROUTER_STEPS.get(kind)
            if kind == "add" and node.param is not None:
                label = "bias"
            elif kind == "mul" and label is None:
                label = "scaling"
            parts.append(label or kind)
        elif node.param is not None and node.param.rsplit(".", 1)[-1] not in ("weight", "bias") and not node.layout:
            parts.append(node.param.rsplit(".", 1)[-1])
        else:
            alone = (  # the one computing op of its scope: named by the scope alone (`q_proj`)
                not node.layout
                and not node.function
                and node.expert is None
                and node.kind != "_to_copy"
                and compute_by_scope[node.scope] == 1
            )
            if not alone or not parts:
                parts.append(kind)
        base = ".".join(parts)
        seen[base] += 1
        node.name = base if seen[base] == 1 else f"{base}#{seen[base]}"
