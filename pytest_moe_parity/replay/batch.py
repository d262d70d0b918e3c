"""`--parity-batch-invariance`: whether a row's output depends on its neighbours or on its padding.
After each prefill point of a batch golden (`moe-parity golden --prompts`), an item
`POINT::batch` runs the point on the candidate twice over: on the golden's batch (the rows padded
together, as the point's own item runs it) and on each row alone, its real tokens only (the golden's
call cut to that row: its hidden states, its mask over its own tokens, its positions, its rotary
tables). A batch-invariant candidate gives each row the same output both ways, up to its dtype's
rounding; the item fails where a row's output in the batch leaves the limits of the point's
tolerance around its own output alone (read as the golden is: the same checks, routing flips within
the dtype's rounding forgiven), and names the rows. Each row's output alone is also judged against
the golden's row: a row wrong alone is the point's own fault, a row right alone and wrong in the
batch is the batch's. Where the golden holds the noise floor, it holds the reference's own
batch-vs-alone difference per point and row in that dtype (`replay.noise.batch_vs_alone`): a row
changes only beyond `noise_factor` times it too.

Where the rows that fail are exactly the padded ones, the padding is the condition (a mask that lets
real tokens see padding, positions or offsets that ignore it); where an unpadded row fails too, its
neighbours are (a kernel that is not batch invariant, capacity shared across rows, an activation
scale shared over the batch). Where the backend says its candidate shares a scale over the batch by
design (`Backend.batch_dependence`: `--hw-option quant=...+dynamic-tensor`), that is the condition named."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import BackendFailure, SetupError
from ..golden import GoldenRecord, GoldenStore
from ..judge.result import PointResult
from ..judge.tolerances import noise_floor
from ..points import Point
from ..report.rows import BatchInvarianceRow, Row, unjudged_row
from ..report.text import fmt
from ..tree import map_structure
from .checks import Checker, CheckerSetup, Option, RunAgain, result_figures
from .runner import ParityRunner

KIND = "batch"

HINTS = {
    "padding": (
        "only the padded rows change in the batch: the candidate lets padding reach real tokens (a mask that "
        "lets them attend to padding, positions or cache offsets that ignore it, padding routed to experts)"
    ),
    "neighbours": (
        "a row without padding changes in the batch: the candidate's output depends on its neighbours (a kernel "
        "that is not batch invariant, expert capacity shared across rows, a reduction over the batch, an "
        "activation scale shared over the batch: per-tensor dynamic quantization)"
    ),
    "shared_scale": (
        "a row's output depends on the other rows of the batch: an activation scale shared over the batch "
        "(per-tensor dynamic quantization) does this, each row rounded on a grid set by the batch's largest "
        "value (the rows holding it keep their output); per-token scales do not"
    ),
}


@dataclass(frozen=True)
class BatchEntry(RunAgain):
    """The batch-invariance item of a prefill point (`layer_N.attention::batch`): right after it."""

    kind = KIND


@dataclass(frozen=True)
class RowResult:
    """One row at one point: its output in the batch against alone, alone against the golden's row, the
    reference's own batch-vs-alone difference there (the noise floor's, where recorded), and whether
    batching alone changed it: beyond the point's limits, and beyond `noise_factor` times the
    reference's own difference."""

    row: int
    against_alone: PointResult
    alone_vs_golden: PointResult
    reference: float | None
    changed: bool


@dataclass(frozen=True)
class Rows:
    """The golden's batch: its rows, their tokens per row, and each row's real token positions."""

    count: int
    tokens: int
    real: tuple[tuple[int, ...], ...]
    side: str | None

    @classmethod
    def of(cls, golden: GoldenStore) -> Rows:
        inputs = golden.manifest["inputs"]
        ids = inputs["input_ids"]
        rows = ids if ids and isinstance(ids[0], list) else [ids]
        masks = inputs.get("attention_mask") or [[1] * len(r) for r in rows]
        real = tuple(tuple(i for i, m in enumerate(mask) if m) for mask in masks)
        return cls(len(rows), len(rows[0]), real, inputs.get("padding_side"))

    def padding(self, row: int) -> int:
        return self.tokens - len(self.real[row])

    def alone(self, record: GoldenRecord, row: int) -> GoldenRecord:
        """The golden's call of a point as row `row` alone makes it (its output left whole)."""
        return replace(record, args=self.cut(record.args, row), kwargs=self.cut(record.kwargs, row))

    def runs_alone(self, runner: ParityRunner, point: Point, record: GoldenRecord) -> Iterator[tuple[int, Any]]:
        """Each row's own run of `point` (`record`, the golden's call with whole masks, cut to the row):
        (row, the candidate's output); a row of padding only (--batch-size) has nothing to run alone."""
        for row in range(self.count):
            if self.real[row]:
                yield row, runner.call(point, self.alone(record, row), row=row)

    def cut(self, obj: Any, row: int) -> Any:
        """`obj` (a call's args, kwargs or output) as row `row` alone has it: every tensor laid out over
        the batch's rows and tokens cut to that row's real tokens, the row dimension kept where it is
        its own ([B, S, ...] -> [1, T, ...]; a mask [B, 1, S, S] -> [1, 1, T, T]; the tokens of every
        row flattened [B * S, ...] -> [T, ...]; cache positions [S] -> [T])."""
        index = torch.tensor(self.real[row], dtype=torch.long)
        rows, tokens = self.count, self.tokens

        def take(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            shape = t.shape
            at = index.to(t.device)
            if t.dim() == 4 and shape[0] == rows and shape[2] == tokens and shape[3] == tokens:  # a mask
                return t[row : row + 1].index_select(2, at).index_select(3, at)
            if t.dim() >= 2 and shape[0] == rows and shape[1] == tokens:
                return t[row : row + 1].index_select(1, at)
            if shape[0] == rows * tokens:
                return t.reshape(rows, tokens, *shape[1:])[row].index_select(0, at)
            if t.dim() == 1 and shape[0] == tokens and not t.is_floating_point():  # cache positions
                return torch.arange(len(self.real[row]), dtype=t.dtype, device=t.device)
            if t.dim() >= 2 and shape[0] == 1 and shape[1] == tokens:  # shared by every row
                return t.index_select(1, at)
            return t

        return map_structure(obj, take)


def _cut_routing(rows: Rows, routing: Any, row: int) -> Any:
    return tuple(rows.cut(list(routing), row)) if routing is not None else None


class BatchItems(Checker):
    """The batch-invariance items of a run over a batch golden."""

    kind = KIND
    family = "differential"
    marker = "moe-parity items of a point run on each row alone (--parity-batch-invariance)"
    options = (
        Option("--parity-batch-invariance", "parity_batch", {"action": "store_true", "default": False},
               "with a batch golden (--prompts): after each prefill point, an item (POINT::batch) that runs it on each "
               "row alone too and fails where a row's output in the batch differs from its own alone, naming the rows"),
    )  # fmt: skip

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: bool) -> BatchItems | None:
        return batch_items(setup.golden, setup.runner, value, cls.flag(setup))

    def __init__(self, golden: GoldenStore, runner: ParityRunner):
        self.golden, self.runner = golden, runner
        self.rows = Rows.of(golden)

    def after(self, point: Point, selected: bool) -> Iterator[BatchEntry]:
        if selected and point.step is None:
            yield BatchEntry(point, self.place(point))

    def unjudged_row(self, entry: BatchEntry, status: str, message: str) -> Row:
        return unjudged_row(self._row(entry, "passed", []), status, message)

    def check(self, entry: BatchEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        point, runner = entry.point, self.runner
        record = self.golden.load(point)  # whole masks: they are cut to a row
        batch = runner.call(point, record)
        router = self.golden.router_of(point)
        bias = runner.score_bias(point, record)
        reference = self.golden.noise(runner.floor.key, "batch", point.id) or []  # the reference's own, per row
        tol, _ = runner.tolerance(point)
        floor = noise_floor(runner.dtype)
        results = []
        try:
            runs = list(self.rows.runs_alone(runner, point, record))
        except BackendFailure as exc:
            raise BackendFailure(entry.id, exc.original) from exc
        for row, alone in runs:
            in_batch = self.rows.cut(batch.output, row)
            alone = replace(alone, output=_as_shaped(alone.output, in_batch))
            routing = (router, _cut_routing(self.rows, batch.routing, row), alone.routing)
            against_alone = runner.judge_between(point, alone.output, in_batch, routing, bias)
            golden_row = self.rows.cut(record.output, row)
            alone_vs_golden = runner.judge_between(point, golden_row, alone.output, (router, None, None), bias)
            own = reference[row] if row < len(reference) else None
            main = against_alone.main
            within = own is not None and main is not None and main.rel_l2 <= tol.noise_factor * max(own, floor)
            results.append(RowResult(row, against_alone, alone_vs_golden, own, not against_alone.passed and not within))
        return self._verdict(entry, results)

    def _row(self, entry: BatchEntry, status: str, results: list, **more: Any) -> BatchInvarianceRow:
        point = entry.point
        per_row, metrics = [], {}
        for r in results:
            row, against_alone = r.row, r.against_alone
            if against_alone.main is not None:
                metrics[f"row_{row}"] = against_alone.main
            alone = result_figures(r.alone_vs_golden)
            per_row.append({
                "row": row, "tokens": len(self.rows.real[row]), "padding": self.rows.padding(row),
                **result_figures(against_alone), "status": "failed" if r.changed else "passed",
                "reference": r.reference, "alone_vs_golden": alone["rel_l2"], "alone_status": alone["status"],
            })  # fmt: skip
        return BatchInvarianceRow(
            id=entry.id, order=entry.order, layer=point.layer, step=point.step, component=point.component,
            status=status, batch_rows=per_row, metrics=metrics, **more,
        )  # fmt: skip

    def _verdict(self, entry: BatchEntry, results: list) -> tuple[Row, str | None]:
        changed = [r.row for r in results if r.changed]
        padded = [row for row in range(self.rows.count) if self.rows.padding(row)]
        if not changed:
            note = f"each of the {len(results)} rows gives the same output in the batch as alone, within its limits"
            if len(results) < self.rows.count:
                note += f" ({self.rows.count - len(results)} of padding only, not run alone)"
            return self._row(entry, "passed", results, notes=[note]), None
        condition = "padding" if set(changed) <= set(padded) else "neighbours"
        # a candidate that shares a scale over the batch by design: the rows holding the batch's largest value
        # keep their output, and those may be exactly the unpadded ones
        shared = self.runner.backend.batch_dependence()
        condition = "shared_scale" if shared else condition
        said = ", ".join(map(str, changed))
        note = (
            f"batching alone changes row{'s' if len(changed) > 1 else ''} {said} of {self.rows.count}: "
            f"{'its' if len(changed) == 1 else 'their'} output in the batch differs from "
            f"{'its' if len(changed) == 1 else 'their'} own run alone"
        )
        hint = HINTS[condition] + (f" ({shared})" if shared else "")
        row = self._row(entry, "failed", results, notes=[note], hint=hint, changed_rows=changed,
                        condition=condition)  # fmt: skip
        return row, "\n".join([f"{entry.id}: {note}", *_rows_table(row, self.rows.side), f"  hint: {row.hint}"])


def _as_shaped(output: Any, like: Any) -> Any:
    """A row's own output laid out as its cut from the batch is, where they hold the same elements (a
    dump of one row without its row dimension: [T, H] for [1, T, H])."""
    if isinstance(output, torch.Tensor) and isinstance(like, torch.Tensor):
        same = output.shape != like.shape and output.numel() == like.numel()
        return output.reshape(like.shape) if same else output
    if isinstance(output, tuple | list) and isinstance(like, tuple | list) and len(output) == len(like):
        return type(output)(_as_shaped(o, k) for o, k in zip(output, like, strict=True))
    return output


def _rows_table(row: BatchInvarianceRow, side: str | None) -> list[str]:
    """Each row's figures, a line each, its verdict last (FAIL marked as the point tables are)."""
    lines = [
        f"  {'row':<4} {'tokens':>6} {'padding':>8} {'rel_l2 vs alone':>16} {'cosine':>10} {'worst token':>12} "
        f"{'reference own':>14} {'alone vs golden':>16}  verdict"
    ]
    for r in row.batch_rows:
        padding = f"{r['padding']} {side or ''}".strip() if r["padding"] else "0"
        lines.append(
            f"  {r['row']:<4} {r['tokens']:>6} {padding:>8} {fmt(r['rel_l2']):>16} {fmt(r['cosine'], 6):>10} "
            f"{fmt(r['max_token_rel_l2']):>12} {fmt(r.get('reference')):>14} {fmt(r['alone_vs_golden']):>16}  "
            f"{'FAIL' if r['status'] == 'failed' else 'pass'}"
        )
    return lines


def batch_items(golden: GoldenStore, runner: ParityRunner, asked: bool, flag: str) -> BatchItems | None:
    """The run's batch-invariance items (`--parity-batch-invariance`), or None where not asked; SetupError
    where the golden is not a batch."""
    if not asked:
        return None
    rows = Rows.of(golden)
    if rows.count < 2:
        raise SetupError(
            f"{flag}: this golden holds one row; record a batch (moe-parity golden --prompts FILE with two or more "
            "prompts, --padding-side left|right, --pad-to N or --batch-size B)"
        )
    if golden.captured_tokens is not None:
        raise SetupError(f"{flag}: this golden keeps some tokens' outputs only (--capture-tokens): record it without")
    backend = runner.backend
    if backend.chain_kind == "recorded":  # a dump: each row's own run is another dump
        root = backend.hw_options.get("rows")
        if not root:
            raise SetupError(
                f"{flag} with --hw {backend.name}: give the rows' own dumps too, each the port's run of one row "
                f"alone: --hw-option rows=DIR (DIR/row_0 ... DIR/row_{rows.count - 1})"
            )
        missing = [f"row_{r}" for r in range(rows.count) if not (Path(root).expanduser() / f"row_{r}").is_dir()]
        if missing:
            raise SetupError(f"{flag}: {root} lacks {', '.join(missing)} (a dump of each row alone, row_0 on)")
    return BatchItems(golden, runner)
