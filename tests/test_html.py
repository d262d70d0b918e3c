"""report.html: the page every --parity-report directory holds beside its JSON. It names the first
divergence, marks each point's cell with its verdict, references nothing outside itself, escapes
every text of the run, is written again by `moe-parity report` (with last night's diff where there is
one), never costs the JSON reports when it cannot be written, and renders in a real browser (Debian's
chromium, where it is installed: the sorting script runs and the page is drawn)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import faults
import pytest
from helpers import NO_CONFIG, NO_WEIGHTS, cli, read_json, run_parity

from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE, read_report, report_rows, write_reports
from pytest_moe_parity.report.history import diff_reports
from pytest_moe_parity.report.html import (
    DIFF_FILE,
    HTML_FILE,
    SCRIPT,
    drawn_with,
    load_diff,
    render_html,
    write_diff,
    write_html,
)
from pytest_moe_parity.report.summary import figure

pytestmark = pytest.mark.usefixtures("_import_everything_once")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAULTY = "layer_2.experts"  # where zero_expert(2, 1) first shows
# a candidate's directory named with what HTML reads as markup: the page must show it as text
ODD_NAME = 'port <i>&"x'
VOID = {"img", "meta", "br", "hr", "input", "link", "source", "wbr", "col", "area", "base", "embed"}


# -- a page as a tree -----------------------------------------------------------------------------
class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None], parent: Node | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node | str] = []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def walk(self):
        yield self
        for c in self.children:
            if isinstance(c, Node):
                yield from c.walk()

    def find(self, tag: str | None = None, **attrs: str) -> list[Node]:
        """The nodes below with this tag and these attributes (`class_`: one of its classes)."""
        out = []
        for n in self.walk():
            if tag is not None and n.tag != tag:
                continue
            ok = True
            for key, value in attrs.items():
                if key == "class_":
                    ok &= value in (n.attrs.get("class") or "").split()
                else:
                    ok &= n.attrs.get(key.replace("_", "-")) == value
            if ok:
                out.append(n)
        return out

    def one(self, tag: str | None = None, **attrs: str) -> Node:
        found = self.find(tag, **attrs)
        assert len(found) == 1, (tag, attrs, len(found))
        return found[0]


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = self.at = Node("#document", {}, None)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, dict(attrs), self.at)
        self.at.children.append(node)
        if tag not in VOID:
            self.at = node

    def handle_endtag(self, tag: str) -> None:
        at = self.at
        while at.parent is not None and at.tag != tag:
            at = at.parent
        assert at.tag == tag, f"</{tag}> closes nothing"
        self.at = at.parent or self.root

    def handle_data(self, data: str) -> None:
        self.at.children.append(data)


def parse(page: str) -> Node:
    builder = _Builder()
    builder.feed(page)
    builder.close()
    return builder.root


def assert_self_contained(page: str, root: Node) -> None:
    """Nothing outside the file: no element that loads another, every src a data: URI, every link
    within the page, no script from elsewhere, no CSS that fetches."""
    for n in root.walk():
        assert n.tag not in ("link", "iframe", "object", "embed", "base", "frame"), n.tag
        src = n.attrs.get("src")
        assert src is None or src.startswith("data:"), src[:60]
        href = n.attrs.get("href")
        assert href is None or href.startswith("#"), href
        assert not any(key.startswith("on") for key in n.attrs), (n.tag, n.attrs)  # no handler from the run's text
    for scheme in ("http:", "https:", "file:", "//cdn", "@import", "url("):
        assert scheme not in page, scheme


def cell(root: Node, point: str, mode: str = "isolated") -> Node:
    """A point's cell in the layer × component grid."""
    return root.one(class_="cell", data_point=point, data_mode=mode)


def picture(root: Node, alt: str) -> bytes:
    """An embedded picture's PNG bytes."""
    src = root.one("img", alt=alt).attrs["src"] or ""
    head, _, data = src.partition(",")
    assert head == "data:image/png;base64", head
    png = base64.b64decode(data)
    assert png[:8] == PNG_SIGNATURE
    return png


# -- the plugin's runs -----------------------------------------------------------------------------
def test_a_failing_run_s_page_names_the_faulty_point_and_marks_its_cell(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    golden = golden_dir("qwen3_moe")
    port = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / ODD_NAME, faults.zero_expert(2, 1))
    report = tmp_path / "report"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, NO_CONFIG, "--parity-report", str(report), model=port
    )
    assert result.ret == 1
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == FAULTY
    page = (report / HTML_FILE).read_text(encoding="utf-8")
    root = parse(page)
    assert_self_contained(page, root)
    # the first divergence: in the title, the banner and its section, with its failure as the run printed it
    assert root.one("title").text().endswith(f"first divergence {FAULTY}")
    assert root.one("header", class_="banner").attrs["class"] == "banner fail"
    section = root.one("section", id="divergence")
    assert section.one("a", class_="big").text() == FAULTY
    failure = section.find("pre")[0].text()
    assert failure.startswith(f"{FAULTY}: candidate (bfloat16) diverges from the golden (float32)")
    assert "--- moe-parity bug report (paste this block) ---" in section.one("pre", class_="block").text()
    # its cell failed, the points before it passed
    assert cell(root, FAULTY).attrs["data-verdict"] == "failed" and "v-failed" in cell(root, FAULTY).attrs["class"]
    assert cell(root, FAULTY).text().startswith("✗")
    assert cell(root, "layer_2.attention").attrs["data-verdict"] == "passed"
    assert cell(root, "embedding").attrs["data-verdict"] == "passed"  # a model-level point has its cell too
    points = read_json(report / REPORT_FILE)["points"]
    table = root.one("table", id="all-points")
    assert [r.attrs["data-point"] for r in table.find("tr") if "data-point" in r.attrs] == [p["id"] for p in points]
    # the point's details: open, with the per-token picture the run drew for it
    details = root.one("details", id=f"p-{FAULTY}")
    assert "open" in details.attrs
    picture(details, f"{FAULTY} (isolated): each token's error")
    # the candidate's odd directory name: shown as text, never read as markup
    assert not root.find("i")
    candidate = next(d for d in root.find("div") if d.find("dt") and d.find("dt")[0].text() == "candidate")
    assert candidate.one("dd").text() == str(port)
    assert str(port) not in page and "port &lt;i&gt;&amp;&quot;x" in page


def test_a_clean_run_s_page_says_no_point_failed(pytester: pytest.Pytester, golden_dir, tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = run_parity(pytester, golden_dir("qwen3_moe"), "--dtype", "bfloat16", "--parity-report", str(report))
    assert result.ret == 0
    page = (report / HTML_FILE).read_text(encoding="utf-8")
    root = parse(page)
    assert_self_contained(page, root)
    assert root.one("header", class_="banner").attrs["class"] == "banner pass"
    assert "No point failed" in root.one("section", id="divergence").text()
    points = read_json(report / REPORT_FILE)["points"]
    cells = root.find(class_="cell")
    assert {c.attrs["data-point"] for c in cells} == {p["id"] for p in points}
    assert {c.attrs["data-verdict"] for c in cells} == {"passed"}
    assert not root.find("details", open="")  # nothing failed: every point's details closed
    picture(root, "heatmap.png")
    picture(root, "layers.png")


# -- the page itself, from reports on disk --------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model, golden_dir) -> dict[str, Path]:
    """Two report directories over one qwen3_moe golden with bf16 noise figures, both modes: a clean
    bf16 candidate and one whose layer-2 expert was never loaded (pytest-free sessions, as
    `moe-parity compare` drives them)."""
    from pytest_moe_parity.session import ParitySession, RunOptions

    golden = golden_dir("qwen3_moe", noise="bfloat16")
    root = tmp_path_factory.mktemp("html-runs")
    model = tiny_model("qwen3_moe")
    broken = faults.edit_checkpoint(model, root / "broken-model", faults.zero_expert(2, 1))
    out = {}
    for name, candidate in (("clean", model), ("broken", broken)):
        options = RunOptions(
            golden_dir=golden, model=candidate, dtype="bfloat16", mode="both", weights=False, report_dir=root / name
        )
        session = ParitySession(options)
        list(session.run_all())
        session.write_reports()
        out[name] = root / name
    return out


def test_every_text_of_the_run_is_escaped() -> None:
    hostile = '<script>alert("x")</script> & <b onmouseover=alert(1)>'
    points = [
        {"id": "embedding", "order": 0, "layer": None, "step": None, "component": "embedding", "status": "error",
         "error": f"the backend said {hostile}", "metrics": {}, "checks": []},
        {"id": "layer_0.weights", "order": 1, "layer": 0, "step": None, "component": "weights", "status": "failed",
         "findings": [f"q_proj {hostile}"], "hint": hostile, "metrics": {}, "checks": []},
    ]  # fmt: skip
    report = {"schema_version": 1, "model_type": "qwen3_moe", "candidate_model": hostile, "hw": "cpu",
              "dtype": "bfloat16", "mode": "isolated", "complete": True, "points": points}  # fmt: skip
    page = render_html(report)
    root = parse(page)
    assert_self_contained(page, root)
    scripts = root.find("script")
    assert len(scripts) == 1 and scripts[0].text() == SCRIPT  # the page's own, and no other
    assert not root.find("b", onmouseover="alert(1)")
    text = root.text()
    assert f"the backend said {hostile}" in text and f"q_proj {hostile}" in text
    assert cell(root, "embedding").attrs["data-verdict"] == "error"
    assert cell(root, "layer_0.weights").attrs["data-verdict"] == "failed"
    assert page == render_html(report)  # deterministic


def test_every_kind_of_item_has_its_place_on_the_page() -> None:
    """A point not judged, the differentials' items (in the table, not the grid: they run a point
    again), a drill (its op table, the culprit marked), and a run that stopped early."""
    moe = {"layer": 0, "step": None, "component": "moe", "mode": "isolated", "metrics": {}, "checks": []}
    points = [
        {"id": "embedding", "order": 0, "layer": None, "step": None, "component": "embedding", "status": "skipped",
         "reason": "not in the dump", "metrics": {}, "checks": []},
        {"id": "layer_0.attention::drill", "order": 1, "layer": 0, "step": None, "component": "attention",
         "status": "failed", "op": None, "metrics": {}, "checks": [],
         "drill": {"point": "layer_0.attention", "culprit": "mm", "recovery": 0.9, "structure": [], "repro": None,
                   "evidence": ["argument 1 differs"], "rows": [
                       {"name": "softmax", "kind": "_softmax", "shape": [2, 3], "verdict": "ok", "error": 1e-4},
                       {"name": "mm", "kind": "mm", "shape": [2, 3], "verdict": "introduced", "error": 0.1}]}},
        {**moe, "id": "layer_0.moe::routing", "order": 2, "status": "failed", "recovered": "ids",
         "levels": [{"level": "own", "status": "failed", "rel_l2": 0.5}, {"level": "ids", "status": "passed"}]},
        {**moe, "id": "layer_0.moe::batch", "order": 3, "status": "failed", "condition": "padding",
         "changed_rows": [1], "batch_rows": [{"row": 0, "failed": False}, {"row": 1, "failed": True}]},
        {**moe, "id": "layer_0.moe::parallel", "order": 4, "status": "passed", "plans": ["tp=1", "tp=2"],
         "figures": {"b_vs_a": 1e-6}},
    ]  # fmt: skip
    report = {"schema_version": 1, "model_type": "qwen3_moe", "hw": "dump", "dtype": "bfloat16", "mode": "isolated",
              "complete": False, "points": points}  # fmt: skip
    root = parse(render_html(report))
    assert cell(root, "embedding").attrs["data-verdict"] == "skipped"
    # a differential is not its point's cell: it stands beside the grid, red where it failed
    assert not root.one("div", class_="panels").find(data_point="layer_0.moe::routing")
    routing = root.one(class_="cell", data_point="layer_0.moe::routing")
    assert routing.attrs["data-verdict"] == "failed" and routing.text().endswith("✗ own 0.50")
    assert "hsl(0 " in routing.attrs["style"]  # the verdict's hue, red
    table = root.one("table", id="all-points")
    assert [r.attrs["data-point"] for r in table.find("tr") if "data-point" in r.attrs] == [
        "embedding", "layer_0.moe::routing", "layer_0.moe::batch", "layer_0.moe::parallel"
    ]  # fmt: skip
    drill = root.one("div", id="drill-layer_0.attention")
    assert [r.find("td")[0].text() for r in drill.find("tr", class_="culprit")] == ["mm"]
    assert "culprit mm, substituting it recovers 90%" in drill.text()
    assert "recovered by forcing the golden's ids" in root.one("details", id="p-layer_0.moe::routing").text()
    assert "condition: padding" in root.one("details", id="p-layer_0.moe::batch").text()
    assert "interrupted" in root.one("header").text()


def test_moe_parity_report_writes_the_page_again_with_last_night_s_diff(runs, capsys, tmp_path: Path) -> None:
    clean, broken = runs["clean"], runs["broken"]
    directory = tmp_path / "tonight"
    shutil.copytree(broken, directory)
    written = (directory / HTML_FILE).read_bytes()
    (directory / HTML_FILE).unlink()
    code, out, err = cli(capsys, "report", directory)
    assert code == 0, err
    assert f"page: {directory / HTML_FILE}" in out.splitlines()
    assert (directory / HTML_FILE).read_bytes() == written  # the same page the run wrote, byte for byte
    assert not parse(written.decode()).find("section", id="diff")  # no diff given: no section
    # last night's diff beside the report: the page shows the points that got worse
    code, _, err = cli(capsys, "diff", clean, directory, "--json", directory / DIFF_FILE)
    assert code == 1, err
    code, out, err = cli(capsys, "report", directory)
    assert code == 0 and "not shown" not in out, out + err
    section = parse((directory / HTML_FILE).read_text(encoding="utf-8")).one("section", id="diff")
    worse = [r.find("td")[0].text() for r in section.find("tr") if r.find("td")]
    assert worse[0] == FAULTY and "passed → failed" in section.text()
    # a diff of another report (a directory reused by a later run), or not a diff at all: not shown, said why
    diff = json.loads((directory / DIFF_FILE).read_text())
    (directory / DIFF_FILE).write_text(json.dumps({**diff, "new_digest": "0" * 16}))
    report = read_report(directory)
    assert load_diff(directory, report)[1].startswith(f"{DIFF_FILE} compares another report than this one")
    write_html(directory, report)
    page = parse((directory / HTML_FILE).read_text(encoding="utf-8"))
    assert "compares another report" in page.one("section", id="diff").text()
    assert not page.one("section", id="diff").find("table")
    (directory / DIFF_FILE).write_text("{")
    code, out, _ = cli(capsys, "report", directory)
    assert code == 0 and f"({DIFF_FILE} not shown: {directory / DIFF_FILE} is not a readable JSON diff" in out
    # what the merge's --previous does: the diff written beside the merged report, the page written again
    old, new = read_report(clean), read_report(directory)
    write_diff(directory, new, diff_reports(old, new).to_json("last night", "tonight", 2.0))
    section = parse((directory / HTML_FILE).read_text(encoding="utf-8")).one("section", id="diff")
    assert section.find("p")[0].text().startswith("last night (--hw cpu, bfloat16, both) → tonight (")
    assert FAULTY in section.text()


def test_a_page_that_cannot_be_written_costs_no_json_report(
    runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = read_report(runs["broken"])
    rows = report_rows(report)
    meta = {k: v for k, v in report.items() if k not in ("points", "schema_version", "complete")}

    def broken(*args, **kwargs):
        raise RuntimeError("no room for it")

    monkeypatch.setattr("pytest_moe_parity.report.html.render_html", broken)
    lines = write_reports(tmp_path, rows, meta=meta, interrupted=False, plots=False)
    assert lines == [
        "plots: off (the JSON reports are written)",
        f"{HTML_FILE} not written: RuntimeError: no room for it (the JSON reports are written)",
    ]
    assert read_report(tmp_path)["points"] == report["points"] and (tmp_path / SUMMARY_FILE).is_file()
    assert not (tmp_path / HTML_FILE).exists()


def test_the_page_shows_no_picture_of_an_earlier_run(runs, tmp_path: Path) -> None:
    """With the plots off, the pictures an earlier run drew in the same directory stay there; the
    page does not show them as this run's."""
    directory = tmp_path / "reused"
    shutil.copytree(runs["broken"], directory)
    pictures = sorted(directory.glob("*.png"))
    assert pictures and drawn_with(directory) == pictures
    report = read_report(directory)
    meta = {k: v for k, v in report.items() if k not in ("points", "schema_version", "complete")}
    write_reports(directory, report_rows(report), meta=meta, interrupted=False, plots=False)
    assert drawn_with(directory) == []
    assert not parse((directory / HTML_FILE).read_text(encoding="utf-8")).find("img")


# -- a real browser --------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium): the page is not rendered"
)


def chromium(tmp_path: Path, *args: str) -> str:
    """Headless chromium (its own profile under tmp_path); its stdout."""
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@needs_chromium
def test_the_browser_runs_the_script_that_sorts_the_points(runs, tmp_path: Path) -> None:
    page = runs["broken"] / HTML_FILE
    dom = parse(chromium(tmp_path, "--dump-dom", f"{page.as_uri()}#sort=rel_l2:desc"))
    table = dom.one("table", id="all-points")
    assert table.attrs["data-sorted"] == "rel_l2:desc"  # the script ran, and read the address
    assert [th.one("button").text() for th in table.find("th")][:3] == ["#", "point", "status"]
    rows = [r.attrs["data-point"] for r in table.find("tr") if "data-point" in r.attrs]
    by_id = {r.id: r for r in report_rows(read_report(runs["broken"]))}
    errors = [figure(by_id[pid], "rel_l2") for pid in rows]
    known = [e for e in errors if e is not None]
    assert known and known == sorted(known, reverse=True) and errors[: len(known)] == known  # the rest: no figure
    assert dom.one("label", class_="filter").one("input").attrs["type"] == "checkbox"


@pytest.mark.slow
@needs_chromium
def test_the_browser_draws_both_pages(runs, tmp_path: Path) -> None:
    from matplotlib.image import imread

    banner = {}
    for name in ("broken", "clean"):
        shot = tmp_path / f"{name}.png"
        chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1600", (runs[name] / HTML_FILE).as_uri())
        assert shot.read_bytes()[:8] == PNG_SIGNATURE
        pixels = imread(shot, format="png")
        assert pixels.shape[:2] == (1600, 1280)
        assert pixels[..., :3].std() > 0.1, f"{name}: the screenshot is blank"
        banner[name] = pixels[30, 640, :3]  # the banner's colour, inside its band
    red, green = banner["broken"], banner["clean"]
    assert red[0] > red[1] + 0.3 and green[1] > green[0] + 0.2, banner
