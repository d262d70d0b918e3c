"""The inputs of the judge's metrics: tensors checked, walked in chunks, and viewed as a [tokens, X]
matrix or a matrix of expert ids; shared by the tensor, token, routing and logits metrics."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["F64", "INF", "as_index_matrix", "as_token_matrix", "blocks", "check_tensor", "chunks", "unravel"]

F64 = torch.float64
INF = math.inf


def check_tensor(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name}: complex tensors are not supported (dtype {t.dtype})")
    return t.detach()


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major multi-dimensional index of flat position ``flat`` in a tensor of ``shape``."""
    index: list[int] = []
    for size in reversed(shape):
        flat, rem = divmod(flat, size)
        index.append(rem)
    return tuple(reversed(index))


def blocks(shape: tuple[int, ...], chunk_elems: int) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """Row-major blocks ``t[prefix][start:stop]`` of a non-empty tensor (ndim >= 1), each <= chunk_elems."""
    inner = math.prod(shape[1:])
    if len(shape) == 1 or inner <= chunk_elems:
        rows = max(1, chunk_elems // inner)
        for start in range(0, shape[0], rows):
            yield (), start, min(start + rows, shape[0])
        return
    for i in range(shape[0]):
        for prefix, start, stop in blocks(shape[1:], chunk_elems):
            yield (i, *prefix), start, stop


def chunks(tensors: Sequence[torch.Tensor], chunk_elems: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Yield ``(flat_offset, [1-D chunk of each tensor])`` in row-major order; all tensors share one shape.

    Contiguous inputs are sliced as flat views (no copy). Otherwise blocks along the leading dimensions
    are reshaped one at a time, so a non-contiguous tensor is never copied as a whole.
    """
    numel = tensors[0].numel()
    if numel == 0:
        return
    if tensors[0].ndim == 0:
        yield 0, [t.reshape(1) for t in tensors]
        return
    if all(t.is_contiguous() for t in tensors):
        flats = [t.reshape(-1) for t in tensors]
        for start in range(0, numel, chunk_elems):
            yield start, [f[start : start + chunk_elems] for f in flats]
        return
    offset = 0
    for prefix, start, stop in blocks(tuple(tensors[0].shape), chunk_elems):
        parts = [t[prefix][start:stop].reshape(-1) for t in tensors]
        yield offset, parts
        offset += parts[0].numel()


def as_token_matrix(t: torch.Tensor, name: str) -> torch.Tensor:
    """[..., X] -> [T, X] (leading dims flattened); a 1-D tensor is a single token."""
    if t.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if t.ndim == 1:
        return t.reshape(1, -1)
    return t.reshape(-1, t.shape[-1])


def as_index_matrix(t: Any, name: str, num_experts: int) -> torch.Tensor:
    t = check_tensor(t, name)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer expert ids, got dtype {t.dtype}")
    ids = as_token_matrix(t, name).long()
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= num_experts).any())):
        raise ValueError(f"{name} holds expert ids outside [0, {num_experts})")
    return ids
