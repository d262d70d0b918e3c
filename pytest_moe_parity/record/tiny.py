"""Deterministic tiny random-init MoE checkpoints in the hub's layout, built from the configs in
`fixtures/configs/` (one per `model_type`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DEFAULT_SEED = 0


def fixtures_dir() -> Path:
    """`fixtures/`: inside the installed wheel, or beside the package in a source checkout."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "fixtures", package.parent / "fixtures"):
        if (candidate / "configs").is_dir():
            return candidate
    raise FileNotFoundError("the fixtures/ directory of pytest-moe-parity is missing from this installation")


def available_archs() -> list[str]:
    return sorted(p.stem for p in (fixtures_dir() / "configs").glob("*.json"))


def tiny_config_dict(arch: str, layers: int | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fixture config of `arch`, at `layers` depth, with `overrides` (e.g. more experts)."""
    path = fixtures_dir() / "configs" / f"{arch}.json"
    if not path.is_file():
        raise KeyError(arch)
    cfg = json.loads(path.read_text())
    cfg.update(overrides or {})
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:  # repeat the pattern (e.g. gpt_oss sliding/full) to the new depth
            pattern = cfg["layer_types"]
            cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return cfg


def tiny_config(arch: str, layers: int | None = None, overrides: dict[str, Any] | None = None):
    from transformers import AutoConfig

    cfg = dict(tiny_config_dict(arch, layers, overrides))
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


@torch.no_grad()
def _perturb_trivial(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter or persistent buffer still at a constant init (norm weights at 1,
    biases and score-correction biases at 0) random values, so that a port that drops it shows."""
    gen = torch.Generator().manual_seed(seed + 1)
    persistent = {
        name
        for module_name, module in model.named_modules()
        for name in (
            f"{module_name}.{b}" if module_name else b
            for b in module._buffers
            if b not in module._non_persistent_buffers_set
        )
    }
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point() or t.numel() == 0:
            continue
        first = t.reshape(-1)[0].item()
        if not bool((t == first).all()):
            continue
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if first == 1.0:  # norm weights
            t.copy_(1.0 + 0.1 * noise)
        else:  # biases, score-correction biases, attention sinks
            t.copy_(first + 0.05 * noise)


def build_tiny_model(
    arch: str,
    *,
    layers: int | None = None,
    seed: int = DEFAULT_SEED,
    overrides: dict[str, Any] | None = None,
    perturb: bool = True,
):
    """The tiny model in float32 with eager attention; same arch + seed gives identical tensors. With
    `perturb=False`, as its config class initialises it (norms at 1, biases at 0)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, layers, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    if perturb:
        _perturb_trivial(model, seed)
    return model.eval()


def write_tiny_model(
    arch: str,
    out: Path | str,
    *,
    layers: int | None = None,
    seed: int = DEFAULT_SEED,
    max_shard_size: str | int = "500KB",
    overrides: dict[str, Any] | None = None,
    perturb: bool = True,
    quant: str | None = None,
    kv_scales: bool = False,
) -> Path:
    """Save a tiny checkpoint that `AutoModelForCausalLM.from_pretrained` loads, in the hub's
    per-expert layout, sharded with a `model.safetensors.index.json` like a published model; with
    `quant` (a scheme of `record.quantized`), quantized in that scheme's hub layout."""
    out = Path(out)
    model = build_tiny_model(arch, layers=layers, seed=seed, overrides=overrides, perturb=perturb)
    out.mkdir(parents=True, exist_ok=True)
    if quant is not None or kv_scales:
        from .quantized import write_quantized

        return write_quantized(model, out, quant or "fp8-block", kv=kv_scales, seed=seed, max_shard_size=max_shard_size)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out
