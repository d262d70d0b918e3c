"""The report's pictures (heatmap, layers, per-token plots of failed points), `moe-parity report`
redrawing them from the JSON, and `moe-parity diff` between two runs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import faults
import pytest
from helpers import NO_CONFIG, NO_WEIGHTS, cli, read_json, run_parity, usage_error
from safetensors.torch import save_file

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE
from pytest_moe_parity.report.html import HTML_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_png(path: Path):
    """The image's pixels (raises when the file is not a complete PNG)."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    pixels = imread(path, format="png")
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100, (path, pixels.shape)
    return pixels


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if matplotlib were not installed: every import of it raises ImportError."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model, golden_dir) -> dict[str, Path]:
    """Three report directories over one qwen3_moe golden with bf16 noise figures, both modes:
    a clean bf16 candidate, one whose layer-2 expert was never loaded, and the clean run again."""
    from pytest_moe_parity.session import ParitySession, RunOptions

    golden = golden_dir("qwen3_moe", noise="bfloat16")
    root = tmp_path_factory.mktemp("runs")
    model = tiny_model("qwen3_moe")
    broken = faults.edit_checkpoint(model, root / "broken-model", faults.zero_expert(2, 1))
    out = {}
    for name, candidate in (("clean", model), ("broken", broken), ("again", model)):
        options = RunOptions(golden_dir=golden, model=candidate, dtype="bfloat16", mode="both", report_dir=root / name)
        session = ParitySession(options)
        list(session.run_all())
        session.write_reports()
        out[name] = root / name
    out["golden"] = golden
    return out


def test_a_report_draws_the_heatmap_the_layers_and_each_failed_points_tokens(
    pytester: pytest.Pytester, tiny_model, golden_dir, tmp_path: Path
) -> None:
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    broken = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "m", faults.zero_expert(2, 1))
    report = tmp_path / "report"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-mode", "both", NO_WEIGHTS, NO_CONFIG,
        "--parity-report", str(report), model=broken,
    )  # fmt: skip
    result.stdout.fnmatch_lines([f"plots in {report}: heatmap.png, layers.png, * per-token plots of failed points"])
    rows = read_json(report / REPORT_FILE)["points"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and failed[0]["id"] == "layer_2.experts"
    for r in rows:
        assert (r["token_errors"] is not None) == (r["status"] == "failed" and r["verdicts"]["isolated"] == "failed")
    experts = failed[0]["token_errors"]
    assert len(experts) == 16 and max(experts) == failed[0]["metrics"]["out"]["max_token_rel_l2"]
    heat, layers = decode_png(report / "heatmap.png"), decode_png(report / "layers.png")
    assert heat.shape[1] > heat.shape[0]  # two panels side by side: isolated and chain
    assert layers.shape[:2] == (400, 700)
    tokens = sorted(p.name for p in report.glob("tokens_*.png"))
    assert "tokens_layer_2.experts.png" in tokens and "tokens_layer_2.experts.chain.png" in tokens
    assert len(tokens) == int(result.stdout.str().split("layers.png, ")[1].split()[0])
    for name in tokens:
        decode_png(report / name)


def test_without_matplotlib_the_json_is_written_and_one_line_says_how_to_get_plots(
    pytester: pytest.Pytester, golden_dir, tmp_path: Path, no_matplotlib
) -> None:
    report = tmp_path / "report"
    result = run_parity(pytester, golden_dir("qwen3_moe"), "--dtype", "bfloat16", "--parity-report", str(report))
    result.assert_outcomes(passed=len(read_json(report / REPORT_FILE)["points"]))
    result.stdout.fnmatch_lines(
        ["plots need matplotlib: pip install 'pytest-moe-parity[plots]' (the JSON reports are written)"]
    )
    assert not list(report.glob("*.png"))


def test_report_redraws_the_pictures_from_the_json(runs, capsys) -> None:
    directory = runs["broken"]
    drawn = sorted(p.name for p in directory.glob("*.png"))
    for png in directory.glob("*.png"):
        png.unlink()
    code, out, err = cli(capsys, "report", directory)
    assert code == 0, err
    assert sorted(p.name for p in directory.glob("*.png")) == drawn
    for name in drawn:
        decode_png(directory / name)
    lines = out.splitlines()
    assert lines[0].startswith(f"moe-parity report: {directory} (qwen3_moe on --hw cpu in bfloat16, both mode")
    assert "first divergence: layer_2.experts" in out and "first chain divergence: layer_2.experts" in out
    plots = next(i for i, line in enumerate(lines) if line.startswith("plots in "))
    assert lines[plots].startswith(f"plots in {directory}: heatmap.png, layers.png, ")
    assert lines[plots + 1] == "--- moe-parity bug report (paste this block) ---"  # then the block to paste
    assert lines[-1] == "--- end of the bug report ---"


def test_report_of_what_is_not_a_report_is_bad_input(tmp_path: Path, capsys, runs, request) -> None:
    code, _, err = cli(capsys, "report", tmp_path)
    assert code == 2 and f"no {REPORT_FILE} in {tmp_path}" in err
    (tmp_path / REPORT_FILE).write_text("{not json")
    code, _, err = cli(capsys, "report", tmp_path)
    assert code == 2 and "is not a readable JSON report" in err
    (tmp_path / REPORT_FILE).write_text(json.dumps({"schema_version": 1, "rows": []}))
    code, _, err = cli(capsys, "report", tmp_path)
    assert code == 2 and "is not a moe-parity comparison report" in err
    request.getfixturevalue("no_matplotlib")
    code, _, err = cli(capsys, "report", runs["clean"])
    assert code == 2 and "plots need matplotlib: pip install 'pytest-moe-parity[plots]'" in err
    assert "Traceback" not in err


def test_diff_names_what_got_worse_and_exits_1(runs, capsys) -> None:
    code, out, err = cli(capsys, "diff", runs["clean"], runs["broken"])
    assert code == 1, err
    lines = out.splitlines()
    assert lines[0].endswith(", 32 points in both") and "(--hw cpu, bfloat16, both)" in lines[0]
    worse = [line.split() for line in lines[2 : 2 + int(lines[1].rsplit(": ", 1)[1])]]
    assert worse[0][:5] == ["layer_2.experts", "isolated", "passed", "->", "failed;"]
    # isolated, the damage stays at the layer that has it; chained, later layers inherit it
    assert {w[0] for w in worse if w[1] == "isolated"} <= {"layer_2.experts", "layer_2.moe", "layer_2.output"}
    assert ["layer_2.experts", "chain"] in [w[:2] for w in worse]
    assert not [w for w in worse if w[0].startswith(("layer_0.", "layer_1.", "embedding"))]


def test_diff_of_a_fix_or_the_same_run_exits_0(runs, capsys) -> None:
    code, out, _ = cli(capsys, "diff", runs["broken"], runs["clean"])
    assert code == 0
    assert "worse beyond x2 or newly failing: 0" in out
    assert "  layer_2.experts              isolated  failed -> passed" in out
    code, out, _ = cli(capsys, "diff", runs["clean"], runs["again"])
    assert code == 0 and "worse beyond x2 or newly failing: 0" in out and "fixed" not in out


def test_diff_counts_a_figure_beyond_the_factor_and_not_within_it(runs, tmp_path: Path, capsys) -> None:
    report = read_json(runs["clean"] / REPORT_FILE)
    row = next(r for r in report["points"] if r["id"] == "layer_1.attention")
    old = row["metrics"]["out"]["rel_l2"]
    row["metrics"]["out"]["rel_l2"] = old * 3
    (tmp_path / REPORT_FILE).write_text(json.dumps(report))
    code, out, _ = cli(capsys, "diff", runs["clean"], tmp_path)
    assert code == 1
    assert out.splitlines()[1:3] == [
        "worse beyond x2 or newly failing: 1",
        f"  layer_1.attention            isolated  rel_l2 {old:.3g} -> {old * 3:.3g} (x3)",
    ]
    assert cli(capsys, "diff", runs["clean"], tmp_path, "--factor", "4")[0] == 0
    assert cli(capsys, "diff", runs["clean"], tmp_path, "--min-error", "1")[0] == 0


def test_diff_of_reports_from_different_goldens_exits_2(runs, golden_dir, tmp_path: Path, capsys) -> None:
    other = golden_dir("qwen3_moe", seq_len=32)
    report = read_json(runs["clean"] / REPORT_FILE)
    from pytest_moe_parity.golden import GoldenStore

    report["golden_fingerprint"] = GoldenStore(other).fingerprint
    assert report["golden_fingerprint"] != read_json(runs["clean"] / REPORT_FILE)["golden_fingerprint"]
    (tmp_path / REPORT_FILE).write_text(json.dumps(report))
    code, out, err = cli(capsys, "diff", runs["clean"], tmp_path)
    assert code == 2 and out == ""
    assert "the reports come from different goldens" in err and "their points are not comparable" in err


def test_a_copied_golden_keeps_its_fingerprint(runs, tmp_path: Path) -> None:
    from pytest_moe_parity.golden import GoldenStore

    copy = shutil.copytree(runs["golden"], tmp_path / "copy")
    assert GoldenStore(copy).fingerprint == GoldenStore(runs["golden"]).fingerprint


def test_the_pictures_can_be_turned_off(pytester: pytest.Pytester, golden_dir, tmp_path: Path, capsys) -> None:
    """`--parity-plots no` (ini `parity_plots = no`, `compare --plots no`): the JSON reports and the page
    (report.html, without pictures) alone."""
    golden = golden_dir("olmoe")
    for how, args in (("flag", ["--parity-plots", "no"]), ("ini", ["-o", "parity_plots=no"])):
        report = tmp_path / how
        result = run_parity(pytester, golden, "-m", "final_norm", "--parity-report", str(report), *args)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["plots: off (the JSON reports are written)"])
        assert sorted(p.name for p in report.iterdir()) == sorted([REPORT_FILE, SUMMARY_FILE, HTML_FILE])
    usage_error(run_parity(pytester, golden, "-o", "parity_plots=maybe"), "parity_plots (ini): expected yes or no")
    dump = tmp_path / "dump"
    dump.mkdir()
    save_file({"embedding": GoldenStore(golden).load("embedding").output.contiguous()}, str(dump / "d.safetensors"))
    code, out, err = cli(capsys, "compare", golden, dump, "--report", tmp_path / "cli", "--plots", "no")
    assert code == 0 and "plots: off (the JSON reports are written)" in out, out + err
    assert not list((tmp_path / "cli").glob("*.png"))


def test_a_golden_recorded_again_keeps_its_fingerprint_and_last_night_s_report(
    runs, tiny_model, tmp_path: Path, capsys
) -> None:
    """The same model and inputs recorded again: the files' bytes may differ (safetensors writes its
    header's metadata in no fixed order), what they hold does not, so `moe-parity diff` takes last
    night's report; other inputs make another golden."""
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.replay.noise import record_noise
    from pytest_moe_parity.session import ParitySession, RunOptions

    first = GoldenStore(runs["golden"])
    again = tmp_path / "again"
    record_golden(tiny_model("qwen3_moe"), again, seq_len=first.manifest["inputs"]["seq_len"])
    record_noise(again, "bfloat16", model_dir=tiny_model("qwen3_moe"))
    assert GoldenStore(again).fingerprint == first.fingerprint
    options = RunOptions(golden_dir=again, model=tiny_model("qwen3_moe"), dtype="bfloat16", mode="both",
                         report_dir=tmp_path / "tonight")  # fmt: skip
    session = ParitySession(options)
    list(session.run_all())
    session.write_reports()
    code, out, err = cli(capsys, "diff", runs["clean"], tmp_path / "tonight")
    assert code == 0, out + err
    other = tmp_path / "other"
    record_golden(tiny_model("qwen3_moe"), other, seq_len=first.manifest["inputs"]["seq_len"] + 1)
    assert GoldenStore(other).fingerprint != first.fingerprint
    # the file digests alone: what the files hold, whatever their bytes
    files = json.loads((again / "manifest.json").read_text())["files"]
    assert all(len(f["content"]) == 64 for f in files.values())


def test_decode_steps_are_drawn_apart_from_the_prefill(
    pytester: pytest.Pytester, tiny_model, golden_dir, tmp_path: Path, monkeypatch
) -> None:
    """Each picture holds one step: the prefill's failed expert is not painted over by the decode
    steps' figures of the same layer and component."""
    from pytest_moe_parity.report import plots

    drawn: list[set] = []
    heatmap = plots.heatmap
    monkeypatch.setattr(
        plots, "heatmap", lambda rows, new, *a: drawn.append({r.step for r in rows}) or heatmap(rows, new, *a)
    )
    golden = golden_dir("qwen3_moe", decode=2)
    broken = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "m", faults.zero_expert(2, 1))
    report = tmp_path / "report"
    result = run_parity(pytester, golden, NO_WEIGHTS, NO_CONFIG, "--parity-report", str(report), model=broken)
    drew = f"plots in {report}: heatmap.png, layers.png, the same for step_1 to step_2, * per-token plots of *"
    result.stdout.fnmatch_lines([drew])
    assert drawn == [{None}, {1}, {2}]
    for name in ("heatmap", "layers"):
        for suffix in ("", ".step_1", ".step_2"):
            decode_png(report / f"{name}{suffix}.png")


def test_diff_counts_an_item_new_tonight_that_failed_as_worse(runs, tiny_model, tmp_path: Path, capsys) -> None:
    """Last night had no config or weight items; tonight's config item is new and failed (the night's
    root cause): worse, `new tonight`, exit 1. The weight items, new and passed, are only in tonight."""
    from pytest_moe_parity.session import ParitySession, RunOptions

    copy = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "copy", lambda t: None)
    edited = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "edited", lambda t: None)
    faults.edit_config(edited, lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * 10))
    nights = {"last": (copy, {"weights": False, "config": False}), "clean": (copy, {}), "tonight": (edited, {})}
    for name, (candidate, items) in nights.items():
        options = RunOptions(golden_dir=runs["golden"], model=candidate, dtype="bfloat16", report_dir=tmp_path / name,
                             **items)  # fmt: skip
        session = ParitySession(options)
        list(session.run_all(items=True))  # the config and weight items too
        session.write_reports()
    ids = {r["id"]: r["status"] for r in read_json(tmp_path / "tonight" / REPORT_FILE)["points"]}
    weights = sorted(i for i in ids if i.endswith("weights"))
    assert ids["config"] == "failed" and weights and all(ids[w] == "passed" for w in weights), ids

    code, out, err = cli(capsys, "diff", tmp_path / "last", tmp_path / "tonight", "--json", tmp_path / "diff.json")
    assert code == 1, out + err
    lines = out.splitlines()
    worse = lines[2 : 2 + int(lines[1].rsplit(": ", 1)[1])]
    assert worse[0].split()[:5] == ["config", "isolated", "new", "tonight,", "failed;"]
    assert "rms_norm_eps" in worse[0]
    assert not [w for w in worse if "weights" in w.split()[0]]
    only_new = next(line for line in lines if line.startswith(f"only in {tmp_path / 'tonight'} (not compared): "))
    assert "config" not in only_new.split(": ", 1)[1].split(", ") and weights[0] in only_new
    written = read_json(tmp_path / "diff.json")
    config = written["worse"][0]
    assert config["id"] == "config" and config["new"] is True and config["status"] == [None, "failed"]
    assert "rms_norm_eps" in config["detail"] and "config" not in written["only_new"]
    assert all(c.get("new") is not True for c in written["worse"][1:] if c["id"] != "config")

    # the page shows it; new items that passed are not worse: exit 0
    shutil.copy(tmp_path / "diff.json", tmp_path / "tonight" / "diff.json")
    code, _, err = cli(capsys, "report", tmp_path / "tonight")
    assert code == 0, err
    assert "new tonight, failed" in (tmp_path / "tonight" / HTML_FILE).read_text()
    code, out, err = cli(capsys, "diff", tmp_path / "last", tmp_path / "clean")
    assert code == 0, out + err
    assert "worse beyond x2 or newly failing: 0" in out
    assert f"only in {tmp_path / 'clean'} (not compared): config, weights, layer_0.weights" in out
