"""Stand-ins for the Neuron packages that only a Neuron host has (`torch_neuronx`, `neuronxcc`,
`nki`, `nkilib`, `libneuronxla`), so that NxD's and NxDI's real Python code imports on any CPU
box and runs its CPU-mode paths (`NXD_CPU_MODE=1`: plain-math RMSNorm, no NKI kernel, no trace).

A stand-in is installed only for a package that is not importable: on a Neuron host the real one
wins. Any name read from a stand-in module is another stand-in (a class, so NxD's code can also
subclass it); calling one raises `DeviceOnly`, naming what was called, so a code path that needs
the device can never pass by computing something else. The one exception is a decorator's use at
import time (`@nki.jit` on a kernel, `@nki_jit()`): it gives back a stand-in of the kernel, which
raises when the kernel is called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

ROOTS = ("torch_neuronx", "neuronxcc", "nki", "nkilib", "libneuronxla")


class DeviceOnly(RuntimeError):
    """A stand-in of a Neuron-only package was called on the CPU path."""


def _raise(name: str) -> Any:
    raise DeviceOnly(
        f"{name} needs a Neuron device (torch-neuronx, neuronx-cc or an NKI kernel), which the CPU build of "
        "--hw nxdi stands in for; this code path has no CPU-mode branch in NxDI: run it with --hw-option "
        "build=neuron on a Neuron host"
    )


def _marker(*args: Any) -> Any:
    """NxDI's layer-boundary markers (`models/layer_boundary_marker.py`): a custom call whose output
    is its input, a hint for the compiler's modular flow; on the CPU, the input."""
    return args[0] if len(args) == 1 else args


# Functions NxD and NxDI wrap as device custom calls whose value is plain math: their CPU form.
PLAIN_KERNELS = {"ModuleMarkerStart.forward_impl": _marker, "ModuleMarkerEnd.forward_impl": _marker}


class _Meta(type):
    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = standin(cls.__module__, f"{cls.__qualname__}.{attr}")
        setattr(cls, attr, value)  # one object per name: pickled by reference, found again as itself
        return value

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if len(args) == 1 and callable(args[0]):  # a decorator applied at import time: jit(kernel, mode=...)
            kernel = getattr(args[0], "__qualname__", repr(args[0]))
            if kernel in PLAIN_KERNELS:
                return PLAIN_KERNELS[kernel]
            return standin(cls.__module__, f"{cls.__qualname__}({kernel})")
        short = cls.__qualname__.rsplit(".", 1)[-1]
        if not args and short in DECORATOR_FACTORIES:  # @nki_jit(), @nki.jit(platform_target=...)
            return standin(cls.__module__, f"{cls.__qualname__}()")
        if short[:1].isupper():  # a type (an enum, a kernel's argument record) built as a value at import time
            return super().__call__(*args, **kwargs)
        return _raise(name)

    def __getitem__(cls, item: Any) -> Any:  # annotations such as nl.ndarray[...]
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


# Factories that NxD and NxDI call at import time to build a decorator.
DECORATOR_FACTORIES = frozenset({"jit", "nki_jit", "baremetal", "benchmark", "simulate_kernel", "trace"})


class _Value:
    """An instance of a stand-in type: inert; what is read from it is a stand-in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = (args, kwargs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return standin(type(self).__module__, f"{type(self).__qualname__}().{attr}")


def standin(module: str, qualname: str) -> type:
    """A stand-in named `module.qualname`, the name pickle finds it by."""
    attrs = {"__qualname__": qualname, "__module__": module}
    return _Meta(qualname.rsplit(".", 1)[-1], (_Value,), attrs)


def platform_target() -> str:
    """torch_neuronx's `get_platform_target` is a question about the host, not a device call: the
    Neuron platform whose code paths NxDI takes (`NEURON_PLATFORM_TARGET_OVERRIDE`, as torch_neuronx
    reads it; trn1 otherwise, the plainest paths and the nightly runner's)."""
    return os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")


def custom_allclose(expected: Any, actual: Any, atol: float = 1e-5, rtol: float = 1e-5) -> tuple[bool, float]:
    """torch_neuronx's comparison that NxDI's `check_accuracy_embeddings` calls: "equivalent to
    torch.allclose except rtol is multiplied by absolute max" (NxDI's `utils/accuracy.py`);
    (passed, the largest absolute difference). Plain math, no device."""
    import torch

    expected, actual = torch.as_tensor(expected).double(), torch.as_tensor(actual).double()
    diff = (actual - expected).abs()
    passed = bool((diff <= atol + rtol * expected.abs().max()).all())
    return passed, float(diff.max()) if diff.numel() else 0.0


# What the stand-ins answer for real: host queries that NxD and NxDI make on their CPU paths too,
# and torch_neuronx's plain-math helpers that NxDI's tests call.
HOST_QUERIES = {
    "torch_neuronx.utils.get_platform_target": platform_target,
    "torch_neuronx.utils.utils.get_platform_target": platform_target,
    "torch_neuronx.testing.validation.custom_allclose": custom_allclose,
}


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = HOST_QUERIES.get(f"{self.__name__}.{attr}") or standin(self.__name__, attr)
        setattr(self, attr, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []  # a package: its submodules are stand-ins too
        module.__standin__ = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class Finder(importlib.abc.MetaPathFinder):
    """Finds a stand-in for a Neuron-only package that no other finder has (it sits last)."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def missing_roots() -> tuple[str, ...]:
    """The Neuron-only packages this interpreter cannot import."""
    out = []
    for root in ROOTS:
        module = sys.modules.get(root)
        if module is not None:
            if getattr(module, "__standin__", False):
                out.append(root)
            continue
        if importlib.util.find_spec(root) is None:
            out.append(root)
    return tuple(out)


def install() -> tuple[str, ...]:
    """Puts stand-ins in place of the Neuron-only packages that are missing; returns their names."""
    if importlib.util.find_spec("torch_xla") is not None:
        # torch_xla looks for libneuronxla when it is imported and, finding it, sets up a Neuron
        # device: it must meet the real absence first, then NxD meets the stand-in.
        importlib.import_module("torch_xla")
    roots = missing_roots()
    if roots and not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder(roots))
    if "torch_neuronx" in roots:
        import torch

        # torch_neuronx's native library registers these classes (its compiled-model holders);
        # NxD names them in annotations at import time
        torch.classes.neuron = _Module("torch_neuronx.classes")
    return roots
