"""The pytest plugin, tested the way pytest plugins are: inner sessions with pytester, on real tiny
models. Clean runs assert that nothing failed; fault injections assert which point failed first."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record.archs import ARCH_TABLE
from pytest_moe_parity.record.tiny import available_archs
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

ALL_ARCHS = available_archs()
# bf16 defaults are calibrated on the seven architectures of the table (phimoe's sparsemixer, for one,
# re-weights experts discontinuously near its threshold: see README, known limits)
ARCHS = sorted(ARCH_TABLE)


def run(pytester: pytest.Pytester, golden: Path, *args: str, model: Path | None = None) -> pytest.RunResult:
    argv = ["--golden-dir", str(golden), "-p", "no:cacheprovider", *args]
    if model is not None:
        argv += ["--model", str(model)]
    return pytester.runpytest(*argv)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# -- clean runs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_fp32_candidate_passes_everything(arch: str, pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir(arch)
    n = len(GoldenStore(golden).point_ids)
    report = pytester.path / "report"
    result = run(pytester, golden, "--parity-report", str(report))
    result.assert_outcomes(passed=n)
    result.stdout.fnmatch_lines([f"{n} points: {n} passed, 0 failed, 0 errors*", "first divergence: none"])
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] is None and summary["failed"] == 0 and summary["passed"] == n
    rows = read_json(report / REPORT_FILE)["points"]
    assert [r["id"] for r in rows] == GoldenStore(golden).point_ids
    # identical weights, same dtype, pinned implementations: the replay is exact
    assert all(m["rel_l2"] == 0 for r in rows for m in r["metrics"].values())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_candidate_passes_at_default_tolerances(
    seed: int, pytester: pytest.Pytester, tiny_model, tmp_path: Path
) -> None:
    """Every architecture, sequence lengths 16 and 64: zero failures at the default tolerances.
    The runs do contain routing disagreements (ties at routers, flips inside whole-layer points):
    they are counted and their tokens excluded, never failed — asserted below, so this test proves
    the flip handling rather than luck."""
    from pytest_moe_parity.record.run import record_golden

    disagreements: dict[str, int] = {}
    for arch in ARCHS:
        model = tiny_model(arch, seed=seed)
        for seq_len in (16, 64):
            golden = tmp_path / f"golden-{arch}-{seq_len}"
            record_golden(model, golden, seq_len=seq_len)
            report = tmp_path / f"report-{arch}-{seq_len}"
            result = run(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report))
            result.assert_outcomes(passed=len(GoldenStore(golden).point_ids))
            result.stdout.fnmatch_lines(["first divergence: none"])
            for row in read_json(report / REPORT_FILE)["points"]:
                if row["routing"]:
                    n = len(row["routing"]["ties"]) + len(row["routing"]["flips"])
                    disagreements[arch] = disagreements.get(arch, 0) + n
    print(f"seed {seed}: routing disagreements handled per architecture: {disagreements}")
    assert sum(disagreements.values()) > 0, "no run exercised the tie/flip handling"


def test_ties_are_counted_and_their_tokens_excluded(pytester: pytest.Pytester, golden_dir, tiny_model) -> None:
    """minimax_m2 at 64 tokens has near-tie routing in bf16: the router passes with the ties
    reported, and the MoE block passes only because the tied tokens are excluded — their own
    error is far above the limit."""
    import torch

    from pytest_moe_parity.backends import BackendOptions
    from pytest_moe_parity.backends.hf import TorchBackend
    from pytest_moe_parity.replay.runner import ParityRunner

    golden = golden_dir("minimax_m2", seq_len=64)
    report = pytester.path / "report"
    run(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report)).assert_outcomes(
        passed=len(GoldenStore(golden).point_ids)
    )
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    tied = {pid: r for pid, r in rows.items() if r["component"] == "router" and r["routing"]["ties"]}
    assert tied, "expected near-tie routing in a bf16 run of this model"
    pid = next(iter(tied))
    layer = rows[pid]["layer"]
    moe = rows[f"layer_{layer}.moe"]
    assert moe["status"] == "passed" and moe["excluded_tokens"]
    # the excluded tokens really differ: judged over them alone, the block would fail
    store = GoldenStore(golden)
    backend = TorchBackend(BackendOptions(store, tiny_model("minimax_m2"), torch.bfloat16))
    runner = ParityRunner(store, lambda: backend, torch.bfloat16)
    cand = backend.run(store.point(f"layer_{layer}.moe"), store.load(f"layer_{layer}.moe"))
    golden_out = store.load(f"layer_{layer}.moe").output.reshape(-1, 64)
    rows_idx = moe["excluded_tokens"]
    diff = (cand.output.float().reshape(-1, 64)[rows_idx] - golden_out[rows_idx]).norm()
    rel = float(diff / golden_out[rows_idx].norm())
    assert rel > runner.tolerance(f"layer_{layer}.moe")[0].rel_l2


# -- fault injection -----------------------------------------------------------------------------


def _used_experts(golden: Path, layer: int) -> tuple[int, int]:
    index = GoldenStore(golden).load(f"layer_{layer}.router").output[2]
    counts = index.flatten().bincount()
    top = counts.argsort(descending=True)
    return int(top[0]), int(top[1])


def _two_input_ids(golden: Path) -> tuple[int, int]:
    ids = GoldenStore(golden).manifest["inputs"]["input_ids"][0]
    a = ids[0]
    b = next(i for i in ids if i != a)
    return a, b


FAULTS = {
    # name: (arch, expected first failing point, edit factory (golden dir) -> (tensor edit, config edit))
    "gate_up_swapped": ("mixtral", "layer_2.experts", lambda g: (faults.swap_gate_up(2), None)),
    "gate_up_swapped_gpt_oss": ("gpt_oss", "layer_2.experts", lambda g: (faults.swap_gate_up(2), None)),
    "two_experts_swapped": (
        "qwen3_moe", "layer_2.experts", lambda g: (faults.swap_experts(2, *_used_experts(g, 2)), None)
    ),
    "router_rows_permuted": ("olmoe", "layer_2.router", lambda g: (faults.permute_router_rows(2), None)),
    "router_rows_permuted_gpt_oss": ("gpt_oss", "layer_1.router", lambda g: (faults.permute_router_rows(1), None)),
    "score_bias_dropped_minimax": ("minimax_m2", "layer_2.router", lambda g: (faults.drop_score_bias(2), None)),
    "score_bias_dropped_deepseek": ("deepseek_v3", "layer_2.router", lambda g: (faults.drop_score_bias(2), None)),
    "post_attn_norm_lost": (
        "qwen2_moe", "layer_2.post_attn_norm",
        lambda g: (faults.lose_weight("model.layers.2.post_attention_layernorm.weight"), None),
    ),
    "input_norm_lost": (
        "minimax_m2", "layer_1.input_norm",
        lambda g: (faults.lose_weight("model.layers.1.input_layernorm.weight"), None),
    ),
    "final_norm_lost": ("deepseek_v3", "final_norm", lambda g: (faults.lose_weight("model.norm.weight"), None)),
    "rope_theta_changed": (
        "mixtral", "rotary", lambda g: (None, lambda c: c["rope_parameters"].update(rope_theta=40000.0))
    ),
    "o_proj_heads_permuted": ("qwen3_moe", "layer_2.attention", lambda g: (faults.permute_o_proj_heads(2, 4), None)),
    "shared_expert_scaled_deepseek": (
        "deepseek_v3", "layer_2.shared_experts", lambda g: (faults.scale("shared_experts.down_proj", 2, 1.5), None)
    ),
    "shared_expert_scaled_qwen2": (
        "qwen2_moe", "layer_2.shared_experts", lambda g: (faults.scale("shared_expert.down_proj", 2, 1.5), None)
    ),
    "embedding_rows_swapped": ("olmoe", "embedding", lambda g: (faults.swap_embedding_rows(*_two_input_ids(g)), None)),
    "lm_head_scaled": ("minimax_m2", "logits", lambda g: (faults.scale("lm_head.weight", None, 1.25), None)),
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_is_caught_at_its_own_point(fault: str, pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    arch, expected, make = FAULTS[fault]
    golden = golden_dir(arch)
    tensor_edit, config_edit = make(golden)
    candidate = pytester.path / "candidate"
    faults.edit_checkpoint(tiny_model(arch), candidate, tensor_edit or (lambda t: None))
    if config_edit:
        faults.edit_config(candidate, config_edit)
    report = pytester.path / "report"
    result = run(pytester, golden, "--dtype", "bfloat16", "-x", "--parity-report", str(report), model=candidate)
    order = GoldenStore(golden).point_ids
    result.assert_outcomes(failed=1, passed=order.index(expected))
    result.stdout.fnmatch_lines([f"first divergence: {expected}*", f"FAILED *parity::{expected} - *"])
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == expected and summary["failed"] == 1
    assert summary["hint"]


def test_failure_text_is_the_diagnosis(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("minimax_m2")
    candidate = faults.edit_checkpoint(tiny_model("minimax_m2"), pytester.path / "c", faults.drop_score_bias(2))
    result = run(pytester, golden, "--dtype", "bfloat16", "-x", model=candidate)
    result.stdout.fnmatch_lines(
        [
            "*layer_2.router: candidate (bfloat16) diverges from the golden (float32)*",
            "*logits: golden (16, 8) float32, candidate (16, 8) bfloat16*",
            "*tensor*metric*value*limit*verdict*",
            "*top_k*flip_share*<= 0.05*FAIL*",
            "*routing: 16 tokens, top-2 of 8 experts, set agreement*real flips*",
            "*token*golden experts*candidate experts*score gap*kind*",
            "*flip",
            "*hint: *score-correction bias*",
        ]
    )


def test_nan_in_candidate_says_where(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("qwen3_moe")
    candidate = faults.edit_checkpoint(tiny_model("qwen3_moe"), pytester.path / "c", faults.poison("o_proj", 1))
    result = run(pytester, golden, "--dtype", "bfloat16", "-x", model=candidate)
    result.assert_outcomes(failed=1, passed=GoldenStore(golden).point_ids.index("layer_1.attention"))
    result.stdout.fnmatch_lines(["*out*finite*FAIL*", "*candidate has * NaN and 0 Inf*first at index (0, *), token *"])
    assert "cosine         nan" not in result.stdout.str()


# -- selection, xdist, --lf / --sw, lazy loading ---------------------------------------------------


def test_k_selects_one_layer_and_reads_only_its_tensors(pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("mixtral", layers=12)
    report = pytester.path / "report"
    result = run(pytester, golden, "-k", "layer_1.", "--parity-report", str(report), "-v")
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines(["*parity::layer_1.input_norm PASSED*", "*parity::layer_1.output PASSED*"])
    assert "layer_10." not in result.stdout.str() and "layer_11." not in result.stdout.str()
    summary = read_json(report / SUMMARY_FILE)
    assert summary["golden_files_read"] == ["layer_1.safetensors"]
    reads = summary["candidate_reads"]
    assert reads["units"] == ["layer_1"]
    assert reads["keys"] and all(".layers.1." in k for k in reads["keys"])


def test_markers_and_keyword_combinations(pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("qwen2_moe")
    run(pytester, golden, "-m", "router").assert_outcomes(passed=4)
    run(pytester, golden, "-m", "shared_experts or experts").assert_outcomes(passed=8)
    run(pytester, golden, "-k", "layer_3 and experts").assert_outcomes(passed=2)  # experts, shared_experts


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_outcomes_with_and_without_xdist(xdist, pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), pytester.path / "c", faults.swap_gate_up(1))
    report = pytester.path / "report"
    result = run(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report), *xdist, model=candidate)
    n = len(GoldenStore(golden).point_ids)
    # experts and the MoE block of layer 1 fail; the rest gets golden inputs and passes (the whole
    # layer passes too: in this tiny model the MoE adds ~1e-3 to a residual stream of ~1)
    result.assert_outcomes(failed=2, passed=n - 2)
    result.stdout.fnmatch_lines(["first divergence: layer_1.experts*"])
    rows = read_json(report / REPORT_FILE)["points"]
    assert [r["id"] for r in rows if r["status"] == "failed"] == ["layer_1.experts", "layer_1.moe"]
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_1.experts"


def test_last_failed_and_stepwise(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    golden = golden_dir("olmoe")
    candidate = faults.edit_checkpoint(tiny_model("olmoe"), pytester.path / "c", faults.permute_router_rows(2))
    base = ["--golden-dir", str(golden), "--model", str(candidate), "--dtype", "bfloat16"]
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
    run(pytester, golden).assert_outcomes(passed=n)  # no path: parity items only
    run(pytester, golden, "test_mine.py").assert_outcomes(passed=n + 1)


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
    assert "--golden-dir" in help_text and "--parity-tol" in help_text


# -- bad input -------------------------------------------------------------------------------------


def _usage_error(result: pytest.RunResult, message: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    err = result.stderr.str()
    assert message in err, err
    assert "INTERNALERROR" not in err + result.stdout.str() and "Traceback" not in err


def test_invalid_golden_dir(pytester: pytest.Pytester, tmp_path: Path) -> None:
    _usage_error(pytester.runpytest("--golden-dir", str(tmp_path)), "manifest.json is missing")
    _usage_error(pytester.runpytest("--golden-dir", str(tmp_path / "nope")), "does not exist")


def test_unknown_hw_lists_the_available(pytester: pytest.Pytester, golden_dir) -> None:
    _usage_error(
        run(pytester, golden_dir("olmoe"), "--hw", "tpu"), "--hw 'tpu' is not a known backend; available: cpu, cuda"
    )


def test_candidate_config_mismatch_lists_differences(pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    result = run(pytester, golden_dir("mixtral"), model=tiny_model("mixtral", layers=3))
    _usage_error(result, "does not match the golden's model: num_hidden_layers: golden 4, candidate 3")
    result = run(pytester, golden_dir("mixtral"), model=tiny_model("qwen3_moe"))
    _usage_error(result, "model_type: golden 'mixtral', candidate 'qwen3_moe'")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtype", "int8"], "--dtype 'int8' is not a floating-point torch dtype"),
        (["--parity-tol", "layer_*:cosine"], "malformed tolerance 'cosine'"),
        (["--parity-tol", "layer_*:speed=3"], "unknown tolerance key 'speed'"),
        (["--parity-tol", "cosine=1.5"], "must be between 0 and 1"),
        (["--model", "/nonexistent/model"], "candidate checkpoint directory does not exist"),
    ],
)
def test_bad_options_are_usage_errors(args, message, pytester: pytest.Pytester, golden_dir) -> None:
    _usage_error(run(pytester, golden_dir("olmoe"), *args), message)


def test_bad_marker_and_ini(pytester: pytest.Pytester, golden_dir) -> None:
    pytester.makepyfile(
        test_custom="""
        import pytest

        @pytest.mark.parity(cosine=0.99, speed=2)
        def test_x(parity):
            pass
        """
    )
    _usage_error(run(pytester, golden_dir("olmoe"), "test_custom.py"), "unknown tolerance key 'speed'")
    ini = pytester.makeini("[pytest]\nparity_tolerances =\n    layer_*:rel_l2=abc\n")
    result = run(pytester, golden_dir("olmoe"), "-c", str(ini))
    _usage_error(result, "parity_tolerances (ini): tolerance rel_l2='abc' is not a number")


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
    result = run(pytester, golden_dir("olmoe"), "test_custom.py", "--dtype", "bfloat16", "-k", "by_hand or strict")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_too_strict: candidate (bfloat16) diverges*", "*rel_l2*<= 1.000e-06*FAIL*"])


def test_fixtures_skip_without_golden(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_custom="def test_x(golden):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs a golden recording: pass --golden-dir*"])


def test_junit_xml_carries_metrics(pytester: pytest.Pytester, golden_dir) -> None:
    xml = pytester.path / "junit.xml"
    run(pytester, golden_dir("olmoe"), "-m", "logits", f"--junitxml={xml}").assert_outcomes(passed=1)
    text = xml.read_text()
    assert 'name="cosine"' in text and 'name="rel_l2"' in text and 'name="parity_status" value="passed"' in text


def test_interrupted_run_leaves_no_half_written_report(pytester: pytest.Pytester, golden_dir, monkeypatch) -> None:
    from pytest_moe_parity import backends
    from pytest_moe_parity.backends.hf import TorchBackend

    class Interrupting(TorchBackend):
        name = "interrupting"

        def run(self, point, golden):
            if point["id"] == "layer_2.attention":
                raise KeyboardInterrupt
            return super().run(point, golden)

    monkeypatch.setitem(backends.BUILTIN_BACKENDS, "interrupting", Interrupting)
    report = pytester.path / "report"
    argv = ["--golden-dir", str(golden_dir("olmoe")), "--hw", "interrupting", "--parity-report", str(report)]
    result = pytester.runpytest(*argv, "-p", "no:cacheprovider", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    summary = read_json(report / SUMMARY_FILE)  # complete JSON, marked incomplete
    assert summary["complete"] is False and summary["failed"] == 0
    assert not list(report.glob(".*tmp*"))


def test_third_party_backend_shape_mismatch_and_crash(pytester: pytest.Pytester, golden_dir, monkeypatch) -> None:
    """The backend interface: a backend returning a wrong shape fails that point with both shapes;
    one that raises gives an error for that point only — never an INTERNALERROR."""
    from pytest_moe_parity import backends
    from pytest_moe_parity.backends.hf import TorchBackend

    class Sloppy(TorchBackend):
        name = "sloppy"

        def run(self, point, golden):
            out = super().run(point, golden)
            if point["id"] == "layer_1.post_attn_norm":
                out.output = out.output[:, :-1]
            if point["id"] == "layer_2.post_attn_norm":
                raise RuntimeError("device lost")
            return out

    monkeypatch.setitem(backends.BUILTIN_BACKENDS, "sloppy", Sloppy)
    report = pytester.path / "report"
    result = run(
        pytester, golden_dir("olmoe"), "--hw", "sloppy", "-m", "post_attn_norm", "--parity-report", str(report)
    )
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        ["*out: shape mismatch: golden (1, 16, 64) vs candidate (1, 15, 64)*", "*RuntimeError: device lost*"]
    )
    assert "INTERNALERROR" not in result.stdout.str()
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == "layer_1.post_attn_norm" and summary["error"] == 1
