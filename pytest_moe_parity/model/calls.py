"""Module calls as forward hooks see them on a live transformers model: the KV cache a call
receives (read as one layer's `CacheState`) and the keyword it takes it by, the tensors of a point's
output, and hooks that keep the first output of every point during one whole-model run (a
candidate's own forward, or the reference in another dtype), optionally steering the run."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import RecordError
from ..points import ATTENTION, Point
from ..tree import CacheState, leaves, map_structure

# A whole-model run's hook on each point's output: (point, output, outputs so far) -> the output to go on with.
Steer = Callable[[Point, Any, dict[str, Any]], Any]
# a whole-model run's consumer of each point's output as it is produced (see OutputCapture)
Seen = Callable[[Point, Any, dict[str, Any]], None]


def is_cache(obj: Any) -> bool:
    """A transformers KV cache object (duck-typed: its per-layer list and `update`)."""
    return hasattr(obj, "layers") and callable(getattr(obj, "update", None)) and not isinstance(obj, nn.Module)


# The names a transformers call takes its KV cache by: `cache` from transformers 5.24 on (where
# `past_key_values` is deprecated), `past_key_values` before.
CACHE_KWARGS = ("cache", "past_key_values")


@functools.cache
def _cache_kwarg_of(forward: Callable) -> str:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return CACHE_KWARGS[1]
    return CACHE_KWARGS[0] if CACHE_KWARGS[0] in params else CACHE_KWARGS[1]


def cache_kwarg(module: nn.Module) -> str:
    """The name `module` takes a KV cache by (`cache`, else `past_key_values`)."""
    return _cache_kwarg_of(type(module).forward)


def in_kept_dtype(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The inputs of a linear layer kept in a wider dtype than the model's (HY-V4's lm_head, kept in
    float32): cast to its weight's dtype, as the model's forward must have (a linear layer takes one
    dtype); any other call as it is."""
    if not isinstance(module, nn.Linear) or not module.weight.is_floating_point():
        return args, kwargs
    wide = module.weight.dtype

    def cast(leaf: Any) -> Any:
        narrower = isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype.itemsize < wide.itemsize
        return leaf.to(wide) if narrower else leaf

    return map_structure(args, cast), map_structure(kwargs, cast)


def with_cache_kwarg(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with a KV cache recorded under one transformers version's name passed by the name
    `module` takes (a golden of transformers 5.23 replayed on 5.24, or the other way round)."""
    name = cache_kwarg(module)
    other = next((k for k in CACHE_KWARGS if k != name and k in kwargs), None)
    if other is None or name in kwargs:
        return kwargs
    return {(name if k == other else k): v for k, v in kwargs.items()}


def cache_state(cache: Any, layer: int) -> CacheState:
    """What `layer` of a live cache holds now: its keys and values (and a sliding window's size and
    positions seen), as tensors to record."""
    entry = cache.layers[layer]
    keys = getattr(entry, "keys", None)
    if keys is None or not getattr(entry, "is_initialized", True):
        raise RecordError(f"layer {layer} of the KV cache is empty at a decode step; cannot record it")
    window = getattr(entry, "sliding_window", None)
    seen = getattr(entry, "cumulative_length", None)
    return CacheState(
        layer,
        keys,
        entry.values,
        window=int(window) if window is not None else None,
        seen=int(seen) if window is not None and seen is not None else None,
    )


def cache_key(pid: str) -> str:
    """Where a whole-model run's outputs (`OutputCapture.outputs`) keep the KV cache that a decode
    step's attention `pid` left in its layer: beside the point's output, under a name no point has."""
    return f"{pid}#cache"


def _cache_written(point: Point, args: tuple, kwargs: dict[str, Any]) -> CacheState | None:
    """A decode step's attention call: its layer of the live cache it was given, as the call left it
    (past and this step's write), copied to the CPU; None for other calls, or where no cache was passed
    or the layer holds nothing."""
    if point.component != ATTENTION or point.step is None or point.layer is None:
        return None
    caches = [v for v in (*args, *kwargs.values()) if is_cache(v)]
    if not caches or point.layer >= len(caches[0].layers):
        return None
    try:
        state = cache_state(caches[0], point.layer)
    except RecordError:
        return None
    return map_structure(state, lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensor leaves of a point's output, in order: what an origin's `leaf` indexes."""
    return [t for t in leaves(output) if isinstance(t, torch.Tensor)]


def _kept(point: Point, output: Any) -> Any:
    """A point's output as a whole-model run keeps it: detached on the CPU, attention weights
    dropped (the golden omits them too)."""
    if point.component == ATTENTION and isinstance(output, tuple) and len(output) > 1:
        output = (output[0], *(None for _ in output[1:]))
    # a copy: the model may change a tensor in place after returning it
    return map_structure(output, lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t)


class OutputCapture:
    """Forward hooks that keep the first output of every point during one whole-model run (the
    candidate's own forward in chain mode, or the reference in another dtype): `outputs[pid]`.
    `steer(point, output, outputs_so_far)` may return a replacement for a point's output, which the
    run then goes on with (see `replay.chain`). With `seen(point, output, outputs_so_far)`, each
    output is handed over as the forward produces it and `outputs` keeps only the points of the group
    (decoder layer, or model-level point) now running: a run over every layer then holds one layer's
    outputs, not the model's."""

    def __init__(
        self,
        model: nn.Module,
        points: list[Point],
        steer: Steer | None = None,
        seen: Seen | None = None,
        calls: dict[str, dict[int | str, Any]] | None = None,
    ):
        self.model = model
        self.points = points
        self.steer = steer
        self.seen = seen
        # per point, the strings its golden call passed, by position or keyword: of a module called more
        # than once per forward, the call with these is kept (MiMo-V2-Flash's rotary embedding runs
        # once per layer type, in an order that changes from one process to the next)
        self.calls = calls or {}
        self.outputs: dict[str, Any] = {}
        self._group: str | None = None
        self._done: set[str] = set()  # points handed over (their outputs may be gone)
        self._handles: list[Any] = []

    def __enter__(self) -> OutputCapture:
        for p in self.points:
            module = self.model.get_submodule(p.module)
            self._handles.append(module.register_forward_hook(self._hook(p), with_kwargs=True))
        return self

    def _is_the_call(self, point: Point, args: tuple, kwargs: dict[str, Any]) -> bool:
        for where, value in self.calls.get(point.id, {}).items():
            given = args[where] if isinstance(where, int) and where < len(args) else kwargs.get(str(where), value)
            if not isinstance(given, torch.Tensor) and given != value:
                return False
        return True

    def _hook(self, point: Point):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
            if point.id in self.outputs or point.id in self._done or not self._is_the_call(point, args, kwargs):
                return None
            if self.seen is not None and point.group != self._group:  # the group before is done with
                self.outputs.clear()
                self._group = point.group
            replaced = None
            if self.steer is not None:
                steered = self.steer(point, output, self.outputs)
                if steered is not output:
                    replaced = output = steered
            self.outputs[point.id] = _kept(point, output)
            written = _cache_written(point, args, kwargs)
            if written is not None:  # a decode step's attention: what it left in its layer's cache
                self.outputs[cache_key(point.id)] = written
            if self.seen is not None:
                self._done.add(point.id)
                self.seen(point, self.outputs[point.id], self.outputs)
            return replaced

        return hook

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# -- a recorded call's CacheState made a live cache of the candidate's own kind -------------------------


def cache_states(obj: Any) -> list[CacheState]:
    """The CacheStates of a call's args or kwargs (top level: where transformers passes its cache)."""
    items = obj.values() if isinstance(obj, dict) else obj
    return [x for x in items if isinstance(x, CacheState)]


def live_cache(state: CacheState, config: Any) -> Any:
    """A transformers `DynamicCache` built from the model's config (so sliding-window layers are
    sliding), holding `state` at its layer; the other layers stay empty."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if state.layer >= len(cache.layers):
        raise ValueError(f"the golden's cache is of layer {state.layer}; the candidate has {len(cache.layers)} layers")
    layer = cache.layers[state.layer]
    layer.lazy_initialization(state.keys, state.values)
    layer.keys, layer.values = state.keys.clone(), state.values.clone()  # the module appends to its copy
    if hasattr(layer, "cumulative_length") and state.seen is not None:
        layer.cumulative_length = state.seen
    return cache


def with_live_caches(args: list[Any], kwargs: dict[str, Any], config: Any) -> tuple[list, dict, list[tuple]]:
    """args and kwargs with every CacheState replaced by a live cache; and (state, cache) pairs to
    read the writes back from."""
    pairs: list[tuple[CacheState, Any]] = []

    def live(x: Any) -> Any:
        if isinstance(x, CacheState):
            cache = live_cache(x, config)
            pairs.append((x, cache))
            return cache
        return x

    return [live(a) for a in args], {k: live(v) for k, v in kwargs.items()}, pairs


def next_inputs(tokens: torch.Tensor, padding: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The inputs of the decode step that feeds `tokens` ([B], a token per row), and, for a padded
    batch, its attention mask grown by the new position and each row's own position (how many real
    tokens it holds so far): `padding` (`attention_mask`, `position_ids` [B, T]) is updated in place to
    the step's. What generate() feeds; the recorder and the candidate's own decode feed the same."""
    feed = {"input_ids": tokens.reshape(-1, 1).to(torch.long)}
    if padding is not None and "attention_mask" in padding:
        mask = padding["attention_mask"]
        positions = mask.sum(-1, keepdim=True)  # the real tokens so far: the new token's position
        padding["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        padding["position_ids"] = positions.to(torch.long)
        feed.update(attention_mask=padding["attention_mask"], position_ids=padding["position_ids"])
    return feed
