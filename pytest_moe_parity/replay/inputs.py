"""Golden inputs as the candidate receives them: cast to its dtype and device."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..golden import GoldenRecord
from ..golden.spec import ParamRef
from ..tree import map_structure


def _cast_input(t: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Golden tensors to the candidate's dtype and device. Additive-mask entries at the golden
    dtype's minimum map to the candidate dtype's minimum, as the candidate would build them."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point() and t.dtype != dtype:
        low = torch.finfo(t.dtype).min
        masked = t == low
        t = t.to(dtype)
        if bool(masked.any()):
            t = t.masked_fill(masked, torch.finfo(dtype).min)
    return t.to(device)


def cast_inputs(obj: Any, dtype: torch.dtype, device: torch.device) -> Any:
    return map_structure(obj, lambda leaf: leaf if isinstance(leaf, ParamRef) else _cast_input(leaf, dtype, device))


def candidate_inputs(record: GoldenRecord, dtype: torch.dtype, device: torch.device) -> GoldenRecord:
    """The record a backend receives: the golden call with its inputs cast, and without the golden
    output and extras (what the candidate must produce is not shown to it)."""
    args, kwargs = cast_inputs(record.args, dtype, device), cast_inputs(record.kwargs, dtype, device)
    return replace(record, args=args, kwargs=kwargs, output=None, extras={})
