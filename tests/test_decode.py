"""Decode steps with a KV cache: recorded after the prefill as `step_k.*` points, the cache each module
reads stored as tensors; replayed on a cache of the candidate's kind, the cache write compared."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import faults
import pytest
import torch
from helpers import TABLE_ARCHS, assert_replays_bitwise, cache_kwarg, cli, load_fp32, read_json, run_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE
from pytest_moe_parity.report.rows import Row
from pytest_moe_parity.report.summary import decode_line
from pytest_moe_parity.tree import CacheState

pytestmark = pytest.mark.usefixtures("_import_everything_once")

SEQ = 12
STEPS = 3


@pytest.mark.parametrize("arch", TABLE_ARCHS)
def test_decode_steps_replay_bitwise_on_a_rebuilt_cache(arch: str, golden_dir, tiny_model) -> None:
    golden = golden_dir(arch, seq_len=SEQ, decode=STEPS)
    store = GoldenStore(golden)
    prefill = [p for p in store.points if p.step is None]
    assert store.decode_steps == STEPS and len(store.manifest["decode"]["tokens"]) == STEPS
    for step in range(1, STEPS + 1):  # every prefill point again at every step, in forward order after it
        assert [p.id for p in store.points if p.step == step] == [f"step_{step}.{p.id}" for p in prefill]
    assert [p.order for p in store.points] == sorted(p.order for p in store.points)
    rec = store.load(f"step_{STEPS}.layer_0.attention")
    state = rec.kwargs[cache_kwarg(rec.kwargs)]
    assert isinstance(state, CacheState) and state.layer == 0
    if state.window is None:  # the cache the step reads: the prefill and the steps before it
        assert state.keys.shape[-2] == SEQ + STEPS - 1
    else:  # gpt_oss's sliding layer keeps window - 1 positions of the SEQ + STEPS - 1 seen
        assert (state.keys.shape[-2], state.seen) == (state.window - 1, SEQ + STEPS - 1)
    assert rec.extras["cache_after.keys"].shape[-2] in (state.keys.shape[-2], state.keys.shape[-2] + 1)
    assert_replays_bitwise(golden, load_fp32(tiny_model(arch)))


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_a_clean_bf16_decode_passes_every_step(arch: str, pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir(arch, seq_len=SEQ, decode=STEPS)
    steps = [p for p in GoldenStore(golden).points if p.step is not None]
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-k", "step_", "--parity-report", str(report))
    result.assert_outcomes(passed=len(steps))
    result.stdout.fnmatch_lines([f"decode: the next token agrees with the golden at every step judged ({STEPS})"])
    rows = read_json(report / REPORT_FILE)["points"]
    attention = [r for r in rows if r["component"] == "attention"]
    assert len(attention) == STEPS * len({p.layer for p in steps if p.layer is not None})
    assert all(set(r["metrics"]) == {"out", "cache.keys", "cache.values"} for r in attention)
    assert read_json(report / SUMMARY_FILE)["first_decode_step_differing"] is None


@pytest.mark.parametrize(
    ("fault", "failing"),
    [
        # the step's output is right (full attention reads the same keys); the write is not
        ("decode_cache_written_one_early", {"cache.keys", "cache.values"}),
        # the new token's query and key unrotated: the output and the keys written
        ("decode_new_token_at_position_0", {"out", "cache.keys"}),
    ],
)
def test_decode_faults_fail_first_at_the_first_steps_attention(
    fault: str, failing: set[str], pytester: pytest.Pytester, golden_dir
) -> None:
    golden = golden_dir("qwen3_moe", seq_len=SEQ, decode=STEPS)
    report = pytester.path / "report"
    with faults.code_fault(fault):
        result = run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-report", str(report))
    rows = read_json(report / REPORT_FILE)["points"]
    assert all(r["status"] == "passed" for r in rows if r["step"] is None)  # prefill never sees it
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed[0]["id"] == "step_1.layer_0.attention"
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "step_1.layer_0.attention"
    assert {c["target"] for c in failed[0]["checks"] if not c["passed"]} == failing
    assert {r["component"] for r in failed} <= {"attention", "post_attn_norm", "router", "experts", "moe",
                                                "output", "input_norm", "final_norm", "logits"}  # fmt: skip
    if fault == "decode_cache_written_one_early":
        # the two positions swapped at step 1: the last prefill token's and the new one's
        assert {t for t, _ in failed[0]["worst_tokens"][:2]} == {SEQ - 1, SEQ}
        assert {r["id"] for r in failed} == {f"step_{k}.layer_{i}.attention" for k in (1, 2, 3) for i in range(4)}
    result.stdout.fnmatch_lines(["first divergence: step_1.layer_0.attention*"])


def test_a_decode_mask_that_hides_the_last_entry_fails_chained_at_the_first_steps_attention(
    pytester: pytest.Pytester, golden_dir
) -> None:
    """The mask is a golden input of every isolated point, so only the candidate's own decode (its
    own cache, masks and positions over the steps) shows a mask builder that is wrong in decode."""
    golden = golden_dir("qwen3_moe", seq_len=SEQ, noise="bfloat16", decode=STEPS)
    report = pytester.path / "report"
    with faults.code_fault("decode_mask_hides_last_entry"):
        result = run_parity(
            pytester, golden, "--dtype", "bfloat16", "--parity-mode", "both", "--parity-report", str(report)
        )
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_isolated_divergence"] is None
    assert summary["first_chain_divergence"] == "step_1.layer_0.attention"
    rows = read_json(report / REPORT_FILE)["points"]
    assert all(r["verdicts"] == {"isolated": "passed", "chain": "passed"} for r in rows if r["step"] is None)
    result.stdout.fnmatch_lines(["first chain divergence: step_1.layer_0.attention"])


def test_a_clean_bf16_decode_chain_passes_under_the_noise_verdict(pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("qwen3_moe", seq_len=SEQ, noise="bfloat16", decode=STEPS)
    report = pytester.path / "report"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-mode", "chain", "--parity-report", str(report)
    )
    rows = read_json(report / REPORT_FILE)["points"]
    result.assert_outcomes(passed=len(rows))
    steps = [r for r in rows if r["step"] is not None]
    assert steps and all(r["mode"] == "chain" and r["noise"] is not None for r in steps)


def test_k_for_a_step_the_golden_lacks_says_so(pytester: pytest.Pytester, golden_dir) -> None:
    result = run_parity(pytester, golden_dir("qwen3_moe"), "-k", "step_1")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(
        [
            "-k 'step_1' asks for step_1; this golden has no decode steps "
            "(record them with `moe-parity golden ... --decode-steps N` or `--decode-at POSITIONS`)"
        ]
    )


def test_compiled_backends_skip_the_points_that_read_the_cache(
    pytester: pytest.Pytester, golden_dir, cache_dir: Path
) -> None:
    golden = golden_dir("qwen3_moe", seq_len=SEQ, decode=STEPS)
    result = run_parity(
        pytester, golden, "--hw", "trace", "--hw-option", f"cache_dir={cache_dir}", "--dtype", "bfloat16",
        "-k", "step_1 and layer_0", "-rs",
    )  # fmt: skip
    result.assert_outcomes(passed=5, skipped=2)  # attention and the whole layer read the cache
    result.stdout.fnmatch_lines(
        [
            "SKIPPED*step_1.layer_0.attention reads the KV cache: compiled decode graphs * are not built yet; "
            "replay decode steps with --hw cpu or cuda"
        ]
    )


def test_golden_cli_records_decode_steps(tmp_path: Path, tiny_model, capsys) -> None:
    model = tiny_model("qwen3_moe")
    code, _, err = cli(capsys, "golden", "--model", model, "--out", tmp_path / "g", "--decode-steps", "0")
    assert code == 2 and "argument --decode-steps: expected a whole number of at least 1, got 0" in err
    code, out, _ = cli(capsys, "golden", "--model", model, "--out", tmp_path / "g", "--decode-steps", "2", "-q")
    assert code == 0 and ", prefill and 2 decode steps (positions 16-17), " in out  # the default 16 tokens
    code, out, _ = cli(capsys, "show", tmp_path / "g", "--inputs")
    assert code == 0
    shown = r"kwargs\.(cache|past_key_values) +KV cache of layer 0: keys and values \(1, 2, 16, 16\)"
    assert re.search(shown, out), out


def _logits_row(step: int | None, flips: list[dict], ties: list[dict]) -> Row:
    return Row.from_json({
        "id": f"step_{step}.logits", "component": "logits", "step": step, "candidate_dtype": "bfloat16",
        "logits": {"top1": {"flips": flips, "ties": ties}}, "status": "passed",
    })  # fmt: skip


def test_the_decode_line_names_the_first_step_whose_next_token_differs() -> None:
    tie = {"token": 0, "golden_experts": [7], "candidate_experts": [9], "gap": 0.004, "is_tie": True}
    flip = {**tie, "gap": 0.5, "is_tie": False}
    rows = [_logits_row(1, [], []), _logits_row(2, [], [tie]), _logits_row(3, [flip], [])]
    assert decode_line(rows) == (
        "decode: the next token first differs at step_2 (golden 7, candidate 9, golden logit gap 0.004): "
        "a tie within bfloat16 rounding, not a failure",
        None,
    )
    assert decode_line([rows[0], rows[2]]) == (
        "decode: the next token first differs at step_3 (golden 7, candidate 9, golden logit gap 0.5)",
        "red",
    )
    assert decode_line(rows[:1]) == ("decode: the next token agrees with the golden at every step judged (1)", "green")
    assert decode_line([_logits_row(None, [], [])]) is None  # no decode steps: no line


def test_a_hybrid_cache_without_keys_and_values_is_refused_before_recording(tmp_path: Path, tiny_model, capsys) -> None:
    out = tmp_path / "g"
    code, _, err = cli(capsys, "golden", "--model", tiny_model("jamba"), "--out", out, "--decode-steps", "1")
    assert code == 2 and "Traceback" not in err
    assert "--decode-steps: this model's cache has LinearAttentionLayer layers (a recurrent state" in err
    assert not (out / "manifest.json").exists() and not list(out.glob("*.safetensors"))


def test_a_decode_steps_left_out_token_is_counted_among_the_steps_own_tokens(golden_dir, tiny_model) -> None:
    """A decode step's tensors have one row per sequence: a token routed elsewhere at an earlier layer
    of the step is token 0 of its step, and the left-out rows are counted against that one token."""
    from helpers import session

    golden = golden_dir("qwen3_moe", seq_len=SEQ, decode=STEPS)
    chain = session(golden, tiny_model("qwen3_moe"), mode="chain").runner.chain
    chain.steered = False  # as a whole-model run that cannot be steered: later tokens are left out too
    store = GoldenStore(golden)
    routed = {"step_2.layer_0.router": [0], "layer_0.router": [5]}
    chain._taint = {p.id: routed.get(p.id, []) for p in store.points if p.component in ("router", "moe", "output")}
    step = store.point("step_2.layer_1.attention")
    assert (chain.tainted(step), chain.tokens(step)) == ([0], 1)
    prefill = store.point("layer_1.attention")
    assert (chain.tainted(prefill), chain.tokens(prefill)) == (list(range(5, SEQ)), SEQ)
    assert chain.tainted(store.point("step_2.layer_0.attention")) == []  # its own layer's routing comes later


def test_a_recorded_cache_is_passed_by_the_name_the_module_takes() -> None:
    """transformers 5.24 renamed a call's KV cache from `past_key_values` to `cache` (the old name
    deprecated): a golden of either version replays on the other, its cache passed by the name the
    candidate's module takes, through transformers' deprecation wrapper too."""
    from torch import nn
    from transformers.utils.deprecation import deprecate_kwarg

    from pytest_moe_parity.model.calls import cache_kwarg, with_cache_kwarg

    class Before(nn.Module):
        def forward(self, hidden_states, past_key_values=None, **kwargs):
            return hidden_states

    class After(nn.Module):
        @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
        def forward(self, hidden_states, cache=None, **kwargs):
            return hidden_states

    state = CacheState(0, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    assert (cache_kwarg(Before()), cache_kwarg(After())) == ("past_key_values", "cache")
    assert with_cache_kwarg(After(), {"x": 1, "past_key_values": state}) == {"x": 1, "cache": state}
    assert with_cache_kwarg(Before(), {"cache": None, "y": False}) == {"past_key_values": None, "y": False}
    assert with_cache_kwarg(After(), {"cache": state}) == {"cache": state}
    assert with_cache_kwarg(Before(), {"hidden_states": 1}) == {"hidden_states": 1}


# -- decode where it breaks: --decode-at ----------------------------------------------------------


@pytest.fixture(scope="module")
def past_512(tiny_model, tmp_path_factory) -> Path:
    """A golden whose decode steps land at positions 511, 512 and 513 (a 511-token prefill), of a
    tiny qwen3_moe whose context reaches 1024."""
    from pytest_moe_parity.record.run import record_golden

    out = tmp_path_factory.mktemp("decode-at") / "golden"
    record_golden(tiny_model("qwen3_moe", max_position_embeddings=1024), out, decode_at="511,512,513")
    return out


def test_decode_at_sizes_the_prefill_so_the_steps_land_there(past_512: Path) -> None:
    store = GoldenStore(past_512)
    assert store.prefill_tokens == 511 and store.recorded_steps == [1, 2, 3]
    assert [store.position(f"step_{k}.layer_0.attention") for k in (1, 2, 3)] == [511, 512, 513]
    assert store.position("layer_0.attention") is None
    assert store.describe_steps() == "3 decode steps (positions 511-513)"
    state = store.load("step_2.layer_0.attention").kwargs
    assert next(v for v in state.values() if isinstance(v, CacheState)).keys.shape[-2] == 512  # the past it reads


def test_a_decode_bug_past_position_512_fails_at_that_steps_attention(
    past_512: Path, pytester: pytest.Pytester
) -> None:
    """A decode graph whose RoPE table ends at position 512: the prefill and step_1 (position 511)
    pass, and the first failure is step_2's attention (pos 512)."""
    report = pytester.path / "report"
    with faults.code_fault("decode_rope_table_ends_at_512"):
        result = run_parity(pytester, past_512, "--dtype", "bfloat16", "--parity-report", str(report))
    rows = read_json(report / REPORT_FILE)["points"]
    assert all(r["status"] == "passed" for r in rows if r["step"] in (None, 1))
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed[0]["id"] == "step_2.layer_0.attention" and failed[0]["position"] == 512
    assert {r["step"] for r in failed} == {2, 3}
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "step_2.layer_0.attention"
    result.stdout.fnmatch_lines(
        [
            "moe-parity: golden * 511 tokens, then 3 decode steps (positions 511-513), float32)*",
            "step_2.layer_0.attention (pos 512): candidate (bfloat16) diverges from the golden (float32)",
            "first divergence: step_2.layer_0.attention*",
        ]
    )


def test_a_clean_run_of_decode_at_passes_every_step(past_512: Path, pytester: pytest.Pytester) -> None:
    report = pytester.path / "report"
    result = run_parity(pytester, past_512, "--dtype", "bfloat16", "-k", "step_", "--parity-report", str(report))
    result.assert_outcomes(passed=3 * 32)
    rows = read_json(report / REPORT_FILE)["points"]
    assert {r["step"]: r["position"] for r in rows} == {1: 511, 2: 512, 3: 513}


def test_decode_at_records_only_the_steps_asked_for_and_the_chain_runs_those_between(
    tmp_path: Path, tiny_model, pytester: pytest.Pytester, capsys
) -> None:
    """Positions apart: the steps between are run for their cache, not recorded; --decode-steps adds
    the first steps; a chained run decodes every step with the golden's tokens and judges those kept."""
    golden = tmp_path / "golden"
    code, out, _ = cli(capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", golden, "--seq-len", "8",
                       "--decode-steps", "1", "--decode-at", "10,13")  # fmt: skip
    assert code == 0
    assert "prefill and 3 of 6 decode steps (positions 8, 10, 13)" in out
    store = GoldenStore(golden)
    assert store.recorded_steps == [1, 3, 6] and store.decode_steps == len(store.decode_tokens) == 6
    assert sorted({p.step for p in store.points if p.step}) == [1, 3, 6]
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "--parity-mode", "chain", "-k", "step_", "--parity-report", str(report))
    result.assert_outcomes(passed=3 * 32)
    rows = read_json(report / REPORT_FILE)["points"]
    assert {r["position"] for r in rows} == {8, 10, 13} and all(r["mode"] == "chain" for r in rows)
    result = run_parity(pytester, golden, "-k", "step_2")
    result.stdout.fnmatch_lines(["*asks for step_2; this golden has decode steps 1, 3, 6*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode-at", "513,512"], "--decode-at 513,512: positions must increase (512 comes after 513)*"),
        (["--decode-at", "12,x"], "--decode-at: 'x' is not a token position*"),
        (["--decode-at", "600"], "--decode-at 600 is beyond the model's context of 512 tokens*"),
        (["--decode-at", "4", "--seq-len", "8"], "--decode-at 4 lies inside the prefill of 8 tokens (positions 0-7)*"),
        (["--decode-at", "0"], "--decode-at 0: a decode step follows at least one prompt token*"),
    ],
)
def test_decode_at_bad_input_says_so_in_one_line(
    args: list[str], message: str, tmp_path: Path, tiny_model, capsys
) -> None:
    out = tmp_path / "golden"
    code, _, err = cli(capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", out, *args)
    assert code == 2 and not out.exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fnmatch.fnmatch(lines[0], f"moe-parity: error: {message}"), err


def test_the_drill_names_the_op_that_breaks_past_position_512(
    past_512: Path, pytester: pytest.Pytester, tmp_path: Path, capsys
) -> None:
    """Below the failing step's attention, with the reference's ops stored first (`drill-ops`: the
    code fault patches transformers, so the reference cannot be captured beside it): the first op
    that leaves the reference's is the new token's rotation, at step 2 only."""
    import shutil

    golden = tmp_path / "golden"
    shutil.copytree(past_512, golden)  # drill-ops writes beside the golden's points
    model = Path(GoldenStore(past_512).manifest["model"]["path"])
    code, _, err = cli(capsys, "drill-ops", golden, "--points", "step_*.layer_0.attention", "--dtype", "bfloat16",
                       "--model", model)  # fmt: skip
    assert code == 0, err
    with faults.code_fault("decode_rope_table_ends_at_512"):
        result = run_parity(pytester, golden, "--dtype", "bfloat16", "-k", "layer_0.attention and step_",
                            "--parity-drill", "step_*.layer_0.attention", model=model)  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "drill step_1.layer_0.attention: * 0 failed; no culprit",
            "drill step_2.layer_0.attention: * failed; culprit apply_rotary_pos_emb.mul, *",
        ]
    )
