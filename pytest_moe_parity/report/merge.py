"""`moe-parity report --merge DIR... --out DIR`: the reports of a sharded run (each shard one
`--parity-layers` selection of one golden, candidate and settings, run on its own machine) made the
report of one run: the rows of every shard in forward order, the summary with the first divergence
over all of them, the pictures, and a JUnit file with one test case per item.

What a merge must never do is read a gap as a pass. Shards are checked against each other first;
what makes them not one run is bad input (`MergeError`, one sentence: `moe-parity` exit 2): a
directory that is not there or holds no report, reports of other goldens, candidates, backends,
dtypes, modes, settings or versions, two shards that ran the same layer. What one run lacks is named
in the merged report (`shard_problems`, `complete: false`, an errored JUnit case each) and fails the
merge (exit 1): a shard that stopped early (`complete: false`: interrupted; or fewer rows than the
points it selected: `-x`, a crash), and the layers, or the model-level points, that no shard ran (the
shard that ran them crashed before writing a report, or never started)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from ..errors import BadInput
from ..files import atomic_write_text
from ..judge.tolerances import JUNIT_FIGURES
from ..points import describe_layers
from ..words import counted
from .files import write_reports
from .html import HTML_FILE
from .rows import Row
from .schema import REPORT_FILE, SUMMARY_FILE, read_report, report_rows
from .summary import counts, first_divergence, mark_inherited, row_note

JUNIT_FILE = "junit.xml"
# what every shard of one run shares (report meta keys); `hw_options` less HOST_OPTIONS, and VERSIONS
SAME = {  # key: what it is, in words
    "golden_fingerprint": "golden (fingerprint)",
    "golden_layers": "golden's layers",
    "model_type": "model type",
    "candidate_model": "candidate",
    "hw": "--hw",
    "dtype": "dtype",
    "mode": "mode",
    "noise_dtypes": "golden's noise dtypes",
    "run_options": "settings (tolerances, weight, config, drill and differential items)",
}
HOST_OPTIONS = ("cache_dir", "threads")  # settings of the machine a shard ran on, not of what it judged
VERSIONS = ("moe-parity", "torch", "transformers")
SHARD_KEYS = ("golden_layers", "model_points", "planned_points", "run_options")  # what a shard's meta must hold
# meta of one process that a merged report does not carry (each shard's report keeps its own)
PER_PROCESS = ("points", "complete", "schema_version", "golden_files_read", "candidate_reads")


class MergeError(BadInput, ValueError):
    """Reports that cannot be merged into one run: one sentence naming the directory and why."""


@dataclass
class Shard:
    """One shard's report: where it is, what it holds, and what it selected."""

    path: Path
    report: dict[str, Any]
    rows: list[Row]

    @property
    def selection(self) -> str:
        """The shard's `--parity-layers`, as given ("every layer" without one)."""
        return self.report.get("parity_layers") or "every layer"

    @property
    def name(self) -> str:
        return f"{self.path} (--parity-layers {self.selection})"

    @property
    def layers(self) -> set[int]:
        chosen = self.report.get("layers")
        return set(self.report["golden_layers"] if chosen is None else chosen)

    @property
    def model_points(self) -> bool:
        return bool(self.report.get("model_points"))

    @property
    def start(self) -> float:
        """Where the shard starts in forward order (for listing shards in that order)."""
        return min((r.order for r in self.rows), default=math.inf if not self.model_points else -1)

    def problem(self) -> str | None:
        """Why this shard is not all of its part of the run (None: it is)."""
        seen = {r.id for r in self.rows}
        planned = self.report.get("planned_points") or []
        missing = [pid for pid in planned if pid not in seen]
        if not self.report.get("complete", True):
            said = f"{self.name} stopped before its end (complete: false: interrupted)"
            return said + (f"; {len(missing)} of its {len(planned)} points not judged" if missing else "")
        if missing:
            return (
                f"{self.name} has no row for {len(missing)} of its {len(planned)} points (first: {missing[0]}): "
                "it stopped early (-x, --maxfail) or crashed"
            )
        return None

    def entry(self) -> dict[str, Any]:
        """The shard as the merged report lists it."""
        n = counts(self.rows)
        first = first_divergence([r for r in self.rows if r.kind != "op"])
        return {
            "dir": str(self.path),
            "parity_layers": self.report.get("parity_layers"),
            "points": len(self.rows),
            **{k: n[k] for k in ("passed", "failed", "error", "skipped")},
            "first_divergence": first.id if first else None,
            "complete": bool(self.report.get("complete", True)),
            "wall_seconds": self.report.get("wall_seconds"),
            "problem": self.problem(),
        }


@dataclass
class Merged:
    """The merged run: its rows in forward order, its meta, and what it lacks (`problems`)."""

    shards: list[Shard]
    rows: list[Row]
    meta: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def passed(self) -> bool:
        """Every shard whole and no item failed or errored: the one outcome that reads as a pass."""
        return self.complete and not any(r.status in ("failed", "error") for r in self.rows)


def read_shard(path: Path) -> Shard:
    """One shard's report; MergeError where the directory or its report is missing or not one a merge
    can check (written before reports carried a shard's selection)."""
    if not path.exists():
        raise MergeError(f"{path} does not exist: a shard that never ran, or a mistyped directory")
    try:
        report = read_report(path)
    except ValueError as exc:
        raise MergeError(f"{path}: {exc}") from None
    lacking = [k for k in SHARD_KEYS if k not in report]
    if lacking:
        raise MergeError(
            f"{path}: its report has no {', '.join(lacking)} (written by an older moe-parity): run the shard again"
        )
    return Shard(path, report, report_rows(report))


def _options(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (report.get("hw_options") or {}).items() if k not in HOST_OPTIONS}


def _versions(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (report.get("versions") or {}).items() if k in VERSIONS}


def check_one_run(shards: list[Shard]) -> None:
    """MergeError where the shards are not parts of one run: another golden, candidate, backend, dtype,
    mode or setting, other versions, or two shards that ran the same layer (or the model-level points)."""
    first = shards[0]
    compared = [*((words, lambda r, k=k: r.get(k)) for k, words in SAME.items()),
                ("--hw-option settings", _options), ("versions", _versions)]  # fmt: skip
    for shard in shards[1:]:
        for words, value in compared:
            a, b = value(first.report), value(shard.report)
            if a != b:
                raise MergeError(
                    f"{shard.path} is not a shard of the run of {first.path}: its {words} {json.dumps(b)}, "
                    f"theirs {json.dumps(a)}"
                )
    for i, a in enumerate(shards):
        for b in shards[i + 1 :]:
            both = sorted(a.layers & b.layers)
            if both:
                raise MergeError(
                    f"{a.name} and {b.name} both ran layer {describe_layers(both)}: shards must not overlap"
                )
            if a.model_points and b.model_points:
                raise MergeError(f"{a.name} and {b.name} both ran the model-level points: shards must not overlap")
            same = {r.id for r in a.rows} & {r.id for r in b.rows}
            if same:
                raise MergeError(f"{a.path} and {b.path} both hold {sorted(same)[0]}: shards must not overlap")


def gaps(shards: list[Shard]) -> list[str]:
    """What no shard ran: layers of the golden, the model-level points."""
    golden = set(shards[0].report["golden_layers"])
    ran = set().union(*(s.layers for s in shards))
    out = []
    missing = sorted(golden - ran)
    if missing:
        out.append(
            f"no shard ran layer {describe_layers(missing)} of the golden's {describe_layers(sorted(golden))}: "
            "its shard failed before writing a report, or never ran"
        )
    if not any(s.model_points for s in shards):
        out.append(
            "no shard ran the model-level points (embedding, rotary, final norm, logits: --parity-layers "
            "model,...): their shard failed before writing a report, or never ran"
        )
    return out


def merge(paths: list[Path]) -> Merged:
    """The shards' reports as one run's (MergeError: they are not one run)."""
    given = [Path(p) for p in paths]
    if not given:
        raise MergeError("--merge needs the shards' report directories")
    unique = list(dict.fromkeys(given))
    if len(unique) < len(given):
        raise MergeError(f"--merge names {next(p for p in unique if given.count(p) > 1)} twice")
    shards = sorted((read_shard(p) for p in unique), key=lambda s: s.start)
    check_one_run(shards)
    rows = sorted((r for s in shards for r in s.rows), key=lambda r: r.order)
    mark_inherited(rows)  # across shards: a chained failure inherits a divergence another shard introduced
    problems = [p for s in shards if (p := s.problem())] + gaps(shards)
    first = shards[0].report
    ran = set().union(*(s.layers for s in shards))
    model = any(s.model_points for s in shards)
    every = model and ran >= set(first["golden_layers"])  # the whole run: as an unsharded run's report says it
    order = {r.id: r.order for r in rows}
    planned = [pid for s in shards for pid in s.report["planned_points"]]
    meta = {k: v for k, v in first.items() if k not in PER_PROCESS}
    meta.update(
        layers=None if every else sorted(ran),
        parity_layers=None if every else ";".join(s.selection for s in shards),
        model_points=model,
        planned_points=sorted(planned, key=lambda pid: order.get(pid, math.inf)),
        # the shards' runner-seconds together (they ran side by side): what one runner would have taken,
        # as `moe-parity estimate --from-report` reads a run's wall
        wall_seconds=round(sum(float(s.report.get("wall_seconds") or 0.0) for s in shards), 3),
        shards=[s.entry() for s in shards],
        shard_problems=problems,
    )
    return Merged(shards, rows, meta, problems)


def write_merged(merged: Merged, out: Path, *, plots: bool = True) -> list[str]:
    """The merged run's JSON reports, pictures and JUnit file in `out`; the lines saying what was written."""
    drawn = write_reports(out, merged.rows, meta=merged.meta, interrupted=not merged.complete, plots=plots)
    atomic_write_text(out / JUNIT_FILE, junit_xml(merged))
    files = [f for f in (REPORT_FILE, SUMMARY_FILE, JUNIT_FILE, HTML_FILE) if (out / f).is_file()]
    return [f"merged report in {out}: {', '.join(files)}", *drawn]


def junit_xml(merged: Merged) -> str:
    """One test case per item of the merged run (classname `parity` and the item's id, as each shard's
    `--junitxml` has them) with its figures, status and shard as properties; then one errored case per
    thing the run lacks, so a JUnit reader never counts a missing shard as a pass."""
    by_id = {r.id: s for s in merged.shards for r in s.rows}
    suite = ET.Element("testsuite", name="moe-parity")
    n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    seconds = 0.0
    for row in merged.rows:
        t = float(getattr(row, "seconds", 0.0) or 0.0)
        seconds += t
        case = ET.SubElement(suite, "testcase", classname="parity", name=row.id, time=f"{t:.3f}")
        props = ET.SubElement(case, "properties")
        for prefix, part in (("", row), ("chain_", getattr(row, "chained", None))):
            main = part.main_metrics if part is not None else None
            if main is not None:
                for name in JUNIT_FIGURES:
                    ET.SubElement(props, "property", name=prefix + name, value=str(getattr(main, name, None)))
            if part is not None and part.noise_ratio is not None:
                ET.SubElement(props, "property", name=prefix + "noise_ratio", value=str(part.noise_ratio))
        ET.SubElement(props, "property", name="parity_status", value=row.status)
        ET.SubElement(props, "property", name="shard", value=by_id[row.id].selection)
        n["tests"] += 1
        said = row_note(row) or row.hint or row.error or row.reason or ""
        if row.status == "failed":
            n["failures"] += 1
            ET.SubElement(case, "failure", message=f"{row.id}: {said}" if said else row.id).text = row.hint or said
        elif row.status == "error":
            n["errors"] += 1
            ET.SubElement(case, "error", message=f"{row.id}: {row.error or said}").text = row.error or said
        elif row.status == "skipped":
            n["skipped"] += 1
            ET.SubElement(case, "skipped", message=row.reason or said)
    for i, problem in enumerate(merged.problems):
        case = ET.SubElement(suite, "testcase", classname="parity.merge", name=f"shard_problem_{i}", time="0")
        ET.SubElement(case, "error", message=problem).text = problem
        n["tests"] += 1
        n["errors"] += 1
    for key, value in n.items():
        suite.set(key, str(value))
    suite.set("time", f"{seconds:.3f}")
    root = ET.Element("testsuites", name="moe-parity merged")
    root.append(suite)
    return '<?xml version="1.0" encoding="utf-8"?>' + ET.tostring(root, encoding="unicode") + "\n"


def merge_lines(merged: Merged) -> list[str]:
    """What the merge prints before the run's own summary: each shard, then what the run lacks."""
    lines = [f"moe-parity report --merge: {counted(len(merged.shards), 'shard')}"]
    for s in merged.shards:
        e = s.entry()
        first = f", first divergence {e['first_divergence']}" if e["first_divergence"] else ""
        state = "" if e["problem"] is None else " INCOMPLETE"
        lines.append(
            f"  {s.name}: {counted(e['points'], 'item')}, {e['passed']} passed, {e['failed']} failed, "
            f"{counted(e['error'], 'error')}"
            f"{first}{state}"
        )
    return lines + problem_lines(merged)


def problem_lines(merged: Merged) -> list[str]:
    """What the merged run lacks, a line each (printed before the table and again last: never missed)."""
    return [f"not a whole run: {p}" for p in merged.problems]
