"""Record every capture point's call (args, kwargs, output) with forward hooks, one layer at a
time. Parameters and buffers passed as arguments are recorded by name (see `golden.spec`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch import nn

from ..golden.spec import Flattener, named_tensor, spec_tensor_keys
from ..golden.writer import Recorded
from ..points import Point


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
        points: list[Point],
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

    def _pre(self, point: Point):
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

    def _post(self, point: Point):
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
                fl.tensors[key] = fl.keep(named_tensor(self.model, point.score_bias))
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
