"""Nested call structures (tuples, lists, dicts of tensors and values): map over their leaves,
flatten them to their tensors and rebuild them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class RowMask(Protocol):
    """A 4-D attention mask `[B, 1, Q, K]` made a block of query rows at a time, never whole unless
    asked: `model.attention.LazyMask` (the mask a long prompt's recording makes) and
    `golden.spec.CausalRows` (a golden's causal mask, made again for a replay in blocks). Eager
    attention run in blocks of query rows (`model.attention`) takes one as it is."""

    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    def rows(self, start: int, stop: int) -> torch.Tensor | None: ...

    def materialize(self) -> torch.Tensor | None: ...


def whole_masks(obj: Any) -> Any:
    """`obj` with each `RowMask` in it made whole (for a call that takes tensors only)."""
    return map_structure(obj, lambda leaf: leaf.materialize() if isinstance(leaf, RowMask) else leaf)


@dataclass(frozen=True)
class CacheState:
    """What one decoder layer's KV cache holds when a decode step calls a module: its keys and values
    ([batch, heads, positions, head_dim]), and for a sliding-window layer its window and how many
    positions it has seen. A recorded call carries this instead of a cache object (which is never
    pickled); a backend turns it into a cache of the candidate's own kind (`model.calls`)."""

    layer: int
    keys: Any
    values: Any
    window: int | None = None  # sliding-window layers: the window
    seen: int | None = None  # sliding-window layers: positions seen so far (kept ones and dropped ones)


def map_structure(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every leaf (tensor, ParamRef, scalar) of a nested structure."""
    if isinstance(obj, CacheState):
        return replace(obj, keys=map_structure(obj.keys, fn), values=map_structure(obj.values, fn))
    if isinstance(obj, tuple):
        return tuple(map_structure(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_structure(v, fn) for v in obj]
    if isinstance(obj, dict):
        return {k: map_structure(v, fn) for k, v in obj.items()}
    return fn(obj)


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


def leaves(obj: Any) -> list[Any]:
    """The leaves of a nested structure in order (dict values in insertion order)."""
    if isinstance(obj, tuple | list):
        return [leaf for item in obj for leaf in leaves(item)]
    if isinstance(obj, dict):
        return [leaf for item in obj.values() for leaf in leaves(item)]
    if isinstance(obj, CacheState):
        return [obj.keys, obj.values]
    return [obj]


def flatten(obj: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """The leaves of a nested structure that `is_leaf` picks (default: tensors), in order, and a
    spec of everything else (plain dicts and lists; JSON-able when the other values are), so that
    `unflatten(spec, leaves)` rebuilds the structure. Other values (None, numbers, strings,
    dtypes...) are kept in the spec as they are."""
    pick = is_leaf or (lambda x: isinstance(x, torch.Tensor))
    leaves: list[Any] = []

    def walk(x: Any) -> Any:
        if pick(x):
            leaves.append(x)
            return {"t": "leaf", "i": len(leaves) - 1}
        if isinstance(x, tuple | list):
            return {"t": "tuple" if isinstance(x, tuple) else "list", "items": [walk(v) for v in x]}
        if isinstance(x, dict):
            return {"t": "dict", "items": {k: walk(v) for k, v in x.items()}}
        return {"t": "const", "value": x}

    return leaves, walk(obj)


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild what `flatten` took apart, with `leaves` in place of the original leaves."""
    kind = spec["t"]
    if kind == "leaf":
        return leaves[spec["i"]]
    if kind in ("tuple", "list"):
        items = [unflatten(s, leaves) for s in spec["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: unflatten(s, leaves) for k, s in spec["items"].items()}
    return spec["value"]
