"""Candidate backends: turn a capture point into something callable on the candidate hardware and
run it on the golden inputs. Built in: `cpu` and `cuda` (transformers modules, weights read per
layer). Third parties register more under the entry-point group `pytest_moe_parity.backends`."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..golden.store import GoldenRecord, GoldenStore
from ..record.capture import ParamRef, map_structure, resolve_params

ENTRY_POINT_GROUP = "pytest_moe_parity.backends"


class BackendError(RuntimeError):
    """The backend cannot be set up (missing package, device, or an unusable candidate)."""


class PointUnavailable(LookupError):
    """The backend has nothing for this point (e.g. a dump that lacks it): the item is skipped."""


@dataclass
class BackendOptions:
    golden: GoldenStore
    model_dir: Path
    dtype: torch.dtype
    device: str = "cpu"
    trust_remote_code: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CandidateOutput:
    """What the candidate produced for one point; `routing` holds the candidate's own router
    output (logits, weights, top-k ids) when the point contains a router and the backend can see it."""

    output: Any
    routing: tuple[torch.Tensor, ...] | None = None
    seconds: float = 0.0


class Backend(ABC):
    """One per session (per xdist worker), created lazily on the first parity item."""

    name: ClassVar[str] = "?"
    # False for backends whose candidate is not a transformers checkpoint (e.g. a dump directory):
    # no config comparison, and --model is required.
    needs_checkpoint: ClassVar[bool] = True

    def __init__(self, options: BackendOptions):
        self.options = options

    @classmethod
    def default_dtype(cls, options: BackendOptions) -> torch.dtype | None:
        """The candidate's dtype when --dtype is not given (None: the golden's)."""
        return None

    @classmethod
    def check_options(cls, options: BackendOptions) -> None:
        """Validate the options up front (raise BackendError with one sentence); cheap, no weights."""
        return None

    @abstractmethod
    def run(self, point: dict[str, Any], golden: GoldenRecord) -> CandidateOutput:
        """Run the candidate's module for `point` on the golden inputs of `golden`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _cast_input(t: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Golden tensors to the candidate's dtype and device. Additive-mask entries at the golden
    dtype's minimum map to the candidate dtype's minimum, as the candidate would build them."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point() and t.dtype != dtype:
        low = torch.finfo(t.dtype).min
        masked = t == low
        t = t.to(dtype)
        if bool(masked.any()):
            t = t.masked_fill(masked, torch.finfo(dtype).min)
    return t.to(device)


def cast_inputs(obj: Any, dtype: torch.dtype, device: torch.device) -> Any:
    return map_structure(obj, lambda leaf: leaf if isinstance(leaf, ParamRef) else _cast_input(leaf, dtype, device))


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


BUILTIN_BACKENDS: dict[str, type[Backend] | str] = {
    "cpu": TorchBackend,
    "cuda": CudaBackend,
    "dump": "pytest_moe_parity.backends.dump:DumpBackend",
}


def available_backends() -> dict[str, Any]:
    """Built-in backends plus entry points (loaded lazily: value is a class or an EntryPoint)."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = dict(BUILTIN_BACKENDS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def backend_class(name: str) -> type[Backend]:
    backends = available_backends()
    if name not in backends:
        raise KeyError(name)
    value = backends[name]
    if not isinstance(value, type):
        try:
            if isinstance(value, str):
                import importlib

                module, _, attr = value.partition(":")
                value = getattr(importlib.import_module(module), attr)
            else:
                value = value.load()
        except ImportError as exc:
            raise BackendError(f"backend {name!r} cannot be imported ({exc})") from None
    if not (isinstance(value, type) and issubclass(value, Backend)):
        raise BackendError(f"entry point {name!r} in {ENTRY_POINT_GROUP} is not a pytest_moe_parity Backend")
    return value
