"""`--hw vllm` on DeepSeek-V3 (vLLM's `DeepseekV3ForCausalLM`): its MLA attention on vLLM's CPU MLA backend
over a latent paged cache, the dense first layer's MLP, its DeepseekV2MoE (gate with the score-correction
bias, grouped top-k, routed experts on the golden's routing, shared experts), prefill and two decode steps.

vLLM's CPU MLA decode kernel takes a latent row of 576 only (kv_lora_rank 512 + qk_rope_head_dim 64), so the
checkpoint is recorded here at those dims; its config carries DeepSeek's `topk_method` and `scoring_func`,
which vLLM's DeepseekV2MoE routes by (transformers does not write them). With DeepSeek-V3's own YaRN rotary
every point passes; with the plain rotary vLLM's CPU rotary kernel is a divergence of its own. Cost on 2
cores: two recordings of about 20 s, then 3 to 7 s an inner session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import read_json, run_parity, usage_error
from vllm_helpers import loading_through, patched, rows_of
from vllm_helpers import vllm_parity as parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

# the dims vLLM's CPU MLA kernels take, and the routing keys of DeepSeek's own config
MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "qk_head_dim": 80}
ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# DeepSeek-V3's own rotary scaling (YaRN; vLLM's DeepseekScalingRotaryEmbedding), at the tiny model's lengths
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
MODEL = "vllm.model_executor.models.deepseek_v2"  # DeepseekV3ForCausalLM takes DeepseekV2ForCausalLM's loader


@pytest.fixture(scope="session")
def deepseek(recorded: Callable[..., Path]) -> Path:
    """A tiny DeepSeek-V3 (the first leg's config, 4 layers, the first dense) at the dims vLLM's CPU MLA takes,
    with DeepSeek-V3's YaRN rotary."""
    return recorded("deepseek_v3", **MLA, **ROUTING, rope_parameters=YARN)


@pytest.fixture(scope="session")
def deepseek_default_rope(recorded: Callable[..., Path]) -> Path:
    """The same with the first leg's plain rotary (`rope_type: default`: vLLM's RotaryEmbedding, whose CPU
    forward is its C++ kernel)."""
    return recorded("deepseek_v3", **MLA, **ROUTING)


def flat_rotary(pytester: pytest.Pytester) -> None:
    """vLLM's CPU rotary kernel (`vllm._custom_ops.rotary_embedding`, in place) given the query and key as the
    2-D [tokens, heads x dim] tensors it reads, each copied back into the view it came from, for one inner
    session (vLLM keeps its rotary modules across model builds, `get_rope`'s cache: the op is what changes)."""
    flat = """def flat(positions, query, key, head_size, *rest):
    q, k = (t.reshape(t.shape[0], -1).clone() for t in (query, key))
    original(positions, q, k, head_size, *rest)
    query.copy_(q.view_as(query))
    key.copy_(k.view_as(key))"""
    patched(pytester, "vllm._custom_ops", "rotary_embedding", "flat", flat)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_s_deepseek_passes_every_point(
    dtype: str, deepseek: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point of the golden runs on vLLM's module for it and passes, prefill and decode: the MLA attention
    (a decode step's latent cache compared after the call), the dense MLP, the router, experts, shared experts
    and MoE block of the sparse layers, the decoder layers."""
    report = tmp_path / "r"
    result = parity(pytester, deepseek, report, "--dtype", dtype)
    ids = GoldenStore(deepseek / "golden").point_ids
    assert {"layer_0.mlp", "layer_1.shared_experts", "step_2.layer_3.router"} <= set(ids)
    result.assert_outcomes(passed=len(ids))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None
    assert {"cache.keys", "cache.values"} <= set(rows_of(report)["step_2.layer_3.attention"]["metrics"])
    result.stdout.fnmatch_lines(["--hw vllm: vLLM 0.32*'s DeepseekV3ForCausalLM built by vLLM's loader on cpu in *"])


def test_vllm_s_cpu_rotary_kernel_is_its_mla_attention_s_divergence_in_float32(
    deepseek_default_rope: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """With the plain rotary (`rope_type: default`), in float32, vLLM's MLA attention leaves the golden at every
    layer, prefill and decode, and nothing else does: its CPU rotary kernel takes the [tokens, heads, rope_dim]
    query and [tokens, 1, rope_dim] key views MLA gives it as 2-D [tokens, heads x dim] tensors (heads counted
    as tokens, each with the position of its row index; the key stepped by its head stride). With the same
    kernel given them as 2-D tensors (an inner session of its own), every point passes."""
    ids = GoldenStore(deepseek_default_rope / "golden").point_ids
    mixing = [p for p in ids if p.rsplit(".", 1)[-1] in ("attention", "output")]
    report = tmp_path / "kernel"
    parity(pytester, deepseek_default_rope, report).assert_outcomes(passed=len(ids) - len(mixing), failed=len(mixing))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_0.attention"
    rows = rows_of(report)
    assert rows["step_1.layer_0.attention"]["metrics"]["cache.keys"]["rel_l2"] < 1e-6  # the latent: not roped
    flat_rotary(pytester)
    report = tmp_path / "flat"
    parity(pytester, deepseek_default_rope, report).assert_outcomes(passed=len(ids))
    assert rows_of(report)["step_2.layer_3.attention"]["metrics"]["out"]["rel_l2"] < 1e-5


def test_a_dropped_routing_bias_fails_first_at_that_layer_s_router(
    deepseek: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Layer 2's `e_score_correction_bias` loaded as zeros: vLLM's grouped top-k of that layer picks other
    experts; its router is the first divergence, the routers before it pass."""
    key = "model.layers.2.mlp.gate.e_score_correction_bias"
    change = f"def change(k, t):\n    return k, (torch.zeros_like(t) if k == {key!r} else t)"
    loading_through(pytester, MODEL, "DeepseekV2ForCausalLM", change)
    report = tmp_path / "r"
    result = parity(pytester, deepseek, report)
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_2.router"
    rows = rows_of(report)
    assert rows["layer_1.router"]["status"] == "passed" and rows["layer_2.experts"]["status"] == "passed"
    result.stdout.fnmatch_lines(["first divergence: layer_2.router*"])


def test_a_deepseek_config_without_its_routing_keys_is_a_usage_error(t5: Path, pytester: pytest.Pytester) -> None:
    """The first leg's DeepSeek-V3 (written by transformers, which keeps no topk_method or scoring_func): vLLM
    would route it by softmax without its score-correction bias; one sentence, before any test."""
    result = run_parity(pytester, t5 / "deepseek_v3-golden", "--hw", "vllm", model=t5 / "deepseek_v3-model")
    usage_error(result, "vLLM's DeepseekV2MoE routes DeepSeek-V3 by its config's topk_method and scoring_func")
