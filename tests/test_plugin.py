"""The pytest plugin, tested the way pytest plugins are: inner sessions with pytester, on real tiny
models. Clean runs assert that nothing failed; fault injections assert which point failed first."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import faults
import pytest
import torch
from helpers import NO_CONFIG, NO_WEIGHTS, assert_stops_at, read_json, rounding_bound, run_parity, usage_error

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.model.archs import ARCH_TABLE
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.record.tiny import available_archs
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

ALL_ARCHS = available_archs()
# bf16 defaults are calibrated on the seven architectures of the table (phimoe's sparsemixer, for one,
# re-weights experts discontinuously near its threshold: see README, known limits)
ARCHS = sorted(ARCH_TABLE)
XDIST = pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])


# -- clean runs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_fp32_candidate_passes_everything(arch: str, pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir(arch)
    n = len(GoldenStore(golden).point_ids)
    report = pytester.path / "report"
    # the golden was recorded here on torch's threads: the replay's forwards on as many (left alone,
    # they give a core to the read-ahead, and a GEMM split over other threads sums in another order)
    threads = f"threads={torch.get_num_threads()}"
    result = run_parity(pytester, golden, "--parity-report", str(report), "--hw-option", threads)
    result.assert_outcomes(passed=n)
    result.stdout.fnmatch_lines([f"{n} points: {n} passed, 0 failed, 0 errors*", "first divergence: none"])
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] is None and summary["failed"] == 0 and summary["passed"] == n
    rows = read_json(report / REPORT_FILE)["points"]
    assert [r["id"] for r in rows] == GoldenStore(golden).point_ids
    # identical weights, same dtype, pinned implementations, the same threads: the replay is exact
    assert all(m["rel_l2"] == 0 for r in rows for m in r["metrics"].values())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_candidate_passes_at_default_tolerances(
    arch: str, seed: int, pytester: pytest.Pytester, tiny_model, tmp_path: Path
) -> None:
    """Sequence lengths 16 and 64: zero failures at the default tolerances. The routing
    disagreements that bf16 produces (ties at routers, flips inside whole-layer points) are
    counted and their tokens excluded, never failed (the two tests below show that they occur and
    that the exclusion is what makes such a block pass)."""
    model = tiny_model(arch, seed=seed)
    for seq_len in (16, 64):
        golden = tmp_path / f"golden-{seq_len}"
        record_golden(model, golden, seq_len=seq_len)
        report = tmp_path / f"report-{seq_len}"
        result = run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report))
        result.assert_outcomes(passed=len(GoldenStore(golden).point_ids))
        result.stdout.fnmatch_lines(["first divergence: none"])
        rows = read_json(report / REPORT_FILE)["points"]
        assert all(r["routing"] for r in rows if r["component"] == "router")  # routers judged on top-k sets


def test_bf16_runs_do_disagree_on_routing(pytester: pytest.Pytester, golden_dir) -> None:
    """minimax_m2 at 64 tokens: bf16 rounding makes some tokens' top-k sets differ from the golden's
    (seen in every seed of the matrix above); the run still passes."""
    golden = golden_dir("minimax_m2", seq_len=64)
    report = pytester.path / "report"
    run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report)).assert_outcomes(
        passed=len(GoldenStore(golden).point_ids)
    )
    rows = read_json(report / REPORT_FILE)["points"]
    assert sum(len(r["routing"]["ties"]) + len(r["routing"]["flips"]) for r in rows if r["routing"]) > 0


def test_ties_are_counted_and_their_tokens_excluded(pytester: pytest.Pytester, golden_dir, tiny_model) -> None:
    """minimax_m2 at 64 tokens has near-tie routing in bf16: the router passes with the ties
    reported, and the MoE block passes only because the tied tokens are excluded — their own
    error is far above the limit."""
    from helpers import session

    golden = golden_dir("minimax_m2", seq_len=64)
    report = pytester.path / "report"
    run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report)).assert_outcomes(
        passed=len(GoldenStore(golden).point_ids)
    )
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    tied = {pid: r for pid, r in rows.items() if r["component"] == "router" and r["routing"]["ties"]}
    assert tied, "expected near-tie routing in a bf16 run of this model"
    layer = rows[next(iter(tied))]["layer"]
    moe = rows[f"layer_{layer}.moe"]
    assert moe["status"] == "passed" and moe["excluded_tokens"]
    # the excluded tokens really differ: judged over them alone, the block would fail
    run = session(golden, tiny_model("minimax_m2"), dtype="bfloat16")
    prepared = run.prepare(run.golden.point(f"layer_{layer}.moe"))
    golden_out = prepared.golden.output.reshape(-1, 64)
    idx = moe["excluded_tokens"]
    diff = (prepared.candidate.output.float().reshape(-1, 64)[idx] - golden_out[idx]).norm()
    assert float(diff / golden_out[idx].norm()) > run.runner.tolerance(f"layer_{layer}.moe")[0].rel_l2


# -- fault injection -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", sorted(faults.CASES))
def test_fault_is_caught_at_its_own_point(fault: str, pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    arch, expected, make = faults.CASES[fault]
    golden = golden_dir(arch)
    tensor_edit, config_edit = make(golden)
    candidate = pytester.path / "candidate"
    faults.edit_checkpoint(tiny_model(arch), candidate, tensor_edit or (lambda t: None))
    if config_edit:
        faults.edit_config(candidate, config_edit)
    report = pytester.path / "report"
    args = ("--dtype", "bfloat16", "-x", NO_WEIGHTS, NO_CONFIG, "--parity-report", str(report))
    result = run_parity(pytester, golden, *args, model=candidate)
    assert_stops_at(result, golden, expected)
    result.stdout.fnmatch_lines([f"first divergence: {expected}*", f"FAILED *parity::{expected} - *"])
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == expected and summary["failed"] == 1
    assert summary["hint"] and summary["first_error"] is None
    # a router's hint names only the causes its own figures leave open
    said = next((hints for prefix, hints in ROUTER_HINTS.items() if fault.startswith(prefix)), None)
    assert said is None or any(h in summary["hint"] for h in said), summary["hint"]


ROUTER_HINTS = {  # fault -> what its router's hint may say
    "router_rows_permuted": ("most tokens routed differently", "router logits differ: the gate's weight"),
    "score_bias_dropped": ("the chosen experts differ while the router's logits agree: the selection rule",),
}


def test_failure_text_is_the_diagnosis(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("minimax_m2")
    candidate = faults.edit_checkpoint(tiny_model("minimax_m2"), pytester.path / "c", faults.drop_score_bias(2))
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", model=candidate)
    result.stdout.fnmatch_lines(
        [
            "*layer_2.router: candidate (bfloat16) diverges from the golden (float32)*",
            "*logits: golden (16, 8) float32, candidate (16, 8) bfloat16*",
            "*tensor*metric*value*limit*verdict*",
            "*top_k*flip_share*<= 0.05*FAIL*",
            "*routing: 16 tokens, top-2 of 8 experts, set agreement*real flips*",
            "*token*golden only*candidate only*score gap*kind*",
            "*flip",
            "*hint: the chosen experts differ while the router's logits agree: the selection rule*",
            "*score-correction bias*",
            "*to accept this result: --parity-tol 'layer_2.router:max_flip_share=*'",
        ]
    )


def test_failure_text_shows_counts_and_worst_elements(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    """A sign flip reads as such: the worst elements show golden and candidate values side by side."""
    golden = golden_dir("qwen3_moe")
    candidate = faults.edit_checkpoint(
        tiny_model("qwen3_moe"), pytester.path / "c", faults.scale("lm_head", None, -1.0)
    )
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-m", "logits", model=candidate)
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    section = text[text.index("logits: candidate (bfloat16)") : text.index("= moe-parity =")]
    assert all(len(line) <= 100 for line in section.splitlines()), max(section.splitlines(), key=len)
    result.stdout.fnmatch_lines(
        [
            "*outside atol=0.01/rtol=0.016: * / 4096 (*%)",
            "*worst elements of out:",
            "*index*golden*candidate*difference",
            "*(0, *, *)*",
        ]
    )
    rows = [line.split() for line in section.splitlines() if line.strip().startswith("(0,")]
    # index takes 3 fields "(0, t, v)"; then golden, candidate, difference: candidate = -golden
    values = [(float(r[3]), float(r[4])) for r in rows]
    # the bf16 candidate's half-ulp rounding (and 4 printed digits): within one bf16 rounding step
    rel = rounding_bound(torch.bfloat16, 1.0, steps=1)
    assert values and all(c == pytest.approx(-g, rel=rel) for g, c in values)
    assert "to accept this result" not in section  # cosine -1: no tolerance accepts a sign flip


def test_nan_in_candidate_says_where(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("qwen3_moe")
    candidate = faults.edit_checkpoint(tiny_model("qwen3_moe"), pytester.path / "c", faults.poison("o_proj", 1))
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", NO_WEIGHTS, NO_CONFIG, model=candidate)
    assert_stops_at(result, golden, "layer_1.attention")
    result.stdout.fnmatch_lines(["*out*finite*FAIL*", "*candidate has * NaN and 0 Inf*first at index (0, *), token *"])
    assert "cosine         nan" not in result.stdout.str()


# -- selection, xdist, --lf / --sw, lazy loading ---------------------------------------------------


@XDIST
def test_k_selects_one_layer_and_reads_only_its_tensors(xdist, pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("mixtral", layers=12)
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "-k", "layer_1.", "--parity-report", str(report), "-v", *xdist)
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines(["*parity::layer_1.input_norm*"])
    assert "layer_10." not in result.stdout.str() and "layer_11." not in result.stdout.str()
    if xdist:  # --dist loadgroup by default: one layer's items run on one worker
        workers = {line.split("]")[0] for line in result.stdout.lines if "PASSED" in line and line.startswith("[gw")}
        assert len(workers) == 1, result.stdout.str()
    summary = read_json(report / SUMMARY_FILE)
    assert summary["passed"] == 7 and summary["first_divergence"] is None
    if not xdist:  # what this process read (under xdist the workers read)
        assert summary["golden_files_read"] == ["layer_1.safetensors"]
        reads = summary["candidate_reads"]
        assert reads["units"] == ["layer_1"]
        assert reads["keys"] and all(".layers.1." in k for k in reads["keys"])


@XDIST
def test_parity_layers_selects_exactly(xdist, pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("mixtral", layers=12)
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "--parity-layers", "1,10-11", "--parity-report", str(report), *xdist)
    result.assert_outcomes(passed=21)  # 3 layers x 7 points; layers 12-19 do not exist, 0 and 2-9 not asked
    rows = read_json(report / REPORT_FILE)["points"]
    assert sorted({r["layer"] for r in rows}) == [1, 10, 11]
    result.stdout.fnmatch_lines(
        ["*2 workers [[]21 items[]]*" if xdist else "*collected 88 items / 67 deselected / 21 selected*"]
    )
    ini = pytester.makeini(f"[pytest]\ngolden_dir = {golden}\nparity_layers = 3\n")
    pytester.runpytest("-c", str(ini), "-p", "no:cacheprovider", *xdist).assert_outcomes(passed=7)
    # -k still matches substrings: layer_1 is also 10 and 11
    run_parity(pytester, golden, "-k", "layer_1", *xdist).assert_outcomes(passed=21)


def test_what_lives_long_is_kept_from_the_collector_until_the_session_closes(
    pytester: pytest.Pytester, golden_dir
) -> None:
    """Once the backend has started, the objects alive then (torch, transformers, the skeleton) are
    frozen, so full collections do not walk them again at every run; they are thawed after pytest's
    own last collections, and an inner run leaves the process as it found it."""
    counts = pytester.path / "frozen.txt"
    pytester.syspathinsert()
    pytester.makepyfile(
        probe=f"""
import gc

def write(when):
    with open({str(counts)!r}, "a") as fh:
        fh.write(f"{{when}} {{gc.get_freeze_count()}}\\n")

def pytest_runtest_teardown(item):
    write("teardown")

def pytest_unconfigure(config):  # where pytest collects garbage for the last time
    write("unconfigure")
"""
    )
    assert gc.get_freeze_count() == 0
    run_parity(pytester, golden_dir("mixtral"), "--parity-layers", "0", "-p", "probe").assert_outcomes(passed=7)
    seen = [line.split() for line in counts.read_text().splitlines()]
    assert [when for when, _ in seen] == ["teardown"] * 7 + ["unconfigure"]
    assert min(int(n) for _, n in seen) > 10_000, seen
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen by someone else: theirs to thaw, not ours
    try:
        frozen = gc.get_freeze_count()
        run_parity(pytester, golden_dir("mixtral"), "--parity-layers", "0").assert_outcomes(passed=7)
        assert 0 < gc.get_freeze_count() <= frozen  # neither thawed nor added to (some were freed)
    finally:
        gc.unfreeze()


def test_markers_and_keyword_combinations(pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("qwen2_moe")
    run_parity(pytester, golden, "-m", "router").assert_outcomes(passed=4)
    run_parity(pytester, golden, "-m", "shared_experts or experts").assert_outcomes(passed=8)
    run_parity(pytester, golden, "-k", "layer_3 and experts").assert_outcomes(passed=2)  # experts, shared_experts


@XDIST
def test_outcomes_and_reports_with_and_without_xdist(xdist, pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), pytester.path / "c", faults.swap_gate_up(1))
    report = pytester.path / "report"
    result = run_parity(
        pytester,
        golden,
        "--dtype",
        "bfloat16",
        NO_WEIGHTS,
        NO_CONFIG,
        "--parity-report",
        str(report),
        *xdist,
        model=candidate,
    )
    n = len(GoldenStore(golden).point_ids)
    # experts and the MoE block of layer 1 fail; the rest gets golden inputs and passes (the whole
    # layer passes too: in this tiny model the MoE adds ~1e-3 to a residual stream of ~1)
    result.assert_outcomes(failed=2, passed=n - 2)
    result.stdout.fnmatch_lines(["first divergence: layer_1.experts*"])
    rows = read_json(report / REPORT_FILE)["points"]
    assert [r["id"] for r in rows] == GoldenStore(golden).point_ids
    assert [r["id"] for r in rows if r["status"] == "failed"] == ["layer_1.experts", "layer_1.moe"]
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == "layer_1.experts" and summary["complete"] is True
    assert summary["remedy"].startswith("--parity-tol 'layer_1.experts:")


def test_last_failed_and_stepwise(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("olmoe")
    candidate = faults.edit_checkpoint(tiny_model("olmoe"), pytester.path / "c", faults.permute_router_rows(2))
    base = ["--golden-dir", str(golden), "--model", str(candidate), "--dtype", "bfloat16", NO_WEIGHTS, NO_CONFIG]
    first = pytester.runpytest(*base)
    assert first.ret == 1
    failed = first.parseoutcomes()["failed"]
    again = pytester.runpytest(*base, "--lf")
    again.assert_outcomes(failed=failed)
    sw = pytester.runpytest(*base, "--sw")
    sw.assert_outcomes(failed=1, passed=GoldenStore(golden).point_ids.index("layer_2.router"))
    resumed = pytester.runpytest(*base, "--sw")
    assert resumed.parseoutcomes().get("passed", 0) == 0  # resumes at the failing point, stops there again
    resumed.stdout.fnmatch_lines(["*FAILED *parity::layer_2.router*"])


def test_paths_given_also_collect_user_tests(pytester: pytest.Pytester, golden_dir) -> None:
    pytester.makepyfile(test_mine="def test_mine():\n    assert True\n")
    golden = golden_dir("olmoe")
    n = len(GoldenStore(golden).point_ids)
    run_parity(pytester, golden).assert_outcomes(passed=n)  # no path: parity items only
    run_parity(pytester, golden, "test_mine.py").assert_outcomes(passed=n + 1)


def test_plugin_is_inert_without_golden_dir(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mine="def test_mine():\n    assert True\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "moe-parity-" in out  # the plugin is loaded ...
    assert "moe-parity:" not in out and "= moe-parity =" not in out and "parity::" not in out  # ... and silent
    strict = pytester.runpytest("--strict-markers", "-m", "router")  # no component markers registered
    assert "Unknown marker(s) in '-m' expression: router" in strict.stdout.str() + strict.stderr.str()
    help_text = pytester.runpytest("--help").stdout.str()
    assert all(flag in help_text for flag in ("--golden-dir", "--parity-tol", "--hw-option", "--parity-layers"))


def test_inert_plugin_imports_no_torch(pytester: pytest.Pytester) -> None:
    """Every pytest run loads the plugin: without a golden it must cost nothing, torch included."""
    pytester.makepyfile(test_mine="import sys\n\ndef test_no_torch():\n    assert 'torch' not in sys.modules\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist").assert_outcomes(passed=1)


# -- the candidate, and bad input ------------------------------------------------------------------


def test_default_candidate_is_the_model_beside_the_golden(pytester: pytest.Pytester, tiny_model, tmp_path) -> None:
    """A golden copied together with its model tests that copy, not whatever sits at the recording
    machine's path; the header says which candidate was taken and why."""
    recorded = tmp_path / "recorded"
    shutil.copytree(tiny_model("olmoe"), recorded / "model")
    record_golden(recorded / "model", recorded / "golden", seq_len=16)
    moved = tmp_path / "moved"
    shutil.copytree(recorded / "golden", moved / "golden")  # recorded/model still exists: the absolute path
    faults.edit_checkpoint(recorded / "model", moved / "model", faults.lose_weight("model.norm.weight"))
    result = run_parity(pytester, moved / "golden", "-m", "final_norm")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"moe-parity: candidate {moved / 'model'} (the golden's model, found relative to the golden)*"]
    )
    shutil.rmtree(moved / "model")
    result = run_parity(pytester, moved / "golden", "-m", "final_norm")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [f"moe-parity: candidate {recorded / 'model'} (the golden's model, at the path it was recorded from)*"]
    )
    result = run_parity(
        pytester, moved / "golden", "-m", "final_norm", model=moved / "golden" / ".." / ".." / "recorded" / "model"
    )
    result.stdout.fnmatch_lines(["moe-parity: candidate * (--model)*"])


def test_invalid_golden_dir(pytester: pytest.Pytester, tmp_path: Path) -> None:
    usage_error(pytester.runpytest("--golden-dir", str(tmp_path)), "manifest.json is missing")
    usage_error(pytester.runpytest("--golden-dir", str(tmp_path / "nope")), "does not exist")


def test_unknown_hw_lists_the_available(pytester: pytest.Pytester, golden_dir) -> None:
    """The built-in backends and whatever else is installed (the README's own example, once installed,
    is listed too)."""
    from pytest_moe_parity.backends import registry

    available = ", ".join(sorted(registry()))
    assert {"compile", "cpu", "cuda", "dump", "neuron", "nxdi", "trace"} <= set(registry())
    usage_error(
        run_parity(pytester, golden_dir("olmoe"), "--hw", "tpu"),
        f"--hw 'tpu' is not a known backend; available: {available}",
    )


def test_a_file_as_the_golden_dir_is_named_as_a_file(pytester: pytest.Pytester, golden_dir) -> None:
    manifest = golden_dir("olmoe") / "manifest.json"
    usage_error(
        pytester.runpytest("--golden-dir", str(manifest)),
        f"{manifest} is a file, not a golden directory: pass the directory that holds manifest.json",
    )


@pytest.mark.parametrize("flag", ["-q", "--no-header"])
def test_the_golden_and_candidate_lines_survive_a_quiet_run(flag: str, pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("olmoe")
    result = run_parity(pytester, golden, flag, "-m", "final_norm")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [f"moe-parity: golden {golden} (olmoe, *", "moe-parity: candidate * on --hw cpu in float32", "*1 passed*"]
    )


def test_candidate_config_mismatch_lists_differences(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    result = run_parity(pytester, golden_dir("mixtral"), model=tiny_model("mixtral", layers=3))
    usage_error(result, "does not match the golden's model: num_hidden_layers: golden 4, candidate 3")
    result = run_parity(pytester, golden_dir("mixtral"), model=tiny_model("qwen3_moe"))
    usage_error(result, "model_type: golden 'mixtral', candidate 'qwen3_moe'")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtype", "int8"], "--dtype 'int8' is not a floating-point torch dtype"),
        (["--parity-tol", "layer_*:cosine"], "malformed tolerance 'cosine'"),
        (["--parity-tol", "layer_*:speed=3"], "unknown tolerance key 'speed'"),
        (["--parity-tol", "cosine=1.5"], "must be between 0 and 1"),
        (["--model", "/nonexistent/model"], "--model /nonexistent/model does not exist"),
        (["--hw", "cuda"], "--hw cuda needs a CUDA device, and torch sees none; use --hw cpu"),
        (["--hw-option", "device=cuda:3"], "needs a CUDA device"),
        (["--hw-option", "device=gpu0"], "--hw-option device=gpu0: not a torch device"),
        (["--hw-option", "speed=3"], "--hw-option speed=3: the cpu backend has no option 'speed'; its options: device"),
        (["--hw-option", "max_layers"], "--hw-option 'max_layers' is not KEY=VALUE"),
        (["--hw-option", "max_layers=0"], "--hw-option max_layers=0: expected a whole number of at least 1"),
        (["--parity-layers", "4"], "--parity-layers 4: the golden has no layer 4; its layers are 0-3"),
        (["--parity-layers", "1,9-12"], "the golden has no layer 9-12; its layers are 0-3"),
        (["--parity-layers", "2-x"], "--parity-layers 2-x: '2-x' is not a layer number or a range like 20-29"),
        (["--parity-layers", "3-1"], "is not a range of layers"),
    ],
)
def test_bad_options_are_usage_errors(args, message, pytester: pytest.Pytester, golden_dir) -> None:
    usage_error(run_parity(pytester, golden_dir("olmoe"), *args), message)


def test_candidate_without_safetensors_is_a_usage_error(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    candidate = pytester.path / "c"
    candidate.mkdir()
    shutil.copy(tiny_model("olmoe") / "config.json", candidate)
    usage_error(
        run_parity(pytester, golden_dir("olmoe"), model=candidate),
        "only safetensors checkpoints can be read one layer at a time",
    )


def test_bad_marker_and_ini(pytester: pytest.Pytester, golden_dir) -> None:
    pytester.makepyfile(
        test_custom="""
        import pytest

        @pytest.mark.parity(cosine=0.99, speed=2)
        def test_x(parity):
            pass
        """
    )
    usage_error(run_parity(pytester, golden_dir("olmoe"), "test_custom.py"), "unknown tolerance key 'speed'")
    ini = pytester.makeini("[pytest]\nparity_tolerances =\n    layer_*:rel_l2=abc\n")
    result = run_parity(pytester, golden_dir("olmoe"), "-c", str(ini))
    usage_error(result, "parity_tolerances (ini): tolerance rel_l2='abc' is not a number")
    ini = pytester.makeini("[pytest]\nparity_hw_options =\n    warp=9\n")
    usage_error(run_parity(pytester, golden_dir("olmoe"), "-c", str(ini)), "the cpu backend has no option 'warp'")


# -- tolerances from the ini file, the command line and markers ------------------------------------


def test_tolerance_sources(pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("olmoe")
    # bf16 errors are ~5e-3: an ini pattern tightening the routers fails them, the command line
    # loosens layer 3's router again
    ini = pytester.makeini(f"[pytest]\ngolden_dir = {golden}\nparity_tolerances =\n    layer_*.router:rel_l2=1e-4\n")
    base = ["-c", str(ini), "-p", "no:cacheprovider", "--dtype", "bfloat16", "-m", "router"]
    result = pytester.runpytest(*base)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*tolerance from: default for bfloat16 < ini layer_[*].router*"])
    result = pytester.runpytest(*base, "--parity-tol", "layer_3.router:rel_l2=0.05")
    result.assert_outcomes(failed=3, passed=1)


def test_the_remedy_line_accepts_the_result(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("olmoe")
    edit = faults.scale("post_attention_layernorm", 2, 1.1)
    candidate = faults.edit_checkpoint(tiny_model("olmoe"), pytester.path / "c", edit)
    report = pytester.path / "report"
    args = ["--dtype", "bfloat16", "-m", "post_attn_norm"]
    run_parity(pytester, golden, *args, "--parity-report", str(report), model=candidate).assert_outcomes(
        passed=3, failed=1
    )
    remedy = read_json(report / SUMMARY_FILE)["remedy"]
    assert remedy.startswith("--parity-tol 'layer_2.post_attn_norm:rel_l2=0.1")
    value = remedy.removeprefix("--parity-tol ").strip("'")
    run_parity(pytester, golden, *args, "--parity-tol", value, model=candidate).assert_outcomes(passed=4)


# -- custom tests with the fixtures, reports, JUnit, interruption ----------------------------------


def test_fixtures_for_custom_tests(pytester: pytest.Pytester, golden_dir) -> None:
    pytester.makepyfile(
        test_custom="""
        import pytest
        import torch

        def test_attention_by_hand(golden, candidate, parity):
            rec = golden.load("layer_1.attention")
            out = candidate.call(rec)
            result = parity(rec.output[0], out[0], component="attention")
            assert result.passed and result.main.cosine > 0.999

        @pytest.mark.parity(rel_l2=1e-6)
        def test_too_strict(golden, candidate, parity):
            rec = golden.load("layer_1.post_attn_norm")
            module = candidate.module("layer_1.post_attn_norm")
            with torch.no_grad():
                out = module(rec.args[0].to(candidate.dtype))
            parity(rec.output, out)
        """
    )
    result = run_parity(
        pytester, golden_dir("olmoe"), "test_custom.py", "--dtype", "bfloat16", "-k", "by_hand or strict"
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_too_strict: candidate (bfloat16) diverges*",
            "*rel_l2*<= 1.000e-06*FAIL*",
            "*to accept this result: --parity-tol 'test_too_strict:rel_l2=*'",
        ]
    )


def test_fixtures_skip_without_golden(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_custom="def test_x(golden):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs a golden recording: pass --golden-dir*"])


def test_junit_xml_carries_the_judged_figures(pytester: pytest.Pytester, golden_dir) -> None:
    from pytest_moe_parity.judge.tolerances import JUNIT_FIGURES

    xml = pytester.path / "junit.xml"
    run_parity(pytester, golden_dir("olmoe"), "-m", "logits", f"--junitxml={xml}").assert_outcomes(passed=1)
    text = xml.read_text()
    assert set(JUNIT_FIGURES) >= {"cosine", "rel_l2"}
    assert all(f'name="{name}"' in text for name in JUNIT_FIGURES)
    assert 'name="parity_status" value="passed"' in text


@pytest.mark.parametrize(
    "args, expect",
    [
        (["-n", "2"], "shared"),  # each worker: the cores / 2
        (["-n", "2", "--parity-threads", "3"], 3),
        (["-o", "parity_threads=3"], 3),
        ([], "torch's"),
    ],
    ids=["xdist", "xdist-option", "ini", "serial"],
)
def test_each_process_running_points_takes_its_share_of_the_cores(
    args: list, expect, pytester: pytest.Pytester, golden_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under -n, each worker's intra-op threads are the cores / the workers (more threads than cores
    make every parallel region wait for a time slice); --parity-threads and the ini set them; a
    serial run keeps torch's."""
    import os

    import torch

    pytester.makepyfile(
        probe="""
import os, torch

def pytest_runtest_call(item):
    with open(os.path.join(os.environ["THREADS_OUT"], f"{os.getpid()}.txt"), "w") as fh:
        fh.write(str(torch.get_num_threads()))
"""
    )
    out = pytester.path / "threads"
    out.mkdir()
    monkeypatch.setenv("THREADS_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path), prepend=os.pathsep)
    result = run_parity(
        pytester, golden_dir("olmoe"), "-p", "probe", "-m", "final_norm or embedding", *args, subprocess=True
    )
    assert result.ret == 0, result.stdout.str()
    seen = {int(f.read_text()) for f in out.iterdir()}
    cores = len(os.sched_getaffinity(0))
    wanted = {"shared": max(1, cores // 2), "torch's": torch.get_num_threads()}.get(expect, expect)
    assert seen == {wanted}, (seen, wanted)


def test_a_bad_thread_count_is_a_usage_error(pytester: pytest.Pytester, golden_dir) -> None:
    usage_error(
        run_parity(pytester, golden_dir("olmoe"), "--parity-threads", "0"),
        "--parity-threads / parity_threads: expected a whole number of at least 1, got 0",
    )
    usage_error(
        run_parity(pytester, golden_dir("olmoe"), "-o", "parity_threads=many"),
        "--parity-threads / parity_threads: expected a whole number of at least 1, got 'many'",
    )
