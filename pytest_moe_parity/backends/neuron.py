"""`--hw neuron`: each point compiled for a NeuronCore with `torch_neuronx.trace` (AWS Trainium and
Inferentia), one graph per layer kind with each layer's weights swapped in, one NeuronCore range per
xdist worker. Everything but four torch_neuronx calls is shared with the CPU twins (`compiled.py`):

    torch_neuronx.trace(wrapper, example_inputs, compiler_args=..., compiler_workdir=...,
                        inline_weights_to_neff=False)   # positional tensors only, static shapes
    torch_neuronx.move_trace_to_device(trace, 0)         # weights kept out of the NEFF are not placed
    torch_neuronx.replace_weights(trace, state_dict)     # the next layer's weights, no recompile
    torch.jit.load(path)                                 # a cached trace (its NEFF loads with it)

torch_neuronx is imported only when the first point runs, after this worker's
NEURON_RT_VISIBLE_CORES is set (the runtime reads it once per process)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..points import Point, RangeError, parse_ranges
from . import BackendError, BackendSetup, HwOption, positive_int
from .compiled import CompiledBackend, PointModule

INSTALL = (
    'pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "pytest-moe-parity[neuron]" '
    "(torch-neuronx 2.9 and neuronx-cc, Neuron SDK 2.31; on a trn1/inf2 instance with the Neuron driver "
    "and runtime)"
)
DEV = Path("/dev")
_DEVICE = re.compile(r"neuron(\d+)")


def parse_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES' forms: an index ("3"), a range ("4-7"), or a list of those ("0,2,4-5")."""
    try:
        return parse_ranges(text)
    except RangeError as exc:
        if exc.kind == "number":
            raise ValueError(f"{text!r} is not a NeuronCore index, range or list (e.g. 0, 4-7, 0,2)") from None
        raise ValueError(f"{text!r} is not a NeuronCore range (LOW-HIGH, 0 <= LOW <= HIGH)") from None


def format_cores(cores: list[int]) -> str:
    """A core list as NEURON_RT_VISIBLE_CORES takes it: a range when contiguous, else a list."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def count_devices(dev: Path | None = None) -> int:
    """The Neuron devices the driver exposes: /dev/neuron0, /dev/neuron1, ..."""
    try:
        return sum(1 for e in (dev or DEV).iterdir() if _DEVICE.fullmatch(e.name))
    except OSError:
        return 0


def visible_cores(devices: int, cores_per_device: int, env: dict[str, str] | None = None) -> list[int]:
    """The NeuronCores this process may use: the devices times the cores of a device, narrowed by
    NEURON_RT_VISIBLE_CORES or NEURON_RT_NUM_CORES as the runtime does."""
    env = os.environ if env is None else env
    total = devices * cores_per_device
    if env.get("NEURON_RT_VISIBLE_CORES"):
        return [c for c in parse_cores(env["NEURON_RT_VISIBLE_CORES"]) if c < total]
    if env.get("NEURON_RT_NUM_CORES"):
        return list(range(min(int(env["NEURON_RT_NUM_CORES"]), total)))
    return list(range(total))


class NeuronBackend(CompiledBackend):
    """`--hw neuron`: the candidate checkpoint's transformers modules on a NeuronCore."""

    name = "neuron"
    graph_words = "torch_neuronx.trace"
    options = (
        *CompiledBackend.options,
        HwOption("compiler_args", "neuronx-cc arguments (default: --auto-cast=none)", str, "--auto-cast=none"),
        HwOption("cores_per_worker", "NeuronCores per xdist worker (default: 1)", positive_int, 1),
        HwOption("cores_per_device", "NeuronCores of a Neuron device (default: 2, trn1 and inf2)", positive_int, 2),
        HwOption("devices", "Neuron devices on this host (default: counted from /dev/neuron*)", positive_int),
    )

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        if importlib.util.find_spec("torch_neuronx") is None:
            raise BackendError(f"--hw neuron needs torch-neuronx, which is not installed: {INSTALL}")
        devices = self.hw_options["devices"] or count_devices()
        visible = visible_cores(devices, self.hw_options["cores_per_device"])
        if not visible:
            narrowed = os.environ.get("NEURON_RT_VISIBLE_CORES")
            hint = f" (NEURON_RT_VISIBLE_CORES={narrowed})" if narrowed else ""
            raise BackendError(
                f"--hw neuron: no Neuron device is visible{hint}: no /dev/neuron* here; run on a trn1 or inf2 "
                "instance with the Neuron driver, or choose --hw trace to test the same graphs on the CPU"
            )
        per = self.hw_options["cores_per_worker"]
        if setup.workers * per > len(visible):
            raise BackendError(
                f"--hw neuron: -n {setup.workers} with cores_per_worker={per} needs {setup.workers * per} "
                f"NeuronCores, and {len(visible)} are visible ({format_cores(visible)}); use -n "
                f"{max(1, len(visible) // per)} or fewer"
            )
        index = setup.worker or 0
        self.cores = visible[index * per : (index + 1) * per]
        if setup.worker is not None or setup.workers == 1:  # an xdist controller runs no point
            # Before torch_neuronx is imported: one range per process (processes do not share cores).
            os.environ["NEURON_RT_VISIBLE_CORES"] = format_cores(self.cores)
        self.compiler_args = shlex.split(self.hw_options["compiler_args"])
        self._neuronx: Any = None

    def start(self) -> None:
        try:
            import torch_neuronx
        except ImportError as exc:
            raise BackendError(f"torch_neuronx cannot be imported ({exc}); {INSTALL}") from None
        self._neuronx = torch_neuronx
        super().start()

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "torch_neuronx": getattr(self._neuronx, "__version__", "unknown"),
            "neuronx_cc": _version("neuronx-cc"),
            "compiler_args": self.compiler_args,
        }

    def ran(self, point: Point) -> dict[str, str] | None:
        said = super().ran(point)
        return {**said, "compiler": f"neuronx-cc {self.hw_options['compiler_args']}".strip()} if said else said

    def _compile(self, wrapper: PointModule, inputs: tuple[torch.Tensor, ...], key: str) -> Any:
        workdir = self.cache_root / "neuron-workdir" / key
        trace = self._neuronx.trace(
            wrapper,
            inputs,
            compiler_args=self.compiler_args,
            compiler_workdir=str(workdir),
            inline_weights_to_neff=False,
        )
        self._neuronx.move_trace_to_device(trace, 0)
        return trace

    def _swap(self, handle: Any, state: dict[str, torch.Tensor]) -> None:
        self._neuronx.replace_weights(handle, state)

    def _load(self, path: Path) -> Any:
        trace = torch.jit.load(str(path))
        self._neuronx.move_trace_to_device(trace, 0)
        return trace


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"
