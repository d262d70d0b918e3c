"""Weight items: a candidate checkpoint's weights against the reference's, one unit (a decoder
layer, or the model-level modules) at a time, both loaded as transformers loads them (so fused
expert layouts are compared as the model holds them), in float32; what differs is said in words
(`judge.weights.diagnose`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..judge.weights import diagnose, dtype_finding
from ..model.checkpoint import read_tensors
from ..model.lazy_model import LazyModel


class WeightCheck:
    """`findings(layer)` (None: the model-level modules) -> what is wrong, [] when nothing is."""

    def __init__(
        self,
        reference: Path,
        candidate: Path,
        *,
        trust_remote_code: bool = False,
        held: Callable[[int | None], dict[str, torch.Tensor] | None] | None = None,
    ):
        """`held(layer)`: the weights a backend holds for the unit, mapped back to the reference's
        names and layout (a backend that converts them); else the candidate checkpoint is read."""
        self.reference, self.candidate = Path(reference), Path(candidate)
        self.held = held
        self._models: dict[str, LazyModel] = {}
        self._stored = {
            "reference": {t.name: t.dtype for t in read_tensors(self.reference)},
            "candidate": {t.name: t.dtype for t in read_tensors(self.candidate)},
        }
        self.trust_remote_code = trust_remote_code

    def _model(self, which: str) -> LazyModel:
        if which not in self._models:
            path = self.reference if which == "reference" else self.candidate
            self._models[which] = LazyModel(
                path, dtype=torch.float32, max_layers=1, trust_remote_code=self.trust_remote_code
            )
        return self._models[which]

    def _unit_params(self, model: LazyModel, layer: int | None) -> dict[str, torch.Tensor | None]:
        """The unit's parameters by name, loaded (None: the checkpoint lacks it)."""
        paths = [model.unit_path(layer)] if layer is not None else model.model_level_paths()
        params: dict[str, torch.Tensor | None] = {}
        for path in paths:
            try:
                module = model.module(path)
            except CheckpointError:
                module = model.model.get_submodule(path)
            for name, p in module.named_parameters(recurse=layer is not None):
                params[f"{path}.{name}"] = None if p.device.type == "meta" else p
        return params

    def findings(self, layer: int | None) -> list[str]:
        ref = self._unit_params(self._model("reference"), layer)
        held = self.held(layer) if self.held is not None else None
        cand = held if held is not None else self._unit_params(self._model("candidate"), layer)
        stored_cand = self._stored["candidate"]
        layer_of = self._model("reference").layer_of
        out = [  # dtypes as stored, checkpoint key by key
            found
            for key, dtype in self._stored["reference"].items()
            if layer_of(key) == layer and (found := dtype_finding(key, dtype, stored_cand.get(key)))
        ]
        for name, r in ref.items():
            if r is None:
                continue
            out += diagnose(name, r, cand.get(name))
        return out

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()
