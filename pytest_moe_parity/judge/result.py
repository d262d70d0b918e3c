"""What a point's judging results in, apart from how it is judged (`verdict`): a point's result
(`PointResult`) with its checks, its batch rows, and what a custom comparison is about. The reports,
the session and the replay read these; only the replay's runner judges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import json_safe
from .logits import LogitsMetrics
from .routing import RoutingMetrics
from .tensors import TensorMetrics
from .tolerances import JUNIT_FIGURES


@dataclass(frozen=True)
class Custom:
    """What a custom comparison (the `parity` fixture) is about: a name and a component."""

    id: str
    component: str = "custom"
    layer: int | None = None
    order: int = 0
    step: int | None = None
    router_kind: str | None = None


@dataclass
class Check:
    name: str
    target: str
    value: float
    limit: float | None
    op: str
    passed: bool
    # the tolerance key that sets the limit (None: no tolerance accepts a failure); not in the reports
    key: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "value": json_safe(self.value),
            "limit": json_safe(self.limit),
            "op": self.op,
            "passed": self.passed,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Check:
        """A check as a report holds it (`to_dict`: without its tolerance key)."""
        limit = data.get("limit")
        return cls(data["name"], data["target"], float(data.get("value", "nan")),
                   None if limit is None else float(limit), data.get("op", ""), bool(data.get("passed")))  # fmt: skip


@dataclass
class BatchRow:
    """One row (prompt) of a batch of several, judged over its real tokens: its relative L2 error and
    its worst token's, in the point's main tensor, and whether they fail the dtype's limits alone."""

    row: int
    tokens: int
    rel_l2: float | None
    max_token_rel_l2: float | None
    failed: bool
    prompt: str | None = None  # the prompt's preview, where the golden has one (`--prompts`)

    def to_dict(self) -> dict[str, Any]:
        data = {"row": self.row, "tokens": self.tokens, "rel_l2": json_safe(self.rel_l2),
                "max_token_rel_l2": json_safe(self.max_token_rel_l2), "failed": self.failed}  # fmt: skip
        return {**data, "prompt": self.prompt} if self.prompt is not None else data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchRow:
        rel, worst = data.get("rel_l2"), data.get("max_token_rel_l2")
        return cls(int(data["row"]), int(data.get("tokens", 0)), None if rel is None else float(rel),
                   None if worst is None else float(worst), bool(data.get("failed")), data.get("prompt"))  # fmt: skip


@dataclass
class PointResult:
    id: str
    layer: int | None
    component: str
    passed: bool
    checks: list[Check] = field(default_factory=list)
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    routing: RoutingMetrics | None = None
    excluded_tokens: list[int] = field(default_factory=list)
    worst: list[tuple[int, float]] = field(default_factory=list)
    # every token's own error in the first tensor with tokens (None: a token left out); in the report of
    # a failed point, for its per-token plot
    token_errors: list[float | None] | None = None
    # experts / moe: the experts that carry most of the error, as (expert, tokens, rel_l2 over its
    # tokens, its own share of the error)
    worst_experts: list[tuple[int, int, float, float]] = field(default_factory=list)
    logits: LogitsMetrics | None = None  # the logits point: next-token agreement
    # per failed tensor: the elements that differ most, as (index, golden, candidate, difference)
    worst_elements: dict[str, list[tuple[tuple[int, ...], float, float, float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hint: str = ""
    tolerance: dict[str, Any] = field(default_factory=dict)
    tolerance_sources: list[str] = field(default_factory=list)
    candidate_dtype: str = ""
    golden_dtype: str = ""
    seconds: float = 0.0
    order: int = 0
    step: int | None = None
    position: int | None = None  # a decode step's: the absolute position of the token it computes
    backend: dict[str, Any] = field(default_factory=dict)  # what the backend said (CandidateOutput.info)
    ran: dict[str, str] | None = None  # what the candidate ran for it (`backends.ran`); None: not said
    mode: str = "isolated"  # "isolated" (golden inputs) or "chain" (the candidate's own inputs)
    # per compared tensor with a row per token: each token's squared error (NaN: left out), for the
    # noise floor's per-token record (not in the reports)
    token_d2: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # against the reference's own error in the candidate's dtype: {"ratio": R, "targets": {...}}
    noise: dict[str, Any] | None = None
    chained: PointResult | None = None  # --parity-mode both: the chained verdict of the same point
    # a batch of several prompts: each row's figures over its real tokens
    rows: list[BatchRow] = field(default_factory=list)
    # the tensor whose figures stand for the point (the table, the pictures, JUnit): the first with a
    # failed check, else the output (the logits), else the first compared
    shown: str | None = None
    # both modes: right on the golden's inputs, wrong on its own, after this earlier point introduced a
    # divergence (failed on the golden's inputs): its failure is that one's, folded under it
    inherited: str | None = None

    @property
    def status(self) -> str:
        return "passed" if self.passed else "failed"

    @property
    def failed_checks(self) -> list[Check]:
        """The checks that failed, the chained verdict's too (--parity-mode both)."""
        own = [c for c in self.checks if not c.passed]
        return own + (self.chained.failed_checks if self.chained is not None else [])

    @property
    def noise_ratio(self) -> float | None:
        return self.noise["ratio"] if self.noise else None

    @property
    def verdicts(self) -> dict[str, str]:
        """Each mode's own verdict: {"isolated": "passed", "chain": "failed"}."""
        own = "passed" if self.checks and all(c.passed for c in self.checks) else "failed"
        return {self.mode: own, **(self.chained.verdicts if self.chained is not None else {})}

    def add_chained(self, chained: PointResult) -> None:
        """Both modes: this (isolated) result and the chained one; it passes when both do."""
        self.chained = chained
        self.passed = self.passed and chained.passed
        if not chained.passed and not self.hint:
            self.hint = chained.hint

    @property
    def main(self) -> TensorMetrics | None:
        """The figures of the tensor that stands for the point (`shown`)."""
        if self.shown in self.metrics:
            return self.metrics[self.shown]
        return next(iter(self.metrics.values()), None)

    def junit_properties(self) -> list[tuple[str, Any]]:
        """The figures a JUnit XML report carries for this point (`chain_` ones for the chained
        verdict of --parity-mode both), then its status."""
        props: list[tuple[str, Any]] = []
        for prefix, result in (("", self), ("chain_", self.chained)):
            if result is None:
                continue
            if result.main is not None:
                props.extend((prefix + name, getattr(result.main, name)) for name in JUNIT_FIGURES)
            if result.noise_ratio is not None:
                props.append((prefix + "noise_ratio", result.noise_ratio))
            failing = [str(row.row) for row in result.rows if row.failed]
            if failing:  # a batch of several prompts: the rows that fail alone
                props.append((prefix + "failing_rows", ",".join(failing)))
        return [*props, ("parity_status", self.status)]

    def remedy(self) -> str | None:
        """The `--parity-tol` that would accept this result, or None when no tolerance can (a shape
        mismatch, NaN, a wrong type)."""
        values: dict[str, float] = {}
        for check in self.failed_checks:
            if check.key is None or not math.isfinite(check.value) or (check.op == ">=" and check.value < 0):
                return None  # a shape, a NaN, a type, a negative cosine: no tolerance accepts these
            proposed = _accepting(check.value, check.op)
            previous = values.get(check.key)
            values[check.key] = proposed if previous is None else _looser(previous, proposed, check.op)
        if not values:
            return None
        body = ",".join(f"{k}={v:.4g}" for k, v in values.items())
        return f"--parity-tol '{self.id}:{body}'"


def _ceil_2(x: float) -> float:
    """x rounded up to two significant digits."""
    if x <= 0:
        return 0.0
    unit = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(x / unit - 1e-9) * unit


def _accepting(value: float, op: str) -> float:
    """A round limit that `value` meets: a maximum rounded up, a minimum rounded down (minimums
    near 1, like cosine, are rounded on their distance to 1)."""
    if op == "<=":
        return _ceil_2(value)
    return max(0.0, 1.0 - _ceil_2(1.0 - value)) if value <= 1.0 else value


def _looser(a: float, b: float, op: str) -> float:
    return max(a, b) if op == "<=" else min(a, b)
