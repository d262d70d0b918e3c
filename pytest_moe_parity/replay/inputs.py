"""Golden inputs as the candidate receives them: cast to its dtype and device."""

from __future__ import annotations

from typing import Any

import torch

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
