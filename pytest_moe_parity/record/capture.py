"""Record every capture point's call (args, kwargs, output) with forward hooks, one layer at a
time. Parameters and buffers passed as arguments are recorded by name (see `golden.spec`); an
input that is an earlier point's output, or the sum of two (a residual connection), is recorded
with that origin, so that a chained replay can feed the candidate's own output in its place."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import RecordError
from ..golden.spec import (
    Flattener,
    Spec,
    causal_mask_spec,
    mask_shaped,
    named_tensor,
    select_tokens,
    spec_tensor_keys,
)
from ..golden.writer import Recorded
from ..model.calls import cache_state, is_cache, output_tensors
from ..points import ATTENTION, Point
from ..tree import RowMask, map_structure

# How many of the most recent point outputs a residual sum is looked for among.
_SUM_CANDIDATES = 12


class Origins:
    """The outputs of the points recorded so far (the current layer's, the previous layer's closing
    point's, and model-level points'), to name the origin of a later point's input: the same values
    (a tensor or a view of it: same storage, same elements) or the sum of two. Every match is
    verified by value, so an address reused after a free can never name a wrong origin.

    What a layer reads of the one before is its residual stream, the previous layer's closing
    output: the previous layer's other outputs are let go when a layer starts (held, they kept a
    second layer of activations alive: 2 x 110 MB at 8k tokens of a hidden-512 model)."""

    def __init__(self) -> None:
        self._by_group: dict[str, list[tuple[str, int, torch.Tensor]]] = {}
        self._layer_groups: list[str] = []

    def add(self, point: Point, output: Any) -> None:
        group = self._by_group.setdefault(point.group, [])
        if point.layer is not None and point.group not in self._layer_groups:
            self._layer_groups.append(point.group)
            for old in self._layer_groups[:-2]:  # the layer before the previous one: nothing of it
                self._by_group.pop(old, None)
            del self._layer_groups[:-2]
            if len(self._layer_groups) == 2:  # the previous layer: its closing point's outputs only
                previous = self._by_group.get(self._layer_groups[0], [])
                if previous:
                    self._by_group[self._layer_groups[0]] = [e for e in previous if e[0] == previous[-1][0]]
        for i, t in enumerate(output_tensors(output)):
            if t.numel():
                group.append((point.id, i, t))

    def _recent(self) -> list[tuple[str, int, torch.Tensor]]:
        return [entry for entries in self._by_group.values() for entry in entries]

    def find(self, x: torch.Tensor) -> Spec | None:
        if not x.numel():
            return None
        recent = self._recent()
        for pid, i, t in reversed(recent):
            same_storage = (
                t.data_ptr() == x.data_ptr()
                and t.numel() == x.numel()
                and t.dtype == x.dtype
                and t.is_contiguous()
                and x.is_contiguous()
            )
            if t is x or (same_storage and torch.equal(t.reshape(-1), x.reshape(-1))):
                return {"point": pid, "leaf": i}
        if not x.is_floating_point():
            return None
        same = [e for e in recent if e[2].numel() == x.numel() and e[2].dtype == x.dtype][-_SUM_CANDIDATES:]
        for a in range(len(same)):
            for b in range(a + 1, len(same)):
                (pa, ia, ta), (pb, ib, tb) = same[a], same[b]
                if torch.equal(ta.reshape(x.shape) + tb.reshape(x.shape), x):
                    return {"sum": [{"point": pa, "leaf": ia}, {"point": pb, "leaf": ib}]}
        return None


def held_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` with its values: where accelerate offloaded it (a meta tensor
    outside its module's forward), the copy its offload hook reads back for each forward."""
    t = named_tensor(model, name)
    if t.device.type != "meta":
        return t
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        hook = getattr(model.get_submodule(".".join(parts[:i])), "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            weights = getattr(h, "weights_map", None)
            if weights is None:
                continue
            try:
                return weights[".".join(parts[i:])]
            except KeyError:
                continue
    raise RecordError(f"{name} is on the meta device and no accelerate offload hook holds its values")


class ParamNames:
    """Names the model's parameters and buffers when a point receives one as an argument (recorded
    by name, not by value). Matched by identity, never by `id` alone: accelerate's offload hooks put
    a fresh tensor in a module's slot for each forward and a meta one after it, so the address of a
    tensor seen at load time can be reused by an activation. Tensors materialised that way are found
    in the slots of the running point's module and its ancestors (`enter`), where the caller's own
    parameters live."""

    def __init__(self, model: nn.Module):
        self.model = model
        # The objects are held, so no other tensor can take their address while this lives.
        self._known: dict[int, tuple[str, torch.Tensor]] = {}
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
            self._known.setdefault(id(t), (name, t))
        self._scope: list[tuple[str, nn.Module]] = []

    def enter(self, module_path: str) -> None:
        parts = module_path.split(".") if module_path else []
        prefixes = [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
        self._scope = [(prefix, self.model.get_submodule(prefix)) for prefix in prefixes]

    def __call__(self, t: torch.Tensor) -> str | None:
        known = self._known.get(id(t))
        if known is not None and known[1] is t:
            return known[0]
        for prefix, module in self._scope:
            for slots in (module._parameters, module._buffers):
                for name, value in slots.items():
                    if value is t:
                        return f"{prefix}.{name}" if prefix else name
        return None


class SliceDone(Exception):
    """Raised by the hook that closes the last group a recording needs (`GoldenRecorder(stop_after=...)`):
    the rest of the forward would record nothing."""


class GoldenRecorder:
    """Forward hooks on every capture point. `on_group` receives a finished group (one layer, or one
    model-level point) as soon as its last point returns, so memory holds one layer at a time. With
    `stop_after`, closing that group raises SliceDone out of the forward."""

    def __init__(
        self,
        model: nn.Module,
        points: list[Point],
        on_group: Callable[[str, list[Recorded]], None],
        stop_after: str | None = None,
        padding: list[list[int]] | None = None,
        tokens: tuple[int, int, list[int]] | None = None,
    ):
        self.model = model
        self.stop_after = stop_after
        # --capture-tokens: (batch, tokens, positions): outputs kept at those positions, inputs not stored
        self.tokens = tokens
        self.padding = padding  # the batch's attention mask, over which a causal mask is made again
        # each input tensor checked once for a causal mask (the same mask reaches every layer): its
        # spec or None, and the tensor itself (so that its id is not reused while the recorder lives)
        self._masks: dict[tuple[int, int], tuple[Spec | None, torch.Tensor]] = {}
        self.points = points
        self.on_group = on_group
        self.param_names = ParamNames(model)
        self._handles: list[Any] = []
        self._pending: dict[str, tuple[list[Any], dict[str, Any], Flattener, float]] = {}
        self._group_records: dict[str, list[Recorded]] = {}
        self._group_flattener: dict[str, Flattener] = {}
        self._recorded: dict[str, Recorded] = {}
        self._closing: dict[str, str] = {}
        self.origins = Origins()
        for p in points:  # the last point of a group closes it (a layer's `output`)
            self._closing[p.group] = p.id

    def __enter__(self) -> GoldenRecorder:
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
            fl = self._group_flattener[group] = Flattener(self.param_names)
        return fl

    def _inputs_flattener(self, group: str) -> Flattener:
        """The group's flattener, naming the origin of each input tensor and storing a causal mask
        as the spec that makes it again."""
        fl = self._flattener(group)
        fl.source = self.origins.find
        fl.compact = self._mask_spec
        return fl

    def _mask_spec(self, t: torch.Tensor | RowMask) -> Spec | None:
        if not mask_shaped(t):  # (and not held: every input tensor kept here kept a layer alive)
            return None
        seen = (id(t), getattr(t, "_version", 0))  # a mask passed to every layer is compared once
        found = self._masks.get(seen)
        if found is None:
            found = self._masks[seen] = (causal_mask_spec(t, self.padding), t)
        return dict(found[0]) if found[0] is not None else None

    def _outputs_flattener(self, group: str) -> Flattener:
        fl = self._flattener(group)
        fl.source = None
        fl.compact = None
        return fl

    def _pre(self, point: Point):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if point.id in self._recorded or point.id in self._pending:
                rec = self._recorded.get(point.id)
                if rec is not None:
                    rec.calls += 1
                return
            fl = self._inputs_flattener(point.group)
            self.param_names.enter(point.module)
            if self.tokens is not None:  # --capture-tokens: a golden judged chained, on its own run's inputs
                self._pending[point.id] = ([], {}, fl, time.perf_counter())
                return
            if point.step is not None:  # a decode step: the cache as the tensors of this layer
                args = tuple(cache_state(a, point.layer) if is_cache(a) else a for a in args)
                kwargs = {k: cache_state(v, point.layer) if is_cache(v) else v for k, v in kwargs.items()}
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
            fl = self._outputs_flattener(point.group)
            self.param_names.enter(point.module)
            if self.tokens is not None:
                batch, seq, positions = self.tokens
                output = map_structure(output, lambda t: select_tokens(t, batch, seq, positions))
            if point.component == ATTENTION and isinstance(output, tuple) and len(output) > 1:
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
                fl.tensors[key] = fl.keep(held_tensor(self.model, point.score_bias))
                rec.extras["score_bias"] = key
            caches = [v for v in (*args, *kwargs.values()) if is_cache(v)]
            if point.component == ATTENTION and point.step is not None and caches:
                after = cache_state(caches[0], point.layer)  # what the attention wrote: compared too
                for name in ("keys", "values"):
                    key = f"{point.id}/cache_after.{name}"
                    fl.tensors[key] = fl.keep(getattr(after, name))
                    rec.extras[f"cache_after.{name}"] = key
            if self.tokens is None:  # (--capture-tokens stores no inputs to name the origins of)
                self.origins.add(point, output if point.component != "attention" else output_tensors(output)[:1])
            self._recorded[point.id] = rec
            self._group_records.setdefault(point.group, []).append(rec)
            if self._closing[point.group] == point.id:
                self._flush(point.group)
                if point.group == self.stop_after:
                    raise SliceDone(point.group)

        return hook

    def _flush(self, group: str) -> None:
        records = self._group_records.pop(group, [])
        fl = self._group_flattener.pop(group)
        for rec in records:
            keys = set(spec_tensor_keys({"t": "list", "items": [*rec.args, *rec.kwargs.values(), rec.output]}))
            keys.update(rec.extras.values())
            rec.tensors = {k: fl.tensors[k] for k in sorted(keys)}
        self.on_group(group, records)
        for rec in records:  # written: a recording holds the captures of the layers in flight, not all
            rec.tensors = {}

    def finish(self) -> list[str]:
        """Flush groups whose closing point never ran; return the ids of points that never ran."""
        for group in list(self._group_records):
            self._flush(group)
        return [p.id for p in self.points if p.id not in self._recorded]
