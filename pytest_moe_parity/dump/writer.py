"""A recorder for any framework: dump a candidate's outputs, in the layout `--hw dump` and
`moe-parity compare` read, from inside the candidate's own process (Megatron, NxDI in CPU mode, a
hand-written port, a custom runtime). The glue a port needs is its point map:

    from pytest_moe_parity.dump import record

    points = {
        "embedding": "embed",
        "layer_{layer}.input_norm": "blocks.{layer}.norm1",
        "layer_{layer}.attention": "blocks.{layer}.attn",
        "layer_{layer}.router": "blocks.{layer}.moe.gate",     # (logits, weights, ids), or logits
        "layer_{layer}.moe": "blocks.{layer}.moe",
        "layer_{layer}.output": "blocks.{layer}",
        "final_norm": "norm",
        "logits": "head",
    }
    with record(model, "dump/", points):
        model(prompt_ids)                 # the prefill
        model(next_id, cache=cache)       # decode step 1 (each call of `model` is the next step)

Forward hooks on the named modules keep each one's output (its tensors, moved to the CPU) under the
point id, `step_k.` prefixed at decode step k; a module called more than once in a step keeps its
first call. `recorder.keep_cache(layer, keys, values)` after a decode step keeps what that step's
attention left in the layer's KV cache, compared with the golden's cache write. On a clean exit each
step is written to `prefill.safetensors`, `step_{k}.safetensors` (under `rank{r}/` when
torch.distributed runs with more than one rank, for a map entry with `"ranks"` to gather); an
exception inside the block writes nothing."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BadInput
from ..points import ATTENTION, TEMPLATE_EXAMPLES, in_step, is_point_template, point_id
from ..tree import leaves

__all__ = ["Recorder", "record"]


def _expand(model: nn.Module, points: Mapping[str, str]) -> dict[str, tuple[str, nn.Module]]:
    """Point id -> (module path, module): `{layer}` templates expanded over the model's modules."""
    if not isinstance(points, Mapping) or not points:
        raise BadInput("record(points=...) must map point ids (e.g. 'layer_{layer}.attention') to module paths")
    modules = dict(model.named_modules())
    found: dict[str, tuple[str, nn.Module]] = {}
    for point, path in points.items():
        if not is_point_template(point):
            raise BadInput(f"record(points=...): {point!r} is not a point id ({TEMPLATE_EXAMPLES})")
        if ("{layer}" in point) != ("{layer}" in path):
            raise BadInput(f"record(points=...): {point!r} -> {path!r}: both or neither must hold {{layer}}")
        if "{layer}" not in path:
            if path not in modules:
                raise BadInput(f"record(points=...): the model has no module {path!r} (for {point})")
            found[point] = (path, modules[path])
            continue
        pattern = re.compile(re.escape(path).replace(re.escape("{layer}"), r"(\d+)"))
        matches = [(int(m.group(1)), name) for name in modules if (m := pattern.fullmatch(name))]
        if not matches:
            raise BadInput(f"record(points=...): no module of the model is named like {path!r} (for {point})")
        for layer, name in matches:
            found[point.replace("{layer}", str(layer))] = (name, modules[name])
    return found


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Recorder:
    """What `record` yields: the outputs kept so far, per step (`None`: the prefill)."""

    def __init__(self, model: nn.Module, out_dir: Path, points: Mapping[str, str], *, overwrite: bool):
        self.model = model
        self.out_dir = Path(out_dir)
        self.points = _expand(model, points)
        rank, world = _rank()
        self.rank_dir = self.out_dir / f"rank{rank}" if world > 1 else self.out_dir
        existing = list(self.rank_dir.glob("*.safetensors")) if self.rank_dir.is_dir() else []
        if existing and not overwrite:
            raise BadInput(
                f"{self.rank_dir} already holds a dump ({existing[0].name}); pass overwrite=True or another directory"
            )
        self.step: int | None = None  # None: the prefill; k: decode step k
        self.calls = 0  # calls of the root model so far
        self.outputs: dict[int | None, dict[str, torch.Tensor]] = {}
        self._handles: list[Any] = []

    def _name(self, point: str) -> str:
        return in_step(point, self.step)

    def _keep(self, point: str, output: Any) -> None:
        kept = self.outputs.setdefault(self.step, {})
        name = self._name(point)
        tensors = [t for t in leaves(output) if isinstance(t, torch.Tensor)]
        if not tensors or name in kept or f"{name}.0" in kept:
            return  # a module called again in the same step: its first call counts
        if len(tensors) == 1:
            kept[name] = tensors[0].detach().to("cpu", copy=True).contiguous()
        else:
            kept.update({f"{name}.{i}": t.detach().to("cpu", copy=True).contiguous() for i, t in enumerate(tensors)})

    def keep_cache(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A decoder layer's KV cache after this step's attention wrote it (`[batch, kv_heads,
        positions, head_dim]`, past and this step): kept as `step_k.layer_L.attention.cache.keys` and
        `.values`, and compared with the golden's cache write (a write at the wrong position fails
        that step's attention). Call it inside the block, after the step, for each layer."""
        kept = self.outputs.setdefault(self.step, {})
        name = self._name(point_id(ATTENTION, layer))
        for part, tensor in (("keys", keys), ("values", values)):
            kept[f"{name}.cache.{part}"] = tensor.detach().to("cpu", copy=True).contiguous()

    def next_step(self) -> None:
        """Start the next decode step by hand (for runtimes that do not call the root model)."""
        self.step = 1 if self.step is None else self.step + 1

    def _root_called(self, module: nn.Module, args: Any) -> None:
        if self.calls:
            self.next_step()
        self.calls += 1

    def start(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._root_called))
        for point, (_, module) in self.points.items():
            self._handles.append(module.register_forward_hook(lambda m, a, out, p=point: self._keep(p, out)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def write(self) -> list[Path]:
        """Each step's outputs to its file, written whole or not at all (a temporary name first)."""
        from safetensors.torch import save_file

        try:
            self.rank_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"cannot write the dump to {self.rank_dir} ({exc})") from None
        written = []
        for step, tensors in self.outputs.items():
            if not tensors:
                continue
            path = self.rank_dir / ("prefill.safetensors" if step is None else f"step_{step}.safetensors")
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"writer": "pytest_moe_parity.dump.record"})
            os.replace(tmp, path)
            written.append(path)
        return written


@contextlib.contextmanager
def record(
    model: nn.Module, out_dir: str | Path, points: Mapping[str, str], *, overwrite: bool = False
) -> Iterator[Recorder]:
    """Record the outputs of `model`'s modules named in `points` (point id -> module path, with
    `{layer}` templates) while the block runs, and write them to `out_dir` when it ends cleanly."""
    recorder = Recorder(model, Path(out_dir), points, overwrite=overwrite)
    recorder.start()
    try:
        yield recorder
    finally:  # an exception in the block leaves with the hooks removed and nothing written
        recorder.close()
    if not any(recorder.outputs.values()):
        raise BadInput("record(): no named module ran inside the block; call the model inside `with record(...)`")
    recorder.write()
