"""Quantized tiny checkpoints, written as the hub writes each layout (`moe-parity tiny-model --quant`).

- `fp8-block[:N]`: DeepSeek-V3's and Qwen3-FP8's layout: every projection of the decoder layers
  (attention, experts, shared experts, dense MLPs) in e4m3 with a float32 `weight_scale_inv` per
  N x N block (128 by default); routers, norms, embeddings and the LM head stay unquantized;
  `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [N, N]}`.
- `fp8-channel` / `fp8-tensor` / `int8-channel`: compressed-tensors as llm-compressor writes an
  FP8-dynamic (or W8A8) checkpoint: `weight_scale` per output channel (or one per tensor) in the
  checkpoint's dtype, `format: float-quantized` (`int-quantized`), activations dynamic per token,
  the routers in `ignore`.
- `mxfp4`: GPT-OSS's: the experts' `gate_up_proj` / `down_proj` as `*_blocks` + `*_scales`, every
  other tensor unquantized.

The unquantized tensors are written in bfloat16, as the hub's quantized releases hold them.
`--kv-scales` adds a `k_scale` / `v_scale` per attention (the largest K / V value over a few
calibration tokens, over 448), and for compressed-tensors its `kv_cache_scheme`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..model.quant import FP8_MAX, MX_GROUP, parse_weight_scheme, quantize_fp8, quantize_int8, quantize_mxfp4

QUANT_CHOICES = ("fp8-block", "fp8-channel", "fp8-tensor", "int8-channel", "mxfp4")
QUANTIZED_CLASSES = ("attention", "experts", "shared_experts", "mlp")
CALIBRATION_TOKENS = 8


def quant_config(scheme: str, block: tuple[int, int] | None, kv_scales: bool, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` of a checkpoint quantized with `scheme`, as its makers write it."""
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if scheme == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ignore}
    bits = "int" if scheme.startswith("int8") else "float"
    weights = {"num_bits": 8, "type": bits, "strategy": scheme.split("-")[1], "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": bits, "strategy": "token", "symmetric": True, "dynamic": True}
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if bits == "int" else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ignore,
        "kv_cache_scheme": kv if kv_scales else None,
    }


def _quantizable(name: str, tensor: torch.Tensor, scheme: str) -> bool:
    from .audit import tensor_class

    if ".layers." not in f".{name}" or tensor_class(name) not in QUANTIZED_CLASSES:
        return False
    if scheme == "mxfp4":  # GPT-OSS: the fused experts' projections alone
        return tensor.dim() == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    return name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()


def quantize_state(
    state: dict[str, torch.Tensor], scheme: str, block: tuple[int, int] | None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A checkpoint's tensors in the layout of `scheme` (unquantized ones in bfloat16) and the names of
    the tensors left unquantized within the decoder layers (a config's `ignore`)."""
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, t in state.items():
        if not _quantizable(name, t, scheme):
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
            if ".layers." in f".{name}" and t.is_floating_point() and t.dim() >= 2:
                kept.append(name)
            continue
        if scheme == "mxfp4":
            blocks, scales = quantize_mxfp4(t.transpose(-1, -2))  # stored [E, out, in]
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        elif scheme == "int8-channel":
            q, s = quantize_int8(t)
            out[name], out[name + "_scale"] = q, s.to(torch.bfloat16)
        else:
            q, s = quantize_fp8(t, scheme, block)
            suffix = "_scale_inv" if scheme == "fp8-block" else "_scale"
            out[name], out[name + suffix] = q, (s if scheme == "fp8-block" else s.to(torch.bfloat16))
    return out, kept


def _ignore(kept: list[str], scheme: str) -> list[str]:
    """The config's list of modules left unquantized: routers by pattern, as the hub writes them."""
    if scheme == "mxfp4":
        return ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    names = sorted({k.rsplit(".", 1)[0] for k in kept})
    return ["lm_head", *names]


@torch.no_grad()
def kv_scales(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Per attention, `k_scale` / `v_scale`: the largest |K| / |V| the model makes on a few random
    calibration tokens, over 448 (what a calibration on a handful of tokens writes)."""
    amax: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        for proj, key in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            child = getattr(module, proj, None)
            if isinstance(child, torch.nn.Module) and name:
                handles.append(child.register_forward_hook(
                    lambda m, a, out, k=f"{name}.{key}": amax.__setitem__(k, out.detach().abs().amax().float())
                ))  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(3, model.config.vocab_size, (1, CALIBRATION_TOKENS), generator=gen)
    try:
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return {k: (v / FP8_MAX).clamp(min=1e-12).reshape(()) for k, v in amax.items()}


def write_quantized(
    model: torch.nn.Module, out: Path, quant: str, *, kv: bool, seed: int, max_shard_size: str | int
) -> Path:
    """Save `model` quantized with `quant` (a QUANT_CHOICES scheme, fp8-block with `:N`) in the hub's
    layout of that scheme: sharded safetensors with an index, the config's `quantization_config`."""
    from huggingface_hub import save_torch_state_dict

    scheme, block = parse_weight_scheme(quant)
    if scheme == "mxfp4" and model.config.model_type != "gpt_oss":
        arch = model.config.model_type
        raise ValueError(f"--quant mxfp4 is GPT-OSS's layout (fused experts); {arch} has no such release")
    if scheme == "mxfp4":
        hidden = model.config.hidden_size
        if hidden % MX_GROUP or model.config.intermediate_size % MX_GROUP:
            raise ValueError(f"--quant mxfp4 needs hidden and intermediate sizes in multiples of {MX_GROUP}")
    model.save_pretrained(out, max_shard_size=max_shard_size)  # config, generation config, the mapping's layout
    state = _read_saved(out)
    for p in out.glob("*.safetensors*"):
        p.unlink()
    quantized, kept = quantize_state(state, scheme, block)
    if kv:
        quantized.update({k: v for k, v in kv_scales(model, seed).items()})
    save_torch_state_dict(quantized, out, max_shard_size=max_shard_size, metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quant_config(scheme, block, kv, _ignore(kept, scheme))
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _read_saved(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for p in sorted(out.glob("*.safetensors")):
        state.update(load_file(str(p)))
    return state
