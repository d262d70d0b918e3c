"""`--parity-parallel "tp=1:tp=2"`: whether the parallelism alone changes the candidate. After each
point, an item `POINT::parallel` runs the point on the golden's call with the candidate built under
plan A and under plan B (`Backend.run_plan`) and judges B's output against A's by the point's
tolerance: it fails where B leaves A's limits, naming the parallelism, and says each plan's error to
the golden beside it (A right and B wrong: the parallelism is the fault). A plan is
`KEY=DEGREE[,KEY=DEGREE]`: `tp` (tensor parallelism) and `ep` (expert parallelism); a backend says
which it runs (`Backend.parallel_keys`: NxDI's modules take both, as NxDI lays a plan out: `tp` ranks,
every layer sharded over them, and with `ep` the MoE's experts split over `ep` groups of them and
sharded over the rest, so `tp=2:tp=2,ep=2` changes the MoE alone)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..backends import plan_name
from ..errors import BackendError, BackendFailure, SetupError
from ..golden import GoldenStore
from ..points import Point, positive_int
from ..report.rows import ParallelRow, Row, unjudged_row
from ..report.text import brief
from .checks import Checker, CheckerSetup, Option, RunAgain, result_figures
from .runner import ParityRunner

KIND = "parallel"
KEYS = {"tp": "tensor parallelism", "ep": "expert parallelism"}


def parse_plans(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """`tp=1:tp=2,ep=2` -> ({"tp": 1}, {"tp": 2, "ep": 2}); ValueError saying what is wrong."""
    halves = str(text).split(":")
    if len(halves) != 2:
        raise ValueError(f"expected two plans, A:B, e.g. tp=1:tp=2, got {text!r}")
    plans = []
    for half in halves:
        plan: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in half.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in KEYS:
                raise ValueError(f"{part!r} is not KEY=DEGREE with KEY one of {', '.join(KEYS)}")
            try:
                plan[key] = positive_int(value)
            except ValueError as exc:
                raise ValueError(f"{part}: {exc}") from None
        if not plan:
            raise ValueError(f"a plan is empty in {text!r}; e.g. tp=1:tp=2")
        plans.append(plan)
    if plans[0] == plans[1]:
        raise ValueError(f"the two plans are the same ({halves[0]}): compare two plans that differ")
    return plans[0], plans[1]


@dataclass(frozen=True)
class ParallelEntry(RunAgain):
    """The parallel differential of a point (`layer_N.attention::parallel`): right after it."""

    kind = KIND


class ParallelItems(Checker):
    """The parallel differential's items of a run: plan B against plan A at every point."""

    kind = KIND
    family = "differential"
    marker = "moe-parity items of a point under two parallel plans"
    options = (
        Option("--parity-parallel", "parity_parallel", {"metavar": "A:B"},
               "after each point, an item (POINT::parallel) that runs it with the candidate built under plan A and "
               "plan B (e.g. tp=1:tp=2) and fails where B leaves A's limits, naming the parallelism "
               "(--hw nxdi, vllm: tp, ep)"),
    )  # fmt: skip

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: str | None) -> ParallelItems | None:
        return parallel_items(setup.golden, setup.runner, value, setup.hw, cls.flag(setup))

    def __init__(self, golden: GoldenStore, runner: ParityRunner, plans: tuple[dict[str, int], dict[str, int]]):
        self.golden, self.runner, self.plans = golden, runner, plans

    def after(self, point: Point, selected: bool) -> Iterator[ParallelEntry]:
        if selected:
            yield ParallelEntry(point, self.place(point))

    def unjudged_row(self, entry: ParallelEntry, status: str, message: str) -> Row:
        return unjudged_row(self._row(entry, "passed"), status, message)

    def _row(self, entry: ParallelEntry, status: str, **more: Any) -> ParallelRow:
        point = entry.point
        return ParallelRow(
            id=entry.id, order=entry.order, layer=point.layer, step=point.step, component=point.component,
            status=status, plans=[plan_name(p) for p in self.plans], **more,
        )  # fmt: skip

    def check(self, entry: ParallelEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        point, runner = entry.point, self.runner
        record = self.golden.load(point, row_masks=runner.backend.row_masks)
        a_plan, b_plan = self.plans
        a = runner.call(point, record, plan=a_plan)
        a_said, b_said = plan_name(a_plan), plan_name(b_plan)
        which = " and ".join(KEYS[k] for k in b_plan if b_plan.get(k) != a_plan.get(k)) or "the parallelism"
        try:
            b = runner.call(point, record, plan=b_plan)
        except BackendFailure as exc:  # A ran: that B cannot is the parallelism's finding, not the backend's error
            raised = str(exc).removeprefix(f"{point.id}: ")
            note = f"{b_said} raises where {a_said} runs: {raised}"
            hint = (
                f"{which} ({b_said} against {a_said}): the candidate does not run this call under {b_said}; a "
                "code path the parallelism takes (or lacks) at this call's size"
            )
            row = self._row(entry, "failed", figures={"b_raised": raised}, notes=[note], hint=hint)
            return row, f"{entry.id}: {note}\n  hint: {hint}"
        router = self.golden.router_of(point)
        bias = runner.score_bias(point, record)
        b_vs_a = runner.judge_between(point, a.output, b.output, (router, b.routing, a.routing), bias)
        golden = [
            runner.judge_between(point, record.output, out.output, (router, None, None), bias).main for out in (a, b)
        ]
        main = b_vs_a.main
        figures = {
            "b_vs_a": main.rel_l2 if main else None,
            "a_vs_golden": golden[0].rel_l2 if golden[0] else None,
            "b_vs_golden": golden[1].rel_l2 if golden[1] else None,
            "failed": result_figures(b_vs_a)["failed"],
        }
        metrics = {"b_vs_a": main} if main is not None else {}
        if b_vs_a.passed:
            note = f"{b_said} gives what {a_said} gives, within the point's limits"
            return self._row(entry, "passed", figures=figures, metrics=metrics, notes=[note]), None
        note = (
            f"the parallelism alone changes it: {b_said} against {a_said}, rel_l2 {brief(figures['b_vs_a'])} "
            f"(to the golden: {a_said} {brief(figures['a_vs_golden'])}, {b_said} {brief(figures['b_vs_golden'])})"
        )
        hint = (
            f"{which} ({b_said} against {a_said}): the same candidate under {a_said} gives another output; a "
            "sharding bug (a rank loading another rank's shard, the wrong half of a split), a missing or "
            "misapplied collective, or tokens an expert-parallel exchange drops"
        )
        row = self._row(entry, "failed", figures=figures, metrics=metrics, notes=[note], hint=hint)
        return row, "\n".join([f"{entry.id}: {note}", f"  failed: {', '.join(figures['failed'])}", f"  hint: {hint}"])


def parallel_items(
    golden: GoldenStore, runner: ParityRunner, text: str | None, hw: str, flag: str
) -> ParallelItems | None:
    """The run's parallel differential (`--parity-parallel A:B`), or None where not asked; SetupError
    where the plans are malformed or the backend cannot run them."""
    if not text:
        return None
    try:
        plans = parse_plans(text)
    except ValueError as exc:
        raise SetupError(f"{flag} {text}: {exc}") from None
    backend = runner.backend
    if not backend.parallel_keys:
        raise SetupError(
            f"{flag} {text}: the {hw} backend runs the candidate in one process, under one plan; the parallel "
            "differential builds it under two (--hw nxdi, vllm: tp, ep), or compare the ranks of a sharded dump with "
            "--hw dump and a map's concat_dim and ranks"
        )
    keys = sorted({k for plan in plans for k in plan})
    other = [k for k in keys if k not in backend.parallel_keys]
    if other:
        raise SetupError(
            f"{flag} {text}: the {hw} backend runs {', '.join(backend.parallel_keys)}, not {', '.join(other)}"
        )
    for plan in plans:
        try:
            backend.check_plan(plan)
        except BackendError as exc:
            raise SetupError(f"{flag} {text}: {exc}") from None
    return ParallelItems(golden, runner, plans)
