"""Dtype names and JSON-safe numbers, shared by every layer of the package (torch is imported only
when a dtype is parsed, so the plugin's startup stays free of it)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: torch.dtype | str) -> str:
    """`torch.bfloat16` (or "torch.bfloat16") -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


# safetensors' dtype codes (file headers) -> torch's names, and those of them that are floating.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip
SAFETENSORS_FLOATS = {code: name for code, name in SAFETENSORS_DTYPES.items() if "float" in name}

# Short names people write on command lines.
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def parse_dtype(name: str, *, floating: bool = False) -> torch.dtype:
    """A torch dtype from its name (or bf16, fp16, fp32, fp64); ValueError if there is none (or,
    with `floating`, if it is not a floating-point dtype)."""
    import torch

    text = dtype_name(name)
    dtype = getattr(torch, _ALIASES.get(text, text), None)
    if not isinstance(dtype, torch.dtype) or (floating and not dtype.is_floating_point):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def json_safe(value: Any) -> Any:
    """Recursively turn tuples into lists and non-finite floats into "inf" / "-inf" / "nan"."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
