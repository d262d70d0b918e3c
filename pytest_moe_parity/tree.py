"""Nested call structures (tuples, lists, dicts of tensors and values): map over their leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def map_structure(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to every leaf (tensor, ParamRef, scalar) of a nested structure."""
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
    return [obj]
