"""A sharded run merged (`moe-parity report --merge DIR... --out DIR`): shards of one golden run by
inner pytest sessions with `--parity-layers` and `--parity-report`, merged, and compared with the
same run unsharded; a gap, a stopped shard and shards of other runs never read as a pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from xml.etree import ElementTree as ET

import faults
import pytest
from helpers import NO_WEIGHTS, cli, read_json, run_parity

from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE
from pytest_moe_parity.report.merge import JUNIT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

ARCH = "qwen3_moe"  # 4 layers: embedding, rotary, 4 x 7 layer points, final norm, logits
FAULT_LAYER = 3  # the last layer: always in a later shard than the model-level points


def _shard(pytester: pytest.Pytester, golden: Path, out: Path, selection: str | None, model: Path, *extra: str):
    """One shard's inner run: its --parity-layers (None: the whole run), its report in `out`."""
    layers = ["--parity-layers", selection] if selection else []
    return run_parity(
        pytester, golden, *layers, "--parity-report", str(out), "--parity-plots", "no", NO_WEIGHTS, *extra,
        model=model,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model, golden_dir) -> dict:
    """The golden, its clean candidate (its own model) and one whose last layer lost an expert."""
    root = tmp_path_factory.mktemp("merge")
    broken = faults.edit_checkpoint(tiny_model(ARCH), root / "broken-model", faults.zero_expert(FAULT_LAYER, 1))
    return {"root": root, "golden": golden_dir(ARCH), "broken": broken, "clean": tiny_model(ARCH)}


def _estimated_shards(model: Path, tmp: Path, capsys, shards: int = 2) -> list[str]:
    code, _, err = cli(
        capsys, "estimate", "--model", model, "--seq-len", 16, "--shards", shards, "--json", tmp / "e.json"
    )
    assert code == 0, err
    return read_json(tmp / "e.json")["shards"]


def _points(report: Path) -> list[tuple[str, str]]:
    return [(p["id"], p["status"]) for p in read_json(report / REPORT_FILE)["points"]]


def test_merged_shards_are_the_unsharded_run_with_the_fault_in_a_later_shard(
    pytester: pytest.Pytester, runs, capsys, tmp_path: Path
) -> None:
    golden, broken = runs["golden"], runs["broken"]
    selections = _estimated_shards(broken, tmp_path, capsys)
    assert len(selections) == 2 and selections[0].startswith("model") and str(FAULT_LAYER) not in selections[0]
    shards = []
    for i, selection in enumerate(selections):
        shards.append(tmp_path / f"shard_{i}")
        result = _shard(pytester, golden, shards[-1], selection, broken)
        assert result.ret == (1 if i == len(selections) - 1 else 0), result.stdout.str()
    whole = tmp_path / "whole"
    assert _shard(pytester, golden, whole, None, broken).ret == 1
    merged = tmp_path / "merged"
    code, out, err = cli(capsys, "report", "--merge", *shards, "--out", merged)
    assert code == 1, err  # a failed point: the merged run fails
    assert _points(merged) == _points(whole)
    summary, unsharded = read_json(merged / SUMMARY_FILE), read_json(whole / SUMMARY_FILE)
    assert summary["first_divergence"] == unsharded["first_divergence"] == f"layer_{FAULT_LAYER}.experts"
    for key in ("total", "passed", "failed", "error", "skipped", "first_divergence_component", "complete"):
        assert summary[key] == unsharded[key], key
    assert summary["complete"] is True and summary["shard_problems"] == []
    assert summary["layers"] is None and summary["parity_layers"] is None  # the whole run, as unsharded says it
    assert [s["parity_layers"] for s in summary["shards"]] == selections
    assert f"first divergence: layer_{FAULT_LAYER}.experts" in out and "not a whole run" not in out
    assert (merged / "heatmap.png").is_file() and (merged / "layers.png").is_file()
    assert "report.html" in out.split("merged report in")[1].splitlines()[0] and (merged / "report.html").is_file()
    suite = ET.parse(merged / JUNIT_FILE).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [pid for pid, _ in _points(whole)]
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert failed == [pid for pid, status in _points(whole) if status == "failed"] and failed[0].endswith("experts")
    assert int(suite.get("failures")) == len(failed) and int(suite.get("errors")) == 0
    shard_of = {c.get("name"): c.find("properties/property[@name='shard']").get("value") for c in cases}
    assert shard_of[failed[0]] == selections[-1] and shard_of["embedding"] == selections[0]


def test_clean_shards_merge_to_a_pass_and_diff_against_last_night(
    pytester: pytest.Pytester, runs, capsys, tmp_path: Path
) -> None:
    golden, clean, broken = runs["golden"], runs["clean"], runs["broken"]
    shards = []
    for selection in ("model", "0-1", "2-3"):  # the model-level points alone, then the layers
        shards.append(tmp_path / f"clean_{selection}")
        assert _shard(pytester, golden, shards[-1], selection, clean).ret == 0
    merged = tmp_path / "merged"
    code, out, err = cli(capsys, "report", "--merge", *reversed(shards), "--out", merged, "--previous", tmp_path / "x")
    assert code == 0, out + err
    assert "first divergence: none" in out and "no previous report at" in out
    summary = read_json(merged / SUMMARY_FILE)
    assert summary["failed"] == summary["error"] == 0 and summary["passed"] == summary["total"] == 32
    ids = [pid for pid, _ in _points(merged)]
    assert ids[:2] == ["embedding", "rotary"] and ids[-2:] == ["final_norm", "logits"]  # forward order over shards
    # tonight's broken candidate against last night's clean merged report
    tonight = tmp_path / "tonight"
    assert _shard(pytester, golden, tonight / "a", "model,0-2", broken).ret == 0
    assert _shard(pytester, golden, tonight / "b", "3", broken).ret == 1
    code, out, _ = cli(capsys, "report", "--merge", tonight / "a", tonight / "b", "--out", tonight / "m",
                       "--previous", merged)  # fmt: skip
    assert code == 1 and f"layer_{FAULT_LAYER}.experts" in out.split("worse beyond")[1]
    code, out, _ = cli(capsys, "diff", merged, tonight / "m")
    assert code == 1 and f"layer_{FAULT_LAYER}.experts" in out


def test_a_shard_that_never_ran_or_stopped_is_named_and_fails(
    pytester: pytest.Pytester, runs, capsys, tmp_path
) -> None:
    golden, broken = runs["golden"], runs["broken"]
    first = tmp_path / "first"
    assert _shard(pytester, golden, first, "model,0-1", broken).ret == 0
    # the shard of layers 2-3 crashed before writing its report: a gap
    code, out, _ = cli(capsys, "report", "--merge", first, "--out", tmp_path / "m1")
    assert code == 1
    gap = "no shard ran layer 2-3 of the golden's 0-3"
    assert out.count(gap) == 2 and out.splitlines()[-3].startswith("not a whole run: ")  # said first and last
    summary = read_json(tmp_path / "m1" / SUMMARY_FILE)
    assert summary["complete"] is False and any(gap in p for p in summary["shard_problems"])
    assert summary["failed"] == 0  # nothing failed, and yet not a pass
    errors = ET.parse(tmp_path / "m1" / JUNIT_FILE).getroot().findall(".//testcase/error")
    assert [e.get("message") for e in errors] == summary["shard_problems"]
    # no shard took the model-level points
    layers = tmp_path / "layers"
    assert _shard(pytester, golden, layers, "0-2", broken).ret == 0
    code, out, _ = cli(capsys, "report", "--merge", layers, "--out", tmp_path / "m2")
    assert code == 1 and "no shard ran the model-level points" in out and "no shard ran layer 3 of" in out
    # a shard interrupted at its second item: complete false, and its points not judged counted
    pytester.syspathinsert()  # a plugin, not a conftest: the items live under the golden, not here
    pytester.makepyfile(
        stopper="""
def pytest_runtest_call(item):
    if item.name.startswith("layer_3.attention"):
        raise KeyboardInterrupt
"""
    )
    stopped = tmp_path / "stopped"
    result = pytester.runpytest(
        "--golden-dir", str(golden), "--model", str(broken), "-p", "no:cacheprovider", "-p", "stopper",
        "--parity-layers", "2-3", "--parity-report", str(stopped), "--parity-plots", "no", NO_WEIGHTS,
        no_reraise_ctrlc=True,  # the interrupt is the shard's, not this test's
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.INTERRUPTED
    report = read_json(stopped / REPORT_FILE)
    planned, judged = len(report["planned_points"]), len(report["points"])
    assert report["complete"] is False and planned == 14 and judged == 8  # layer 2, then layer_3.input_norm
    code, out, _ = cli(capsys, "report", "--merge", first, stopped, "--out", tmp_path / "m3")
    assert code == 1
    said = f"(--parity-layers 2-3) stopped before its end (complete: false: interrupted); {planned - judged} of its"
    assert said in out
    assert read_json(tmp_path / "m3" / SUMMARY_FILE)["complete"] is False
    # a shard stopped by -x after its first failure: complete, but its later points have no row
    quick = tmp_path / "quick"
    assert _shard(pytester, golden, quick, "2-3", broken, "-x").ret == 1
    code, out, _ = cli(capsys, "report", "--merge", first, quick, "--out", tmp_path / "m4")
    assert code == 1 and "has no row for 2 of its 14 points (first: layer_3.moe)" in out


@pytest.fixture(scope="module")
def shard_pair(tmp_path_factory: pytest.TempPathFactory, runs) -> dict[str, Path]:
    """Shard reports made without pytester (a module fixture): `ParitySession`, as `moe-parity compare`
    and the plugin drive it, with the options of each case."""
    from pytest_moe_parity.session import ParitySession, RunOptions

    root = tmp_path_factory.mktemp("pairs")

    def run(name: str, layers: str, model: Path, golden: Path | None = None, **options) -> Path:
        session = ParitySession(
            RunOptions(golden_dir=golden or runs["golden"], model=model, layers=layers, report_dir=root / name,
                       plots=False, weights=False, **options)
        )  # fmt: skip
        try:
            list(session.run_all(items=True))
            session.write_reports()
        finally:
            session.close()
        return root / name

    return {
        "head": run("head", "model,0-1", runs["broken"]),
        "tail": run("tail", "2-3", runs["broken"]),
        "tail_clean": run("tail_clean", "2-3", runs["clean"]),
        "tail_bf16": run("tail_bf16", "2-3", runs["broken"], dtype="bfloat16"),
        "overlap": run("overlap", "1-3", runs["broken"]),
    }


@pytest.mark.parametrize(
    "case, message",
    [
        (lambda p, t: [p["head"], t / "nope"], "nope does not exist: a shard that never ran"),
        (lambda p, t: [p["head"], p["tail_clean"]], "tail_clean is not a shard of the run of"),
        (lambda p, t: [p["head"], p["tail_bf16"]], 'its dtype "bfloat16", theirs "float32"'),
        (lambda p, t: [p["head"], p["overlap"]], "both ran layer 1: shards must not overlap"),
        (lambda p, t: [p["head"], p["head"]], "twice"),
        (lambda p, t: [p["head"], _older(p["tail"], t)], "(written by an older moe-parity): run the shard again"),
        (lambda p, t: [p["head"], t], f"no {REPORT_FILE} in"),
    ],
    ids=["missing", "other-candidate", "other-dtype", "overlap", "twice", "older", "not-a-report"],
)
def test_what_is_not_one_run_is_bad_input_in_one_line(case, message, shard_pair, tmp_path: Path, capsys) -> None:
    code, out, err = cli(capsys, "report", "--merge", *case(shard_pair, tmp_path), "--out", tmp_path / "merged")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not (tmp_path / "merged").exists() and not out


def test_shards_of_another_golden_are_bad_input(shard_pair, golden_dir, runs, tmp_path: Path, capsys) -> None:
    from pytest_moe_parity.session import ParitySession, RunOptions

    other = golden_dir(ARCH, seq_len=8)  # the same model, another prompt: another golden
    session = ParitySession(RunOptions(golden_dir=other, model=runs["broken"], layers="2-3",
                                       report_dir=tmp_path / "other", plots=False, weights=False))  # fmt: skip
    list(session.run_all())
    session.write_reports()
    session.close()
    code, _, err = cli(capsys, "report", "--merge", shard_pair["head"], tmp_path / "other", "--out", tmp_path / "m")
    assert code == 2 and "its golden (fingerprint)" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, "report", "--merge", shard_pair["head"], "--out", shard_pair["head"])
    assert code == 2 and "is one of the shards" in err
    code, _, err = cli(capsys, "report", "--merge", shard_pair["head"])
    assert code == 2 and "--merge DIR... and --out DIR go together" in err


def _older(report_dir: Path, tmp: Path) -> Path:
    """A copy of a shard's report as a moe-parity before shard metadata wrote it."""
    out = tmp / "older"
    shutil.copytree(report_dir, out)
    data = read_json(out / REPORT_FILE)
    for key in ("golden_layers", "model_points", "planned_points", "run_options"):
        data.pop(key)
    (out / REPORT_FILE).write_text(json.dumps(data))
    return out
