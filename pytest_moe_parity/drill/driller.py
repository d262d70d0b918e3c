"""The drill of a run's points (`Driller`): the reference's ops of a point (captured here on the
golden's model, or read from the golden), the candidate's (`Backend.drill_call`, checked against its
contract), and the drill that judges them (`engine.run_drill`), once per point; the culprit's repro
file."""

from __future__ import annotations

import fnmatch
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import compat
from ..dtypes import dtype_name
from ..errors import ParityError
from ..golden import GoldenStore
from ..golden.spec import ParamRef, resolve_params
from ..judge.distance import rel_l2
from ..judge.tolerances import noise_floor
from ..model.calls import with_cache_kwarg, with_live_caches
from ..points import ROUTER, Point
from ..replay.runner import candidate_inputs, cast_inputs
from ..report.drill import Drill
from ..tree import first_tensor
from . import store
from .capture import LAYOUT_OPS, OpGraph, capture_ops, extend
from .engine import Reference
from .made import named_inputs
from .ranks import join_ranks
from .verdicts import run_drill

if TYPE_CHECKING:
    from ..backends import Backend

AUTO = "auto"
OTHER_CODE_FLOOR = 1e-5  # the least noise an op of a port's own code is judged against (float32)


class DrillError(ParityError):
    """A drill that cannot run (no reference model here, a backend without modules)."""


def drill_patterns(values: list[str]) -> list[str]:
    """`--parity-drill` values (repeatable, comma-separated) -> patterns."""
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def drill_ops_command(golden: Path, points: str, dtype: torch.dtype) -> str:
    """The `moe-parity drill-ops` command that records the reference's ops of `points` in `dtype`,
    as it is pasted."""
    return shlex.join(["moe-parity", "drill-ops", str(golden), "--points", points, "--dtype", dtype_name(dtype)])


def selects(patterns: list[str], point_id: str) -> bool:
    return any(p != AUTO and fnmatch.fnmatchcase(point_id, p) for p in patterns)


def _router(point: Point) -> bool | None:
    """A router point's ops are named by step; elsewhere a router is found by its module path."""
    return True if point.component == ROUTER else None


class Driller:
    """Drills the points of one run. The reference model (the golden's, float32, on the CPU) is read
    a layer at a time, as the backend reads the candidate; where the golden holds the reference's
    ops of a point (`store`), they are read instead. `reference`: the golden's model (None: not on
    this machine); `backend`: the candidate's (None: only `capture`, for `moe-parity drill-ops`)."""

    def __init__(
        self,
        golden: GoldenStore,
        reference: Path | None,
        backend: Backend | None,
        *,
        trust_remote_code: bool = False,
    ):
        self.golden, self.reference_dir, self.backend = golden, reference, backend
        self.trust_remote_code = trust_remote_code
        self._lazy: dict[torch.dtype, Any] = {}
        self._references: dict[str, Reference] = {}
        self.reproduced: dict[str, float | None] = {}  # point -> the rerun's error against the golden
        self.drills: dict[str, Drill] = {}

    def _reference_model(self, dtype: torch.dtype = torch.float32):
        """The golden's model read a layer at a time: in float32, and in the candidate's dtype as
        transformers loads it there (modules it keeps in float32 stay so)."""
        if dtype not in self._lazy:
            from ..model.lazy_model import LazyModel

            self._lazy[dtype] = LazyModel(
                self.reference_dir, dtype=dtype, max_layers=1, trust_remote_code=self.trust_remote_code
            )
        return self._lazy[dtype]

    def _reference_call(
        self, point: Point, record: Any, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.nn.Module, list, dict]:
        """The golden's call at `point` on the reference's module in `dtype` (inputs cast to it)."""
        lazy = self._reference_model(dtype)
        args, kwargs = record.args, record.kwargs
        if dtype != torch.float32:
            cpu = torch.device("cpu")
            args, kwargs = cast_inputs(args, dtype, cpu), cast_inputs(kwargs, dtype, cpu)
        module = lazy.module(point.module)
        args, kwargs = resolve_params(args, lazy.model), with_cache_kwarg(module, resolve_params(kwargs, lazy.model))
        args, kwargs, _ = with_live_caches(list(args), kwargs, lazy.model.config)  # decode steps: the past
        return module, args, kwargs

    def capture(self, point: Point, dtypes: list[torch.dtype]) -> tuple[dict[str, OpGraph], float | None]:
        """The reference's ops at `point` in float32 and in each of `dtypes` (name -> graph), and how
        far its float32 output is from the golden's (`reproduces`): the golden's model run on the
        point's recorded inputs."""
        if compat.MAJOR < 5:
            raise DrillError(
                f"{point.id}: the reference runs op by op on transformers' own modules as transformers 5 lays them "
                f"out, and this environment has transformers {compat.VERSION}: record its ops where the golden was "
                f"recorded ({self._drill_ops(point, dtypes)}) and drill here"
            )
        if self.reference_dir is None:
            raise DrillError(
                f"{point.id}: no ops of the reference are stored with the golden for it, and the golden's model "
                "is not on this machine: copy the checkpoint here, or record them with moe-parity drill-ops"
            )
        record = self.golden.load(point.id)
        names, router = weight_names(record), _router(point)
        graphs: dict[str, OpGraph] = {}
        output = None
        for dtype in [torch.float32, *(d for d in dtypes if d != torch.float32)]:
            module, args, kwargs = self._reference_call(point, record, dtype)
            graphs[dtype_name(dtype)], out = capture_ops(module, args, kwargs, input_names=names, router=router)
            output = out if output is None else output
        return graphs, reproduces(record.output, output)

    def _drill_ops(self, point: Point, dtypes: list[torch.dtype]) -> str:
        """The `moe-parity drill-ops` command that records the reference's ops of `point`."""
        dtype = next((d for d in dtypes if d != torch.float32), None) or (
            self.backend.dtype if self.backend is not None else torch.float32
        )
        return drill_ops_command(self.golden.root, point.id, dtype)

    def reference(self, point: Point) -> Reference:
        """The reference's side of the drill at `point`: its ops in float32 and in the candidate's
        dtype (kept until the point's drill is done: `release`). Those stored with the golden
        (`moe-parity drill-ops`) where there are, else captured here."""
        if point.id not in self._references:
            dtype = self.backend.dtype
            try:
                stored = store.load(self.golden.root, point.id, dtype_name(dtype))
            except store.StoreError as exc:
                raise DrillError(f"{point.id}: {exc}") from None
            if stored is not None:
                reference = stored
                self.reproduced[point.id] = reproduces(self.golden.load(point.id).output, stored.graph.output_values())
            elif (others := store.stored_dtypes(self.golden.root, point.id)) and (
                compat.MAJOR < 5 or self.reference_dir is None
            ):  # stored, but not in this dtype, and no reference to capture here
                raise DrillError(
                    f"{point.id}: the golden holds the reference's ops in {', '.join(others)}, not in the "
                    f"candidate's {dtype_name(dtype)}: record them with {self._drill_ops(point, [dtype])}, or drill "
                    f"in {others[0]} (--dtype)"
                )
            else:
                graphs, self.reproduced[point.id] = self.capture(point, [dtype])
                reference = Reference.of(graphs["float32"], graphs[dtype_name(dtype)])
            self._references[point.id] = reference
        return self._references[point.id]

    def op_names(self, point: Point) -> list[str]:
        """The reference's op rows at `point`, in forward order (the drill items): from its stored
        ops, else from one float32 capture whose values are dropped at once (collection names every
        drilled point's ops before any runs: their values would all be held)."""
        if point.id in self._references:
            return [n.name for n in self._references[point.id].graph.compute()]
        names = store.op_names(self.golden.root, point.id)
        if names is not None:
            return names
        graphs, _ = self.capture(point, [])
        return [n.name for n in graphs["float32"].compute()]

    def release(self, point: Point) -> None:
        """A drilled point's values go (its verdicts stay): the reference's and the candidate's ops."""
        self._references.pop(point.id, None)
        drill = self.drills.get(point.id)
        if drill is not None:
            drill.state = None

    def drill(self, point: Point, factor: float, point_passed: bool | None = None) -> Drill:
        """The drill at `point` (run once), judged with the point's noise factor (`factor`: an op
        introduced the divergence where its error is above that many times the reference's own).
        `point_passed`: the point's own verdict passed (a port's
        op above its own noise is then noted, not failed: see `engine.Drilling`), failed (no op to
        blame: the error accumulates), or None where it was not judged in this run."""
        if point.id in self.drills:
            return self.drills[point.id]
        reference = self.reference(point)
        backend = self.backend
        record = candidate_inputs(self.golden.load(point.id), backend.dtype, backend.device)
        try:
            with backend.drilling():
                module, args, kwargs, same_code = _checked_call(backend, point, backend.drill_call(point, record))
                names = weight_names(record) if same_code else None
                remote = getattr(module, "capture_ops", None)  # captured where it runs (NxDI's ranks)
                if remote is not None:
                    ranks = remote(capture_ops, args, kwargs, router=_router(point))
                    candidate = join_ranks([graph for graph, _ in ranks])
                else:
                    candidate, _ = capture_ops(module, args, kwargs, input_names=names, router=_router(point))
                read_as = getattr(module, "read_as", None)  # its outputs as the point reads them
                if read_as is not None:
                    candidate = extend(candidate, read_as)
        except NotImplementedError as exc:
            raise DrillError(str(exc)) from None
        if not candidate.compute():
            raise DrillError(f"{point.id}: {backend.name}'s drill_call module {_computes_nothing(candidate)}")
        runner = backend.op_runner()
        # a dtype without rounding: run_drill's own least floor (its ratios divide by it), not the verdict's 0
        floor = noise_floor(backend.dtype, default=1e-6)
        if not same_code and backend.dtype.is_floating_point:
            # a port's own ops round and sum in their own order: a rounding of the output (in float32,
            # a matmul's summation order) is no finding
            floor = max(floor, torch.finfo(backend.dtype).eps / 2, OTHER_CODE_FLOOR)
        result = run_drill(
            point.id, reference, candidate, dtype=backend.dtype, factor=factor, floor=floor,
            execute=runner, replay_chained=runner is not None, same_code=same_code, point_passed=point_passed,
            inputs=named_inputs(record),
        )  # fmt: skip
        result.reference_error = self.reproduced.get(point.id)
        self.drills[point.id] = result
        return result

    def write_repro(self, drill: Drill, out_dir: Path) -> Path | None:
        """The culprit's repro file (see `repro`), or None where its op cannot be isolated."""
        from .explain import differing_constants
        from .repro import constants_said, write_repro

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
        own = [cand_call[0].value]  # a static cache's slots that are not live: the candidate's own
        expected_candidate = m.to_candidate([ref_node.value], [shape], own)[0] if len(m.ref) == 1 else ref_node.value
        limit = drill.factor * max(row.isolated_noise or 0.0, d.floor)
        backend = self.backend
        kind = backend.name if backend.name in ("compile", "trace", "neuron") else "eager"
        runner = {"kind": kind, "compiler": backend.hw_options.get("compiler"), "device": str(backend.device)}
        figures = {"isolated": row.isolated, "isolated_noise": row.isolated_noise, "dtype": drill.dtype}
        constants = [
            {"where": where, "reference": a, "candidate": b}
            for where, a, b in differing_constants(d.ref, ref_node, d.cand, cand_call[0])
        ]
        path = write_repro(
            out_dir, drill.point, row.name, cand_call, low_call, ref_node.value, expected_candidate, limit, runner,
            figures, constants,
        )  # fmt: skip
        drill.repro, drill.repro_cause = str(path), constants_said(constants) or None
        return path

    def close(self) -> None:
        for lazy in self._lazy.values():
            lazy.close()
        self._lazy.clear()


def _checked_call(backend: Backend, point: Point, call: Any) -> tuple[Any, list, dict, bool]:
    """`drill_call`'s return as its contract says it (`(module, args, kwargs, same_code)`, the module
    an eager torch module), or a DrillError that says what it returned instead."""
    contract = "it returns (module, args, kwargs, same_code): a torch module, a list, a dict and a bool"
    # (or, for a module that runs elsewhere, an object with `capture_ops`: see Backend.drill_call)
    if not isinstance(call, tuple | list) or len(call) != 4:
        got = f"a {type(call).__name__}" + (f" of {len(call)}" if isinstance(call, tuple | list) else "")
        raise DrillError(f"{point.id}: {backend.name}'s drill_call returned {got}; {contract}")
    module, args, kwargs, same_code = call
    wrong = [
        f"{what} is a {type(value).__name__}"
        for what, value, ok in (
            ("the module", module, isinstance(module, torch.nn.Module) or hasattr(module, "capture_ops")),
            ("args", args, isinstance(args, list | tuple)),
            ("kwargs", kwargs, isinstance(kwargs, dict)),
            ("same_code", same_code, isinstance(same_code, bool)),
        )
        if not ok
    ]
    if wrong:
        raise DrillError(f"{point.id}: {backend.name}'s drill_call returned {', '.join(wrong)}; {contract}")
    if isinstance(module, torch.jit.ScriptModule) or hasattr(module, "_orig_mod"):
        kind = "scripted (torch.jit)" if isinstance(module, torch.jit.ScriptModule) else "compiled (torch.compile)"
        raise DrillError(
            f"{point.id}: {backend.name}'s drill_call returned a {kind} module, whose ops the drill cannot see "
            f"one by one: return the eager module it was made from (a compiled one's `_orig_mod`)"
        )
    return module, list(args), kwargs, same_code


def _computes_nothing(candidate: OpGraph) -> str:
    """What a module whose capture holds no op to judge ran instead (compiled and scripted modules are
    refused before it runs, by `_checked_call`; values made inside the call are rows, `capture`)."""
    if not candidate.nodes:
        return "ran no aten op: nothing it returns was computed in its call"
    computing = sorted({n.kind for n in candidate.nodes if n.kind not in LAYOUT_OPS})
    if computing:
        return (
            f"computed only on values it made inside the call ({', '.join(computing[:6])}), and none of them "
            f"reaches what it returns"
        )
    kinds = sorted({n.kind for n in candidate.nodes})
    return f"ran no op that computes: only views, copies and factories ({', '.join(kinds[:6])})"


def weight_names(record: Any) -> list[str | None]:
    """Per tensor of a golden call (pytree order), the weight's name where the module received one
    as an argument (a ParamRef), else None."""
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten((list(record.args), dict(record.kwargs)))[0]
    return [x.name if isinstance(x, ParamRef) else None for x in leaves if isinstance(x, torch.Tensor | ParamRef)]


def reproduces(golden: Any, rerun: Any) -> float | None:
    """The rerun's first output against the golden's (relative L2), or None where there is none."""
    g, r = first_tensor(golden), first_tensor(rerun)
    if g is None or r is None or g.numel() != r.numel():
        return None
    return rel_l2(r.reshape(g.shape), g)
