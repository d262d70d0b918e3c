"""A quantized checkpoint's tensors checked from their headers alone, before anything is read: every
quantized weight (an e4m3 / int8 weight, MXFP4 `_blocks`) has its scale, every scale its weight, and
each scale a shape its weight fits under the layout (`quant.expand_scale` decides, on the meta device,
so the check and the reading agree). One sentence per problem, naming the tensor; a
`weight_block_size` that no scale fits is one sentence, naming the block size the scales do fit where
one does. The candidate's setup, LazyModel and `moe-parity audit` / `estimate` / `dequantize` all say
these sentences."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtypes import SAFETENSORS_DTYPES
from ..errors import CheckpointError
from .quant import MX_GROUP, QUANTIZED_CODES, Dequantizer, Layout, expand_scale, expected_scale_shape


def check_tensors(tensors: list[Any], quant: Layout, where: str) -> None:
    """CheckpointError with the first of `tensor_problems`, if any."""
    problems = tensor_problems(tensors, quant, where)
    if problems:
        raise CheckpointError(problems[0])


def tensor_problems(tensors: list[Any], quant: Layout, where: str) -> list[str]:
    """One sentence per tensor (`checkpoint.Tensor`: name, dtype, shape) the layout cannot read."""
    if quant.bits == "mxfp4":
        return _mxfp4_problems(tensors, where)
    deq = Dequantizer(quant, where)
    by_name = {t.name: t for t in tensors}
    out: list[str] = []
    misfits: list[tuple[Any, Any]] = []
    fitting = 0
    for t in tensors:
        companion = deq.companion(t.name)
        if companion is not None and not deq.aside(t.name):
            if companion not in by_name:
                out.append(f"{where}: {t.name} is there but its weight {companion} is not")
            continue
        if deq.aside(t.name) or t.dtype not in QUANTIZED_CODES:
            continue
        key = t.name.removesuffix("weight") + quant.scale_suffix
        scale = by_name.get(key)
        if scale is None:
            out.append(
                f"{where}: {t.name} is stored in {SAFETENSORS_DTYPES.get(t.dtype, t.dtype)} but has no {key}: "
                "a quantized weight needs its scale"
            )
        elif _fits(scale, t, quant):
            fitting += 1
        else:
            misfits.append((t, scale))
    return out + _misfit_problems(misfits, fitting, quant, where)


def _fits(scale: Any, weight: Any, quant: Layout) -> bool:
    """Whether `quant.expand_scale` takes the scale for the weight (run on the meta device)."""
    if len(weight.shape) < 2:
        return math.prod(scale.shape) == 1
    try:
        expand_scale(torch.empty(scale.shape, device="meta"), tuple(weight.shape), quant.block, layout=quant)
    except CheckpointError:
        return False
    return True


def _need(weight: Any, quant: Layout) -> str:
    want = expected_scale_shape(tuple(weight.shape), quant) if len(weight.shape) >= 2 else None
    return str(list(want)) if want else "one element"


def _misfit_problems(misfits: list[tuple[Any, Any]], fitting: int, quant: Layout, where: str) -> list[str]:
    if not misfits:
        return []
    block = quant.block
    if block is not None and quant.scheme.endswith("-block") and not fitting:
        t, scale = misfits[0]
        fit = fitting_block(misfits)
        hint = f"; they fit blocks of {fit[0]}x{fit[1]}" if fit else ""
        return [
            f"{where}: weight_block_size {list(block)} does not match the scales: {scale.name} has shape "
            f"{list(scale.shape)}, and a {list(t.shape)} weight in blocks of {block[0]}x{block[1]} needs "
            f"{_need(t, quant)}{hint}"
        ]
    return [
        f"{where}: {scale.name} has shape {list(scale.shape)}; its {list(t.shape)} weight under {quant.name} "
        f"needs {_need(t, quant)}"
        for t, scale in misfits
    ]


def _mxfp4_problems(tensors: list[Any], where: str) -> list[str]:
    by_name = {t.name: t for t in tensors}
    out = []
    for t in tensors:
        base, suffix = t.name[:-7], t.name[-7:]
        other = {"_blocks": "_scales", "_scales": "_blocks"}.get(suffix)
        if other is None:
            continue
        partner = by_name.get(base + other)
        if partner is None:
            out.append(f"{where}: {t.name} has no {base}{other} beside it: MXFP4 needs both")
        elif suffix == "_blocks" and (list(t.shape[:-1]) != list(partner.shape) or t.shape[-1] != MX_GROUP // 2):
            out.append(
                f"{where}: {t.name} has shape {list(t.shape)} and {partner.name} {list(partner.shape)}; MXFP4 needs "
                f"[..., groups, {MX_GROUP // 2}] bytes and [..., groups] exponents"
            )
    return out


def fitting_block(misfits: list[tuple[Any, Any]]) -> tuple[int, int] | None:
    """A block size every misfit scale fits (a mistyped `weight_block_size`; a power of two where one
    does), or None: per dimension, the sizes b with ceil(n / b) = s, intersected over the weights."""
    ranges = [[1, 2**62], [1, 2**62]]
    for weight, scale in misfits:
        if len(scale.shape) != len(weight.shape) or len(weight.shape) < 2 or scale.shape[:-2] != weight.shape[:-2]:
            return None
        for r, n, s in zip(ranges, weight.shape[-2:], scale.shape[-2:], strict=True):
            if s <= 0:
                return None
            r[0] = max(r[0], math.ceil(n / s))  # (s - 1) * b < n <= s * b
            r[1] = min(r[1], math.ceil(n / (s - 1)) - 1 if s > 1 else 2**62)
    if any(lo > hi for lo, hi in ranges):
        return None
    picks = []
    for lo, hi in ranges:
        twos = [2**k for k in range(63) if lo <= 2**k <= hi]
        picks.append(twos[-1] if twos else lo)
    return picks[0], picks[1]
