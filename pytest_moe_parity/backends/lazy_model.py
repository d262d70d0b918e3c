"""A candidate transformers model whose weights are read per layer on demand: the skeleton lives
on the meta device, and asking for a module reads only that layer's tensors from the sharded
safetensors checkpoint (through its index), converted to the model's layout as transformers
converts them (e.g. per-expert hub tensors fused into 3-D expert weights)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The candidate checkpoint cannot be read (missing, not safetensors, lacks a layer)."""


@dataclass
class ReadStats:
    """What was read from the checkpoint, for tests and benchmarks."""

    keys: list[str] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    bytes: int = 0


def weight_map(model_dir: Path) -> dict[str, str]:
    """Checkpoint key -> shard file name, from the index or the single safetensors file."""
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
        return dict(mapping)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as fh:
            return dict.fromkeys(fh.keys(), SINGLE_FILE)
    raise CheckpointError(
        f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; the candidate must be a safetensors checkpoint"
    )


class LazyModel:
    """A transformers causal LM built on the meta device; `module(path)` materialises the weights
    of the unit (decoder layer or model-level module) that contains `path`, once."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
        config=None,
        max_layers: int = 2,
    ):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self.config = config or AutoConfig.from_pretrained(self.model_dir, trust_remote_code=trust_remote_code)
        self.weight_map = weight_map(self.model_dir)
        self.stats = ReadStats()
        # Parameters on meta, buffers (rotary inv_freq, ...) real: they are computed, not loaded.
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(
                self.config, attn_implementation="eager", dtype=dtype, trust_remote_code=trust_remote_code
            )
        model.config._experts_implementation = "eager"
        self.model = model.eval()
        if self.device.type != "cpu":
            for module in self.model.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None:
                        module._buffers[name] = buf.to(self.device)
        from ..record.archs import plan_points

        self.plan = plan_points(self.model, self.config)
        # "model.layers": the decoder stack, the parent of every layer's `output` point
        self._layers_path = next(p.module.rsplit(".", 1)[0] for p in self.plan.points if p.component == "output")
        layers_name = self._layers_path.rsplit(".", 1)[-1]
        self._layer_re = re.compile(rf"(?:^|\.){re.escape(layers_name)}\.(\d+)\.")
        # Checkpoint keys by decoder layer (None: model-level), grouped once rather than per load.
        self._keys_by_layer: dict[int | None, list[str]] = {}
        for key in self.weight_map:
            self._keys_by_layer.setdefault(self.layer_of_key(key), []).append(key)
        self._loaded: set[str] = set()
        self._layer_lru: list[str] = []
        self.max_layers = max(1, max_layers)
        self.evicted: list[str] = []
        self._handles: dict[str, Any] = {}

    # -- which checkpoint keys belong to which unit ----------------------------------------------
    def layer_of_key(self, key: str) -> int | None:
        m = self._layer_re.search(key)
        return int(m.group(1)) if m else None

    def unit_of(self, module_path: str) -> str:
        """`layer_<i>` for anything inside decoder layer i, else the module path itself."""
        m = self._layer_re.search(module_path + ".")
        return f"layer_{m.group(1)}" if m else module_path

    def _keys_for(self, unit: str) -> list[str]:
        if unit.startswith("layer_"):
            return list(self._keys_by_layer.get(int(unit.removeprefix("layer_")), []))
        # A model-level module: its own keys, with or without the base-model prefix.
        short = unit.split(".", 1)[1] if "." in unit else unit
        return [k for k in self._keys_by_layer.get(None, []) if k.startswith((unit + ".", short + "."))]

    # -- loading --------------------------------------------------------------------------------
    def module(self, path: str) -> nn.Module:
        """The submodule at `path`, with the weights of its unit loaded."""
        self.ensure(self.unit_of(path))
        return self.model.get_submodule(path)

    def _unit_module(self, unit: str) -> nn.Module:
        if unit.startswith("layer_"):
            return self.model.get_submodule(f"{self._layers_path}.{unit.removeprefix('layer_')}")
        return self.model.get_submodule(unit)

    def ensure(self, unit: str) -> None:
        if unit in self._loaded:
            if unit in self._layer_lru:  # most recently used last
                self._layer_lru.remove(unit)
                self._layer_lru.append(unit)
            return
        keys = self._keys_for(unit)
        target = self._unit_module(unit)
        if unit.startswith("layer_"):
            self._evict(keep=self.max_layers - 1)
        if keys:
            self._load_keys(keys)
        self._tie_if_needed(unit, target)
        missing = [n for n, p in target.named_parameters() if p.device.type == "meta"]
        if missing:
            raise CheckpointError(
                f"{self.model_dir} lacks weights for {unit}: {', '.join(missing[:4])}"
                + (" ..." if len(missing) > 4 else "")
            )
        self._loaded.add(unit)
        if unit.startswith("layer_"):
            self._layer_lru.append(unit)

    def _evict(self, keep: int) -> None:
        """Put the least recently used layers' parameters back on the meta device, so a run over
        every layer of a huge model holds `max_layers` layers in memory, not the model."""
        while len(self._layer_lru) > max(keep, 0):
            unit = self._layer_lru.pop(0)
            for module in self._unit_module(unit).modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        module._parameters[name] = nn.Parameter(
                            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                        )
            self._loaded.discard(unit)
            self.evicted.append(unit)

    def _tie_if_needed(self, unit: str, target: nn.Module) -> None:
        """lm_head tied to the embedding: load the embedding and share its weight."""
        out_emb = self.model.get_output_embeddings()
        if target is not out_emb or not getattr(self.config, "tie_word_embeddings", False):
            return
        if out_emb.weight.device.type != "meta":
            return
        in_emb = self.model.get_input_embeddings()
        emb_path = next(n for n, m in self.model.named_modules() if m is in_emb)
        self.ensure(emb_path)
        out_emb.weight = in_emb.weight

    def _handle(self, file: str):
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            path = self.model_dir / file
            if not path.is_file():
                raise CheckpointError(f"{path} (named by the checkpoint index) is missing")
            h = self._handles[file] = safe_open(str(path), framework="pt")
        return h

    def _load_keys(self, keys: list[str]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        state: dict[str, Any] = {}
        for key in keys:
            file = self.weight_map[key]
            handle = self._handle(file)
            sl = handle.get_slice(key)
            state[key] = sl
            self.stats.keys.append(key)
            self.stats.files.add(file)
            numel = 1
            for d in sl.get_shape():
                numel *= d
            self.stats.bytes += numel * _dtype_size(sl.get_dtype())
        config = LoadStateDictConfig(
            dtype=self.dtype,
            dtype_plan=self.model._get_dtype_plan(self.dtype),
            device_map={"": self.device},
            weight_mapping=get_model_conversion_mapping(self.model),
        )
        convert_and_load_state_dict_in_model(self.model, state, config)

    @property
    def loaded_units(self) -> set[str]:
        return set(self._loaded)

    def close(self) -> None:
        self._handles.clear()


_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _dtype_size(name: str) -> int:
    return _DTYPE_SIZES.get(name, 1)
