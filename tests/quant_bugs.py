"""Scale bugs of quantized checkpoints (issue 51, item 4), injected into a copy of a clean quantized
tiny checkpoint the way a broken quantization script or loader leaves them: a scale where its inverse
is meant, a block size off, transposed scales, one expert's scale for every expert, a missing scale
(bad input) or one never applied, a weight quantized twice. Each bug is an edit of the checkpoint's
tensors and config (`edit_quantized`)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pytest_moe_parity.model.quant import FP8, FP8_MAX, expand_scale, fake_quant, quantize_fp8

Tensors = dict[str, torch.Tensor]
Edit = Callable[[Tensors, dict], None]  # a checkpoint's tensors and config, edited in place
INDEX = "model.safetensors.index.json"


def edit_quantized(src: Path, dst: Path, edit: Edit) -> Path:
    """Copy `src` to `dst` and apply `edit` to its tensors and config: tensors it removes leave their
    shard and the index, tensors it adds go to the first shard."""
    shutil.copytree(src, dst)
    shards = sorted(dst.glob("*.safetensors"))
    by_file: dict[Path, list[str]] = {}
    everything: Tensors = {}
    for f in shards:
        with safe_open(str(f), "pt") as fh:
            by_file[f] = list(fh.keys())
            everything.update({k: fh.get_tensor(k) for k in by_file[f]})
    config = json.loads((dst / "config.json").read_text())
    before = set(everything)
    edit(everything, config)
    added = [k for k in everything if k not in before]
    by_file[shards[0]] += added
    weight_map = {}
    for f, keys in by_file.items():
        kept = [k for k in keys if k in everything]
        save_file({k: everything[k].contiguous() for k in kept}, str(f), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(kept, f.name))
    index = dst / INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = weight_map
        index.write_text(json.dumps(data, indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def scale_key(t: Tensors, weight: str) -> str:
    """The scale beside a quantized weight: DeepSeek's `weight_scale_inv` or compressed-tensors' `weight_scale`."""
    base = weight[: -len("weight")]
    return next(base + s for s in ("weight_scale_inv", "weight_scale") if base + s in t)


def _matching(t: Tensors, pattern: str) -> list[str]:
    found = [k for k in t if re.search(pattern, k) and t[k].dtype in (FP8, torch.int8)]
    assert found, pattern
    return found


def inverse(pattern: str) -> Edit:
    """The scale stored as its inverse (1/scale where the loader multiplies by it); for MXFP4's e8m0
    exponents (`pattern` matching `*_scales`), the negated exponent."""

    def edit(t: Tensors, config: dict) -> None:
        exponents = [k for k in t if re.search(pattern, k) and k.endswith("_scales")]
        for k in exponents:
            t[k] = (254 - t[k].int()).to(torch.uint8)
        for w in [] if exponents else _matching(t, pattern):
            k = scale_key(t, w)
            t[k] = (1.0 / t[k].float()).to(t[k].dtype)

    return edit


def transposed(pattern: str) -> Edit:
    """A square grid of block scales stored transposed."""

    def edit(t: Tensors, config: dict) -> None:
        for w in _matching(t, pattern):
            k = scale_key(t, w)
            assert t[k].shape[-1] == t[k].shape[-2] > 1, (k, t[k].shape)
            t[k] = t[k].transpose(-1, -2).contiguous()

    return edit


def block_size(size: int) -> Edit:
    """The config's weight_block_size off: the scales were made with another block (same grid, where the
    new size gives every weight as many blocks as the old one)."""

    def edit(t: Tensors, config: dict) -> None:
        config["quantization_config"]["weight_block_size"] = [size, size]

    return edit


def one_expert_scale(layer: int, proj: str, expert: int = 0) -> Edit:
    """Every expert of a layer's projection given one expert's scale (per-expert tensors, or GPT-OSS's
    fused `*_scales`)."""

    def edit(t: Tensors, config: dict) -> None:
        fused = f"model.layers.{layer}.mlp.experts.{proj}_scales"
        if fused in t:
            t[fused] = t[fused][expert : expert + 1].expand_as(t[fused]).clone()
            return
        weights = _matching(t, rf"layers\.{layer}\.[\w.]*experts\.\d+\.{proj}\.weight$")
        source = scale_key(t, re.sub(r"experts\.\d+\.", f"experts.{expert}.", weights[0]))
        for w in weights:
            t[scale_key(t, w)] = t[source].clone()

    return edit


def missing_scale(weight: str) -> Edit:
    """A quantized weight's scale left out of the checkpoint."""

    def edit(t: Tensors, config: dict) -> None:
        del t[scale_key(t, weight)]

    return edit


def unapplied(pattern: str) -> Edit:
    """A scale of 1 everywhere: the values are the raw e4m3 numbers."""

    def edit(t: Tensors, config: dict) -> None:
        for w in _matching(t, pattern):
            k = scale_key(t, w)
            t[k] = torch.ones_like(t[k])

    return edit


def twice(pattern: str, factor: float = 1.25) -> Edit:
    """Dequantized and quantized again at a scale `factor` times the first (block-scaled fp8): the
    values rounded a second time."""

    def edit(t: Tensors, config: dict) -> None:
        block = tuple(config["quantization_config"]["weight_block_size"])
        for w in _matching(t, pattern):
            k = scale_key(t, w)
            shape = tuple(t[w].shape)
            values = t[w].float() * expand_scale(t[k].float(), shape, block)
            scale = t[k].float() * factor
            q = (values / expand_scale(scale, shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            t[w], t[k] = q, scale.to(t[k].dtype)

    return edit


def twice_from(plain: Path, weight: str, first_block: int = 16) -> Edit:
    """`weight` quantized from a copy of the unquantized checkpoint's that was quantized already
    (fp8 in blocks of `first_block`), in the checkpoint's own blocks: two roundings of the original."""

    def edit(t: Tensors, config: dict) -> None:
        original = _read(plain, weight).float()
        block = tuple(config["quantization_config"]["weight_block_size"])
        once = fake_quant(original, "fp8-block", (first_block, first_block))
        t[weight], t[scale_key(t, weight)] = quantize_fp8(once, "fp8-block", block)

    return edit


def _read(model: Path, key: str) -> torch.Tensor:
    index = model / INDEX
    file = json.loads(index.read_text())["weight_map"][key] if index.is_file() else "model.safetensors"
    with safe_open(str(model / file), "pt") as fh:
        return fh.get_tensor(key)
