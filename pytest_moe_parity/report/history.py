"""Run-to-run comparison of two JSON reports (`moe-parity diff OLD NEW`): which points got worse
beyond a factor, which newly fail or error, which were fixed. Nightly regressions, from the rows alone.
A diff written as JSON beside the report it was taken against (`diff.json`) is read back here
(:func:`load_diff`), not shown where it names another report (:func:`stale_diff`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..words import counted
from .ran import RanChange, ran_changes
from .rows import Row
from .summary import figure

# figures a regression is judged on, with the value under which a growth does not count: rel_l2 below
# `min_error` is rounding whatever its growth; a noise ratio under 1 is within the reference's own error
FIGURES = ("rel_l2", "noise_ratio")
DIFF_SCHEMA_VERSION = 1  # of the diff's JSON (`Diff.to_json`)
DIFF_FILE = "diff.json"  # a diff kept beside the report it was taken against (the page shows it)


@dataclass
class Change:
    """How one point's verdict in one mode changed: its status, and the figures that moved beyond the
    factor, as (figure, old, new). An item new tonight that failed (`new`) has no old status (None) and
    says what failed it (`detail`: its figures, findings or error)."""

    id: str
    mode: str
    status: tuple[str | None, str] | None = None
    figures: list[tuple[str, float, float]] = field(default_factory=list)
    new: bool = False
    detail: str = ""

    def line(self) -> str:
        if self.new and self.status:
            parts = [f"new tonight, {self.status[1]}"]
        else:
            parts = [f"{self.status[0]} -> {self.status[1]}"] if self.status else []
        for what, old, new in self.figures:
            factor = f" (x{new / old:.3g})" if old else ""
            parts.append(f"{what} {old:.3g} -> {new:.3g}{factor}")
        if self.detail:
            parts.append(self.detail)
        return f"{self.id:<28} {self.mode:<9} " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        figures = [{"figure": what, "old": old, "new": new} for what, old, new in self.figures]
        out = {"id": self.id, "mode": self.mode, "status": list(self.status) if self.status else None,
               "figures": figures}  # fmt: skip
        if self.new:  # new tonight (not in the old report) and failed: status [null, "failed"]
            out.update(new=True, detail=self.detail)
        return out


@dataclass
class Diff:
    old: dict[str, Any]
    new: dict[str, Any]
    common: int = 0
    worse: list[Change] = field(default_factory=list)
    fixed: list[Change] = field(default_factory=list)
    better: list[Change] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    ran: list[RanChange] = field(default_factory=list)  # points that ran another kernel, implementation or dtype

    def lines(self, old_name: str, new_name: str, factor: float) -> list[str]:
        out = [
            f"moe-parity diff: {old_name} ({_run(self.old)}) -> {new_name} ({_run(self.new)}), "
            f"{counted(self.common, 'point')} in both"
        ]
        out.append(f"worse beyond x{factor:g} or newly failing: {len(self.worse)}")
        out += [f"  {c.line()}" for c in self.worse]
        if self.fixed:
            out.append(f"fixed: {len(self.fixed)}")
            out += [f"  {c.line()}" for c in self.fixed]
        if self.better:
            out.append(f"better beyond x{factor:g}: {len(self.better)}")
        if self.ran:
            out.append(f"ran otherwise: {counted(len({c.id for c in self.ran}), 'point')}")
            out += [f"  {c.line()}" for c in self.ran]
        for name, ids in ((old_name, self.only_old), (new_name, self.only_new)):
            if ids:
                shown = ", ".join(ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
                out.append(f"only in {name} (not compared): {shown}")
        return out

    def to_json(self, old_name: str, new_name: str, factor: float) -> dict[str, Any]:
        """The diff as `moe-parity diff --json` writes it, and as report.html's section reads it
        (report/html.py): `new_digest` names the report it was taken against, so a page never shows
        it for another."""
        return {
            "schema_version": DIFF_SCHEMA_VERSION,
            "old": old_name,
            "new": new_name,
            "old_run": _run(self.old),
            "new_run": _run(self.new),
            "factor": factor,
            "common": self.common,
            "new_digest": report_digest(self.new),
            "worse": [c.to_json() for c in self.worse],
            "fixed": [c.to_json() for c in self.fixed],
            "better": [c.to_json() for c in self.better],
            "only_old": self.only_old,
            "only_new": self.only_new,
            "ran": [c.to_json() for c in self.ran],
        }


def report_digest(report: dict[str, Any]) -> str:
    """What a report's points hold, in 16 hex digits: the same for the dict a run wrote and for the
    file read back."""
    return hashlib.sha256(json.dumps(report["points"], sort_keys=True).encode()).hexdigest()[:16]


def _run(report: dict[str, Any]) -> str:
    return f"--hw {report.get('hw', '?')}, {report.get('dtype', '?')}, {report.get('mode', 'isolated')}"


def comparable(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why two reports cannot be compared (different goldens), or None."""
    fo, fn = old.get("golden_fingerprint"), new.get("golden_fingerprint")
    if fo and fn and fo != fn:
        return (
            f"the reports come from different goldens ({old.get('golden_dir')} {fo} vs "
            f"{new.get('golden_dir')} {fn}); their points are not comparable"
        )
    if old.get("model_type") != new.get("model_type"):
        return f"the reports are of different models ({old.get('model_type')} vs {new.get('model_type')})"
    return None


def diff_reports(old: dict[str, Any], new: dict[str, Any], *, factor: float = 2.0, min_error: float = 1e-3) -> Diff:
    """Point by point and mode by mode: a status that went from passed to failed or error, and a
    figure that grew beyond `factor` (rel_l2 ending above `min_error`, a noise ratio above 1); an item
    new tonight that failed or errored is worse too (it may be the night's root cause)."""
    floors = {"rel_l2": min_error, "noise_ratio": 1.0}
    old_rows = {r.id: r for r in map(Row.from_json, old["points"])}
    new_rows = {r.id: r for r in map(Row.from_json, new["points"])}
    diff = Diff(old, new)
    diff.only_old = [pid for pid in old_rows if pid not in new_rows]
    for pid, n_row in new_rows.items():
        o_row = old_rows.get(pid)
        if o_row is None:  # new tonight: worse where it failed (a config item, weight items), else not compared
            failures = new_failures(n_row)
            diff.worse += failures
            if not failures:
                diff.only_new.append(pid)
            continue
        diff.common += 1
        diff.ran += ran_changes(o_row, n_row)
        if "skipped" in (o_row.status, n_row.status):
            continue
        o_modes, n_modes = o_row.by_mode(), n_row.by_mode()
        for mode in (m for m in n_modes if m in o_modes):
            o_status = "error" if o_row.status == "error" else o_row.verdict(mode)
            n_status = "error" if n_row.status == "error" else n_row.verdict(mode)
            worse, better = Change(pid, mode), Change(pid, mode)
            if o_status == "passed" and n_status in ("failed", "error"):
                worse.status = (o_status, n_status)
            elif o_status in ("failed", "error") and n_status == "passed":
                better.status = (o_status, n_status)
            for what in FIGURES:
                a, b = figure(o_modes[mode], what), figure(n_modes[mode], what)
                if a is None or b is None or any(map(math.isnan, (a, b))):
                    continue
                if b > factor * a and b > floors[what]:
                    worse.figures.append((what, a, b))
                elif a > factor * b and a > floors[what]:
                    better.figures.append((what, a, b))
            if worse.status or worse.figures:
                diff.worse.append(worse)
            if better.status:
                diff.fixed.append(better)
            elif better.figures:
                diff.better.append(better)
    return diff


def new_failures(row: Row) -> list[Change]:
    """An item new tonight, as the worse changes of its modes that failed or errored (none where it
    passed or was skipped): each says what failed it."""
    out = []
    for mode, mode_row in row.by_mode().items():
        status = "error" if row.status == "error" else mode_row.verdict(mode)
        if status in ("failed", "error"):
            out.append(Change(row.id, mode, (None, status), new=True, detail=_what_failed(row, mode_row)))
    return out


def _what_failed(row: Row, mode_row: Row) -> str:
    """One line on what failed a new item: its error, its findings (a config or weight item), or its
    figures (a point)."""
    if row.error:
        return row.error.strip().splitlines()[0] if row.error.strip() else "error"
    findings = getattr(row, "findings", None) or []
    if findings:
        more = f" and {len(findings) - 2} more" if len(findings) > 2 else ""
        return ", ".join(findings[:2]) + more
    shown = [(what, figure(mode_row, what)) for what in FIGURES]
    figures = [f"{what} {value:.3g}" for what, value in shown if value is not None and not math.isnan(value)]
    return "; ".join(figures) or mode_row.hint or row.hint


def load_diff(directory: Path, report: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """`diff.json` beside a report: (the diff, None), or (None, why it is not shown); (None, None)
    where there is none."""
    path = directory / DIFF_FILE
    if not path.is_file():
        return None, None
    try:
        diff = read_diff(path)
    except ValueError as exc:
        return None, str(exc)
    stale = stale_diff(diff, report)
    return (None, stale) if stale is not None else (diff, None)


def stale_diff(diff: dict[str, Any], report: dict[str, Any]) -> str | None:
    """Why `diff` is not the diff of `report` (it names another report's digest); None where it is."""
    said = diff.get("new_digest")
    if said and said != report_digest(report):
        return (
            f"{DIFF_FILE} compares another report than this one (written before this run's report): "
            f"write it again with moe-parity diff OLD THIS_DIR --json THIS_DIR/{DIFF_FILE}"
        )
    return None


def read_diff(path: Path) -> dict[str, Any]:
    """A diff as `moe-parity diff --json` writes it; ValueError with one sentence when it is not one."""
    try:
        diff = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable JSON diff ({exc})") from None
    lists = [diff.get(k, []) for k in ("worse", "fixed", "better")] if isinstance(diff, dict) else []
    if not lists or "worse" not in diff or not all(isinstance(c, list) and all(map(_change, c)) for c in lists):
        raise ValueError(f"{path} is not a moe-parity diff (write one with moe-parity diff OLD NEW --json FILE)")
    if diff.get("schema_version") != DIFF_SCHEMA_VERSION:
        raise ValueError(
            f"{path} has diff schema {diff.get('schema_version')}; this moe-parity reads schema "
            f"{DIFF_SCHEMA_VERSION} (write it again with moe-parity diff --json)"
        )
    return diff


def _change(c: Any) -> bool:
    """Whether `c` is a change as :meth:`~.history.Change.to_json` writes it (what the page reads)."""
    if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(c.get("mode"), str):
        return False
    status, figures = c.get("status"), c.get("figures", [])
    return (status is None or (isinstance(status, list) and len(status) == 2)) and (
        isinstance(figures, list) and all(isinstance(f, dict) for f in figures)
    )
