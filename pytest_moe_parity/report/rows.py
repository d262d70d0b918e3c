"""The report's rows: one :class:`Row` per item of a run, a class per kind, each with its one builder.

- a judged point (:class:`PointRow`, :func:`point_row`, from the judge's `PointResult`), with its
  chained twin under ``--parity-mode both``;
- a point that was not judged (:class:`UnjudgedRow`, :func:`unjudged_row`): ``skipped`` with a reason,
  or an ``error`` with the backend's message (a weight item not judged keeps its own class);
- a weight item (:class:`WeightsRow`, :func:`weights_row`): ``layer_N.weights`` / ``weights``, failed
  with its findings;
- an op of a drilled component (:class:`DrillRow`, :func:`drill_row`): ``POINT::OP``, with its figures
  in ``op``, and the drill's summary ``POINT::drill``;
- a MoE block replayed with the golden's routing (:class:`RoutingRow`): ``POINT::routing``, with each
  level's figures (``--parity-routing``);
- a point run on the batch and on each row alone (:class:`BatchInvarianceRow`): ``POINT::batch``, with
  each row's figures (``--parity-batch-invariance``);
- a point run under two parallel plans (:class:`ParallelRow`): ``POINT::parallel``
  (``--parity-parallel``);
- a point run in another serving state (:class:`StateRow`): ``POINT::state`` (``--parity-state``).

The text, the JSON reports, the pictures and ``moe-parity diff`` read a row's fields. A row is written
to ``comparison_report.json`` by :meth:`Row.to_json` (the keys of report schema 1, unchanged) and read
back by :meth:`Row.from_json`, so a report on disk redraws and diffs as the live rows do. The judge's
figures are its own types (``TensorMetrics``, ``Check``, ``RoutingMetrics``, ``LogitsMetrics``,
``BatchRow``), a drill is the drill's :class:`~.drill.Drill`; ``noise``, ``op`` and what the backend
said stay the dicts the noise floor, the drill and the backend give.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

from ..dtypes import json_safe
from ..judge.logits import LogitsMetrics
from ..judge.result import BatchRow, Check, PointResult
from ..judge.routing import RoutingMetrics
from ..judge.tensors import TensorMetrics
from ..points import CONFIG, WEIGHTS, Point
from .drill import Drill

__all__ = [
    "BatchInvarianceRow",
    "ConfigRow",
    "DrillRow",
    "ParallelRow",
    "PointRow",
    "PrecisionRow",
    "RoutingRow",
    "Row",
    "StateRow",
    "UnjudgedRow",
    "WeightsRow",
    "config_row",
    "drill_row",
    "number",
    "point_row",
    "unjudged_row",
    "weights_row",
]

Kind = Literal["point", "unjudged", "weights", "config", "op", "routing", "batch", "parallel", "state", "precision"]
# the kinds that run a point again under a condition (a differential): rows of their own, not the
# pictures' points
DIFFERENTIALS = ("routing", "batch", "parallel", "state", "precision")
JsonDict = dict[str, Any]


def number(x: Any) -> float | None:
    """A JSON figure as a float ("inf"/"nan" strings included); None when absent."""
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


@dataclass
class Row:
    """One item of a run as the reports show it: what every kind has (where it stands, its status, the
    words said about it). A kind's own figures are its class's (as pytest's ``TestReport`` and
    ``CollectReport`` share ``BaseReport``): :class:`PointRow`, :class:`UnjudgedRow`,
    :class:`WeightsRow`, :class:`DrillRow`. Readers of mixed rows ask :attr:`kind`, or the figures
    every row answers (:attr:`main_metrics`, :attr:`noise_ratio`, :meth:`verdict`, :meth:`by_mode`)."""

    kind: ClassVar[Kind]

    id: str
    order: float
    layer: int | None
    step: int | None
    component: str
    status: str  # passed, failed, error or skipped
    position: int | None = None  # a judged decode step's: the absolute position of its token
    mode: str = "isolated"  # a point's verdict's inputs: "isolated" (the golden's) or "chain" (its own)
    notes: list[str] = field(default_factory=list)
    hint: str = ""
    remedy: str | None = None  # the option that would accept a failure (a point's: a --parity-tol)
    # an item that was not judged, or not to the end: the backend's error, or why it was skipped
    error: str | None = None
    reason: str | None = None
    # a drill item's summary (`POINT::drill`), or a failed point drilled by --parity-drill auto
    drill: Drill | None = None

    @property
    def main_metrics(self) -> TensorMetrics | None:
        """The figures of the main tensor (a judged point's): none for the other kinds."""
        return None

    @property
    def noise_ratio(self) -> Any:
        return None

    def by_mode(self) -> dict[str, Row]:
        """The row's verdicts per mode: {"isolated": row, "chain": its chained row}."""
        return {self.mode: self}

    def verdict(self, mode: str) -> str | None:
        """The verdict in `mode` (None: not judged in that mode)."""
        return None

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> JsonDict:
        """The row as comparison_report.json holds it (report schema 1)."""
        head: JsonDict = {
            "id": self.id,
            "order": self.order,
            "layer": self.layer,
            "step": self.step,
            "component": self.component,
            "status": self.status,
        }
        return {**head, "position": self.position} if self.position is not None else head

    def _drill_json(self) -> JsonDict | None:
        return self.drill.to_json() if self.drill is not None else None

    def _message_json(self) -> JsonDict:
        if self.error is not None:
            return {"error": self.error}
        return {"reason": self.reason} if self.reason is not None else {}

    @staticmethod
    def from_json(data: JsonDict) -> Row:
        """A row of a comparison_report.json (what :meth:`to_json` wrote; absent keys take defaults),
        of the kind its keys say."""
        judged = any(data.get(k) for k in _JUDGED_KEYS)  # a point's own figures (an older report: no verdicts)
        cls: type[Row] = (
            RoutingRow
            if "levels" in data
            else PrecisionRow
            if "precision_verdict" in data
            else BatchInvarianceRow
            if "batch_rows" in data
            else ParallelRow
            if "plans" in data
            else StateRow
            if "serving_state" in data
            else PointRow
            if "verdicts" in data or judged
            else DrillRow
            if "op" in data
            else ConfigRow
            if "findings" in data and data.get("component") == CONFIG
            else WeightsRow
            if "findings" in data
            else UnjudgedRow
        )
        known = {f.name for f in fields(cls) if f.name != "chained"}
        values = {k: v for k, v in data.items() if k in known and v is not None}
        for name, typed in _TYPED.items():  # the judge's figures, as the judge's types
            if name in values:
                values[name] = typed(values[name])
        values.setdefault("order", 0)
        values.setdefault("layer", None)
        values.setdefault("step", None)
        values.setdefault("component", "")
        values.setdefault("status", "")
        drill = values.pop("drill", None)  # a drill's op table: the drill's own record
        if isinstance(drill, dict) and "rows" in drill:
            values["drill"] = Drill.from_json(drill)
        if cls is PointRow and isinstance(data.get("chain"), dict):
            values["chained"] = Row.from_json(data["chain"])
        return cls(**values)


@dataclass
class PointRow(Row):
    """A judged point, from the judge's `PointResult` (:func:`point_row`), with its chained twin under
    ``--parity-mode both``."""

    kind: ClassVar[Kind] = "point"

    verdicts: dict[str, str] = field(default_factory=dict)  # each mode's own verdict
    noise: JsonDict | None = None  # {"ratio": R, "targets": {...}} against the reference's own error
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # per tensor compared
    checks: list[Check] = field(default_factory=list)  # in the judge's order
    limits: JsonDict = field(default_factory=dict)
    tolerance_sources: list[str] = field(default_factory=list)
    routing: RoutingMetrics | None = None
    excluded_tokens: list[int] = field(default_factory=list)
    worst_tokens: list[list[Any]] = field(default_factory=list)  # [token, rel error]
    token_errors: list[float | None] | None = None  # a failed point's per-token errors, for its plot
    worst_experts: list[list[Any]] = field(default_factory=list)  # [expert, tokens, rel error, share]
    logits: LogitsMetrics | None = None
    worst_elements: dict[str, list[list[Any]]] = field(default_factory=dict)  # [index, golden, candidate, diff]
    candidate_dtype: str = ""
    golden_dtype: str = ""
    seconds: float = 0.0
    backend: JsonDict = field(default_factory=dict)  # what the backend said (graph, origin, ...)
    ran: dict[str, str] | None = None  # what the candidate ran (module, dtypes, implementations: backends.ran)
    chained: PointRow | None = None  # --parity-mode both: the chained verdict of the same point
    # a batch of several prompts: each row's figures over its real tokens (PointResult.rows)
    rows: list[BatchRow] = field(default_factory=list)
    # the tensor that stands for the point (PointResult.shown): a failed point's first failing one
    shown: str | None = None
    inherited: str | None = None  # both modes: the earlier point whose divergence this one's failure is

    @property
    def main_metrics(self) -> TensorMetrics | None:
        """The figures of the tensor that stands for the point (`shown`: a failed point's first failing
        tensor); in a report without it, its output (or the logits), else its first tensor."""
        metrics = self.metrics
        if self.shown in metrics:
            return metrics[self.shown]
        return metrics.get("out") or metrics.get("logits") or next(iter(metrics.values()), None)

    @property
    def noise_ratio(self) -> Any:
        return self.noise.get("ratio") if self.noise else None

    def by_mode(self) -> dict[str, Row]:
        out: dict[str, Row] = {self.mode: self}
        if self.chained is not None:
            out[self.chained.mode] = self.chained
        return out

    def verdict(self, mode: str) -> str | None:
        return self.verdicts.get(mode)

    def to_json(self) -> JsonDict:
        judged = {
            **super().to_json(),
            "mode": self.mode,
            "verdicts": self.verdicts,
            "noise": self.noise,
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
            "checks": [c.to_dict() for c in self.checks],
            "limits": self.limits,
            "tolerance_sources": self.tolerance_sources,
            "routing": self.routing.to_dict() if self.routing is not None else None,
            "excluded_tokens": self.excluded_tokens,
            "worst_tokens": self.worst_tokens,
            "token_errors": self.token_errors,
            "worst_experts": self.worst_experts,
            "logits": self.logits.to_dict() if self.logits is not None else None,
            "worst_elements": self.worst_elements,
            "notes": self.notes,
            "hint": self.hint,
            "remedy": self.remedy,
            "candidate_dtype": self.candidate_dtype,
            "golden_dtype": self.golden_dtype,
            "seconds": self.seconds,
            "backend": self.backend,
            "ran": self.ran,
            "chain": self.chained.to_json() if self.chained is not None else None,
            **({"rows": [r.to_dict() for r in self.rows]} if self.rows else {}),
            "shown": self.shown,
            "inherited": self.inherited,
        }
        return {**judged, "drill": self.drill.to_json()} if self.drill is not None else judged


@dataclass
class UnjudgedRow(Row):
    """A point that was not judged: ``skipped`` with a reason, or an ``error`` with the backend's
    message (:func:`unjudged_row`)."""

    kind: ClassVar[Kind] = "unjudged"

    def to_json(self) -> JsonDict:
        return {**super().to_json(), **self._message_json(), "metrics": {}, "checks": []}


@dataclass
class WeightsRow(Row):
    """A weight item (:func:`weights_row`): ``layer_N.weights`` / ``weights``, failed with its findings
    (or not judged, with the error or reason of :func:`unjudged_row`)."""

    kind: ClassVar[Kind] = "weights"

    findings: list[str] = field(default_factory=list)

    def verdict(self, mode: str) -> str | None:
        return self.status if mode == self.mode else None

    def to_json(self) -> JsonDict:
        weights = {**super().to_json(), "metrics": {}, "checks": [], "findings": self.findings}
        if self.findings:
            weights["hint"] = self.hint
        if self.notes:  # what was not wrong: a conversion, fields not judged
            weights["notes"] = self.notes
        return {**weights, **self._message_json()}


@dataclass
class ConfigRow(WeightsRow):
    """The config item (:func:`config_row`): ``config``, failed with the fields the forward reads that
    differ from the reference's (its findings), with notes on what was not judged."""

    kind: ClassVar[Kind] = "config"


@dataclass
class DrillRow(Row):
    """A drill item (:func:`drill_row`): ``POINT::OP`` with the op's figures (`op`), or
    ``POINT::drill`` with the drill's summary (`drill`)."""

    kind: ClassVar[Kind] = "op"

    op: JsonDict | None = None

    def verdict(self, mode: str) -> str | None:
        return self.status if mode == self.mode else None

    def to_json(self) -> JsonDict:
        return {**super().to_json(), "metrics": {}, "checks": [], "op": self.op, "drill": self._drill_json(),
                **self._message_json()}  # fmt: skip


@dataclass
class RunAgainRow(Row):
    """What the rows of a differential share (a point run again under a condition): the figures of
    each run compared (`metrics`), a verdict of the mode it ran in, and the keys of its JSON that every
    row holds; each kind adds its own figures (`_own_json`)."""

    metrics: dict[str, TensorMetrics] = field(default_factory=dict)

    def verdict(self, mode: str) -> str | None:
        return self.status if mode == self.mode else None

    def _own_json(self) -> JsonDict:
        return {}

    def to_json(self) -> JsonDict:
        return {
            **super().to_json(), "mode": self.mode, **self._own_json(),
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()}, "checks": [], "notes": self.notes,
            "hint": self.hint, **self._message_json(),
        }  # fmt: skip


@dataclass
class RoutingRow(RunAgainRow):
    """A MoE block replayed at each level of the golden's routing (``POINT::routing``,
    ``--parity-routing``): its own routing (near ties forgiven), the golden's expert ids, then ids and
    weights. `levels`: each level's verdict and figures, in that order (`metrics`: each level's main
    tensor); `recovered`: the first forced level within the block's limits where its own routing is not
    (the routing's fault is there), else None; `routing`: its own routing's flips, ties and the weight
    the flips carry."""

    kind: ClassVar[Kind] = "routing"

    levels: list[JsonDict] = field(default_factory=list)  # {"level", "status", "rel_l2", "cosine", ...}
    recovered: str | None = None
    routing: RoutingMetrics | None = None

    @property
    def main_metrics(self) -> TensorMetrics | None:
        """Its own routing's figures (the level a real run has)."""
        return self.metrics.get("own")

    def _own_json(self) -> JsonDict:
        routing = self.routing.to_dict() if self.routing is not None else None
        return {"levels": self.levels, "recovered": self.recovered, "routing": routing}


@dataclass
class BatchInvarianceRow(RunAgainRow):
    """A point run on the golden's batch and on each row alone (``POINT::batch``,
    ``--parity-batch-invariance``): `batch_rows`, each row's figures in the batch against its own run
    alone (and its run alone against the golden's row; `metrics`: each row's, in the batch vs alone);
    `changed_rows`, the rows batching alone changes; `condition`, "padding" (only padded rows change) or
    "neighbours"."""

    kind: ClassVar[Kind] = "batch"

    batch_rows: list[JsonDict] = field(default_factory=list)
    changed_rows: list[int] = field(default_factory=list)
    condition: str | None = None

    @property
    def main_metrics(self) -> TensorMetrics | None:
        """The row that differs most between the batch and alone."""
        rows = [m for m in self.metrics.values() if m is not None]
        return max(rows, key=lambda m: number(m.rel_l2) or 0.0) if rows else None

    def _own_json(self) -> JsonDict:
        return {"batch_rows": self.batch_rows, "changed_rows": self.changed_rows, "condition": self.condition}


@dataclass
class ParallelRow(RunAgainRow):
    """A point run with the candidate built under two parallel plans (``POINT::parallel``,
    ``--parity-parallel A:B``): `plans` [A, B]; `figures`, B's relative L2 to A (`b_vs_a`) and each
    plan's to the golden; `metrics`, B against A."""

    kind: ClassVar[Kind] = "parallel"

    plans: list[str] = field(default_factory=list)
    figures: JsonDict = field(default_factory=dict)

    @property
    def main_metrics(self) -> TensorMetrics | None:
        return self.metrics.get("b_vs_a")

    def _own_json(self) -> JsonDict:
        return {"plans": self.plans, "figures": self.figures}


@dataclass
class PrecisionRow(RunAgainRow):
    """A failing point's precision search (``POINT::precision``, ``--parity-precision-search``):
    `precision_verdict` ("precision": `raised` are the fewest units whose float32 makes it pass;
    "defect": it fails with every unit raised; "not_precision": it passes with none raised), `units`
    (every op group that ran, in forward order), `runs` (each run of the search: its units raised,
    status and rel_l2), `search_seconds`; `metrics`: nothing raised (`none`), the units found
    (`raised`), or every unit (`all`)."""

    kind: ClassVar[Kind] = "precision"

    precision_verdict: str | None = None
    raised: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    runs: list[JsonDict] = field(default_factory=list)
    search_seconds: float | None = None

    @property
    def main_metrics(self) -> TensorMetrics | None:
        return self.metrics.get("raised") or self.metrics.get("none")

    def _own_json(self) -> JsonDict:
        return {
            "precision_verdict": self.precision_verdict, "raised": self.raised, "units": self.units,
            "runs": self.runs, "search_seconds": self.search_seconds,
        }  # fmt: skip


@dataclass
class StateRow(RunAgainRow):
    """A point run in another serving state of the candidate against its own clean run (``POINT::state``,
    ``--parity-state reused|prefix|DIR``): `serving_state`, the state asked (a word, or a dump's directory)
    and `said`, how the backend names it ("after another request in slot 0"); `figures`, the state's
    relative L2 to the clean run (`state_vs_clean`) and each one's to the golden, the token rows the state
    changes (`rows`) and the cache rows whose keys or values differ (`cache_rows`); `metrics`, the state's
    run against the clean one."""

    kind: ClassVar[Kind] = "state"

    serving_state: str = ""
    said: str = ""
    figures: JsonDict = field(default_factory=dict)

    @property
    def main_metrics(self) -> TensorMetrics | None:
        return self.metrics.get("state_vs_clean")

    def _own_json(self) -> JsonDict:
        return {"serving_state": self.serving_state, "said": self.said, "figures": self.figures}


_JUDGED_KEYS = ("metrics", "checks", "routing", "logits", "noise", "limits", "candidate_dtype")
_TYPED: dict[str, Any] = {  # the fields read back as the judge's types (`Row.from_json`)
    "metrics": lambda items: {k: TensorMetrics.from_dict(m) for k, m in items.items()},
    "checks": lambda items: [Check.from_dict(c) for c in items],
    "routing": RoutingMetrics.from_dict,
    "logits": LogitsMetrics.from_dict,
    "rows": lambda items: [BatchRow.from_dict(r) for r in items],
}


def _place(entry: Point | PointResult) -> JsonDict:
    """Where a row stands: its point id, forward order, layer, decode step and component."""
    return {name: getattr(entry, name) for name in ("id", "order", "layer", "step", "component")}


def point_row(result: PointResult) -> PointRow:
    """The row of a judged point (and of its chained verdict under --parity-mode both)."""
    failed = not result.passed
    return PointRow(
        **_place(result),
        status=result.status,
        position=result.position,
        mode=result.mode,
        verdicts=result.verdicts,
        noise=result.noise,
        metrics=result.metrics,
        checks=result.checks,
        limits={k: json_safe(v) for k, v in result.tolerance.items()},
        tolerance_sources=result.tolerance_sources,
        routing=result.routing,
        excluded_tokens=result.excluded_tokens,
        worst_tokens=[[t, json_safe(e)] for t, e in result.worst],
        token_errors=result.token_errors if result.verdicts[result.mode] == "failed" else None,
        worst_experts=[[e, n, json_safe(err), round(share, 4)] for e, n, err, share in result.worst_experts],
        logits=result.logits,
        worst_elements={
            k: [[list(i), json_safe(g), json_safe(c), json_safe(d)] for i, g, c, d in rows]
            for k, rows in result.worst_elements.items()
        },
        notes=result.notes,
        hint=result.hint if failed else "",
        remedy=result.remedy() if failed else None,
        candidate_dtype=result.candidate_dtype,
        golden_dtype=result.golden_dtype,
        seconds=round(result.seconds, 6),
        backend=result.backend,
        ran=result.ran,
        chained=point_row(result.chained) if result.chained is not None else None,
        rows=result.rows,
        shown=result.shown,
        inherited=result.inherited,
    )


def result_of(row: PointRow) -> PointResult:
    """The judge's result of a report's point (:func:`point_row` read back), for
    :func:`~.text.failure_text`: report.html shows a failure in the very words the run printed."""
    return PointResult(
        id=row.id,
        layer=row.layer,
        component=row.component,
        passed=row.status == "passed",
        checks=row.checks,
        metrics=row.metrics,
        routing=row.routing,
        excluded_tokens=row.excluded_tokens,
        worst=[(t, e) for t, e in row.worst_tokens],
        token_errors=row.token_errors,
        worst_experts=[tuple(e) for e in row.worst_experts],
        logits=row.logits,
        worst_elements={k: [(tuple(i), g, c, d) for i, g, c, d in v] for k, v in row.worst_elements.items()},
        notes=row.notes,
        hint=row.hint,
        tolerance=row.limits,
        tolerance_sources=row.tolerance_sources,
        candidate_dtype=row.candidate_dtype,
        golden_dtype=row.golden_dtype,
        seconds=row.seconds,
        order=int(row.order),
        step=row.step,
        position=row.position,
        backend=row.backend,
        ran=row.ran,
        mode=row.mode,
        noise=row.noise,
        chained=result_of(row.chained) if row.chained is not None else None,
        rows=row.rows,
        shown=row.shown,
        inherited=row.inherited,
    )


def weights_row(name: str, layer: int | None, order: float, findings: list[str]) -> WeightsRow:
    """The row of a weight item (`layer_N.weights`, `weights`): ordered just before its unit's first
    point, failed with the findings in words."""
    return WeightsRow(
        id=name,
        order=order,
        layer=layer,
        step=None,
        component=WEIGHTS,
        status="failed" if findings else "passed",
        findings=findings,
        hint=findings[0] if findings else "",
    )


def config_row(order: float, differ: list[str], notes: list[str]) -> ConfigRow:
    """The row of the config item: first in order, failed with the fields that differ."""
    hint = (
        f"the candidate reads another config than the reference ({differ[0]}): the points that read it diverge; "
        "make the port's config the reference's (or convert it) first"
        if differ
        else ""
    )
    return ConfigRow(
        id=CONFIG, order=order, layer=None, step=None, component=CONFIG,
        status="failed" if differ else "passed", findings=differ, notes=notes, hint=hint,
    )  # fmt: skip


def drill_row(entry: Any, status: str, op: JsonDict | None, drill: Drill | None) -> DrillRow:
    """The row of a drill item (`entry`: the session's DrillEntry): one op's figures (`op`), or the
    drill's summary (`drill`)."""
    return DrillRow(
        id=entry.id, order=entry.order, layer=entry.layer, step=None, component=entry.component,
        status=status, op=op, drill=drill,
    )  # fmt: skip


def unjudged_row(entry: Point | Row, status: str, message: str) -> Row:
    """The row of an item that was not judged: `skipped` (with a reason) or `error` (the message).
    `entry` is the point, or the weight item's own row."""
    said = {"error": message} if status == "error" else {"reason": message}
    if isinstance(entry, Row):
        return replace(entry, status=status, **said)
    return UnjudgedRow(**_place(entry), status=status, **said)
