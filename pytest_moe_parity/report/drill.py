"""A drill's record (`Drill`, its op rows `OpRow`): what the drill (`drill/engine.py`) produces and what
the report writes, reads back (:meth:`Drill.from_json`) and renders. Each sentence a drill says of
its culprit is written here once (:func:`differs`, :func:`recovers`, :func:`finding`);
the text, the summary, the bug-report block and the page place them."""

from __future__ import annotations

import copy
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

FAILED = ("introduced", "inherited", "missing", "extra")
# The golden's model rerun in float32 on this machine reproduces the golden to ~1e-7 (same code and
# weights; another CPU's kernels ~1e-6): beyond this, the drill's reference is not the golden's.
REPRODUCE_TOL = 1e-3


@dataclass
class OpRow:
    name: str
    kind: str
    shape: list[int]
    how: str | None  # how it was matched; None: unmatched
    candidate: list[str] = field(default_factory=list)  # the candidate's ops that compute it
    error: float | None = None
    noise: float | None = None
    ratio: float | None = None
    isolated: float | None = None
    isolated_noise: float | None = None
    isolated_ratio: float | None = None
    verdict: str = "ok"
    note: str = ""
    recovery: float | None = None  # of the component's error, substituting this op's golden output

    @property
    def failed(self) -> bool:
        return self.verdict in FAILED

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpRow:
        """A row as :func:`dataclasses.asdict` wrote it (absent keys: their defaults)."""
        return cls(**_values(cls, data, {"name": "", "kind": "", "shape": [], "how": None}))


@dataclass
class Drill:
    """One component drilled: its op rows in forward order and the culprit."""

    point: str
    rows: list[OpRow]
    culprit: str | None
    recovery: float | None
    component_error: float
    component_noise: float
    factor: float
    dtype: str
    same_code: bool
    seconds: float = 0.0
    culprit_candidate: list[str] = field(default_factory=list)  # the candidate ops substituted
    recovery_introduced: float | None = None  # substituting every op that introduced error
    repro: str | None = None  # the repro file written for the culprit (--parity-repro)
    # what the repro reproduces where it is no kernel's error: a constant that differs, with its values
    repro_cause: str | None = None
    reference_error: float | None = None  # the reference's float32 rerun here against the golden's output
    structure: list[str] = field(default_factory=list)  # missing and extra ops, with the ops they feed
    # the culprit recovers under half: the other op whose substitution recovers most {"op", "recovery"}
    partial: dict[str, Any] | None = None
    accumulation: str | None = None  # the component diverges and no op leaves its floor: how it builds up
    unmatched: str | None = None  # most of the reference's ops matched nothing: matching failed, no culprit
    # a value the candidate makes inside the call (positions, a mask, a table) that differs from the
    # golden's of the same meaning (`drill.made`)
    made: str | None = None
    # the culprit's aten op and what it was given that the reference's was not (`explain`)
    culprit_op: str = ""
    evidence: list[str] = field(default_factory=list)
    # the same op introduced error in several experts (`drill.groups`): the group in words ("gate_up_proj
    # in all 8 experts"), its ops (rows' names, the culprit first) and what substituting them all recovers
    culprit_group: str | None = None
    group_ops: list[str] = field(default_factory=list)
    group_recovery: float | None = None
    # experts that ran on other rows than the reference's ("expert 0 ran on 5 of its 7 tokens: ...")
    row_sets: list[str] = field(default_factory=list)
    # the drill's values while its point is drilled (the engine's `Drilling`, for a repro file); dropped
    # by `Driller.release`, never in the JSON
    state: Any = field(default=None, repr=False, compare=False)

    @property
    def foreign_reference(self) -> bool:
        """Whether the reference rerun on this machine fails to reproduce the golden (other code or
        weights than the recording's): the drill then compares against something else."""
        return self.reference_error is not None and self.reference_error > REPRODUCE_TOL

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.rows) or self.foreign_reference or self.accumulation is not None

    def row(self, name: str) -> OpRow | None:
        return next((r for r in self.rows if r.name == name), None)

    # -- what it says ------------------------------------------------------------------------------
    def differs(self) -> list[str]:
        """What the culprit's op was given that the reference's was not, a sentence each."""
        return differs(self.evidence)

    def finding(self) -> str | None:
        """What the drill proved about its point, as the point's hint (None: nothing beyond it)."""
        return finding(self.culprit, self.recovery, self.structure, self.culprit_group, self.group_recovery,
                       self.row_sets)  # fmt: skip

    def findings(self) -> list[str]:
        """The drill's sentences beside its line and op table: the culprit's evidence, the structure,
        how the error accumulates, why matching failed, the next op that explains it, the repro."""
        said = [*self.differs(), *(f"rows differ: {s}" for s in self.row_sets)]
        said += [f"structure: {s}" for s in self.structure]
        if self.made:
            said.append(f"made inside the call: {self.made}")
        if self.accumulation:
            said.append(str(self.accumulation))
        if self.unmatched:
            said.append(f"matching failed: {self.unmatched}")
        if self.partial:
            p = self.partial
            said.append(f"the next op that explains the error: {p.get('op')} (recovers {pct(p.get('recovery'))})")
        if self.repro:
            said.append(repro_line(self.repro, self.repro_cause))
        return said

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The drill as the report holds it (report schema 1): every field but `state`."""
        return {
            f.name: [asdict(r) for r in self.rows] if f.name == "rows" else copy.deepcopy(getattr(self, f.name))
            for f in fields(self)
            if f.name != "state"
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Drill:
        """A drill as :meth:`to_json` wrote it (absent keys: their defaults)."""
        values = _values(cls, data, _DRILL_DEFAULTS)
        values["rows"] = [OpRow.from_json(r) for r in data.get("rows") or []]
        return cls(**values)


# what a drill's JSON may lack (a report written by hand, a test's) reads back as
_DRILL_DEFAULTS = dict.fromkeys(("culprit", "recovery", "component_error", "component_noise", "factor"))
_DRILL_DEFAULTS.update(point="", dtype="", same_code=True)


def _values(cls: type, data: dict[str, Any], required: dict[str, Any]) -> dict[str, Any]:
    """`cls`'s fields from `data`; a field without a default that `data` lacks takes `required`'s."""
    known = {f.name for f in fields(cls) if f.name != "state"}
    values = {k: v for k, v in data.items() if k in known}
    missing = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    return {**{k: required[k] for k in missing - values.keys() if k in required}, **values}


def repro_line(path: str, cause: str | None) -> str:
    """The drill's line naming its repro file, with its cause where it is no kernel's error."""
    return f"repro: {path}" + (f" ({cause})" if cause else "")


def pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * float(x):.0f}%"


def differs(evidence: list[str]) -> list[str]:
    """The culprit's evidence (`Drill.evidence`), a sentence each."""
    return [f"the culprit's op differs: {said}" for said in evidence]


def recovers(recovery: float | None, them: bool = False) -> str:
    """ "substituting it recovers N%" ("them": a group's; empty where nothing was substituted)."""
    return f"substituting {'them' if them else 'it'} recovers {100 * recovery:.0f}%" if recovery is not None else ""


def culprit_said(
    culprit: str,
    recovery: float | None,
    group: str | None = None,
    group_recovery: float | None = None,
    row_sets: list[str] | None = None,
) -> str:
    """The culprit and its recovery in one phrase: `gate_up_proj in all 8 experts, substituting them
    recovers 100%`, `down_proj, substituting it recovers 97%`, or the rows it ran on where no
    substitution can be measured (`expert[0].index: expert 0 ran on 5 of its 7 tokens: ...`)."""
    said = _recovered(recovery, group, group_recovery)
    text = f"{group or culprit}{', ' + said if said else ''}"
    if not said and row_sets:
        text += f" ({row_sets[0]}{'; ...' if len(row_sets) > 1 else ''})"
    return text


def _recovered(recovery: float | None, group: str | None, group_recovery: float | None) -> str:
    """What substituting the culprit recovers: its group's where it has one, else its own."""
    return recovers(group_recovery, them=True) if group else recovers(recovery)


def finding(
    culprit: str | None,
    recovery: float | None,
    structure: list[str] | None,
    group: str | None = None,
    group_recovery: float | None = None,
    row_sets: list[str] | None = None,
) -> str | None:
    """What a drill proved about its point (of a drill, or of the summary's `drills` entry)."""
    if culprit:
        said = _recovered(recovery, group, group_recovery)
        if not said and row_sets:
            said = row_sets[0]
        return f"drill: {group or culprit} introduced the divergence{'; ' + said if said else ''}"
    if structure:
        return f"drill: {structure[0]}"
    return None
