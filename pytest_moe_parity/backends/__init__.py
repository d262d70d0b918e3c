"""Candidate backends: turn a capture point into something callable on the candidate hardware and
run it on the golden inputs. Built in: `cpu` and `cuda` (transformers modules, weights read per
layer). Third parties register more under the entry-point group `pytest_moe_parity.backends`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..golden import GoldenRecord, GoldenStore

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


BUILTIN_BACKENDS: dict[str, type[Backend] | str] = {
    "cpu": "pytest_moe_parity.backends.hf:TorchBackend",
    "cuda": "pytest_moe_parity.backends.hf:CudaBackend",
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
