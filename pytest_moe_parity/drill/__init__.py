"""Below a component: its forward op by op on the reference and on the candidate, the op that
introduced the divergence, how much substituting its golden output recovers, and a repro file.

The reference is the golden's model on this machine (as weight items need it), run in float32 on the
point's recorded inputs and again in the candidate's dtype (every op's noise floor), captured op by
op (`capture`). The candidate is the backend's module for the point (`Backend.drill_call`), run on the
same inputs; a backend that compiles runs each op again through its compiler (`Backend.op_runner`),
on its own earlier outputs (chained) and on the reference's (isolated). `match` pairs the two sides'
ops, `engine` judges them."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ParityError
from ..golden import GoldenStore
from ..golden.spec import ParamRef, resolve_params
from ..judge.tolerances import NOISE_FLOOR_EPS
from ..points import ROUTER, Point
from .capture import OpGraph, capture_ops, name_ops
from .engine import Drill, OpRow, run_drill

if TYPE_CHECKING:
    from ..backends import Backend

__all__ = ["Drill", "DrillError", "Driller", "OpRow", "drill_patterns", "selects"]

AUTO = "auto"


class DrillError(ParityError):
    """A drill that cannot run (no reference model here, a backend without modules)."""


def drill_patterns(values: list[str]) -> list[str]:
    """`--parity-drill` values (repeatable, comma-separated) -> patterns."""
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def selects(patterns: list[str], point_id: str) -> bool:
    return any(p != AUTO and fnmatch.fnmatchcase(point_id, p) for p in patterns)


def _cast(obj: Any, dtype: torch.dtype, device: torch.device) -> Any:
    from ..replay.runner import cast_inputs

    return cast_inputs(obj, dtype, device)


class Driller:
    """Drills the points of one run. The reference model (the golden's, float32, on the CPU) is read
    a layer at a time, as the backend reads the candidate."""

    def __init__(
        self,
        golden: GoldenStore,
        reference: Path,
        backend: Backend,
        factor: Callable[[Point], float],
        *,
        trust_remote_code: bool = False,
    ):
        self.golden, self.reference_dir, self.backend = golden, reference, backend
        self.factor = factor
        self.trust_remote_code = trust_remote_code
        self._lazy = None
        self._graphs: dict[str, tuple[OpGraph, OpGraph]] = {}
        self.reproduced: dict[str, float | None] = {}  # point -> the rerun's error against the golden
        self.drills: dict[str, Drill] = {}

    def _reference_model(self):
        if self._lazy is None:
            from ..model.lazy_model import LazyModel

            self._lazy = LazyModel(
                self.reference_dir, dtype=torch.float32, max_layers=1, trust_remote_code=self.trust_remote_code
            )
        return self._lazy

    def reference(self, point: Point) -> tuple[OpGraph, OpGraph]:
        """The reference's ops at `point`: in float32 and in the candidate's dtype."""
        if point.id not in self._graphs:
            record = self.golden.load(point.id)
            lazy = self._reference_model()
            module = lazy.module(point.module)
            args, kwargs = resolve_params(record.args, lazy.model), resolve_params(record.kwargs, lazy.model)
            router = point.component == ROUTER
            names = weight_names(record)
            ref, output = capture_ops(module, args, kwargs, root=point.module, input_names=names)
            self.reproduced[point.id] = _reproduces(record.output, output)
            dtype = self.backend.dtype
            low_module = _cast_copy(module, dtype)
            cpu = torch.device("cpu")
            lookup = _Lookup(lazy.model, low_module, point.module, dtype)
            low_args = resolve_params(_cast(record.args, dtype, cpu), lookup)
            low_kwargs = resolve_params(_cast(record.kwargs, dtype, cpu), lookup)
            low, _ = capture_ops(low_module, low_args, low_kwargs, root=point.module, input_names=names)
            if router:
                name_ops(ref, router=True)
                name_ops(low, router=True)
            self._graphs[point.id] = (ref, low)
        return self._graphs[point.id]

    def op_names(self, point: Point) -> list[str]:
        """The reference's op rows at `point`, in forward order (the drill items)."""
        return [n.name for n in self.reference(point)[0].compute()]

    def drill(self, point: Point) -> Drill:
        if point.id in self.drills:
            return self.drills[point.id]
        ref, low = self.reference(point)
        backend = self.backend
        from ..replay.runner import candidate_inputs

        record = candidate_inputs(self.golden.load(point.id), backend.dtype, backend.device)
        try:
            with backend.drilling():
                module, args, kwargs, same_code = backend.drill_call(point, record)
                names = weight_names(record) if same_code else None
                candidate, _ = capture_ops(module, args, kwargs, root=point.module, input_names=names)
        except NotImplementedError as exc:
            raise DrillError(str(exc)) from None
        if point.component == ROUTER:
            name_ops(candidate, router=True)
        runner = backend.op_runner()
        floor = torch.finfo(backend.dtype).eps / NOISE_FLOOR_EPS if backend.dtype.is_floating_point else 1e-6
        result = run_drill(
            point.id, ref, low, candidate, dtype=backend.dtype, factor=self.factor(point), floor=floor,
            execute=runner, replay_chained=runner is not None, same_code=same_code,
        )  # fmt: skip
        result.reference_error = self.reproduced.get(point.id)
        self.drills[point.id] = result
        return result

    def write_repro(self, drill: Drill, out_dir: Path) -> Path | None:
        """The culprit's repro file (see `repro`), or None where its op cannot be isolated."""
        from .repro import write_repro

        name = drill.culprit
        row = drill.row(name) if name else None
        if row is None:
            return None
        if row.verdict == "missing":  # the candidate's op that goes on without it
            row = next((r for r in drill.rows if r.verdict == "introduced" and r.how), None)
            if row is None:
                return None
        d = getattr(drill, "state", None)
        calls = d.isolated_calls(row.name) if d is not None else None
        if calls is None:
            return None
        cand_call, low_call, ref_node, m = calls
        shape = cand_call[0].value.shape
        expected_candidate = m.to_candidate([ref_node.value], [shape])[0] if len(m.ref) == 1 else ref_node.value
        limit = drill.factor * max(row.isolated_noise or 0.0, d.floor)
        backend = self.backend
        kind = backend.name if backend.name in ("compile", "trace", "neuron") else "eager"
        runner = {"kind": kind, "compiler": backend.hw_options.get("compiler"), "device": str(backend.device)}
        figures = {"isolated": row.isolated, "isolated_noise": row.isolated_noise, "dtype": drill.dtype}
        path = write_repro(
            out_dir, drill.point, row.name, cand_call, low_call, ref_node.value, expected_candidate, limit, runner,
            figures,
        )  # fmt: skip
        drill.repro = str(path)
        return path

    def close(self) -> None:
        if self._lazy is not None:
            self._lazy.close()
            self._lazy = None


def weight_names(record: Any) -> list[str | None]:
    """Per tensor of a golden call (pytree order), the weight's name where the module received one
    as an argument (a ParamRef), else None."""
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten((list(record.args), dict(record.kwargs)))[0]
    return [x.name if isinstance(x, ParamRef) else None for x in leaves if isinstance(x, torch.Tensor | ParamRef)]


def _cast_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `module` in `dtype`, its weights cast straight into the copy (not copied, then cast)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype) if p.is_floating_point() else p.detach(), False)
    return copy.deepcopy(module, memo).to(dtype)


def _reproduces(golden: Any, rerun: Any) -> float | None:
    """The rerun's first output against the golden's (relative L2), or None where there is none."""
    from torch.utils._pytree import tree_flatten

    from .match import rel_l2

    g = next((t for t in tree_flatten(golden)[0] if isinstance(t, torch.Tensor)), None)
    r = next((t for t in tree_flatten(rerun)[0] if isinstance(t, torch.Tensor)), None)
    if g is None or r is None or g.numel() != r.numel():
        return None
    return rel_l2(r.reshape(g.shape), g)


class _Lookup:
    """ParamRef names (from the model root) resolved on the cast copy of the point's module, or on
    the model (cast) for a tensor outside it."""

    def __init__(self, model: torch.nn.Module, module: torch.nn.Module, path: str, dtype: torch.dtype):
        self.model, self.module, self.prefix, self.dtype = model, module, path + "." if path else "", dtype

    def __call__(self, name: str) -> torch.Tensor:
        from ..golden.spec import named_tensor

        if self.prefix and name.startswith(self.prefix):
            return named_tensor(self.module, name[len(self.prefix) :])
        value = named_tensor(self.model, name)
        return value.to(self.dtype) if value.is_floating_point() else value
