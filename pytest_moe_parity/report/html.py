"""`report.html`: the run as one page for people who will not read JSON, beside the JSON reports.

One self-contained file: the CSS and the small sorting script inline (`static/`), the pictures that
:func:`~.plots.render_plots` drew embedded as ``data:`` URIs, a per-token chart as inline SVG; it
references nothing outside itself, so it can be mailed, attached to a CI run or opened offline. Built
from the report JSON alone (:func:`~.schema.read_report`'s dict), so the plugin, ``moe-parity report
DIR`` and a merge of shards write the same page for the same report, byte for byte (no clock, no
path of the machine that drew it beyond what the report holds).

Every text that comes from the run (point ids, failure texts, backend errors, paths) goes through
:func:`html.escape`: the page is built from :class:`~.markup.Safe` fragments by :func:`~.markup.el`, which escapes any
child that is not one, so no user text is ever spliced into markup unescaped.

Last night's diff is an optional input: a dict as :meth:`~.history.Diff.to_json` writes it (``moe-parity
diff OLD NEW --json NEW/diff.json``), passed in or found as ``diff.json`` beside the report
(:func:`~.history.load_diff`). It names the digest of the report it was taken against, so a diff left
in a directory reused by a later run is not shown as tonight's."""

from __future__ import annotations

import base64
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..files import atomic_write_text
from ..points import LAYER_COMPONENTS, MODEL_TAIL, WEIGHTS, describe_layers
from ..words import counted
from .block import bug_report_text
from .cells import face, grid_noise
from .drill import Drill, finding, pct
from .history import DIFF_FILE, load_diff, stale_diff
from .markup import Safe, el, join, legend, sort_value, token_chart
from .neuron_terms import section as neuron_section
from .plots import HEATMAP, LAYERS, TOKENS_PREFIX, token_plot_name
from .ran import ran_of, ran_words
from .ran_page import ran_diff_html, ran_html
from .rows import (
    DIFFERENTIALS,
    BatchInvarianceRow,
    ParallelRow,
    PointRow,
    RoutingRow,
    Row,
    StateRow,
    WeightsRow,
    number,
    result_of,
)
from .schema import REPORT_FILE, report_rows
from .schema import summary as make_summary
from .summary import STATUSES, drill_line, figure, modes, row_note, summary_lines
from .text import failure_text, fmt

HTML_FILE = "report.html"
OPENED = 8  # failed and errored points whose details the page opens (the others one click away)


def _static(name: str) -> str:
    """A file of the page's own (`static/`: its CSS and script), as text."""
    return (files(__package__) / "static" / name).read_text(encoding="utf-8")


# The page's look (`static/report.css`): system fonts, one column up to 1280 px, verdict colours that
# survive a greyscale print (the marks ✗ E s say it in the cells too).
CSS = _static("report.css")
# Sorting of the table of every point (`static/report.js`): header names become buttons (without the
# script the table is plain, in forward order); `#sort=KEY[:desc]` in the address sorts on load.
# Missing figures sort last.
SCRIPT = _static("report.js")


# -- the page ------------------------------------------------------------------------------------
def write_html(
    directory: Path,
    report: dict[str, Any],
    summary: dict[str, Any] | None = None,
    diff: dict[str, Any] | None = None,
    pictures: list[Path] | None = None,
) -> Path:
    """Write `directory/report.html` (atomically) for `report` (a comparison_report.json's dict) and
    return its path. `summary`: the comparison_summary.json dict (computed from the report when None);
    `diff`: last night's diff as :meth:`~.history.Diff.to_json` writes it (when None, `diff.json` in
    `directory` if there is one); `pictures`: the pictures drawn for this report (None: those in
    `directory` drawn with it, :func:`drawn_with`; [] none, e.g. with the plots off, so that pictures
    of an earlier run in a reused directory are not shown as this one's)."""
    why_not = None
    if diff is None:
        diff, why_not = load_diff(directory, report)
    elif (stale := stale_diff(diff, report)) is not None:
        diff, why_not = None, stale
    if pictures is None:
        pictures = drawn_with(directory)
    images = {p.name: p.read_bytes() for p in sorted(pictures, key=lambda p: p.name) if p.is_file()}
    page = render_html(report, summary, diff, images, diff_note=why_not)
    path = directory / HTML_FILE
    atomic_write_text(path, page)
    return path


def drawn_with(directory: Path) -> list[Path]:
    """The pictures in `directory` drawn with its report: by the names :mod:`.plots` gives them, and
    not older than its comparison_report.json (the pictures follow the JSON; an older one is an
    earlier run's, left where this run drew none)."""
    report = directory / REPORT_FILE
    since = report.stat().st_mtime_ns if report.is_file() else 0
    names = (HEATMAP[:-4], LAYERS[:-4], TOKENS_PREFIX)
    return sorted(p for p in directory.glob("*.png") if p.name.startswith(names) and p.stat().st_mtime_ns >= since)


def write_diff(directory: Path, report: dict[str, Any], diff: dict[str, Any]) -> Path:
    """`diff` (:meth:`~.history.Diff.to_json`) written as `directory/diff.json`, and the page written
    again to show it (`moe-parity report --merge --previous`); the page's path."""
    atomic_write_text(directory / DIFF_FILE, json.dumps(diff, indent=1) + "\n")
    return write_html(directory, report, diff=diff)


def render_html(
    report: dict[str, Any],
    summary: dict[str, Any] | None = None,
    diff: dict[str, Any] | None = None,
    images: dict[str, bytes] | None = None,
    *,
    diff_note: str | None = None,
) -> str:
    """The page as text: a pure function of its inputs (`images`: a picture's file name -> its PNG bytes)."""
    every = sorted(report_rows(report), key=lambda r: r.order)
    if summary is None:
        meta = {k: v for k, v in report.items() if k not in ("points", "schema_version", "complete")}
        summary = make_summary(every, meta=meta, interrupted=not report.get("complete", True))
    page = _Page(report, summary, every, images or {})
    return page.render(diff, diff_note)


class _Page:
    def __init__(self, report: dict[str, Any], summary: dict[str, Any], rows: list[Row], images: dict[str, bytes]):
        self.report, self.summary, self.images = report, summary, images
        self.all = rows
        self.points = [r for r in rows if r.kind != "op"]  # a drill's ops are its table, not points
        self.by_id = {r.id: r for r in self.points}
        self.drills = [r.drill for r in rows if r.drill is not None]

    # -- the whole --------------------------------------------------------------------------------
    def render(self, diff: dict[str, Any] | None, diff_note: str | None) -> str:
        first = self.summary.get("first_divergence")
        run = _describe(self.report)
        title = f"moe-parity: {run}: " + (f"first divergence {first}" if first else "no divergence")
        sections = [
            ("divergence", "First divergence", self.divergence()),
            ("grid", "Layers × components", self.grids()),
            ("diff", "Since last run", self.diff(diff, diff_note)),
            ("run", "Run", self.facts()),
            ("points", "All points", self.table()),
            ("drills", "Drills", self.drill_section()),
            ("neuron", "vLLM Neuron plugin's terms", neuron_section(self.summary, self.points)),
            ("details", "Each point", self.details()),
            ("pictures", "Pictures", self.pictures()),
        ]
        sections = [(key, name, body) for key, name, body in sections if body]
        nav = el("nav", [el("a", name, href=f"#{key}") for key, name, _ in sections])
        body = [el("section", el("h2", name), content, id=key) for key, name, content in sections]
        versions = self.report.get("versions") or {}
        schema = self.report.get("schema_version")
        footer = el(
            "footer",
            f"written by moe-parity {versions.get('moe-parity', '')} from comparison_report.json (report schema "
            f"{schema}); every figure here is in that file.",
        )
        doc = join(
            Safe("<!DOCTYPE html>\n"),
            el(
                "html",
                el(
                    "head",
                    el("meta", charset="utf-8"),
                    el("meta", name="viewport", content="width=device-width, initial-scale=1"),
                    el("title", title),
                    el("style", Safe(CSS)),
                ),
                el("body", self.banner(), nav, el("main", body), footer, el("script", Safe(SCRIPT))),
                lang="en",
            ),
        )
        return doc + "\n"

    def banner(self) -> Safe:
        n = {s: sum(1 for r in self.points if r.status == s) for s in STATUSES}
        first = self.summary.get("first_divergence")
        complete = self.report.get("complete", True)
        planned, missing = self.missing()
        stopped = self.stopped(missing)
        if first:
            state, said = "fail", el("span", "first divergence ", el("a", first, href=f"#p-{first}", class_="pid"))
        elif n["error"]:
            state, said = "warn", f"no divergence; {counted(n['error'], 'point')} not judged (errors)"
        elif not self.points:
            state, said = "warn", "no point was judged"
        elif missing:
            state, said = "warn", f"no divergence in the {n['passed']} judged points; {stopped}"
        else:
            state, said = "pass", f"no divergence: all {n['passed']} judged points within their limits"
        if not complete:
            state = "fail" if first else "warn"
        total = len(self.points)
        chips = [el("span", counted(total, "point"), class_="chip")]
        if missing:  # -x, -k, a crash: what the run never reached
            ran = len(planned) - len(missing)
            chips.append(el("span", f"{ran} of the {len(planned)} points planned", class_="chip"))
        chips += [
            el("span", f"{n[s]} {s}", class_=f"chip s-{s}") for s in STATUSES if n[s] or s in ("passed", "failed")
        ]
        problems = self.report.get("shard_problems") or []
        if problems:  # a merged run that lacks part of itself
            chips.append(el("a", f"incomplete: {counted(len(problems), 'shard problem')}",
                            href="#divergence", class_="chip s-error"))  # fmt: skip
        elif not complete:
            chips.append(
                el("span", "interrupted: the run stopped before every point was judged", class_="chip s-error")
            )
        elif missing:  # what `report --merge` calls a gap: never "complete"
            chips.append(el("span", stopped, class_="chip s-error"))
        else:
            chips.append(el("span", "complete", class_="chip"))
        return el(
            "header",
            el("div", "moe-parity report", class_="kicker"),
            el("h1", _describe(self.report)),
            el("div", said, class_="said"),
            el("div", chips, class_="chips"),
            class_=f"banner {state}",
        )

    def missing(self) -> tuple[list[str], list[str]]:
        """The points the run planned (its selection), and those of them it has no row for."""
        planned = self.report.get("planned_points")
        if not isinstance(planned, list):
            return [], []
        ids = {r.id for r in self.points}
        return planned, [pid for pid in planned if pid not in ids]

    def stopped(self, missing: list[str]) -> str:
        """How a run that lacks some of its planned points ended: at its first failure (-x: its last
        item in forward order is its only failure), after several (--maxfail), or short of them."""
        failed = [r for r in self.points if r.status == "failed"]
        last = max(self.points, key=lambda r: r.order, default=None)
        if failed and last is not None and last.status == "failed":
            return "stopped at the first failure" if len(failed) == 1 else f"stopped after {len(failed)} failures"
        return f"incomplete: {counted(len(missing), 'planned point')} not judged"

    def completeness(self) -> str:
        """The run's `complete` fact in words (as the badges say it)."""
        if not self.report.get("complete", True):
            return "no: interrupted"
        planned, missing = self.missing()
        if missing:
            stopped = self.stopped(missing)
            unjudged = f"{len(missing)} of the {len(planned)} points planned not judged"
            return f"no: {stopped} ({unjudged})" if stopped.startswith("stopped") else f"no: {unjudged}"
        return "yes"

    # -- the run's facts ---------------------------------------------------------------------------
    def facts(self) -> Safe:
        r = self.report
        options = r.get("hw_options") or {}
        layers = r.get("layers")
        golden_layers = r.get("golden_layers")
        rows: list[tuple[str, Any]] = [
            ("model type", r.get("model_type")),
            ("--hw", r.get("hw")),
            ("--hw-option", ", ".join(f"{k}={v}" for k, v in options.items()) or "none"),
            ("dtype", r.get("dtype")),
            ("mode", r.get("mode", "isolated")),
            ("layers", describe_layers(layers) if isinstance(layers, list) and layers else "all"),
            ("golden", r.get("golden_dir")),
            ("golden fingerprint", r.get("golden_fingerprint")),
            ("candidate", r.get("candidate_model")),
            ("candidate from", r.get("candidate_source")),
            ("noise figures in", ", ".join(r.get("noise_dtypes") or []) or "none"),
            ("complete", self.completeness()),
        ]
        if isinstance(golden_layers, list):
            rows.append(("golden's layers", f"{len(golden_layers)} ({describe_layers(golden_layers)})"))
        if r.get("parity_layers"):
            rows.append(("--parity-layers", r["parity_layers"]))
        if isinstance(r.get("planned_points"), list):
            rows.append(("points planned", len(r["planned_points"])))
        versions = r.get("versions") or {}
        rows += [(f"{name} version", value) for name, value in versions.items()]
        reads = r.get("candidate_reads")
        if isinstance(reads, dict) and "bytes" in reads:
            rows.append(("candidate read", f"{len(reads.get('keys') or [])} tensors, {reads['bytes']} bytes"))
        if r.get("golden_files_read"):
            rows.append(("golden files read", len(r["golden_files_read"])))
        # the report's other facts (the run's options, its host; those of a newer run) in words, never JSON
        rows += [(key.replace("_", " "), _plain(v, ("on", "off"))) for key, v in r.items() if key not in _FACTS_SHOWN]
        table = el("dl", [el("div", el("dt", k), el("dd", "-" if v is None else v)) for k, v in rows], class_="facts")
        parts: list[Any] = [table]
        if r.get("shards"):  # a merged run: its shards
            parts += [el("h3", "Shards"), el("div", _dict_table(r["shards"]), class_="scroll")]
        closing = [el("li", text, class_=f"c-{colour}" if colour else None) for text, colour in summary_lines(self.all)]
        parts += [el("h3", "What the run said"), el("ul", closing, class_="closing")]
        return join(parts)

    # -- the first divergence ----------------------------------------------------------------------
    def divergence(self) -> Safe:
        s = self.summary
        first = s.get("first_divergence")
        parts: list[Any] = []
        problems = self.report.get("shard_problems") or []
        if problems:  # what a merged run lacks comes before what its points say
            parts.append(el("div", el("b", "This run is not whole: "), el("ul", [el("li", p) for p in problems]),
                            class_="warnbox"))  # fmt: skip
        if first is None:
            parts.append(el("p", "No point failed: every judged point is within its limits.", class_="ok-note"))
        else:
            row = self.by_id.get(first)
            where = f"layer {s['first_divergence_layer']}, " if s.get("first_divergence_layer") is not None else ""
            parts.append(
                el(
                    "p",
                    el("a", first, href=f"#p-{first}", class_="pid big"),
                    f"  ({where}{s.get('first_divergence_component') or ''})",
                )
            )
            drill = (s.get("drills") or {}).get(first)
            keys = ("culprit", "recovery", "structure", "culprit_group", "group_recovery", "row_sets")
            proved = finding(*(drill.get(k) for k in keys)) if drill else None
            if proved:
                parts.append(el("p", el("b", "drill: "), proved.removeprefix("drill: ")))
            if s.get("hint"):
                parts.append(el("p", el("b", "hint: "), s["hint"]))
            if s.get("remedy"):
                parts.append(el("p", el("b", "to accept this result: "), el("code", s["remedy"])))
            if len(modes(self.points)) > 1:  # both modes: where the error is introduced, and where it shows
                for mode in modes(self.points):
                    parts.append(el("p", f"first {mode} divergence: ", s.get(f"first_{mode}_divergence") or "none"))
            if isinstance(row, PointRow) and row.status == "failed":
                parts.append(
                    el(
                        "details",
                        el("summary", "its failure, as the run printed it"),
                        el("pre", failure_text(result_of(row))),
                    )
                )
        if s.get("first_error"):
            parts.append(
                el(
                    "p",
                    el("b", "first backend error: "),
                    el("a", s["first_error"], href=f"#p-{s['first_error']}"),
                    ": ",
                    s.get("first_error_message") or "",
                    class_="c-yellow",
                )
            )
        block = s.get("bug_report")
        if block:
            parts.append(el("h3", "For a bug report"))
            parts.append(el("pre", "\n".join(bug_report_text(block)), class_="block"))
        return join(parts)

    # -- last night's diff -------------------------------------------------------------------------
    def diff(self, diff: dict[str, Any] | None, note: str | None) -> Safe | None:
        if diff is None:
            return el("p", note, class_="c-yellow") if note else None
        factor = number(diff.get("factor")) or 2.0
        worse = diff.get("worse") or []
        head = el(
            "p",
            f"{diff.get('old', 'the old report')} ({diff.get('old_run', '')}) → {diff.get('new', 'this report')}"
            f" ({diff.get('new_run', '')}): {diff.get('common', '?')} points in both; ",
            el("b", f"{len(worse)} worse beyond ×{factor:g} or newly failing", class_="c-red" if worse else "c-green"),
        )
        parts: list[Any] = [head]
        if worse:
            parts.append(self._changes(worse))
        fixed = diff.get("fixed") or []
        if fixed:
            parts.append(el("h3", f"fixed: {len(fixed)}"))
            parts.append(self._changes(fixed))
        better = diff.get("better") or []
        if better:
            parts.append(el("p", f"better beyond ×{factor:g}: {len(better)}"))
        parts.append(ran_diff_html(diff.get("ran") or [], set(self.by_id)))
        for key, name in (("only_old", diff.get("old", "the old report")), ("only_new", "this report")):
            ids = diff.get(key) or []
            if ids:
                parts.append(el("p", f"only in {name} (not compared): ", ", ".join(map(str, ids))))
        return join(parts)

    def _changes(self, changes: list[dict[str, Any]]) -> Safe:
        head = el("tr", el("th", "point"), el("th", "mode"), el("th", "status"), el("th", "figures"))
        body = []
        for c in changes:
            status = " → ".join(map(str, c["status"])) if c.get("status") else ""
            if c.get("new"):  # new tonight (not in the old report) and failed: what failed it
                status = f"new tonight, {c['status'][1] if c.get('status') else 'failed'}"
            figures = [str(c["detail"])] if c.get("detail") else []
            for f in c.get("figures") or []:
                old, new = number(f.get("old")), number(f.get("new"))
                times = f" (×{new / old:.3g})" if old and new is not None else ""
                figures.append(f"{f.get('figure')} {fmt(old, 3)} → {fmt(new, 3)}{times}")
            pid = str(c["id"])
            link = el("a", pid, href=f"#p-{pid}", class_="pid") if pid in self.by_id else el("span", pid, class_="pid")
            body.append(el("tr", el("td", link), el("td", c["mode"]), el("td", status), el("td", "; ".join(figures))))
        return el("table", el("thead", head), el("tbody", body), class_="data")

    # -- the grids ---------------------------------------------------------------------------------
    def grids(self) -> Safe | None:
        rows = [r for r in self.points if r.kind not in DIFFERENTIALS]
        if not rows:
            return None
        judged = [r for r in rows if isinstance(r, PointRow)]  # the other kinds read the same in every mode
        run_mode = "chain" if self.report.get("mode") == "chain" else "isolated"  # where no point was judged
        shown_modes = [m for m in ("isolated", "chain") if any(m in r.by_mode() for r in judged)] or [run_mode]
        noise = grid_noise(self.points)
        what = (
            "noise ratio: the point's error over the reference's own in the candidate's dtype (1 = the reference's "
            "own rounding)"
            if noise
            else "rel_l2 of the point's main tensor"
        )
        parts: list[Any] = [
            el(
                "p",
                "Each cell is an item: its colour the verdict (failed: red, whatever its figure), darker the larger "
                "its figure; the figure is the ",
                what,
                ". A failed cell shows what failed it (a flip share, a config field, the tensors found wrong). "
                "Click a cell for the item.",
                class_="lead",
            ),
            legend(noise),
        ]
        steps = sorted({r.step for r in rows}, key=lambda s: -1 if s is None else s)
        panels = []
        for step in steps:  # the prefill, then each decode step: its own grid, never painted over by another's
            these = [r for r in rows if r.step == step]
            name = "prefill" if step is None else f"decode step {step}"
            panels += [
                el("div", el("h3", f"{name}: {mode}"), self.grid(these, mode, noise), class_="panel")
                for mode in shown_modes
            ]
        parts.append(el("div", panels, class_="panels"))
        again = [r for r in self.points if r.kind in DIFFERENTIALS]
        if again:  # a differential runs a point again: its verdict beside the grid, not in the point's cell
            cells = [self.cell(r, r.mode, noise, label=r.id, tag="a") for r in again]
            parts += [el("h3", "Points run again (routing, batch, parallel plans)"), el("div", cells, class_="strip")]
        return join(parts)

    def grid(self, rows: list[Row], mode: str, noise: bool) -> Safe:
        head = [r for r in rows if r.layer is None and r.component not in MODEL_TAIL]
        tail = [r for r in rows if r.layer is None and r.component in MODEL_TAIL]
        layered = [r for r in rows if r.layer is not None]
        order = [WEIGHTS, *LAYER_COMPONENTS]
        columns = [c for c in order if any(r.component == c for r in layered)]
        layers = sorted({r.layer for r in layered if r.layer is not None})
        at = {(r.layer, r.component): r for r in layered}
        parts: list[Any] = [self.strip(head, mode, noise)] if head else []
        if layers:
            thead = el("tr", el("th", ""), [el("th", c, class_="col") for c in columns])
            body = [
                el(
                    "tr",
                    el("th", f"layer {layer}", class_="rowh"),
                    [
                        self.cell(at[(layer, c)], mode, noise) if (layer, c) in at else el("td", class_="empty")
                        for c in columns
                    ],
                )
                for layer in layers
            ]
            parts.append(el("table", el("thead", thead), el("tbody", body), class_="grid"))
        if tail:
            parts.append(self.strip(tail, mode, noise))
        return join(parts)

    def strip(self, rows: list[Row], mode: str, noise: bool) -> Safe:
        """The model-level points (config, weights, embedding, rotary above the layers; the final norm
        and the logits below), in forward order, each cell named."""
        cells = [self.cell(r, mode, noise, label=r.component, tag="a") for r in sorted(rows, key=lambda r: r.order)]
        return el("div", cells, class_="strip")

    def cell(self, row: Row, mode: str, noise: bool, *, label: str | None = None, tag: str = "td") -> Safe:
        """A point's cell: its colour its verdict's, its shade its figure's, a failed one's text what
        failed it (:func:`~.cells.face`, as `heatmap.png` draws it)."""
        said = face(row, mode, noise)
        verdict, text, tip = said.verdict, said.text, said.tip
        colour, ink = said.colours
        inner = [el("span", label, class_="lbl")] if label else []
        inner.append(el("span", text, class_="val"))
        attrs = {
            "class": f"cell v-{verdict}",
            "style": f"background:{colour};color:{ink}",
            "title": tip,
            "data-point": row.id,
            "data-mode": mode,
            "data-verdict": verdict,
        }
        if tag == "a":
            return el("a", inner, attrs={**attrs, "href": f"#p-{row.id}"})
        return el("td", el("a", inner, href=f"#p-{row.id}"), attrs=attrs)

    # -- the table of every point ------------------------------------------------------------------
    def table(self) -> Safe | None:
        if not self.points:
            return None
        cols = self.columns()
        figures = [_figures(i, r) for i, r in enumerate(self.points)]
        head = el("tr", [el("th", name, data_key=key, data_type=kind) for key, name, kind in cols])
        body = [
            el("tr", [_cell(key, kind, values[key]) for key, _, kind in cols], class_=f"r-{r.status}", data_point=r.id)
            for r, values in zip(self.points, figures, strict=True)
        ]
        hint = el(
            "p",
            "In forward order; click a column's name to sort by it (again to reverse), or open this page as "
            "report.html#sort=rel_l2:desc.",
            class_="lead",
        )
        return join(hint, el("table", el("thead", head), el("tbody", body), class_="data sortable", id="all-points"))

    def columns(self) -> list[tuple[str, str, str]]:
        """The table's columns (key, name, kind): the noise ratio where a point has one, the chained
        rel_l2 where a point was chained."""
        chained = any(isinstance(r, PointRow) and r.chained is not None for r in self.points)
        noise = any(r.noise_ratio is not None for r in self.points)
        ran = any(ran_of(r) for r in self.points)
        shown = {"noise_ratio": noise, "chain_rel_l2": chained, "ran": ran}
        return [c for c in COLUMNS if shown.get(c[0], True)]

    # -- drills ------------------------------------------------------------------------------------
    def drill_section(self) -> Safe | None:
        return join([self.drill_table(d) for d in self.drills]) if self.drills else None

    def drill_table(self, drill: Drill) -> Safe:
        line, colour = drill_line(drill)
        parts: list[Any] = [
            el("h3", el("a", drill.point, href=f"#p-{drill.point}", class_="pid"), " drilled"),
            el("p", line, class_=f"c-{colour}" if colour else None),
        ]
        if drill.culprit_op and drill.culprit_op != drill.culprit:
            parts.append(el("p", "the culprit's op: ", el("code", drill.culprit_op)))
        said = drill.findings()
        if said:
            parts.append(el("ul", [el("li", s) for s in said]))
        cols = [
            "name",
            "kind",
            "shape",
            "candidate",
            "error",
            "noise",
            "ratio",
            "isolated_ratio",
            "verdict",
            "recovery",
            "how",
            "note",
        ]
        head = el("tr", [el("th", c) for c in cols])
        body = []
        for op in drill.rows:
            culprit = op.name == drill.culprit
            cells = []
            for c in cols:
                v = getattr(op, c)
                if c in ("shape", "candidate"):
                    v = "×".join(map(str, v)) if c == "shape" and v else ", ".join(map(str, v or []))
                elif c == "recovery":
                    v = pct(v) if v is not None else "-"
                elif isinstance(v, float | int) and not isinstance(v, bool):
                    v = fmt(v, 3)
                cells.append(el("td", "-" if v in (None, "") else v))
            state = "r-failed" if op.verdict != "ok" else None
            body.append(el("tr", cells, class_=" ".join(filter(None, [state, "culprit" if culprit else None])) or None))
        parts.append(el("div", el("table", el("thead", head), el("tbody", body), class_="data ops"), class_="scroll"))
        return el("div", parts, class_="drill", id=f"drill-{drill.point}")

    # -- each point --------------------------------------------------------------------------------
    def details(self) -> Safe | None:
        if not self.points:
            return None
        bad = [r.id for r in self.points if r.status in ("failed", "error")]
        opened = set(bad[:OPENED])
        said = "Failed and errored points open" + (f" (the first {OPENED})" if len(bad) > OPENED else "")
        intro = el("p", f"{said}; the others closed.", class_="lead")
        return join(intro, [self.detail(r, r.id in opened) for r in self.points])

    def detail(self, r: Row, opened: bool) -> Safe:
        summary = el(
            "summary",
            el("span", r.status, class_=f"tag s-{r.status}"),
            " ",
            el("span", r.id, class_="pid"),
            el("span", row_note(r), class_="note"),
        )
        body: list[Any] = []
        if isinstance(r, PointRow):
            if r.status == "failed":  # its failure in the run's words, its tokens beside it
                body.append(el("div", el("pre", failure_text(result_of(r))), self.tokens(r), class_="pt"))
            else:
                body.append(self.checks(r))
                body.append(self.tokens(r))
                body.append(ran_html(r))
            body.append(self.routing(r))
        elif isinstance(r, WeightsRow):
            if r.findings:
                body.append(el("ul", [el("li", f) for f in r.findings], class_="findings"))
            if r.notes:
                body.append(el("ul", [el("li", n) for n in r.notes], class_="notes"))
        elif isinstance(r, RoutingRow):
            body.append(_dict_table(r.levels))
            if r.recovered:
                body.append(el("p", f"recovered by forcing the golden's {r.recovered}"))
        elif isinstance(r, BatchInvarianceRow):
            body.append(_dict_table(r.batch_rows))
            if r.condition:
                body.append(el("p", f"condition: {r.condition}; rows that change: {r.changed_rows or 'none'}"))
        elif isinstance(r, ParallelRow | StateRow):
            body.append(el("p", " vs ".join(r.plans) if isinstance(r, ParallelRow) else r.said or r.serving_state))
            body.append(_dict_table([{"figure": k, "value": v} for k, v in r.figures.items()]))
        if r.error:
            body.append(el("pre", r.error, class_="error"))
        if r.reason:
            body.append(el("p", "skipped: ", r.reason))
        if not isinstance(r, PointRow) and r.notes:
            body.append(el("ul", [el("li", n) for n in r.notes], class_="notes"))
        if r.hint and not (isinstance(r, PointRow) and r.status == "failed"):
            body.append(el("p", el("b", "hint: "), r.hint))
        if r.drill is not None:
            body.append(el("p", el("a", "its drill", href=f"#drill-{r.drill.point}")))
        return el("details", summary, el("div", body, class_="body"), id=f"p-{r.id}", class_="point", open=opened)

    def checks(self, r: PointRow) -> Safe | None:
        """A passed point's checks and figures (a failed one's are in its failure text)."""
        parts: list[Any] = []
        for name, row in r.by_mode().items():
            if not isinstance(row, PointRow) or not row.checks:
                continue
            head = el("tr", [el("th", c) for c in ("tensor", "metric", "value", "limit", "verdict")])
            body = [
                el(
                    "tr",
                    el("td", c.target),
                    el("td", c.name),
                    el("td", fmt(c.value), class_="num"),
                    el("td", "-" if c.limit is None else f"{c.op} {fmt(c.limit)}", class_="num"),
                    el("td", "ok" if c.passed else "FAIL"),
                    class_=None if c.passed else "r-failed",
                )
                for c in row.checks
            ]
            label = f"{name} ({'golden inputs' if name == 'isolated' else 'its own inputs'})"
            parts.append(el("p", label, class_="mode") if len(r.by_mode()) > 1 else None)
            parts.append(el("table", el("thead", head), el("tbody", body), class_="data checks"))
            for target, m in row.metrics.items():
                parts.append(
                    el(
                        "p",
                        f"{target}: golden {tuple(m.shape_golden)} {m.dtype_golden}, candidate "
                        f"{tuple(m.shape_candidate)} {m.dtype_candidate}; snr {fmt(m.snr_db)} dB, "
                        f"max_abs {fmt(m.max_abs)}, mean_abs {fmt(m.mean_abs)}",
                        class_="figs",
                    )
                )
        return join(parts) if parts else None

    def tokens(self, r: PointRow) -> Safe | None:
        """A failed point's per-token errors: the picture drawn for it, else (no matplotlib, plots off, or
        beyond the pictures' count) the same bars as inline SVG."""
        parts: list[Any] = []
        for mode, row in r.by_mode().items():
            name = token_plot_name(r.id, mode)
            if name in self.images:
                parts.append(_img(self.images[name], f"{r.id} ({mode}): each token's error"))
            elif isinstance(row, PointRow) and row.token_errors:
                limit = next(
                    (c.limit for c in row.checks if c.name == "max_token_rel_l2" and c.limit is not None), None
                )
                parts.append(el("p", f"each token's error ({mode})", class_="mode"))
                parts.append(token_chart(row.token_errors, number(limit)))
        return el("div", parts, class_="tokens") if parts else None

    def routing(self, r: PointRow) -> Safe | None:
        rt = r.routing
        if rt is None or r.status == "failed":  # a failed point's routing is in its failure text
            return None
        weight = f", the flips carry {rt.flipped_weight:.1%} of the weight" if rt.flips and rt.flipped_weight else ""
        return el(
            "p",
            f"routing: {rt.num_tokens} tokens, top-{rt.top_k} of {rt.num_experts} experts, set agreement "
            f"{rt.set_agreement * 100:.1f}%, real flips {len(rt.flips)}, ties {len(rt.ties)}{weight}",
            class_="figs",
        )

    # -- pictures ----------------------------------------------------------------------------------
    def pictures(self) -> Safe | None:
        names = [n for n in self.images if not n.startswith(TOKENS_PREFIX)]
        order = lambda n: (0 if n.startswith(HEATMAP[:-4]) else 1, _step_of(n), n)  # noqa: E731
        figures = [
            el("figure", _img(self.images[n], n), el("figcaption", n))
            for n in sorted(names, key=order)
            if n.startswith((HEATMAP[:-4], LAYERS[:-4]))
        ]
        return el("div", figures, class_="figures") if figures else None


COLUMNS = [  # the table of every point: (key, name, kind), those `_Page.columns` shows
    ("order", "#", "num"),
    ("id", "point", "text"),
    ("status", "status", "text"),
    ("cosine", "cosine", "num"),
    ("rel_l2", "rel_l2", "num"),
    ("noise_ratio", "noise R", "num"),
    ("chain_rel_l2", "chain rel_l2", "num"),
    ("max_abs", "max_abs", "num"),
    ("ran", "ran", "text"),  # what the candidate ran (backends.ran), but its module's class
    ("notes", "notes", "text"),
]


def _figures(i: int, r: Row) -> dict[str, Any]:
    """A row of the table of every point, as values (`i`: its place in forward order)."""
    main = r.main_metrics
    chain = r.chained if isinstance(r, PointRow) else None
    return {
        "order": i,
        "id": r.id,
        "status": r.status,
        "cosine": number(getattr(main, "cosine", None)),
        "rel_l2": figure(r, "rel_l2"),
        "noise_ratio": figure(r, "noise_ratio"),
        "chain_rel_l2": figure(chain, "rel_l2") if chain is not None else None,
        "max_abs": number(getattr(main, "max_abs", None)),
        "ran": ran_words(ran_of(r), skip=("module", "break")),
        "notes": row_note(r),
    }


def _cell(key: str, kind: str, value: Any) -> Safe:
    """One cell of the table of every point, its sort key beside it."""
    if kind == "num":
        shown = str(value) if key == "order" else fmt(value, 6 if key == "cosine" else 4)
        return el("td", shown, data_v=sort_value(value), class_="num")
    if key == "id":
        return el("td", el("a", value, href=f"#p-{value}", class_="pid"), data_v=value)
    if key == "status":
        return el("td", el("span", value, class_=f"tag s-{value}"), data_v=value)
    return el("td", value, data_v=value)


def _step_of(name: str) -> int:
    """heatmap.step_3.png -> 3; the prefill's -> -1."""
    part = name.split(".")[1] if name.count(".") > 1 else ""
    return int(part[5:]) if part.startswith("step_") and part[5:].isdigit() else -1


def _img(data: bytes, alt: str) -> Safe:
    return el("img", src="data:image/png;base64," + base64.b64encode(data).decode("ascii"), alt=alt)


# the report's keys the facts show in their own words (the others as `_plain` text)
_FACTS_SHOWN = {
    "points", "schema_version", "versions", "golden_files_read", "candidate_reads", "model_type", "hw", "hw_options",
    "dtype", "mode", "layers", "golden_dir", "golden_fingerprint", "candidate_model", "candidate_source",
    "noise_dtypes", "complete", "golden_layers", "parity_layers", "planned_points", "shards", "shard_problems",
}  # fmt: skip


def _plain(value: Any, switches: tuple[str, str] = ("yes", "no")) -> str:
    """A fact as text, never JSON: a switch as `switches` (on/off for the run's options), None as "not
    set", a dict as `key: value, ...`, a list comma-joined (a long one as its length), nested ones in
    parentheses."""
    if isinstance(value, bool):
        return switches[0] if value else switches[1]
    if value is None:
        return "not set"
    if isinstance(value, float):
        return fmt(value)
    if isinstance(value, int | str):
        return str(value) or "-"
    inner = lambda v: f"({_plain(v, switches)})" if isinstance(v, dict | list | tuple) and v else _plain(v, switches)  # noqa: E731
    if isinstance(value, dict):
        return ", ".join(f"{k}: {inner(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple):
        if len(value) > 12:
            return f"{len(value)} items"
        return ", ".join(inner(v) for v in value) or "none"
    return str(value)


def _describe(report: dict[str, Any]) -> str:
    return (
        f"{report.get('model_type', '?')} on --hw {report.get('hw', '?')} in {report.get('dtype', '?')}, "
        f"{report.get('mode', 'isolated')} mode"
    )


def _dict_table(items: list[dict[str, Any]]) -> Safe | None:
    """A list of flat dicts (a differential's levels or rows) as a table, columns in first-seen order."""
    if not items:
        return None
    cols: list[str] = []
    for item in items:
        cols += [k for k in item if k not in cols]
    head = el("tr", [el("th", c) for c in cols])
    body = []
    for item in items:
        cells = []
        for c in cols:
            v = item.get(c)
            text = fmt(v) if isinstance(v, float) else "-" if v is None else _plain(v)
            cells.append(el("td", text))
        failed = item.get("status") == "failed" or item.get("failed") is True
        body.append(el("tr", cells, class_="r-failed" if failed else None))
    return el("table", el("thead", head), el("tbody", body), class_="data")
