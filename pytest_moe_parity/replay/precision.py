"""`--parity-precision-search POINTS`: the fewest parts of a failing point that must run in float32
for it to pass. After each point the patterns select, an item `POINT::precision` replays the point's
module on the golden's call with some of its op groups raised to float32 (`model.raised`: a unit is
an op group of one submodule, e.g. the router's `score` ops or an attention's `q_proj:matmul`) and
searches, as Polygraphy's `debug precision` bisects a network's layers, for the fewest units whose
float32 makes the point pass:

1. nothing raised (the census: which units run, in forward order): where it passes, the point's
   failure is not its precision (a compiled graph's own, or another run's); the item fails saying so;
2. every unit raised: where it still fails, the point is a defect, not precision; the item fails
   saying so;
3. otherwise the shortest prefix of the units (in forward order) that passes, by bisection (its last
   unit is needed), then each earlier unit of that prefix dropped where the point passes without it.

The item fails with what it found ("layer_12.router passes with its score ops in float32; nothing
else needs it"); a point that passed has nothing to search: its item is skipped, saying so. The
knob exists where the candidate's modules run as torch modules on this host (`--hw cpu`, `cuda`,
`trace`, `compile`; the compiled backends' modules are searched eagerly: a compiled graph cannot have
one op raised). On `--hw nxdi` (its CPU build) a unit is a precision setting NxDI's config exposes
for the point's module, the module rebuilt per trial (`precision_nxdi`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..backends import Backend, CandidateOutput
from ..dtypes import dtype_name
from ..errors import BackendFailure, PointUnavailable, SetupError
from ..golden import GoldenRecord, GoldenStore
from ..judge.result import PointResult
from ..judge.routing import with_experts_call
from ..model.raised import Unit, raised_ops, unit_name
from ..points import Point
from ..report.rows import PrecisionRow, Row, unjudged_row
from ..tree import leaves
from .checks import Checker, CheckerSetup, Option, RunAgain
from .runner import ParityRunner, candidate_inputs

KIND = "precision"
KNOBS = ("cpu", "cuda", "trace", "compile")  # the backends whose candidate's ops can be raised one by one
SETTINGS = ("nxdi",)  # the backends whose precision settings are searched (`precision_nxdi`)


def patterns_of(values: Sequence[str]) -> list[str]:
    """`--parity-precision-search` values (repeatable, comma-separated) -> patterns."""
    return [p.strip() for v in values for p in str(v).split(",") if p.strip()]


def selects(patterns: Sequence[str], point_id: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatchcase(point_id, p) for p in patterns)


@dataclass(frozen=True)
class PrecisionEntry(RunAgain):
    """The precision search of a point (`layer_N.router::precision`): right after it."""

    kind = KIND


@dataclass
class Trial:
    """One run of the search: the units raised, its verdict and main figure."""

    raised: list[Unit]
    result: PointResult

    def to_json(self) -> dict[str, Any]:
        main = self.result.main
        return {
            "raised": [unit_name(u) for u in self.raised],
            "status": self.result.status,
            "rel_l2": main.rel_l2 if main else None,
        }


class Searcher:
    """Runs one point's module with chosen units raised (`model.raised`) and judges it; the wide lane
    of its parameters is the candidate checkpoint read again in float32 (a layer at a time)."""

    def __init__(self, golden: GoldenStore, runner: ParityRunner):
        self.golden, self.runner = golden, runner
        self.backend: Backend = runner.backend
        self._wide_model: Any = None

    def _wide_module(self, path: str) -> torch.nn.Module:
        if self._wide_model is None:
            from ..model.lazy_model import LazyModel

            backend = self.backend
            self._wide_model = LazyModel(
                backend.setup.model_dir, dtype=torch.float32, device=backend.device,
                trust_remote_code=backend.setup.trust_remote_code, max_layers=1, fit_threads=False,
            )  # fmt: skip
        return self._wide_model.module(path)

    def run(self, point: Point, record: GoldenRecord, raised: set[Unit]) -> tuple[PointResult, list[Unit]]:
        """The point judged with `raised` in float32, and the units that ran (in forward order)."""
        runner, backend = self.runner, self.backend
        runner.start(point)
        natural = candidate_inputs(record, runner.dtype, backend.device)
        wide_call = candidate_inputs(record, torch.float32, backend.device)
        try:
            module, args, kwargs, _ = backend.drill_call(point, natural)
            _, wide_args, wide_kwargs, _ = backend.drill_call(point, wide_call)
            wide = self._wide_lane(module, point, (args, kwargs), (wide_args, wide_kwargs))
            routing: list[Any] = []
            hook = self._router_hook(point, routing)
            try:
                with torch.no_grad(), raised_ops(module, raised, wide) as mode:
                    output = module(*args, **kwargs)
            finally:
                if hook is not None:
                    hook.remove()
        except PointUnavailable:
            raise
        except Exception as exc:
            raise BackendFailure(point.id, exc) from exc
        seen = with_experts_call(routing[0], None) if routing else None
        readable = tuple(seen) if isinstance(seen, tuple | list) else None
        result = runner.judge_output(point, record, CandidateOutput(output, readable), "isolated", None)
        return result, list(mode.seen)

    def _wide_lane(self, module: torch.nn.Module, point: Point, call: tuple, wide_call: tuple) -> list[tuple]:
        """The float32 values beside the natural ones: the golden's inputs, the module's weights."""
        pairs = [(n, w) for n, w in zip(leaves(call), leaves(wide_call), strict=False) if _pair(n, w)]
        own = self._wide_module(point.module)
        mine = dict(module.named_parameters())
        mine.update(dict(module.named_buffers()))
        for name, w in [*own.named_parameters(), *own.named_buffers()]:
            n = mine.get(name)
            if _pair(n, w):
                pairs.append((n, w))
        return pairs

    def _router_hook(self, point: Point, routing: list[Any]) -> Any:
        router = self.golden.router_of(point)
        if router is None or not point.routed_block:
            return None

        def seen(module: Any, args: Any, out: Any) -> None:
            routing.append(out)

        return self.backend.module(router.module).register_forward_hook(seen)

    def describe(self, point_id: str, units: list[Unit], others: int) -> str:
        return describe(point_id, units, others)

    def defect_words(self, point_id: str, order: list[Unit]) -> str:
        return f"{point_id} still fails with every op group raised to float32 ({len(order)}): a defect, not precision"

    def not_precision_words(self, point_id: str) -> str:
        return (
            f"{point_id} passes with nothing raised to float32: its failure is not its precision (not on this "
            "eager replay of its module: a compiled graph's own, or another tolerance) - a defect, not precision"
        )

    def close(self) -> None:
        if self._wide_model is not None:
            self._wide_model.close()
            self._wide_model = None


def _pair(natural: Any, wide: Any) -> bool:
    return (
        isinstance(natural, torch.Tensor)
        and isinstance(wide, torch.Tensor)
        and natural.is_floating_point()
        and natural.shape == wide.shape
        and natural.dtype != torch.float32
    )


def search(try_units: Callable[[set[Unit]], bool], units: list[Unit]) -> list[Unit]:
    """The fewest units (in forward order) whose raising passes, where raising all of them does and
    none does not: the shortest passing prefix by bisection, then each earlier unit of it dropped
    where the rest still pass."""
    lo, hi = 0, len(units)  # prefix lo fails, prefix hi passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if try_units(set(units[:mid])):
            hi = mid
        else:
            lo = mid
    kept = list(units[:hi])
    for unit in reversed(units[: hi - 1]):
        trial = [u for u in kept if u != unit]
        if try_units(set(trial)):
            kept = trial
    return kept


def describe(point_id: str, units: list[Unit], others: int) -> str:
    """What the search found, in words."""
    own = [u for u in units if not u[0]]
    subs = [u for u in units if u[0]]
    parts = []
    if own:
        parts.append(f"its {' and '.join(g for _, g in own)} op{'s' if len(own) > 1 else ''}")
    parts.extend(unit_name(u) for u in subs)
    said = " and ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + f" and {parts[-1]}"
    rest = "nothing else needs it" if others else "it has no other op group"
    return f"{point_id} passes with {said} in float32; {rest}"


class PrecisionItems(Checker):
    """The precision search's items of a run (`--parity-precision-search POINTS`)."""

    kind = KIND
    family = "differential"
    marker = "moe-parity items of a failing point's precision search (--parity-precision-search)"
    options = (
        Option("--parity-precision-search", "parity_precision", {"action": "append", "default": [],
               "metavar": "POINTS"},
               "after each of these points (ids or globs, comma-separated, repeatable, e.g. 'layer_*.router'), an item "
               "(POINT::precision) that, where the point fails, bisects for the fewest op groups of its submodules "
               "that must run in float32 for it to pass, and names them (--hw cpu, cuda, trace, compile)"),
    )  # fmt: skip

    @classmethod
    def recorded(cls, value: Sequence[str]) -> list[str]:
        return patterns_of(value or [])

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: Sequence[str] | None) -> PrecisionItems | None:
        patterns = patterns_of(value or [])
        if not patterns:
            return None
        flag, said = cls.flag(setup), ",".join(patterns)
        if setup.hw not in KNOBS + SETTINGS:
            raise SetupError(
                f"{flag} {said}: the {setup.hw} backend has no precision knob the search can turn (the dtype of each "
                f"op of a torch module on this host, NxDI's precision settings); search with --hw "
                f"{', '.join(KNOBS + SETTINGS)}"
            )
        if setup.hw in SETTINGS:
            from .precision_nxdi import nxdi_search_usable

            why = nxdi_search_usable(setup.runner.backend)
            if why:
                raise SetupError(f"{flag} {said}: {why}")
        if setup.runner.dtype == torch.float32 or not setup.runner.dtype.is_floating_point:
            raise SetupError(
                f"{flag} {said}: the candidate runs in {dtype_name(setup.runner.dtype)}: there is nothing narrower to "
                "raise to float32; search a candidate in --dtype bfloat16 or float16"
            )
        for pattern in patterns:
            if not any(selects([pattern], p.id) for p in setup.golden.points):
                raise SetupError(
                    f"{flag} {pattern!r} matches no point of this golden (e.g. layer_0.router, 'layer_*.attention')"
                )
        return cls(setup.golden, setup.runner, patterns)

    def __init__(self, golden: GoldenStore, runner: ParityRunner, patterns: list[str]):
        self.golden, self.runner, self.patterns = golden, runner, patterns
        if runner.backend.name in SETTINGS:
            from .precision_nxdi import NxdiSearcher

            self.searcher: Any = NxdiSearcher(golden, runner)
        else:
            self.searcher = Searcher(golden, runner)

    def after(self, point: Point, selected: bool) -> Iterator[PrecisionEntry]:
        if selected and selects(self.patterns, point.id):
            yield PrecisionEntry(point, self.place(point))

    def unjudged_row(self, entry: PrecisionEntry, status: str, message: str) -> Row:
        return unjudged_row(self._row(entry, "passed"), status, message)

    def _row(self, entry: PrecisionEntry, status: str, **more: Any) -> PrecisionRow:
        point = entry.point
        return PrecisionRow(
            id=entry.id, order=entry.order, layer=point.layer, step=point.step, component=point.component,
            status=status, **more,
        )  # fmt: skip

    def check(self, entry: PrecisionEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        point = entry.point
        own = rows.get(point.id)
        if own is not None and own.status == "passed":
            raise PointUnavailable(f"{point.id} passed: nothing to search")
        started = time.perf_counter()
        record = self.golden.load(point, row_masks=False)
        trials: dict[frozenset[Unit], Trial] = {}

        def attempt(raised: set[Unit]) -> tuple[PointResult, list[Unit]]:
            result, seen = self.searcher.run(point, record, raised)
            trials[frozenset(raised)] = Trial(sorted(raised, key=lambda u: order.index(u) if u in order else 0), result)
            return result, seen

        order: list[Unit] = []
        none, order[:] = attempt(set())
        if none.passed and (own is None or own.status != "failed"):  # its item did not run here
            raise PointUnavailable(f"{point.id} passes on the golden's call: nothing to search")
        if none.passed:
            said = self.searcher.not_precision_words(point.id)
            return self._done(entry, "not_precision", said, [], order, trials, started, {"none": none})
        every = attempt(set(order))[0] if order else none  # nothing to raise: the census is every unit raised
        if not every.passed:
            said = self.searcher.defect_words(point.id, order)
            return self._done(entry, "defect", said, [], order, trials, started, {"none": none, "all": every})

        def passes(raised: set[Unit]) -> bool:
            key = frozenset(raised)
            return trials[key].result.passed if key in trials else attempt(raised)[0].passed

        found = search(passes, order)
        best = trials[frozenset(found)].result
        said = self.searcher.describe(point.id, found, len(order) - len(found))
        return self._done(entry, "precision", said, found, order, trials, started, {"none": none, "raised": best})

    def _done(
        self,
        entry: PrecisionEntry,
        verdict: str,
        said: str,
        found: list[Unit],
        order: list[Unit],
        trials: dict[frozenset[Unit], Trial],
        started: float,
        results: dict[str, PointResult],
    ) -> tuple[Row, str]:
        seconds = time.perf_counter() - started
        runs = len(trials)
        metrics = {k: r.main for k, r in results.items() if r.main is not None}
        row = self._row(
            entry, "failed", precision_verdict=verdict, raised=[unit_name(u) for u in found],
            units=[unit_name(u) for u in order], runs=[t.to_json() for t in trials.values()],
            search_seconds=round(seconds, 3), metrics=metrics, notes=[said],
        )  # fmt: skip
        return row, f"{entry.id}: {said}\n  ({runs} runs of the point, {seconds:.2f} s; units: {len(order)})"

    def close(self) -> None:
        self.searcher.close()
