"""Decode steps: the KV cache a recorded call carries as a `CacheState` (tensors only) becomes a cache
object of the candidate's own kind for the call (what the module wrote into it is read back with
`model.calls.cache_state`, as the recorder reads the reference's)."""

from __future__ import annotations

from typing import Any

from ..tree import CacheState


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
