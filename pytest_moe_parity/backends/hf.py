"""The `cpu` and `cuda` backends: the candidate checkpoint's transformers modules, weights read
per layer on demand."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..golden import GoldenRecord
from ..golden.spec import resolve_params
from ..replay.inputs import cast_inputs
from . import Backend, BackendError, BackendOptions, CandidateOutput


class TorchBackend(Backend):
    """The transformers model of the candidate checkpoint, in `--dtype` on `device`."""

    name = "cpu"
    device_type = "cpu"

    def __init__(self, options: BackendOptions):
        super().__init__(options)
        from .lazy_model import LazyModel

        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise BackendError("--hw cuda needs a CUDA device, and torch sees none; use --hw cpu")
        device = options.device if options.device != "cpu" or self.device_type == "cpu" else self.device_type
        self.device = torch.device(device)
        self.lazy = LazyModel(
            options.model_dir, dtype=options.dtype, device=self.device, trust_remote_code=options.trust_remote_code
        )

    def run(self, point: dict[str, Any], golden: GoldenRecord) -> CandidateOutput:
        module = self.lazy.module(point["module"])
        args = resolve_params(cast_inputs(golden.args, self.options.dtype, self.device), self.lazy.model)
        kwargs = resolve_params(cast_inputs(golden.kwargs, self.options.dtype, self.device), self.lazy.model)
        routing: list[Any] = []
        handle = None
        router_point = self.options.golden.router_point(point["layer"])
        if point["component"] in ("moe", "output") and router_point is not None:
            router = self.lazy.module(router_point["module"])
            handle = router.register_forward_hook(lambda m, a, out: routing.append(out))
        started = time.perf_counter()
        try:
            with torch.no_grad():
                output = module(*args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return CandidateOutput(output, tuple(routing[0]) if routing else None, seconds)

    def close(self) -> None:
        self.lazy.close()


class CudaBackend(TorchBackend):
    name = "cuda"
    device_type = "cuda"
