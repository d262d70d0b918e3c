"""The reference's ops of a point, kept with the golden (`moe-parity drill-ops`): for a drill where
the golden's model cannot run (the Neuron SDK's stack, whose transformers 4.57 lays the model out
otherwise than the recording's transformers 5), and so that a drill does not rerun the reference.

`<golden>/drill/<point>.json` holds the op graphs' structure (ops by name, their arguments with
tensors as references, module paths, names), `<point>.safetensors` their tensors: one graph in
float32 and one per dtype the reference was also run in (the ops' noise floor). No pickle: the
file is read as data, its ops looked up in torch's op registry by name."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput
from ..tree import leaves, map_structure
from .capture import LAYOUT_OPS, Opaque, OpGraph, OpNode, Ref, op_kind, op_name, resolve_op

FORMAT = 1
DIR = "drill"
# A view's output is not stored (it would be a copy of what it views): it is taken again at reading.
VIEWS = frozenset(
    ["view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "slice",
     "select", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind", "as_strided", "_reshape_alias",
     "unflatten", "flatten", "movedim", "narrow", "lift_fresh", "lift"]
)  # fmt: skip
RECOMPUTE = "view"


class StoreError(BadInput, ValueError):
    """A stored capture that cannot be read back (a newer format, an op this torch lacks)."""


def paths(golden_root: Path, point: str) -> tuple[Path, Path]:
    return golden_root / DIR / f"{point}.json", golden_root / DIR / f"{point}.safetensors"


def stored_points(golden_root: Path) -> list[str]:
    """The points whose reference ops the golden holds."""
    folder = golden_root / DIR
    return sorted(p.name.removesuffix(".json") for p in folder.glob("*.json")) if folder.is_dir() else []


def stored_dtypes(golden_root: Path, point: str) -> list[str]:
    """The dtypes a point's stored capture has besides float32 ([] where none is stored)."""
    meta_path, _ = paths(golden_root, point)
    if not meta_path.is_file():
        return []
    return [d for d in json.loads(meta_path.read_text())["graphs"] if d != "float32"]


def save(golden_root: Path, point: str, graphs: dict[str, OpGraph]) -> int:
    """Writes a point's graphs (dtype name -> graph, float32 among them), with each op's noise in
    each dtype and its norm (`engine.Reference`: computed once here, not at every drill); returns
    the bytes written. Written to temporary names and renamed: a capture is whole or absent."""
    from safetensors.torch import save_file

    from .engine import Reference

    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def tensor(t: torch.Tensor, key: str) -> str:
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if identity not in seen:
            seen[identity] = key
            tensors[key] = t.detach().to("cpu").contiguous().clone()
            if not t.is_contiguous() and _dense(t):  # kernels follow strides: kept
                strides[key] = list(t.stride())
        return seen[identity]

    strides: dict[str, list[int]] = {}
    meta: dict[str, Any] = {"format": FORMAT, "point": point, "graphs": {}, "strides": strides}
    for dtype, graph in graphs.items():
        p = f"{dtype}/"

        def values(xs: list, prefix: str, p: str = p) -> list:
            return [tensor(x, f"{p}{prefix}{i}") if isinstance(x, torch.Tensor) else _enc(x) for i, x in enumerate(xs)]

        figures = Reference.of(graphs["float32"], graph) if dtype != "float32" else None
        meta["graphs"][dtype] = {
            "low_of": {str(r): n.index if n else None for r, n in figures.low_of.items()} if figures else None,
            "noise": {str(i): v for i, v in figures.noise.items()} if figures else None,
            "norm": {str(i): v for i, v in figures.norm.items()} if figures else None,
            "inputs": values(graph.inputs, "input"),
            "params": {n: tensor(v, f"{p}param.{n}") for n, v in graph.params.items()},
            "consts": values(graph.consts, "const"),
            "output": _enc(graph.output),
            "nodes": [
                {
                    "func": op_name(n.func),
                    "args": _enc(n.args),
                    "kwargs": _enc(n.kwargs),
                    "outputs": RECOMPUTE if n.kind in VIEWS else values(n.outputs, f"op{n.index}."),
                    "scope": n.scope,
                    "function": n.function,
                    "expert": n.expert,
                    "param": n.param,
                    "mutates": list(n.mutates),
                    "name": n.name,
                    "constant": n.constant,
                    "made": n.made,
                }
                for n in graph.nodes
            ],
        }
    meta_path, data_path = paths(golden_root, point)
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_meta, tmp_data = meta_path.with_suffix(".json.tmp"), data_path.with_suffix(".safetensors.tmp")
    save_file(tensors, str(tmp_data))
    tmp_meta.write_text(json.dumps(meta))
    tmp_data.replace(data_path)
    tmp_meta.replace(meta_path)
    return data_path.stat().st_size + meta_path.stat().st_size


def load(golden_root: Path, point: str, dtype: str) -> Any:
    """A point's stored reference (`engine.Reference`: its float32 graph and its graph in `dtype`),
    or None where none is stored. The weights are read when an op is run again on them (a drill
    rarely does), the rest at once."""
    from safetensors import safe_open

    from .engine import Reference

    meta_path, data_path = paths(golden_root, point)
    if not meta_path.is_file() or not data_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise StoreError(f"{meta_path} is of format {meta.get('format')}, this version reads {FORMAT}: record it again")
    if dtype not in meta["graphs"]:
        return None
    strides = meta["strides"]
    weights = {key for g in meta["graphs"].values() for key in g["params"].values()}
    tensors = _Tensors(data_path, strides)
    with safe_open(str(data_path), framework="pt") as f:  # the float32 run's values at once, the rest when used
        for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            if key.startswith("float32/") and key not in weights:
                tensors[key] = _strided(f.get_tensor(key), strides.get(key))
    low = meta["graphs"][dtype]
    figures = None
    if low.get("low_of") is not None:  # each op's run in the candidate's dtype, noise and norm: as recorded
        figures = tuple({int(i): v for i, v in low[k].items()} for k in ("low_of", "noise", "norm"))
    return Reference.of(_graph(meta["graphs"]["float32"], tensors), _graph(low, tensors, lazy=True), figures)


class _Tensors(dict):
    """A stored capture's tensors by key: read at once, or (weights) on first use."""

    def __init__(self, path: Path, strides: dict[str, list[int]]):
        super().__init__()
        self.path, self.strides = path, strides

    def __missing__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            self[key] = _strided(f.get_tensor(key), self.strides.get(key))
        return self[key]


class _Params(dict):
    """A graph's weights by name, each read from the store when first asked for."""

    def __init__(self, keys: dict[str, str], tensors: _Tensors):
        super().__init__()
        self.keys_of, self.tensors = keys, tensors

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in self.keys_of:
            raise KeyError(name)
        self[name] = self.tensors[self.keys_of[name]]
        return self[name]

    def __iter__(self):
        return iter(self.keys_of)

    def __len__(self) -> int:
        return len(self.keys_of)

    def __contains__(self, name: object) -> bool:
        return name in self.keys_of

    def items(self):  # type: ignore[override]
        return [(name, self[name]) for name in self.keys_of]


class _View(list):
    """A stored op's outputs, made when first read: a view taken again of what it viewed (a view of
    a weight would otherwise read the weight), or values read from the store."""

    def __init__(self, make: Callable[[], Any]):
        super().__init__()
        self.make: Callable[[], Any] | None = make

    def _taken(self) -> _View:
        if self.make is not None:
            make, self.make = self.make, None
            self.extend(t.detach() if isinstance(t, torch.Tensor) else t for t in leaves(make()))
        return self

    def __getitem__(self, i):  # type: ignore[override]
        return list.__getitem__(self._taken(), i)

    def __iter__(self):
        return list.__iter__(self._taken())

    def __len__(self) -> int:
        return list.__len__(self._taken())


def _strided(t: torch.Tensor, stride: list[int] | None) -> torch.Tensor:
    return t if stride is None else torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)


def op_names(golden_root: Path, point: str) -> list[str] | None:
    """The names of a point's stored reference ops that are rows (the drill items), read without
    its tensors; None where none are stored."""
    meta_path, _ = paths(golden_root, point)
    if not meta_path.is_file():
        return None
    nodes = json.loads(meta_path.read_text())["graphs"]["float32"]["nodes"]
    return [n["name"] for n in nodes if (not n["constant"] or n.get("made")) and op_kind(n["func"]) not in LAYOUT_OPS]


def _dense(t: torch.Tensor) -> bool:
    """Whether a tensor's strides lay its elements out without gaps or overlaps (a permutation)."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.shape[d] != 1:
            if t.stride(d) != expected:
                return False
            expected *= t.shape[d]
    return True


def _graph(meta: dict[str, Any], tensors: _Tensors, lazy: bool = False) -> OpGraph:
    """A stored graph; `lazy`: its ops' outputs read when first used (the reference's run in the
    candidate's dtype: a drill reads its figures, kept in the JSON, and rarely its values)."""

    def values(xs: list) -> list:
        return [tensors[x] if isinstance(x, str) else _dec(x) for x in xs]

    graph = OpGraph([], values(meta["inputs"]), _Params(meta["params"], tensors), values(meta["consts"]),
                    _dec(meta["output"]))  # fmt: skip

    def value(x: Any) -> Any:
        return graph.value_of(x) if isinstance(x, Ref) else x

    for i, n in enumerate(meta["nodes"]):
        try:
            func = resolve_op(n["func"])
        except (AttributeError, ValueError, RuntimeError):
            raise StoreError(f"the stored op {n['func']} is not in this torch's op registry") from None
        node = OpNode(
            i, func, op_kind(func), _dec(n["args"]), _dec(n["kwargs"]), [], n["scope"], n["function"], n["expert"],
            n["param"], tuple(n["mutates"]), n["name"], n["constant"], made=n.get("made", False),
        )  # fmt: skip
        if n["outputs"] == RECOMPUTE:  # a view, taken again of what it viewed when first read
            node.outputs = _View(lambda node=node: node.func(*map_structure(node.args, value),
                                                              **map_structure(node.kwargs, value)))  # fmt: skip
        elif lazy:
            node.outputs = _View(lambda stored=n["outputs"]: values(stored))
        else:
            node.outputs = values(n["outputs"])
        graph.nodes.append(node)
    return graph


_TYPES = {
    "dtype": lambda s: getattr(torch, s),
    "device": torch.device,
    "layout": lambda s: getattr(torch, s),
    "memory_format": lambda s: getattr(torch, s),
}


def _enc(x: Any) -> Any:
    """An op's argument as JSON (tensors were replaced by refs at capture)."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, Ref):
        return {"ref": [x.kind, x.at, x.out]}
    if isinstance(x, Opaque):
        return {"opaque": x.type}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout | torch.memory_format):
        kind = "layout" if isinstance(x, torch.layout) else "memory_format"
        return {kind: str(x).removeprefix("torch.")}
    if isinstance(x, torch.Size):
        return {"size": list(x)}
    if isinstance(x, list):
        return [_enc(v) for v in x]
    if isinstance(x, tuple):
        return {"tuple": [_enc(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[_enc(k), _enc(v)] for k, v in x.items()]}
    raise StoreError(f"an op argument of type {type(x).__name__} cannot be stored")


def _dec(x: Any) -> Any:
    if isinstance(x, list):
        return [_dec(v) for v in x]
    if not isinstance(x, dict):
        return x
    (kind, value), *_ = x.items()
    if kind == "ref":
        return Ref(value[0], value[1], value[2])
    if kind == "tuple":
        return tuple(_dec(v) for v in value)
    if kind == "dict":
        return {_dec(k): _dec(v) for k, v in value}
    if kind == "size":
        return torch.Size(value)
    if kind == "float":
        return float(value)
    if kind == "opaque":
        return Opaque(value)
    return _TYPES[kind](value)
