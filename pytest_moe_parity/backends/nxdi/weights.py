"""One unit's checkpoint through NxDI's conversion: its tensors read (renamed to layer 0), converted
by the application's `convert_hf_to_neuron_state_dict`, cast as NxDI casts them, and mapped back to
the reference's names for weight items. With NxDI's own quantization (`--hw-option quantized=`), the
quantized state dict NxDI's `save_quantized_state_dict` writes, read back as stored (`Stored`: the
format's values, a float32 scale per output channel) under the reference's names."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import compat
from ...errors import BackendError
from ...judge.quant_weights import Stored
from ...model.checkpoint import weight_map


def unit_state(
    model_dir: Path, layer: int | None, weights: dict[str, str] | None = None, layout: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """One decoder layer's checkpoint tensors, renamed to layer 0, or (layer None) the model-level
    ones, without the base-model prefix (`model.layers.17.mlp.gate.weight` ->
    `layers.0.mlp.gate.weight`, `model.norm.weight` -> `norm.weight`), as NxDI's get_state_dict
    hands them to its conversion: only these tensors are read. `layout` (the table's `checkpoint`):
    another base-model `prefix` and name of the `layers` (DBRX's `transformer.blocks.N.`), and the
    `model_level` tensors the conversion reads for any unit, given to a layer's unit as empty stand-ins,
    and the conversion's `names` of tensors it reads under another name."""
    from safetensors import safe_open

    layout = layout or {}
    prefix, stack = layout.get("prefix", "model."), layout.get("layers", "layers") + "."
    weights = weights if weights is not None else weight_map(model_dir)
    renamed: dict[str, str] = {}
    for key in weights:
        bare = key.removeprefix(prefix)
        if layer is not None and bare.startswith(f"{stack}{layer}."):
            renamed[key] = f"{stack}0." + bare[len(f"{stack}{layer}.") :]
        elif layer is None and not bare.startswith(stack):
            renamed[key] = bare
    state: dict[str, torch.Tensor] = {}
    for file in sorted({weights[k] for k in renamed}):
        with safe_open(str(model_dir / file), framework="pt") as fh:
            for key in (k for k in renamed if weights[k] == file):
                state[renamed[key]] = fh.get_tensor(key)
    names = layout.get("names", {})  # the conversion's name of a tensor (Llama 4's `language_model.lm_head.weight`)
    state = {names.get(k, k): v for k, v in state.items()}
    if layer is not None:
        state.update({name: torch.empty(0) for name in layout.get("model_level", ()) if name not in state})
    return state


def convert_unit(
    state: dict[str, torch.Tensor], convert: Any, config: Any, layers: int, count: str = "num_hidden_layers"
) -> dict[str, torch.Tensor]:
    """NxDI's conversion of one unit's tensors with a config of `layers` decoder layers (1 for a
    layer renamed to layer 0, 0 for the model-level tensors; `count`: the config attribute the
    conversion loops over, DBRX's `n_layers`); the caller's config is untouched. What it makes of a
    layer unit's empty stand-ins (`unit_state`'s `model_level`) is dropped."""
    one = copy.copy(config)
    setattr(one, count, layers)
    return {k: v for k, v in convert(dict(state), one).items() if v.numel() or not layers}


def table_conversion(state: dict[str, torch.Tensor], config: Any, rules: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The table's own layout of one unit's tensors for NxD's modules, where NxDI ships no application
    to convert them (`ModuleTable.conversion`): each layer's `rename` (layer-relative names), and the
    per-expert `experts` ({"from": "mlp.experts.{expert}.", "to": "mlp.expert_mlps.mlp_op.", "gate",
    "up", "down": their tensor names}) stacked as NxD's ExpertMLPsV2 holds them: gate_up [E, H, 2I] (each
    expert's gate then up, transposed), down [E, I, H]. Any other tensor keeps its name."""
    out = dict(state)
    experts = rules.get("experts")
    for layer in range(config.num_hidden_layers):
        base = f"layers.{layer}."
        for old, new in rules.get("rename", {}).items():
            if base + old in out:
                out[base + new] = out.pop(base + old)
        if experts and base + experts["from"].format(expert=0) + experts["gate"] in out:  # else a dense layer
            _stack_experts(out, base, experts)
    return out


def _stack_experts(out: dict[str, torch.Tensor], base: str, experts: dict[str, str]) -> None:
    """One layer's per-expert weights (under `base`) stacked in place as NxD's ExpertMLPsV2 holds them."""
    head = base + experts["from"].split("{expert}")[0]
    count = sum(1 for k in out if k.startswith(head) and k.endswith("." + experts["gate"]))
    parts = ("gate", "up", "down")
    taken = [{p: out.pop(base + experts["from"].format(expert=e) + experts[p]).T for p in parts} for e in range(count)]
    out[base + experts["to"] + "gate_up_proj.weight"] = torch.stack(
        [torch.cat([t["gate"], t["up"]], dim=1) for t in taken]
    ).contiguous()
    out[base + experts["to"] + "down_proj.weight"] = torch.stack([t["down"] for t in taken]).contiguous()


def back_to_reference(
    converted: dict[str, torch.Tensor], inverse: dict[str, Any], layer: int | None
) -> dict[str, torch.Tensor]:
    """A unit's converted tensors (its layer renamed to 0) under the reference's names and layout,
    by the table's inverse rules: `neuron` -> `hf` (with `{layer}`), an optional `transpose` of two
    dims; any other name is the reference's under `prefix` (except the `top_level` ones)."""
    rules = {r["neuron"].format(layer=0): r for r in inverse.get("rules", [])}
    prefix, top = inverse.get("prefix", ""), tuple(inverse.get("top_level", ()))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in converted.items():
        rule = rules.get(name)
        if rule is None:
            bare = name if layer is None else name.replace("layers.0.", f"layers.{layer}.", 1)
            out[bare if bare.startswith(top) else prefix + bare] = tensor
            continue
        if "transpose" in rule:
            tensor = tensor.transpose(*rule["transpose"])
        out[rule["hf"].format(layer=layer)] = tensor
    return out


def under(converted: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The converted tensors under `prefix` (e.g. `layers.0.mlp.`), relative to it."""
    kept = {k[len(prefix) :]: v for k, v in converted.items() if k.startswith(prefix)}
    if not kept:
        raise BackendError(f"NxDI's conversion gave no tensor under {prefix!r}; is the table's module path right?")
    return kept


def nxdi_cast(module: nn.Module, dtype: torch.dtype) -> None:
    """NxDI's model-wide cast (`ModelWrapper`'s `load_module` with `cast_type="config"`, which
    `build_module` leaves out): every floating tensor but fp8 to the config's dtype."""
    if dtype != torch.float32:
        keep = (torch.float8_e4m3fn, torch.float8_e5m2)
        module._apply(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype not in keep else t)


def nxdi_cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """NxDI's cast of a checkpoint with `cast_type="config"` (`get_state_dict`'s `_cast_helper`):
    floating tensors but fp8 and `*scale` to the config's dtype."""
    if dtype == torch.float32:
        return state
    cast = {k for k, v in state.items() if v.is_floating_point() and v.dtype != torch.float8_e4m3fn}
    return {k: v.to(dtype) if k in cast and not k.endswith("scale") else v for k, v in state.items()}


# --hw-option quantized=: NxD's quantization dtype (NeuronConfig's `quantization_dtype`) -> the judge's format
QUANTIZED = {"int8": "int8", "f8e4m3": "e4m3"}


def quantized_state(application: Any, model_dir: Path, config: Any, dtype: str, path: Path) -> dict[str, torch.Tensor]:
    """The quantized state dict NxDI writes for `neuron_config.quantized=True` with per-channel
    symmetric `dtype` (application_base's `save_quantized_state_dict`: the HF model quantized by NxD's
    `quantize_pytorch_model_per_channel_symmetric`, saved to `quantized_checkpoints_path`), read back
    from where NxDI wrote it; the caller's config is untouched."""
    quant = copy.copy(config)
    quant.neuron_config = copy.copy(config.neuron_config)
    settings = {"quantized": True, "quantization_type": "per_channel_symmetric", "quantization_dtype": dtype}
    for name, value in {**settings, "quantized_checkpoints_path": str(path)}.items():
        setattr(quant.neuron_config, name, value)
    try:
        application.save_quantized_state_dict(str(readable(model_dir, path.parent / "hf-view")), quant)
    except NotImplementedError as exc:
        raise BackendError(f"--hw-option quantized={dtype}: NxDI cannot quantize this model ({exc})") from None
    if not path.is_file():
        raise BackendError(f"--hw-option quantized={dtype}: NxDI's save_quantized_state_dict wrote nothing to {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


def readable(model_dir: Path, view: Path) -> Path:
    """The checkpoint as this transformers reads it, for NxDI's `load_hf_model`: itself where the config
    reads as written; else (a config written by transformers 5 on the Neuron stack's 4.57) a view of it,
    its tensors linked and its config as `compat.load_config` reads it."""
    config = compat.load_config(model_dir)
    written = json.loads((model_dir / "config.json").read_text())
    if all(config.to_dict().get(k) == v for k, v in written.items() if not isinstance(v, dict)):
        return model_dir
    view.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.name != "config.json" and not (view / file.name).exists():
            (view / file.name).symlink_to(file.resolve())
    config.to_json_file(str(view / "config.json"))
    return view


def stored_unit(
    state: dict[str, torch.Tensor], layer: int | None, inverse: dict[str, Any], fmt: str
) -> dict[str, Stored]:
    """One unit's quantized tensors of NxDI's quantized state dict (HF module names, less the base
    model's prefix; each quantized weight beside its `scale`), as stored, under the reference's names
    (`prefix`, but for the `top_level` names): a scale per output channel (NxD's [out, 1]) covers its
    row, one of a single element the whole weight."""
    top, prefix = tuple(inverse.get("top_level", ())), inverse.get("prefix", "")
    out: dict[str, Stored] = {}
    for key, scale in state.items():
        weight = state.get(key[: -len("scale")] + "weight")
        if not key.endswith(".scale") or weight is None or weight.dim() != 2:
            continue
        if not (key.startswith(f"layers.{layer}.") if layer is not None else not key.startswith("layers.")):
            continue
        rows, cols = weight.shape
        per_channel = scale.numel() == rows and scale.numel() > 1
        grid = scale.float().reshape(rows, 1) if per_channel else scale.float().reshape(1, 1)
        name = key[: -len("scale")] + "weight"
        stored = Stored(weight.float(), grid, (1, cols) if per_channel else (rows, cols), fmt, "scale", "nxdi-channel")
        out[name if name.startswith(top) else prefix + name] = stored
    return out
