"""An accelerate placement (`--device-map`, `--max-memory`, `--offload-folder`) built one unit at a
time: the device map transformers would compute, each unit read from the checkpoint with
transformers' own conversion and put where the map says (a GPU, the host, or the offload folder),
then accelerate's hooks. `from_pretrained` gives the same model, but maps every shard while it
converts and re-saves the offloaded weights, so its peak host memory is about the checkpoint's size
whatever the caps; this one holds what the map keeps on the host and one unit in flight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BadInput
from ..host import malloc_trim
from ..model.lazy_model import LazyModel
from .memory import device_name


def does_not_fit(model_dir: Path) -> BadInput:
    return BadInput(
        f"{model_dir} does not fit in the memory --max-memory gives; pass --offload-folder DIR "
        "for accelerate to offload the rest to disk"
    )


def _tensors(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module, str, bool]]:
    """(full name, owning module, slot name, is a parameter) of a unit's parameters and persistent
    buffers."""
    out = []
    for path, sub in module.named_modules(prefix=prefix):
        for name in sub._parameters:
            if sub._parameters[name] is not None:
                out.append((f"{path}.{name}" if path else name, sub, name, True))
        for name in sub._buffers:
            if sub._buffers[name] is not None and name not in sub._non_persistent_buffers_set:
                out.append((f"{path}.{name}" if path else name, sub, name, False))
    return out


def dispatch_by_unit(
    model_dir: Path,
    config: Any,
    *,
    dtype: torch.dtype,
    device_map: str,
    max_memory: dict | None,
    offload_folder: Path | None,
    trust_remote_code: bool,
) -> nn.Module:
    """The reference placed by accelerate, read one unit at a time (see the module docstring)."""
    from transformers.integrations.accelerate import (
        _get_device_map,
        accelerate_dispatch,
        expand_device_map,
        offload_weight,
    )

    lazy = LazyModel(
        model_dir,
        dtype=dtype,
        device="cpu",
        trust_remote_code=trust_remote_code,
        config=config,
        max_layers=None,
    )
    model = lazy.model
    placed = _get_device_map(model, device_map, max_memory, None)
    if "disk" in placed.values() and offload_folder is None:
        raise does_not_fit(model_dir)
    index: dict[str, Any] = {}
    units: list[Any] = [*lazy.model_level_paths(), *range(lazy.num_layers)]
    for unit in units:
        prefix = lazy.unit_path(unit)
        lazy.ensure(unit)
        tensors = _tensors(model.get_submodule(prefix), prefix)
        where = expand_device_map(placed, [name for name, *_ in tensors])
        for name, owner, slot, is_param in tensors:
            device = where[name]
            value = owner._parameters[slot] if is_param else owner._buffers[slot]
            if device == "cpu" or (device == "disk" and not is_param):
                continue  # buffers stay in memory, as from_pretrained keeps them (offload_buffers=False)
            if device == "disk":
                index = offload_weight(value.data, name, str(offload_folder), index)
                new = torch.empty_like(value, device="meta")
            else:
                new = value.data.to(device_name(device))
            if is_param:
                owner._parameters[slot] = nn.Parameter(new, requires_grad=False)
            else:
                owner._buffers[slot] = new
        malloc_trim()
    model.hf_device_map = placed
    if len(set(placed.values())) > 1 or "disk" in placed.values():
        accelerate_dispatch(model, None, placed, str(offload_folder) if offload_folder else None, index, False)
    else:  # one device: the model simply lives there
        model.to(device_name(next(iter(placed.values()))))
    return model.eval()
