"""Where a recording's model lives and what it cost: the placement report printed before the
forward (modules and bytes per device, as accelerate placed them) and the memory report after it
(peak allocated per GPU, peak host RSS)."""

from __future__ import annotations

import resource
import sys
from itertools import chain
from typing import Any

import torch
from torch import nn

from ..host import gib
from ..words import counted


def device_name(device: Any) -> str:
    """accelerate names GPUs by index; torch by `cuda:N`."""
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


def placement(model: nn.Module, device: torch.device | None = None) -> dict[str, dict[str, int]]:
    """Per device: how many modules of accelerate's device map it holds (0 without one) and their
    parameter and buffer bytes; offloaded entries (`cpu`, `disk`), and a model whose weights are
    read as it runs (on `device`), are counted from their meta placeholders, which keep the shapes."""
    device_map = getattr(model, "hf_device_map", None)
    entries = device_map.items() if device_map else [("", device or next(model.parameters()).device)]
    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()  # tied weights count once
    for name, device in entries:
        module = model.get_submodule(name) if name else model
        size = 0
        for t in chain(module.parameters(), module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                size += t.numel() * t.element_size()
        entry = out.setdefault(device_name(device), {"modules": 0, "bytes": 0})
        entry["modules"] += 1 if device_map else 0
        entry["bytes"] += size
    return out


def placement_line(placed: dict[str, dict[str, int]]) -> str:
    if len(placed) == 1 and not next(iter(placed.values()))["modules"]:
        device, entry = next(iter(placed.items()))
        return f"placement: the whole model on {device}, {gib(entry['bytes'])}"
    parts = [
        f"{device} {counted(entry['modules'], 'module')} {gib(entry['bytes'])}" for device, entry in placed.items()
    ]
    return "placement: " + ", ".join(parts)


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peaks(placed: dict[str, dict[str, int]]) -> dict[str, int]:
    """Peak memory per device of the placement after the run: allocated bytes per GPU, the host's RSS."""
    out = {"host_rss": peak_rss_bytes()}
    for device in placed:
        if device.startswith("cuda") and torch.cuda.is_available():
            out[device] = int(torch.cuda.max_memory_allocated(torch.device(device)))
    return out


def memory_line(peak: dict[str, int]) -> str:
    gpus = [f"{device} {gib(size)}" for device, size in peak.items() if device != "host_rss"]
    return f"memory: peak host RSS {gib(peak['host_rss'])}" + (f"; peak allocated {', '.join(gpus)}" if gpus else "")
