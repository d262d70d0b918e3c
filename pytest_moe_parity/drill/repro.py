"""`--parity-repro DIR`: for a drill's culprit, a standalone pytest file and a safetensors file with
the op's inputs (the reference's values, as the candidate's op received them) and the reference's
output. It needs neither the golden nor the model: `test_reference` runs the reference's op in the
candidate's dtype and passes, `test_candidate` runs the candidate's op as the candidate runs it (its
device, or its compiler: `torch.compile` with the same backend, `torch.jit.trace`,
`torch_neuronx.trace`) and fails. The file to attach to a compiler or kernel bug report, unless the
culprit's difference is a constant it is given (a number, a flag, a one-element tensor: a value made,
not computed from the inputs, `explain.differing_constants`): then the file, and the drill's `repro:`
line, say it is a constant that differs, with both values, and no kernel bug."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils._pytree import tree_flatten, treespec_dumps

from .capture import OpNode


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format | torch.layout):
        return {"repr": str(value).removeprefix("torch.")}
    if isinstance(value, float) and value != value:
        return {"float": "nan"}
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return {"float": str(value)}
    return {"value": value}


def _call(prefix: str, node: OpNode, args: list, kwargs: dict, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    leaves, spec = tree_flatten((args, kwargs))
    encoded = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            name = f"{prefix}.{i}"
            tensors[name] = leaf.detach().to("cpu").contiguous().clone()
            encoded.append({"tensor": name})
        else:
            encoded.append(_encode(leaf))
    op = node.func
    return {
        "op": f"{op.namespace}.{op._opname}.{op._overloadname}",
        "spec": treespec_dumps(spec),
        "leaves": encoded,
    }


def write_repro(
    out_dir: Path,
    point: str,
    op_name: str,
    candidate: tuple[OpNode, list, dict],
    reference: tuple[OpNode, list, dict],
    expected: torch.Tensor,
    expected_candidate: torch.Tensor,
    limit: float,
    runner: dict[str, Any],
    figures: dict[str, Any],
    constants: list[dict[str, Any]] | None = None,
) -> Path:
    """Write `test_<point>__<op>.py` and its `.safetensors`; returns the test file's path. `constants`:
    the culprit's constants that differ from the reference's op's ({"where", "reference", "candidate"})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "test_" + re.sub(r"[^0-9A-Za-z]+", "_", f"{point}__{op_name}").strip("_")
    tensors: dict[str, torch.Tensor] = {
        "expected": expected.detach().to("cpu", torch.float32).contiguous().clone(),
        "expected_candidate": expected_candidate.detach().to("cpu", torch.float32).contiguous().clone(),
    }
    meta = {
        "point": point,
        "op": op_name,
        "candidate": _call("candidate", *candidate, tensors),
        "reference": _call("reference", *reference, tensors),
        "limit": limit,
        "runner": runner,
        "figures": figures,
        "constants": constants or [],
    }
    save_file(tensors, str(out_dir / f"{stem}.safetensors"), metadata={"format": "pt"})
    path = out_dir / f"{stem}.py"
    text = _TEMPLATE.replace("@CAUSE@", _cause(constants or [])).replace("@STEM@", stem)
    path.write_text(text.replace("@META@", json.dumps(meta, indent=1, default=str)))
    return path


def constants_said(constants: list[dict[str, Any]]) -> str:
    """The repro's cause where it is constants that differ, in words ("" where it is none)."""
    if not constants:
        return ""
    values = "; ".join(f"{c['where']} is {c['candidate']!r} in the candidate, {c['reference']!r} in the reference"
                       for c in constants)  # fmt: skip
    return f"a constant that differs, not a kernel bug: {values}"


def _cause(constants: list[dict[str, Any]]) -> str:
    """The repro's docstring paragraph on its cause."""
    if not constants:
        return "Attach it to a compiler or kernel bug report."
    return (
        f"Its cause is {constants_said(constants)}. A constant is a value made, not computed from the\n"
        "inputs: fix the value the port gives the op (its config, its code); there is no kernel bug to report."
    )


_TEMPLATE = '''"""Repro written by pytest-moe-parity's drill: @STEM@.

The candidate's op, fed the reference's values of its inputs, differs from the reference's output by
more than the reference's own rounding allows (the limit below); the reference's op, run the same way
in the candidate's dtype, stays within it. Needs torch and safetensors only:

    pytest @STEM@.py        # test_reference passes, test_candidate fails

@CAUSE@
"""

import importlib
import json
import pathlib

import torch
from safetensors.torch import load_file
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_loads

META = json.loads(r"""@META@""")
DATA = load_file(str(pathlib.Path(__file__).with_suffix(".safetensors")))


def _leaf(leaf):
    if "tensor" in leaf:
        return DATA[leaf["tensor"]]
    if "dtype" in leaf:
        return getattr(torch, leaf["dtype"])
    if "device" in leaf:
        return torch.device(leaf["device"])
    if "repr" in leaf:
        return getattr(torch, leaf["repr"])
    if "float" in leaf:
        return float(leaf["float"])
    return leaf["value"]


def _op(call):
    namespace, name, overload = call["op"].split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _arguments(call):
    return tree_unflatten([_leaf(x) for x in call["leaves"]], treespec_loads(call["spec"]))


def _first(out):
    leaves, _ = tree_flatten(out)
    return next(x for x in leaves if isinstance(x, torch.Tensor))


def _rel_l2(out, expected):
    out, expected = out.detach().double().cpu().reshape(expected.shape), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def _compiled(call):
    """The candidate's op as the candidate runs it."""
    op, (args, kwargs) = _op(call), _arguments(call)
    runner = META["runner"]
    device = torch.device(runner.get("device", "cpu"))
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    inputs = tuple(leaves[i].to(device) for i in at)

    def fn(*tensors):
        filled = list(leaves)
        for i, t in zip(at, tensors):
            filled[i] = t
        a, k = tree_unflatten(filled, spec)
        return _first(op(*a, **k)).clone()

    kind = runner.get("kind", "eager")
    if kind == "compile":
        backend = runner.get("compiler") or "inductor"
        if ":" in backend:
            module, _, attr = backend.partition(":")
            backend = getattr(importlib.import_module(module), attr)
        return torch.compile(fn, dynamic=False, backend=backend)(*inputs)
    if kind == "trace":
        return torch.jit.trace(fn, inputs, check_trace=False)(*inputs)
    if kind == "neuron":
        import torch_neuronx

        return torch_neuronx.trace(fn, inputs)(*inputs)
    return fn(*inputs)


def test_reference():
    call = META["reference"]
    args, kwargs = _arguments(call)
    error = _rel_l2(_first(_op(call)(*args, **kwargs)), DATA["expected"])
    assert error <= META["limit"], f"the reference's own op: rel_l2 {error:.4g} > {META['limit']:.4g}"


def test_candidate():
    error = _rel_l2(_compiled(META["candidate"]), DATA["expected_candidate"])
    given = "; ".join(
        f"{c['where']} is {c['candidate']!r} in the candidate, {c['reference']!r} in the reference"
        for c in META["constants"]
    )
    cause = f" (a constant that differs, not a kernel bug: {given})" if given else ""
    assert error <= META["limit"], (
        f"{META['point']}::{META['op']}: the candidate's {META['candidate']['op']}{cause} gives rel_l2 "
        f"{error:.4g} against the reference's float32 output; the reference's own op in the candidate's dtype "
        f"stays within {META['limit']:.4g}"
    )
'''
