"""A test double of torch_neuronx: the documented contract of the four calls `--hw neuron` makes,
enforced, with the graph run on the CPU (torch.jit.trace stands in for neuronx-cc). It holds what
AWS documents for torch-neuronx 2.9 (see shared/NEURON.md, section 1):

- `trace(func, example_inputs, *_, input_output_aliases={}, compiler_workdir=None, compiler_args=None,
  partitioner_config=None, inline_weights_to_neff=True, cpu_backend=False)` -> `torch.jit.ScriptModule`;
  example inputs are a tensor or a tuple of tensors, passed positionally; the options by keyword.
- A trace runs with positional tensors of the traced shapes and dtypes only (static shapes).
- With `inline_weights_to_neff=False` the weights are not placed with the NEFF: the trace must be
  moved with `move_trace_to_device(trace, device_id)` (in place, returns None) before it runs.
- `replace_weights(trace, weights)` works only on a weight-separated trace; `weights` is a module or
  a state dict whose keys are the trace's state_dict names; in place.

Every call is appended to `calls` as (name, details) so tests can check the order and arguments.
`NEURON_DOUBLE_LOG`, when set, names a file to which the import appends this process's
NEURON_RT_VISIBLE_CORES (one line per import), so tests see what each xdist worker was given.
"""

from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

__version__ = "2.9.0.2.15.32035+double"

calls: list[tuple[str, dict[str, Any]]] = []

if os.environ.get("NEURON_DOUBLE_LOG"):
    with open(os.environ["NEURON_DOUBLE_LOG"], "a") as _log:
        _log.write(f"{os.getpid()} {os.environ.get('NEURON_RT_VISIBLE_CORES', '')}\n")


class ContractError(AssertionError):
    """The caller broke the documented contract of torch_neuronx."""


_STATE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_CHECKED: dict[type, type] = {}


def _signature(tensors: tuple[torch.Tensor, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _checked_call(self, *args: Any, **kwargs: Any) -> Any:
    state = _STATE.get(self)
    if state is None:
        raise ContractError("this ScriptModule did not come from torch_neuronx.trace or move_trace_to_device")
    if kwargs:
        raise ContractError(f"a Neuron trace takes positional tensors only, got keyword arguments {sorted(kwargs)}")
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise ContractError("a Neuron trace takes tensors only")
    if state["separated"] and not state["placed"]:
        raise ContractError("inline_weights_to_neff=False: move the trace with move_trace_to_device before running it")
    signature = _signature(args)
    if state["example"] is None:
        state["example"] = signature
    elif signature != state["example"]:
        raise ContractError(f"static shapes: traced with {state['example']}, called with {signature}")
    state["runs"] += 1
    return type(self).__mro__[1].__call__(self, *args)


def _track(module: Any, *, example: Any, separated: bool) -> None:
    cls = type(module)
    if cls not in _CHECKED.values():
        checked = _CHECKED.setdefault(cls, type(f"Neuron{cls.__name__}", (cls,), {"__call__": _checked_call}))
        object.__setattr__(module, "__class__", checked)  # a traced module forwards setattr inside
    _STATE[module] = {"example": example, "separated": separated, "placed": False, "runs": 0}


def trace(
    func: Any,
    example_inputs: Any,
    *_: Any,
    input_output_aliases: dict | None = None,
    compiler_workdir: str | os.PathLike | None = None,
    compiler_args: str | list[str] | None = None,
    partitioner_config: Any = None,
    inline_weights_to_neff: bool = True,
    cpu_backend: bool = False,
) -> torch.jit.ScriptModule:
    if _:
        raise ContractError("trace(func, example_inputs, ...): its options are keyword-only")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise ContractError("example_inputs must be a tensor or a flat tuple of tensors (no kwargs, None or nesting)")
    if any(t.device.type != "cpu" for t in inputs):
        raise ContractError("example_inputs must be CPU tensors")
    if compiler_args is not None and not (
        isinstance(compiler_args, str)
        or (isinstance(compiler_args, list) and all(isinstance(a, str) for a in compiler_args))
    ):
        raise ContractError("compiler_args must be a string or a list of strings")
    if cpu_backend:
        raise ContractError("cpu_backend=True compiles without a device and needs compiler_args='--target trn1'")
    if compiler_workdir is not None:
        workdir = Path(compiler_workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "graph.neff").write_bytes(b"NEFF (double)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        traced = torch.jit.trace(func, inputs, check_trace=False)
    _track(traced, example=_signature(inputs), separated=not inline_weights_to_neff)
    calls.append(
        (
            "trace",
            {
                "inputs": _signature(inputs),
                "compiler_args": compiler_args,
                "compiler_workdir": str(compiler_workdir) if compiler_workdir is not None else None,
                "inline_weights_to_neff": inline_weights_to_neff,
                "module": traced,
            },
        )
    )
    return traced


def move_trace_to_device(trace: Any, device_id: int) -> None:
    if not isinstance(trace, torch.jit.ScriptModule):
        raise ContractError("move_trace_to_device takes the ScriptModule that trace (or torch.jit.load) returned")
    if not isinstance(device_id, int) or isinstance(device_id, bool) or device_id < 0:
        raise ContractError("device_id must be a NeuronCore index (an int >= 0, relative to the visible cores)")
    if trace not in _STATE:  # a trace loaded with torch.jit.load: its NEFF loads with it
        _track(trace, example=None, separated=True)
    _STATE[trace]["placed"] = True
    calls.append(("move_trace_to_device", {"device_id": device_id, "module": trace}))


def replace_weights(neuron_model: Any, weights: Any) -> None:
    state = _STATE.get(neuron_model)
    if state is None:
        raise ContractError("replace_weights takes a trace made by torch_neuronx.trace")
    if not state["separated"]:
        raise ContractError("replace_weights works only on traces made with inline_weights_to_neff=False")
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ContractError("weights must be an nn.Module or a dict of tensors")
    expected = neuron_model.state_dict()
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise ContractError(
            f"weights must carry the trace's state_dict names: missing {missing[:4]}, extra {extra[:4]}"
        )
    for name, value in weights.items():
        if value.shape != expected[name].shape or value.dtype != expected[name].dtype:
            raise ContractError(f"{name}: {tuple(value.shape)} {value.dtype} instead of {tuple(expected[name].shape)}")
    neuron_model.load_state_dict(weights)
    calls.append(("replace_weights", {"keys": sorted(weights), "module": neuron_model, "weights": dict(weights)}))
