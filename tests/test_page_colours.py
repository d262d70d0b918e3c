"""report.html's colours follow the verdict, drawn by a real browser: a failed item is a strong red
whatever its figure (a config field, a router's flip share) and its cell says what failed it; a
passing cell is never red; a run that `-x` stopped is never "complete"; the run's facts read as
text. Three runs of the plugin (pytester inner sessions on tiny models) rendered in headless
chromium, the colours read back as the browser computed them.

With MOE_PARITY_SHOTS=DIR the screenshots of the three pages are kept in DIR (to look at them)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import faults
import pytest
from helpers import NO_WEIGHTS, cli, read_json, run_parity
from test_html import CHROMIUM, PNG_SIGNATURE, Node, chromium, parse

from pytest_moe_parity.report.html import HTML_FILE
from pytest_moe_parity.report.schema import REPORT_FILE, SUMMARY_FILE

pytestmark = [
    pytest.mark.usefixtures("_import_everything_once"),
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"),
]

# what the browser computed, written onto each coloured element before the DOM is dumped (the test's
# own script, added to a copy of the page: the page itself has no such thing)
PROBE = (
    "<script>document.querySelectorAll('.cell,.tag,.chip,tr[data-point] td:first-child').forEach(function(e){"
    "var s=getComputedStyle(e);e.setAttribute('data-bg',s.backgroundColor);e.setAttribute('data-ink',s.color);"
    "e.setAttribute('data-edge',s.boxShadow);});</script>"
)
EPS_EDIT = 1000  # the candidate's rms_norm_eps: the reference's times this


def rendered(report: Path, tmp_path: Path, name: str) -> Node:
    """The page of `report` as chromium laid it out (its computed colours on each cell), and a
    screenshot of it (kept under $MOE_PARITY_SHOTS)."""
    page = report / HTML_FILE
    probed = tmp_path / f"{name}-probed.html"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = parse(chromium(tmp_path, "--dump-dom", probed.as_uri()))
    shot = tmp_path / f"{name}.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1500", page.as_uri())
    assert shot.read_bytes()[:8] == PNG_SIGNATURE
    if os.environ.get("MOE_PARITY_SHOTS"):
        keep = Path(os.environ["MOE_PARITY_SHOTS"])
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep / f"{name}.png")
    return dom


def colour(css: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in re.findall(r"\d+", css)[:3])
    return r, g, b


def red(css: str) -> bool:
    """A strong red: what a failed item is drawn in."""
    r, g, b = colour(css)
    return r >= 120 and r - max(g, b) >= 90


def assert_colours_follow_verdicts(dom: Node) -> list[Node]:
    """Every cell red exactly when it failed, in white ink; a passed one green (never red). The
    cells, for the caller."""
    cells = dom.find(class_="cell")
    assert cells
    for c in cells:
        verdict, bg = c.attrs["data-verdict"], c.attrs["data-bg"] or ""
        assert red(bg) == (verdict == "failed"), (c.attrs["data-point"], verdict, bg)
        if verdict == "failed":
            assert colour(c.attrs["data-ink"] or "") == (255, 255, 255) and value(c).startswith("✗ ")
        if verdict == "passed":
            r, g, b = colour(bg)
            assert g > r and g > b, (c.attrs["data-point"], bg)
    for tag in dom.find("span", class_="tag"):  # the status in the table and the details: red when failed
        failed = "s-failed" in (tag.attrs.get("class") or "")
        assert red(tag.attrs["data-bg"] or "") == failed, (tag.text(), tag.attrs["data-bg"])
    return cells


def value(cell: Node) -> str:
    """What a cell says (a model-level cell's name above it left out)."""
    return cell.one("span", class_="val").text()


def chips(dom: Node) -> list[str]:
    return [c.text() for c in dom.one("header").find(class_="chip")]


def facts(dom: Node) -> dict[str, str]:
    section = dom.one("section", id="run")
    return {d.one("dt").text(): d.one("dd").text() for d in section.find("div") if d.find("dt")}


def test_a_config_field_changed_is_a_red_cell_that_names_the_field(
    pytester: pytest.Pytester, tiny_model, golden_dir, tmp_path: Path
) -> None:
    """The candidate's config differs in rms_norm_eps: the config item fails first (the night's root
    cause) and is red, its cell the field and both values; its weights, the same as the reference's,
    pass (green); every point the eps reaches fails red, the others stay green."""
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    port = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "port", lambda t: None)
    faults.edit_config(port, lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * EPS_EDIT))
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report), model=port)
    assert result.ret == 1
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "config"
    dom = rendered(report, tmp_path, "config-failed")
    cells = {c.attrs["data-point"]: c for c in assert_colours_follow_verdicts(dom)}
    config = cells["config"]
    assert config.attrs["data-verdict"] == "failed"
    assert re.fullmatch(r"✗ rms_norm_eps: \S+ → \S+", value(config)), value(config)
    assert "config field differs: rms_norm_eps" in config.attrs["title"]
    weights = [c for pid, c in cells.items() if pid.endswith("weights")]
    assert weights and {c.attrs["data-verdict"] for c in weights} == {"passed"}
    assert cells["layer_0.input_norm"].attrs["data-verdict"] == "failed"  # where the eps is read
    assert cells["layer_0.router"].attrs["data-verdict"] == "passed"  # on the golden's inputs: untouched
    # its row in the table of every point: a red status and a red edge
    row = dom.one("tr", data_point="config")
    assert red(row.one("span", class_="tag").attrs["data-bg"] or "")
    assert "198, 40, 40" in (row.find("td")[0].attrs["data-edge"] or "")
    assert "stopped" not in " ".join(chips(dom)) and "complete" in chips(dom)


def test_a_router_failing_on_its_flip_share_shows_the_share_in_red(
    pytester: pytest.Pytester, tiny_model, golden_dir, tmp_path: Path
) -> None:
    """A lost score-correction bias: layer 2's router chooses other experts while its logits agree
    with the golden's (noise ratio about 1, which alone would read as the reference's own rounding).
    Its cell is red and says the flip share that failed it."""
    golden = golden_dir("minimax_m2", noise="bfloat16")
    port = faults.edit_checkpoint(tiny_model("minimax_m2"), tmp_path / "port", faults.drop_score_bias(2))
    report = tmp_path / "report"
    args = ("--dtype", "bfloat16", NO_WEIGHTS, "--parity-report", str(report))
    result = run_parity(pytester, golden, *args, model=port)
    assert result.ret == 1
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_2.router"
    router = next(p for p in read_json(report / REPORT_FILE)["points"] if p["id"] == "layer_2.router")
    (flip,) = [c for c in router["checks"] if not c["passed"]]
    assert flip["name"] == "flip_share" and router["noise"]["ratio"] < 1.5  # its noise figure passes
    dom = rendered(report, tmp_path, "router-flip-share")
    cells = assert_colours_follow_verdicts(dom)
    assert [c.attrs["data-point"] for c in cells if c.attrs["data-verdict"] == "failed"] == ["layer_2.router"]
    cell = dom.one(class_="cell", data_point="layer_2.router")
    assert value(cell) == f"✗ flip {100 * flip['value']:.0f}%"
    assert "failed top_k.flip_share" in cell.attrs["title"] and "limit <= 0.05" in cell.attrs["title"]


def test_a_clean_run_has_no_red_and_its_facts_read_as_text(
    pytester: pytest.Pytester, tiny_model, golden_dir, tmp_path: Path
) -> None:
    """A bf16 copy of the reference's checkpoint: its config and weight items and every point pass."""
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    port = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "port", lambda t: None)
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report), model=port)
    assert result.ret == 0
    dom = rendered(report, tmp_path, "clean")
    cells = assert_colours_follow_verdicts(dom)
    assert {c.attrs["data-verdict"] for c in cells} == {"passed"}
    assert {"config", "weights", "layer_0.weights"} <= {c.attrs["data-point"] for c in cells}
    assert not any(red(n.attrs["data-bg"] or "") for n in dom.walk() if n.attrs.get("data-bg"))
    assert chips(dom)[-1] == "complete"
    said = facts(dom)
    assert said["run options"].startswith("tolerances: none, config: on, weights: not set")
    assert "batch: off" in said["run options"] and "routing: not set" in said["run options"]
    assert said["host"].startswith("cores: ") and said["complete"] == "yes"
    assert not any(v.startswith(("{", "[")) or '": ' in v for v in said.values()), said


def test_a_run_stopped_by_x_says_so_as_the_merge_does(
    pytester: pytest.Pytester, tiny_model, golden_dir, tmp_path: Path, capsys
) -> None:
    """`-x` stops at the failed config item, before any point: the badges say the run stopped at its
    first failure (never "complete"), and `report --merge` calls the same report a gap."""
    golden = golden_dir("qwen3_moe")
    port = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "port", lambda t: None)
    faults.edit_config(port, lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * EPS_EDIT))
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", "--parity-report", str(report), model=port)
    result.assert_outcomes(failed=1)
    planned = read_json(report / REPORT_FILE)["planned_points"]
    dom = parse((report / HTML_FILE).read_text(encoding="utf-8"))
    assert chips(dom) == [
        "1 point", f"0 of the {len(planned)} points planned", "0 passed", "1 failed", "stopped at the first failure"
    ]  # fmt: skip
    assert facts(dom)["complete"] == f"no: stopped at the first failure ({len(planned)} of the {len(planned)} " \
        "points planned not judged)"  # fmt: skip
    code, out, err = cli(capsys, "report", "--merge", report, "--out", tmp_path / "merged")
    assert code == 1 and "it stopped early (-x, --maxfail) or crashed" in out + err, out + err
