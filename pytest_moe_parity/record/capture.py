"""Record every capture point's call (args, kwargs, output) with forward hooks, and rebuild the
call from the record for replay. Parameters and buffers passed as arguments are recorded by name
and, on replay, taken from the model under test: only activations are golden."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .archs import CapturePoint

# A spec is plain JSON describing a nested call structure; tensors are referenced by key.
Spec = dict[str, Any]


class RecordError(RuntimeError):
    """A module call cannot be recorded faithfully (an argument type we cannot store)."""


@dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of the model that a module received as an argument."""

    name: str


@dataclass
class Recorded:
    """One point's call as recorded: the structure specs plus the tensors they reference."""

    point: CapturePoint
    args: list[Spec]
    kwargs: dict[str, Spec]
    output: Spec
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Reference values kept for diagnosis only, never fed to the candidate (e.g. the golden
    # score-correction bias, to tell a routing tie from a real flip): name -> tensor key.
    extras: dict[str, str] = field(default_factory=dict)
    calls: int = 1
    seconds: float = 0.0


def dtype_name(dtype: torch.dtype | str) -> str:
    """`torch.bfloat16` (or "torch.bfloat16") -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, *, floating: bool = False) -> torch.dtype:
    """A torch dtype from its name; ValueError if there is none (or, with `floating`, if it is not
    a floating-point dtype)."""
    dtype = getattr(torch, dtype_name(name), None)
    if not isinstance(dtype, torch.dtype) or (floating and not dtype.is_floating_point):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _scalar_spec(value: Any) -> Spec:
    if isinstance(value, float) and not math.isfinite(value):
        return {"t": "float", "value": repr(value)}
    return {"t": "value", "value": value}


class Flattener:
    """Turns a nested call structure into a spec, copying tensors to CPU under stable keys."""

    def __init__(self, params: dict[int, str], keep: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.params = params
        self.tensors: dict[str, torch.Tensor] = {}
        # (id, version) of a tensor already stored -> key; the original is kept alive so that its
        # id cannot be reused by another tensor while this flattener lives.
        self._seen: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
        self.keep = keep or (lambda t: t.detach().to("cpu", copy=True).contiguous())

    def flatten(self, obj: Any, key: str) -> Spec:
        if isinstance(obj, torch.Tensor):
            name = self.params.get(id(obj))
            if name is not None:
                return {"t": "param", "name": name}
            seen = self._seen.get((id(obj), obj._version))
            if seen is not None:
                return {"t": "tensor", "key": seen[0]}
            self.tensors[key] = self.keep(obj)
            self._seen[(id(obj), obj._version)] = (key, obj)
            return {"t": "tensor", "key": key}
        if obj is None:
            return {"t": "none"}
        if isinstance(obj, bool | int | float | str):
            return _scalar_spec(obj)
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "value": dtype_name(obj)}
        if isinstance(obj, tuple | list):
            kind = "tuple" if isinstance(obj, tuple) else "list"
            return {"t": kind, "items": [self.flatten(v, f"{key}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise RecordError(f"{key}: dict with non-string keys cannot be recorded")
            return {"t": "dict", "items": {k: self.flatten(v, f"{key}.{k}") for k, v in obj.items()}}
        raise RecordError(
            f"{key}: cannot record an argument of type {type(obj).__name__} "
            "(record with use_cache=False so that no cache object is passed between layers)"
        )


def spec_tensor_keys(spec: Spec) -> Iterator[str]:
    """The keys of every tensor a spec references."""
    kind = spec["t"]
    if kind == "tensor":
        yield spec["key"]
    elif kind in ("tuple", "list", "dict"):
        items = spec["items"].values() if kind == "dict" else spec["items"]
        for item in items:
            yield from spec_tensor_keys(item)


def build(spec: Spec, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild a recorded structure; parameters come back as ParamRef placeholders."""
    kind = spec["t"]
    if kind == "tensor":
        return tensors[spec["key"]]
    if kind == "param":
        return ParamRef(spec["name"])
    if kind == "none":
        return None
    if kind == "value":
        return spec["value"]
    if kind == "float":
        return float(spec["value"])
    if kind == "dtype":
        return getattr(torch, spec["value"])
    if kind == "omitted":
        return None
    if kind in ("tuple", "list"):
        items = [build(s, tensors) for s in spec["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: build(s, tensors) for k, s in spec["items"].items()}
    raise ValueError(f"unknown spec kind {kind!r}")


def map_structure(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every leaf (tensor, ParamRef, scalar) of a nested structure."""
    if isinstance(obj, tuple):
        return tuple(map_structure(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_structure(v, fn) for v in obj]
    if isinstance(obj, dict):
        return {k: map_structure(v, fn) for k, v in obj.items()}
    return fn(obj)


def resolve_params(obj: Any, model: nn.Module) -> Any:
    """Replace ParamRef placeholders by the named parameter or buffer of `model` (the candidate)."""
    return map_structure(obj, lambda leaf: _named_tensor(model, leaf.name) if isinstance(leaf, ParamRef) else leaf)


def _named_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer called `name` (dotted path from the model root)."""
    owner, _, attr = name.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    if attr in mod._parameters:
        return mod._parameters[attr]
    return mod.get_buffer(attr)


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The primary tensor of a module output: the tensor itself, or the first tensor of a tuple."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, tuple | list):
        for item in obj:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def parameter_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    return names


class Recorder:
    """Forward hooks on every capture point. `on_group` receives a finished group (one layer, or one
    model-level point) as soon as its last point returns, so memory holds one layer at a time."""

    def __init__(
        self,
        model: nn.Module,
        points: list[CapturePoint],
        on_group: Callable[[str, list[Recorded]], None],
    ):
        self.model = model
        self.points = points
        self.on_group = on_group
        self.params = parameter_names(model)
        self._handles: list[Any] = []
        self._pending: dict[str, tuple[list[Any], dict[str, Any], Flattener, float]] = {}
        self._group_records: dict[str, list[Recorded]] = {}
        self._group_flattener: dict[str, Flattener] = {}
        self._recorded: dict[str, Recorded] = {}
        self._closing: dict[str, str] = {}
        for p in points:  # the last point of a group closes it (a layer's `output`)
            self._closing[p.group] = p.id

    def __enter__(self) -> Recorder:
        for p in self.points:
            module = self.model.get_submodule(p.module)
            self._handles.append(module.register_forward_pre_hook(self._pre(p), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(p), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _flattener(self, group: str) -> Flattener:
        fl = self._group_flattener.get(group)
        if fl is None:
            fl = self._group_flattener[group] = Flattener(self.params)
        return fl

    def _pre(self, point: CapturePoint):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if point.id in self._recorded or point.id in self._pending:
                rec = self._recorded.get(point.id)
                if rec is not None:
                    rec.calls += 1
                return
            fl = self._flattener(point.group)
            arg_specs = [fl.flatten(a, f"{point.id}/args.{i}") for i, a in enumerate(args)]
            kw_specs = {k: fl.flatten(v, f"{point.id}/kwargs.{k}") for k, v in kwargs.items()}
            self._pending[point.id] = (arg_specs, kw_specs, fl, time.perf_counter())

        return hook

    def _post(self, point: CapturePoint):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            pending = self._pending.pop(point.id, None)
            if pending is None:
                return
            arg_specs, kw_specs, fl, started = pending
            if point.component == "attention" and isinstance(output, tuple) and len(output) > 1:
                # (out, attn_weights): the weights are O(heads·T²) and never compared.
                out_spec = {
                    "t": "tuple",
                    "items": [fl.flatten(output[0], f"{point.id}/out.0")] + [{"t": "omitted"} for _ in output[1:]],
                }
            else:
                out_spec = fl.flatten(output, f"{point.id}/out")
            rec = Recorded(point, arg_specs, kw_specs, out_spec, seconds=time.perf_counter() - started)
            if point.score_bias:
                key = f"{point.id}/golden.score_bias"
                fl.tensors[key] = fl.keep(_named_tensor(self.model, point.score_bias))
                rec.extras["score_bias"] = key
            self._recorded[point.id] = rec
            self._group_records.setdefault(point.group, []).append(rec)
            if self._closing[point.group] == point.id:
                self._flush(point.group)

        return hook

    def _flush(self, group: str) -> None:
        records = self._group_records.pop(group, [])
        fl = self._group_flattener.pop(group)
        for rec in records:
            keys = set(spec_tensor_keys({"t": "list", "items": [*rec.args, *rec.kwargs.values(), rec.output]}))
            keys.update(rec.extras.values())
            rec.tensors = {k: fl.tensors[k] for k in sorted(keys)}
        self.on_group(group, records)

    def finish(self) -> list[str]:
        """Flush groups whose closing point never ran; return the ids of points that never ran."""
        for group in list(self._group_records):
            self._flush(group)
        return [p.id for p in self.points if p.id not in self._recorded]
