"""One parity run, without pytest: which candidate and why, the config check, the dtype, the
backend (validated, not started), the layer selection, the rows of the report, the header and
summary lines. The pytest plugin and `moe-parity compare` both drive this object, so they agree on
defaults and print the same lines."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import compat
from .backends import Backend, BackendSetup, parse_hw_options
from .drill.items import DrillItems
from .dtypes import dtype_name, json_safe
from .errors import BackendError, BackendFailure, GoldenError, PointUnavailable, SetupError
from .golden import GoldenStore
from .host import HeldThreads
from .judge.result import PointResult
from .judge.tolerances import Override
from .points import PARTS, Point, describe_layers, point_id
from .replay import vacuous
from .replay.batch import BatchItems
from .replay.checks import Checker, CheckerSetup, Entry
from .replay.config import ConfigItems
from .replay.floors import pick_floor
from .replay.parallel import ParallelItems
from .replay.precision import PrecisionItems
from .replay.routing import RoutingItems
from .replay.runner import ParityRunner, Prepared
from .replay.setup import (
    backend_named,
    candidate_dtype,
    chained_hint,
    check_noise,
    find_candidate,
    run_mode,
    select_units,
)
from .replay.state import StateItems
from .replay.weights import WeightItems
from .report.drill import Drill
from .report.files import write_reports
from .report.rows import Row, point_row, unjudged_row
from .report.summary import coloured_table, first_introduced, mark_inherited, summary_lines


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers in our output."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


# The kinds of items beside the points (`replay.checks`): options, markers, items, rows follow this order.
CHECKERS = (ConfigItems, WeightItems, DrillItems, ParallelItems, BatchItems, RoutingItems, StateItems, PrecisionItems)


@dataclass
class RunOptions:
    """What the user asked for; the names in `flags` are how the front end spells each option."""

    golden_dir: Path
    hw: str = "cpu"
    model: Path | None = None
    dtype: str | None = None
    hw_options: Sequence[str] = ()  # KEY=VALUE
    cli_tolerances: Sequence[Override] = ()
    ini_tolerances: Sequence[Override] = ()
    layers: str | None = None
    mode: str | None = None  # isolated, chain or both (None: isolated, or chain for a --capture-tokens golden)
    noise_quant: str | None = None  # --noise-quant: the golden's quantization floor to judge by (`replay.floors`)
    report_dir: Path | None = None
    plots: bool = True  # the report's pictures beside its JSON
    trust_remote_code: bool = False
    checks: dict[str, Any] = field(default_factory=dict)  # what each kind was asked (`Checker.value`), by kind
    workers: int = 1  # xdist workers (-n)
    # intra-op threads of the process running points (None: the cores / workers under xdist, else torch's)
    threads: int | None = None
    worker: int | None = None  # this worker's index; None on a controller or without xdist
    # keep what is alive once the backend has started from the garbage collector until `close()`
    # (see `freeze_long_lived`): for front ends that always close the session (the plugin, the CLI)
    freeze_gc: bool = False
    # the kinds' values as keywords, folded into `checks` where it lacks them. weights: None, where they
    # apply; True, also saying why not where they do not; False, none
    weights: InitVar[bool | None] = None
    config: InitVar[bool] = True  # the candidate checkpoint's config against the reference's
    drill: InitVar[Sequence[str]] = ()  # --parity-drill: point ids or globs to drill into, or "auto"
    repro_dir: InitVar[Path | None] = None  # --parity-repro: where a drill's culprit gets its repro file
    routing: InitVar[str | None] = None  # --parity-routing: the level of the golden's routing to force up to
    batch: InitVar[bool] = False  # --parity-batch-invariance: each prefill point on the batch and on each row alone
    parallel: InitVar[str | None] = None  # --parity-parallel A:B: each point under two parallel plans
    flags: dict[str, str] = field(
        default_factory=lambda: {
            "golden": "--golden-dir",
            "model": "--model",
            "dtype": "--dtype",
            "hw": "--hw",
            "layers": "--parity-layers",
            "mode": "--parity-mode",
        }  # and a kind's, by its kind (its options' own flags where not)
    )

    def __post_init__(self, weights, config, drill, repro_dir, routing, batch, parallel) -> None:
        given = {"weights": weights, "config": config, "drill": (drill, repro_dir), "routing": routing}
        self.checks = {**given, "batch": batch, "parallel": parallel, **self.checks}


for _keyword in ("weights", "config", "drill", "repro_dir", "routing", "batch", "parallel"):
    delattr(RunOptions, _keyword)  # folded into `checks`: no attribute of the class stands for them


class ParitySession:
    """Set up in the constructor, which raises `SetupError` with one sentence for anything the user
    must fix; nothing heavy happens until the first point runs."""

    def __init__(self, options: RunOptions):
        self.options = options
        self.started = time.perf_counter()  # the run's wall in its report: `moe-parity estimate --from-report`
        flags = options.flags
        try:
            self.golden = GoldenStore(options.golden_dir)
        except GoldenError as exc:
            raise SetupError(f"{flags['golden']}: {exc}") from None
        self.hw = options.hw
        cls = backend_named(self.hw, flags["hw"])
        self.candidate_dir, self.candidate_source = find_candidate(self.golden, options.model, cls, self.hw, flags)
        self.backend = self._start_backend(cls)
        self.dtype: torch.dtype = self.backend.dtype
        self._fit_threads()
        self.layers, self.model_points = select_units(options.layers, self.golden, flags["layers"])
        self.floor = pick_floor(self.golden, self.dtype, options.noise_quant, self.backend, self.candidate_dir)
        self.mode = run_mode(self.golden, cls, options.mode, flags["mode"], self.hw, self.dtype, self.floor.key)
        check_noise(self.golden, self.dtype, [*options.cli_tolerances, *options.ini_tolerances], self.floor.key)
        self.runner = ParityRunner(
            self.golden,
            self.backend,
            cli_tolerances=list(options.cli_tolerances),
            ini_tolerances=list(options.ini_tolerances),
            mode=self.mode,
            freeze_gc=options.freeze_gc,
            floor=self.floor,
        )
        self.rows: dict[str, Row] = {}
        self.interrupted = False
        self.report_lines: list[str] = []  # what write_reports drew, for the closing lines
        self.checkers = self._checkers()
        self.vacuous = vacuous.against_itself(self)  # the golden against itself (or, said later, no point)

    # -- setup ----------------------------------------------------------------------------------
    def _start_backend(self, cls: type[Backend]) -> Backend:
        """The backend, set up (validated, not started) for the candidate in the asked dtype."""
        options, flags = self.options, self.options.flags
        dtype = candidate_dtype(options.dtype, flags["dtype"])
        if cls.runs_transformers_modules and compat.MAJOR < 5:
            raise SetupError(f"{flags['hw']} {self.hw}: {compat.needs_transformers_5()}")
        try:
            setup = BackendSetup(
                self.golden,
                self.candidate_dir,
                dtype,
                options=parse_hw_options(options.hw_options),
                trust_remote_code=options.trust_remote_code,
                workers=options.workers,
                worker=options.worker,
            )
            return cls(setup)
        except (ValueError, BackendError) as exc:
            message = str(exc)  # a backend's sentence names its flag, else the run names the backend
            raise SetupError(message if message.startswith("--") else f"{flags['hw']} {self.hw}: {message}") from None

    def _checkers(self) -> dict[str, Checker]:
        """The run's checker of each kind in CHECKERS that it asked for (or that says why it has none),
        each ranked by its place there."""
        o = self.options
        setup = CheckerSetup(
            self.golden, self.backend, self.runner, self.hw, o.flags, self.candidate_dir, o.trust_remote_code,
            [p for p in self.points if self.selected(p)],
        )  # fmt: skip
        checkers = {}
        for rank, kind in enumerate(CHECKERS):
            checker = kind.from_options(setup, o.checks.get(kind.kind))
            if checker is not None:
                checker.rank = rank
                checkers[kind.kind] = checker
        return checkers

    # -- points ---------------------------------------------------------------------------------
    @property
    def points(self) -> list[Point]:
        """Every point of the golden, in forward order."""
        return self.golden.points

    def selected(self, point: Point | int | None) -> bool:
        """Whether --parity-layers keeps the point, or the weight item of a layer (None: the
        model-level ones, which are not layers: kept with no selection, or with its word `model`)."""
        layer = point.layer if isinstance(point, Point) else point
        if layer is None:
            return self.model_points
        return self.layers is None or layer in self.layers

    def schedule(self) -> Iterator[Point | Entry]:
        """The run's items in forward order: each point, with the entries each kind of item puts
        before it (a unit's weight check before its first point) and after it (a drilled point's
        ops and the drill's summary)."""
        for point in self.points:
            for checker in self.checkers.values():
                yield from checker.before(point)
            yield point
            for checker in self.checkers.values():
                yield from checker.after(point, self.selected(point))

    def check(self, entry: Entry) -> tuple[Row, str | None]:
        """An item beside the points: its row and failure text (None: it passed), by its kind's checker."""
        return self.checkers[entry.kind].check(entry, self.rows)

    def auto_drill(self, point: Point) -> tuple[Drill | None, str]:
        """`--parity-drill auto` at a failed point: the drill's row and text, or (None, "")."""
        for checker in self.checkers.values():
            said = checker.failed(point)
            if said[1]:
                return said
        return None, ""

    def unjudged_row(self, entry: Point | Entry, status: str, message: str) -> Row:
        """The row of an item that was not judged: `skipped` (with a reason) or `error`."""
        if isinstance(entry, Point):
            return unjudged_row(entry, status, message)
        return self.checkers[entry.kind].unjudged_row(entry, status, message)

    def prepare(self, point: Point) -> Prepared:
        return self.runner.prepare(point)

    def judge(self, prepared: Prepared, marker: dict[str, Any] | None = None) -> PointResult:
        result = self.runner.judge(prepared, marker)
        if not result.passed:
            self._part_failed_first(prepared.point, result)
            self._inherited(result)
        return result

    def _inherited(self, result: PointResult) -> None:
        """Both modes: a point right on the golden's inputs and wrong on its own, after an earlier
        point failed on the golden's inputs (introduced a divergence), inherits that one's failure."""
        if result.chained is None or result.verdicts.get("isolated") != "passed":
            return
        source = first_introduced(list(self.rows.values()), result.order)
        result.inherited = source.id if source is not None else None

    def _part_failed_first(self, point: Point, result: PointResult) -> None:
        """A whole (the MoE block, the decoder layer) whose part failed before it in this run: its hint
        names that part, whose failure shows in the whole too (the whole's own hint would say its parts
        pass)."""
        parts = [self.rows.get(point_id(c, point.layer, point.step)) for c in PARTS.get(point.component, ())]
        failed = [r for r in parts if r is not None and r.status == "failed"]
        if failed:
            first = min(failed, key=lambda r: r.order).id
            result.hint = (
                f"{first} runs inside this point and failed first: likely its failure showing here; fix {first} first"
            )

    def plan(self, points: list[Point]) -> None:
        """The points this run will prepare, in order (the backend reads ahead, the golden checks ahead)."""
        self.runner.plan(points)

    def run_all(self, items: bool = False) -> Iterator[Row]:
        """Judge every selected point in forward order, recording and yielding its row; with `items`,
        the other kinds' items too, each where the schedule puts it (what pytest would collect)."""
        points = [p for p in self.points if self.selected(p)]
        self.plan(points)
        for entry in self.schedule() if items else points:
            if isinstance(entry, Point) and not self.selected(entry):
                continue
            try:
                row = point_row(self.judge(self.prepare(entry))) if isinstance(entry, Point) else self.check(entry)[0]
            except PointUnavailable as exc:
                row = self.unjudged_row(entry, "skipped", str(exc))
            except BackendFailure as exc:
                row = self.unjudged_row(entry, "error", str(exc))
            self.add_row(row)
            yield row
            if self.runner.start_failure is not None:  # no point can run: said once, at the first
                return

    # -- rows and reports -----------------------------------------------------------------------
    def add_row(self, row: Row) -> None:
        self.rows[row.id] = row

    def header_lines(self) -> list[str]:
        m = self.golden.manifest
        layers = f", {said}" if (said := self.describe_selection()) else ""
        recorded = f"{m['model'].get('num_hidden_layers')} layers"
        if "layers" in m["record"]:  # a slice: `moe-parity golden --layers`
            recorded = f"a slice: layers {describe_layers(self.golden.layers)} of {recorded}"
        steps = self.golden.describe_steps()
        return [
            f"moe-parity: golden {self.golden.root} ({m['model']['model_type']}, "
            f"{recorded}, {len(self.golden.point_ids)} points, "
            f"{m['inputs']['seq_len']} tokens{f', then {steps}' if steps else ''}, {self.golden.dtype}){layers}",
            *([f"moe-parity: {quant}"] if (quant := self.golden.quantization_line()) else []),
            f"moe-parity: candidate {self.candidate_dir} ({self.candidate_source}) on --hw {self.hw} "
            f"in {dtype_name(self.dtype)}",
            self.inputs_line(),
            *self.floor.lines(),
            *(line for checker in self.checkers.values() for line in checker.header_lines()),
            *vacuous.header_line(self.vacuous),
        ]

    def describe_selection(self) -> str:
        """What --parity-layers kept, in words ("" for everything)."""
        if self.layers is None:
            return ""
        if not self.layers:
            return "the model-level points only"
        said = f"layers {describe_layers(self.layers)}"
        return f"{said} and the model-level points" if self.model_points else said

    def inputs_line(self) -> str:
        """Which inputs came from the golden: a port's own mask, position or rotary builder is
        exercised only where the candidate builds them (a chained whole-model run, a dump of its run)."""
        kind = self.backend.chain_kind
        if kind == "recorded":  # a dump: whatever the mode, its outputs are of the candidate's own run
            return "moe-parity: inputs: the candidate's own run as its dump holds it (its own masks and positions)"
        if self.mode == "isolated" or kind is None:
            return (
                "moe-parity: inputs: each point on the golden's recorded call (hidden states, masks, position ids, "
                "rotary tables, caches): a port's own mask and position builders run only in a module that makes them"
                + ("; --parity-mode chain runs them" if kind == "model" else "")
            )
        if kind == "model":
            return (
                "moe-parity: inputs: chained, the candidate's own whole-model run on the golden's input ids (its own "
                "masks, positions, rotary)"
            )
        return (
            "moe-parity: inputs: chained, each point on the candidate's own earlier outputs; masks, position ids "
            "and rotary tables stay the golden's"
        )

    def closing_lines(self) -> list[tuple[str, str | None]]:
        """The summary table and the closing lines, as (text, colour)."""
        rows, said = list(self.rows.values()), [(line, "yellow") for line in vacuous.header_line(self.vacuous)]
        if not rows:
            return [("no parity items ran", None), *said]
        mark_inherited(rows)
        table = coloured_table(rows)
        reports = [(line, None) for line in [*self.floor.lines(), *self.report_lines]]
        points = [r for r in rows if r.kind != "op"]
        backend = [(line, None) for line in self.backend.closing_lines([r.to_json() for r in points])]
        nothing = self.nothing_compared()
        warning = [(nothing, "red")] if nothing else []
        mode = [(hint, "yellow")] if (hint := self.mode_hint(points)) else []
        return (
            table + summary_lines(rows, report_dir=self.options.report_dir) + backend + mode + warning + said + reports
        )

    def mode_hint(self, rows: list[Row]) -> str | None:
        """Where a candidate that holds its own run (a dump) was judged isolated: whether its failures
        read as a whole-model run's (`setup.chained_hint`)."""
        if self.mode != "isolated" or self.backend.chain_kind != "recorded":
            return None
        return chained_hint(rows, self.golden, self.dtype, self.options.flags["mode"])

    def nothing_compared(self) -> str | None:
        """Why a run whose every point was skipped compared nothing (`replay.vacuous`), or None."""
        return vacuous.nothing_compared(list(self.rows.values()), self.hw)

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "golden_dir": str(self.golden.root.resolve()),
            "golden_fingerprint": self.golden.fingerprint,
            "model_type": self.golden.model_type,
            "candidate_model": str(self.candidate_dir),
            "candidate_source": self.candidate_source,
            "hw": self.hw,
            "hw_options": dict(self.backend.setup.options),  # as given (KEY: VALUE), parsed once at setup
            "dtype": dtype_name(self.dtype),
            "layers": self.layers,
            # what `moe-parity report --merge` checks shards by: their selection, and the run's settings
            "parity_layers": self.options.layers or None,
            "model_points": self.model_points,
            "golden_layers": self.golden.layers,
            "planned_points": [p.id for p in self.points if self.selected(p)],
            "run_options": self.run_options(),
            # what `moe-parity estimate --from-report` scales a run's measured seconds by
            "tokens": self.golden.prefill_tokens * self.golden.sequences,
            "host": {"cores": len(os.sched_getaffinity(0)), "threads": torch.get_num_threads()},
            "workers": self.options.workers,
            "wall_seconds": round(time.perf_counter() - self.started, 3),
            "mode": self.mode,
            "vacuous": self.vacuous,  # why this run checks nothing about a port (`replay.vacuous`), or None
            "noise_dtypes": self.golden.noise_dtypes,
            "noise_floor": self.floor.to_json(),
            "versions": compat.versions(),
        }
        # What this process read (absent under xdist, where the workers did the reading).
        if self.golden.opened_files:
            meta["golden_files_read"] = sorted(self.golden.opened_files)
        reads = self.backend.read_stats()
        if reads:
            meta["candidate_reads"] = reads
        return meta

    def run_options(self) -> dict[str, Any]:
        """The options that decide which items a run has and how they are judged, beside the golden, the
        candidate, the backend, the dtype and the mode: shards of one run share them (`report --merge`)."""
        o = self.options
        return {
            "tolerances": [[pattern, json_safe(values)] for pattern, values in [*o.cli_tolerances, *o.ini_tolerances]],
            **{kind.kind: kind.recorded(o.checks.get(kind.kind)) for kind in CHECKERS},
        }

    def write_reports(self) -> None:
        """The JSON reports and pictures (`--parity-report`); what was drawn joins the closing lines."""
        if self.options.report_dir is not None and self.rows:
            mark_inherited(list(self.rows.values()))
            self.report_lines = write_reports(
                self.options.report_dir,
                list(self.rows.values()),
                meta=self.meta(),
                interrupted=self.interrupted,
                plots=self.options.plots,
            )

    def close(self) -> None:
        try:
            self.runner.close()
            for checker in self.checkers.values():
                checker.close()
        finally:
            self._threads.restore()

    def _fit_threads(self) -> None:
        """The intra-op threads of this process: `threads`, else under xdist the cores this process
        may run on shared among the workers (two workers of two threads each on two cores make every
        one of OpenMP's parallel regions wait for a time slice: the judge's metric pass took 2.7-27 s
        where one thread each took 0.5 s); else torch's own. Put back on close."""
        count = self.options.threads
        if count is None and self.options.worker is not None and self.options.workers > 1:
            count = max(1, len(os.sched_getaffinity(0)) // self.options.workers)
        self._threads = HeldThreads()
        if count is not None:
            self._threads.set(count)
