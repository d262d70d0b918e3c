"""Quantized checkpoints as they ship, read one unit at a time.

Three layouts are read, each as its config declares it (`quantization_config`):
- `fp8` (DeepSeek-V3/R1, MiniMax-M2, Qwen3-*-FP8, GLM-4.5-FP8, Kimi-K2): e4m3 weights with a
  `weight_scale_inv` per `weight_block_size` block (per tensor where the config names no block); a
  weight is `q * scale_inv`. Blocks that do not divide a dimension cover its last, shorter block.
- `compressed-tensors` (the FP8-dynamic and W8A8 checkpoints vLLM users run): `float-quantized`
  (e4m3) or `int-quantized`/`naive-quantized` (int8) weights with a `weight_scale` per tensor, per
  output channel or per block (and a `weight_zero_point` where asymmetric); `k_scale`/`v_scale` for
  an FP8 KV cache.
- `mxfp4` (GPT-OSS's experts): `*_blocks` (two e2m1 values a byte) and `*_scales` (an e8m0 exponent
  per 32 values along the input dimension), stored `[E, out, in]` for a `[E, in, out]` parameter.

`Dequantizer.dequantize` turns a unit's raw checkpoint tensors into the tensors an unquantized
checkpoint of the same model would hold, under the same names, in the run's dtype, with the
arithmetic transformers' own loading uses (bit for bit: `tests/test_quant.py` checks it against
`from_pretrained` on every layout). The quantization schemes a candidate may use (`SCHEMES`) are
here too, as round trips (`fake_quant`): `tiny-model --quant` writes checkpoints with them and
`golden --noise-quant` records the reference's error under them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..dtypes import SAFETENSORS_DTYPES
from ..errors import CheckpointError
from ..formats import FP4_VALUES, FP8, FP8_MAX, INT8_MAX, MX_GROUP, expand_blocks, nearest_e2m1, per_block

READ_METHODS = ("fp8", "compressed-tensors", "mxfp4")
COMPRESSED_FORMATS = {"float-quantized": "fp8", "int-quantized": "int8", "naive-quantized": "int8"}
# A scale of an FP8 KV cache (compressed-tensors, vLLM): kept aside, not a weight of the model.
KV_SCALE = re.compile(r"\.(k_scale|v_scale|q_scale|prob_scale)$")
# A weight stored in one of these is quantized (MXFP4: its `_blocks`).
QUANTIZED_CODES = ("F8_E4M3", "F8_E5M2", "I8")
# Scales of activations (static input scales): kept aside too.
ACT_SCALE = re.compile(r"\.(input_scale|activation_scale)$")
# The experts' tensors, which transformers' conversion merges (and dequantizes in float32 first).
EXPERT = re.compile(r"\.experts\.")


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's weights are stored: its `quant_method`, the scheme of its weights, the block
    (rows, columns) of a block-scaled one, its activations' scheme (None: weight-only) and whether it
    carries KV-cache scales."""

    method: str
    scheme: str  # a weight scheme of SCHEMES
    block: tuple[int, int] | None = None
    activations: str | None = None
    kv_cache: bool = False
    scale_suffix: str = "weight_scale_inv"  # the weight's companion: `<name>.weight` + `_scale_inv`
    bits: str = "fp8"  # fp8 | int8 | mxfp4

    @property
    def name(self) -> str:
        """The scheme as options spell it: `fp8-block:128`, `fp8-channel`, `mxfp4`, ..."""
        if self.block and self.scheme == "fp8-block":
            b0, b1 = self.block
            return f"fp8-block:{b0}" if b0 == b1 else f"fp8-block:{b0}x{b1}"
        return self.scheme

    def describe(self) -> str:
        """One phrase for headers and audits: `fp8 (fp8-block:128, activations dynamic-token, KV scales)`."""
        parts = [self.name]
        if self.activations:
            parts.append(f"activations {self.activations}")
        if self.kv_cache:
            parts.append("KV-cache scales")
        return f"{self.method} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "scheme": self.name,
            "block": list(self.block) if self.block else None,
            "activations": self.activations,
            "kv_cache": self.kv_cache,
        }


def _config_dict(config: Any) -> dict[str, Any] | None:
    q = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if not q:
        return None
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return q


def layout(config: Any, where: str = "the checkpoint") -> Layout | None:
    """The layout a config (a transformers config or config.json's dict) declares; None: unquantized.
    CheckpointError, one sentence, for a method or format this reads not."""
    q = _config_dict(config)
    if q is None:
        return None
    method = q.get("quant_method")
    method = str(getattr(method, "value", method) or "")
    if method == "fp8":
        return _fp8_layout(q, where)
    if method == "compressed-tensors":
        return _compressed_layout(q, config, where)
    if method == "mxfp4":
        return Layout("mxfp4", "mxfp4", (1, MX_GROUP), scale_suffix="_scales", bits="mxfp4")
    raise CheckpointError(
        f"{where} is quantized with {method or 'an unnamed method'}, which moe-parity cannot read "
        f"(it reads {', '.join(READ_METHODS)}): dequantize it to a bf16 checkpoint first"
    )


def _fp8_layout(q: dict[str, Any], where: str) -> Layout:
    block = q.get("weight_block_size")
    if block is not None:
        sizes = block if isinstance(block, (list, tuple)) else ()
        if len(sizes) != 2 or not all(isinstance(b, int) and b > 0 for b in sizes):
            raise CheckpointError(f"{where}: weight_block_size {block!r} is not two positive integers (rows, columns)")
        block = (int(block[0]), int(block[1]))
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise CheckpointError(f"{where}: fp8 format {fmt!r} is not read (moe-parity reads e4m3 weights)")
    acts = q.get("activation_scheme", "dynamic")
    activations = {"dynamic": "dynamic-token", "static": "static"}.get(acts)
    if activations is None:
        raise CheckpointError(f"{where}: activation_scheme {acts!r} is not one of dynamic, static")
    scheme = "fp8-block" if block else "fp8-tensor"
    return Layout("fp8", scheme, block, activations)


def _compressed_layout(q: dict[str, Any], config: Any, where: str) -> Layout:
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    bits = COMPRESSED_FORMATS.get(fmt or "")
    if bits is None:
        raise CheckpointError(
            f"{where}: compressed-tensors format {fmt!r} is not read "
            f"(moe-parity reads {', '.join(COMPRESSED_FORMATS)}): decompress it to a bf16 checkpoint first"
        )
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if not weights:
        raise CheckpointError(f"{where}: its compressed-tensors config names no weight scheme (config_groups)")
    w = weights[0]
    strategy = w.get("strategy", "tensor")
    block = None
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
        if len(block) != 2:
            raise CheckpointError(f"{where}: a block strategy without a block_structure of two sizes")
        scheme = f"{bits}-block"
    elif strategy in ("channel", "tensor"):
        scheme = f"{bits}-{strategy}"
    else:
        raise CheckpointError(
            f"{where}: compressed-tensors weight strategy {strategy!r} is not read "
            "(moe-parity reads tensor, channel, block)"
        )
    acts = [g.get("input_activations") for g in groups.values() if isinstance(g, dict) and g.get("input_activations")]
    activations = None
    if acts:
        a = acts[0]
        activations = f"dynamic-{a.get('strategy', 'token')}" if a.get("dynamic") else "static"
    return Layout(
        "compressed-tensors",
        scheme,
        block,  # type: ignore[arg-type]
        activations,
        kv_cache=bool(q.get("kv_cache_scheme")),
        scale_suffix="weight_scale",
        bits=bits,
    )


def dtype_code(sl: Any) -> str:
    """A safetensors slice's (or tensor's) dtype code: F8_E4M3, U8, ..."""
    if isinstance(sl, torch.Tensor):
        return {FP8: "F8_E4M3", torch.uint8: "U8", torch.int8: "I8"}.get(sl.dtype, str(sl.dtype))
    return sl.get_dtype()


def _read(sl: Any) -> torch.Tensor:
    return sl if isinstance(sl, torch.Tensor) else sl[...]  # `[...]`: a 0-dim slice (a per-tensor scale) too


class Dequantizer:
    """A layout's reading: which raw keys make which weight, and the weights themselves."""

    def __init__(self, layout: Layout, where: str = "the checkpoint"):
        self.layout = layout
        self.where = where

    # -- names ----------------------------------------------------------------------------------
    def companion(self, key: str) -> str | None:
        """The weight a scale key belongs to (None: not a weight's scale)."""
        if self.layout.bits == "mxfp4":
            for suffix in ("_blocks", "_scales"):
                if key.endswith(suffix):
                    return key[: -len(suffix)]
            return None
        for suffix in (self.layout.scale_suffix, "weight_zero_point"):
            if key.endswith("." + suffix):
                return key[: -len(suffix)] + "weight"
        return None

    def aside(self, key: str) -> bool:
        """Scales of activations and of the KV cache: no weight of the model (the noise floor reads them)."""
        return bool(KV_SCALE.search(key) or ACT_SCALE.search(key))

    def plain_keys(self, keys: list[str]) -> list[str]:
        """The keys an unquantized checkpoint of the same model would have for these raw keys."""
        out: dict[str, None] = {}
        for key in keys:
            if self.aside(key):
                continue
            out[self.companion(key) or key] = None
        return list(out)

    # -- values ---------------------------------------------------------------------------------
    def dequantize(self, raw: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        """Raw tensors (or safetensors slices) of some units -> the plain tensors, quantized ones
        dequantized into `dtype`, the others passed on as they are (the loader casts them)."""
        groups: dict[str, dict[str, Any]] = {}
        for key, value in raw.items():
            if self.aside(key):
                continue
            weight = self.companion(key)
            groups.setdefault(weight or key, {})[key] = value
        out: dict[str, Any] = {}
        for name, parts in groups.items():
            out[name] = self._one(name, parts, dtype)
        return out

    def _one(self, name: str, parts: dict[str, Any], dtype: torch.dtype) -> Any:
        if self.layout.bits == "mxfp4":
            blocks, scales = parts.get(name + "_blocks"), parts.get(name + "_scales")
            if blocks is None and scales is None:
                return parts[name]
            if blocks is None or scales is None:
                have, lack = ("_blocks", "_scales") if scales is None else ("_scales", "_blocks")
                raise CheckpointError(f"{self.where}: {name}{have} has no {name}{lack} beside it: MXFP4 needs both")
            return mxfp4_dequantize(_read(blocks), _read(scales), dtype, name=name, where=self.where)
        weight = parts.get(name)
        scale_key = name[: -len("weight")] + self.layout.scale_suffix
        scale = parts.get(scale_key)
        if weight is None:
            raise CheckpointError(f"{self.where}: {scale_key} is there but its weight {name} is not")
        if scale is None:
            if dtype_code(weight) in QUANTIZED_CODES:
                stored = SAFETENSORS_DTYPES.get(dtype_code(weight), dtype_code(weight))
                raise CheckpointError(
                    f"{self.where}: {name} is stored in {stored} but has no {scale_key}: "
                    "a quantized weight needs its scale"
                )
            return weight
        zero = parts.get(name[: -len("weight")] + "weight_zero_point")
        return self.weight(name, _read(weight), _read(scale), dtype, zero=None if zero is None else _read(zero))

    def weight(
        self, name: str, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, zero: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One quantized weight, dequantized (its scale's shape checked against the layout)."""
        shape = tuple(q.shape)

        def full(t: torch.Tensor) -> torch.Tensor:
            return expand_scale(t, shape, self.layout.block, name=name, where=self.where, layout=self.layout)

        if self.layout.method == "compressed-tensors" and not EXPERT.search(name):
            # compressed-tensors' own `dequantize` of a Linear: the values in the scale's dtype, less the
            # zero point, times the scale, then cast (transformers' expert converter multiplies in float32)
            x = q.to(scale.dtype)
            if zero is not None:
                x = x - full(zero).to(scale.dtype)
            return (x * full(scale)).to(dtype)
        # transformers' Fp8Dequantize: both in float32, the product cast once (e8m0 bytes as powers of two)
        if zero is not None:
            q = q.to(torch.float32) - full(zero).to(torch.float32)
        s = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
        return (q.to(torch.float32) * full(s)).to(dtype)


def expected_scale_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...] | None:
    """The scale shape a weight of `shape` has under `layout` (None: per tensor, any one-element shape)."""
    rows, cols = shape[-2], shape[-1]
    lead = tuple(shape[:-2])
    if layout.scheme.endswith("-tensor"):
        return None
    if layout.scheme.endswith("-channel"):
        return (*lead, rows, 1)
    b0, b1 = layout.block or (rows, cols)
    return (*lead, math.ceil(rows / b0), math.ceil(cols / b1))


def expand_scale(
    scale: torch.Tensor,
    shape: tuple[int, ...],
    block: tuple[int, int] | None,
    *,
    name: str = "",
    where: str = "the checkpoint",
    layout: Layout | None = None,
) -> torch.Tensor:
    """A scale broadcast to its weight's `shape`: per tensor (one element), per row (`[rows, 1]`) or per
    block (each block's scale over its block, the last block of a dimension cut to what is left).
    CheckpointError naming the tensor where the scale's shape fits none of these."""
    if scale.numel() == 1:
        return scale.reshape(())
    rows, cols = shape[-2], shape[-1]
    per_row = layout is None or not layout.scheme.endswith("-block")
    if per_row and scale.dim() >= 2 and tuple(scale.shape[-2:]) == (rows, 1):
        return scale
    if per_row and layout is not None and layout.scheme.endswith("-channel") and tuple(scale.shape) == (*shape[:-1],):
        return scale.unsqueeze(-1)
    if block is not None and scale.dim() >= 2:
        b0, b1 = block
        want = (math.ceil(rows / b0), math.ceil(cols / b1))
        if tuple(scale.shape[-2:]) == want and tuple(scale.shape[:-2]) == tuple(shape[:-2]):
            return expand_blocks(scale, block, shape)
    expect = expected_scale_shape(shape, layout) if layout is not None else None
    hint = (
        f"a {list(shape)} weight in blocks of {block[0]}x{block[1]} needs {list(expect or ())}: "
        "the checkpoint's weight_block_size does not match its scales"
        if block is not None and expect is not None
        else f"a {list(shape)} weight needs {list(expect) if expect else 'one element'}"
    )
    raise CheckpointError(f"{where}: the scale of {name} has shape {list(scale.shape)}; {hint}")


def mxfp4_dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *, name: str = "", where: str = "the checkpoint"
) -> torch.Tensor:
    """GPT-OSS's `[..., out, in/32, 16]` bytes and `[..., out, in/32]` exponents -> the `[..., in, out]`
    parameter: each e2m1 value (low nibble first) times 2**(exponent - 127). Exact in bf16 and float32,
    so any order of operations gives transformers' values."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != MX_GROUP // 2:
        raise CheckpointError(
            f"{where}: {name}_blocks has shape {list(blocks.shape)} and {name}_scales {list(scales.shape)}; "
            f"MXFP4 needs [..., groups, {MX_GROUP // 2}] bytes and [..., groups] exponents"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.reshape(*blocks.shape[:-1], MX_GROUP)
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exp.unsqueeze(-1).to(torch.float32))
    out = out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MX_GROUP)  # [..., out, in]
    return out.transpose(-1, -2).contiguous().to(dtype)


# -- quantization schemes (what a candidate does to its weights) -----------------------------------

WEIGHT_SCHEMES = ("fp8-block", "fp8-channel", "fp8-tensor", "mxfp4", "int8-channel")


def parse_weight_scheme(text: str) -> tuple[str, tuple[int, int] | None]:
    """`fp8-block[:N|:RxC]`, `fp8-channel`, ... -> (scheme, block); ValueError naming the text."""
    base, _, arg = text.partition(":")
    if base not in WEIGHT_SCHEMES:
        raise ValueError(f"{text!r} is not a weight scheme (one of {', '.join(WEIGHT_SCHEMES)}; fp8-block takes :N)")
    if base != "fp8-block":
        if arg:
            raise ValueError(f"{text!r}: only fp8-block takes a block size")
        return base, ((1, MX_GROUP) if base == "mxfp4" else None)
    if not arg:
        return base, (128, 128)
    try:
        sizes = [int(x) for x in arg.lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or any(s <= 0 for s in sizes):
        raise ValueError(f"{text!r}: a block size is N or RxC, positive integers")
    return base, (sizes[0], sizes[-1])


def quantize_fp8(w: torch.Tensor, scheme: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` ([..., rows, cols]) -> (e4m3 values, the dequantizing scale: `q * scale` is `w` rounded),
    the scale per block (`[..., ceil(rows/b0), ceil(cols/b1)]`), per row (`[..., rows, 1]`) or per tensor."""
    x = w.to(torch.float32)
    if scheme == "fp8-tensor":
        amax = x.abs().amax()
    elif scheme == "fp8-channel":
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        b0, b1 = block or (128, 128)
        amax = per_block(x.abs(), (math.ceil(x.shape[-2] / b0), math.ceil(x.shape[-1] / b1)), (b0, b1), "amax")
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    full = scale if scheme != "fp8-block" else expand_scale(scale, tuple(x.shape), block)
    q = (x / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (values, scale `[..., rows, 1]`)."""
    x = w.to(torch.float32)
    scale = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` ([..., out, in], in a multiple of 32) -> GPT-OSS's (blocks `[..., out, in/32, 16]` uint8,
    scales `[..., out, in/32]` uint8): per group of 32, the exponent that brings its largest value
    under 6 (OCP MX: floor(log2(amax)) - 2), each value rounded to the nearest e2m1 value."""
    x = w.to(torch.float32)
    *lead, out, inp = x.shape
    if inp % MX_GROUP:
        raise ValueError(f"MXFP4 needs the input dimension in multiples of {MX_GROUP}, not {inp}")
    g = x.reshape(*lead, out, inp // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, torch.zeros_like(amax))
    exp = exp.clamp(-127, 127)
    scaled = g / torch.exp2(exp)
    mag = nearest_e2m1(scaled)
    nibble = (mag + 8 * (scaled < 0)).to(torch.uint8)
    nibble = torch.where(mag == 0, torch.zeros_like(nibble), nibble)  # no negative zero
    pairs = nibble.reshape(*lead, out, inp // MX_GROUP, MX_GROUP // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks, scales


def fake_quant(w: torch.Tensor, scheme: str, block: tuple[int, int] | None = None) -> torch.Tensor:
    """`w` through a weight scheme and back, in `w`'s dtype: what a candidate quantizing `w` so computes
    with. mxfp4 takes `w` as `[..., out, in]`."""
    if scheme == "mxfp4":
        blocks, scales = quantize_mxfp4(w)
        return mxfp4_dequantize(blocks, scales, torch.float32).transpose(-1, -2).to(w.dtype)
    if scheme == "int8-channel":
        q, s = quantize_int8(w)
        return (q.to(torch.float32) * s).to(w.dtype)
    q, s = quantize_fp8(w, scheme, block)
    full = s if scheme != "fp8-block" else expand_scale(s, tuple(w.shape), block)
    return (q.to(torch.float32) * full).to(w.dtype)
