"""Sliding-window layers on vLLM's paged cache: transformers' cache of such a layer holds only its
window - 1 latest positions; vLLM's paged cache keeps every position and its attention reads only the
window (the layer's own `sliding_window`, which vLLM's metadata builder takes from the layer)."""

from __future__ import annotations

from ...tree import CacheState


def first_held(past: CacheState | None) -> int:
    """The position of the first token a decode step's past holds: 0, or for a sliding-window layer the
    positions it has dropped (its past goes in at the slots of its own positions; the slots before it
    are left empty, outside vLLM's window, so a window read wrong reads them)."""
    if past is None or past.window is None:
        return 0
    return past.seen - past.keys.shape[2]


def as_golden(cache: CacheState, past: CacheState, new: int) -> CacheState:
    """A layer's cache after a call as transformers keeps it: all of it, or for a sliding-window layer
    its window - 1 latest positions."""
    if past.window is None:
        return cache
    kept = past.window - 1
    keys, values = cache.keys[:, :, -kept:], cache.values[:, :, -kept:]
    return CacheState(cache.layer, keys, values, past.window, past.seen + new)
