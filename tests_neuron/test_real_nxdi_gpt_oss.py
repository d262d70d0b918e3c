"""`--hw nxdi --hw-option build=cpu` on NxDI's real GPT-OSS (modules/gpt_oss.json): a tiny GPT-OSS in the
hub's MXFP4 layout (the only layout NxDI's GPT-OSS conversion reads), sliding and full attention layers
alternating, prefill and two decode steps, at TP 1 and 2, in float32 and bfloat16; its experts through NxDI's
own conversion (the MXFP4 blocks dequantized on the bf16-compute path NxDI's CPU run takes); a conversion that
loses what GPT-OSS has and other MoEs lack (expert biases, attention sinks) failing first at its point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import read_json, run_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

CPU = ("--hw", "nxdi", "--hw-option", "build=cpu")
ROTARY = "NxDI computes the rotary embedding (GptOssRotaryEmbedding, YaRN) inside each attention module"


def _paths(t5: Path) -> tuple[Path, Path]:
    return t5 / "gpt_oss-golden", t5 / "gpt_oss-model"


def test_the_tiny_model_has_sliding_and_full_layers_and_mxfp4_experts(t5: Path) -> None:
    """What the clean runs below cover: both attention kinds (a window shorter than the prompt, so the
    sliding layers' masks and caches really slide) and the hub's MXFP4 experts."""
    golden, model = _paths(t5)
    config = json.loads((model / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    store = GoldenStore(golden)
    assert config["sliding_window"] < len(store.manifest["inputs"]["input_ids"][0])
    sliding = store.load("step_1.layer_0.attention").kwargs["cache"]
    assert (sliding.window, sliding.keys.shape[2]) == (config["sliding_window"], config["sliding_window"] - 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_clean_run_passes_every_point_on_nxdi_s_gpt_oss(
    tp: int, dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point but the rotary embedding (inside NxDI's attention) is NxDI's own GPT-OSS module and
    passes: attention with sinks on sliding and full layers, the router's softmax over its top-k logits
    with its bias, the experts' clamped SwiGLU with their biases, the decoder layer; the decode steps on
    NxDI's token-generation path, a sliding layer fed the window its cache keeps; the cache write
    compared at TP 1 (at TP 2 each rank holds its own heads)."""
    golden, model = _paths(t5)
    report = tmp_path / "r"
    args = ("--hw-option", f"tp_degree={tp}", "--dtype", dtype, "--parity-report", str(report), "-W", "error")
    result = run_parity(pytester, golden, *CPU, *args, model=model)
    ids = GoldenStore(golden).point_ids
    rotary = [p for p in ids if p.endswith("rotary")]
    assert len(rotary) == 3  # the prefill's and each decode step's: the only points not built
    result.assert_outcomes(passed=len(ids) - len(rotary), skipped=len(rotary))
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert ROTARY in rows["rotary"]["reason"]
    for layer in (0, 1):  # sliding, full
        written = {"cache.keys", "cache.values"} <= set(rows[f"step_2.layer_{layer}.attention"]["metrics"])
        assert written == (tp == 1)
    assert rows["layer_0.experts"]["backend"]["nxdi_module"] == "layers.0.feed_forward"


def test_the_mxfp4_experts_go_through_nxdi_s_own_conversion(t5: Path) -> None:
    """The unit NxDI's conversion made of layer 1: its experts are the checkpoint's MXFP4 blocks times
    their exponents (dequantized by NxDI's convert_moe_packed_tensors, as transformers reads them), gate
    and up de-interleaved into NxDI's halves, the biases and the sinks carried over, the blocks gone."""
    from helpers import session
    from safetensors import safe_open

    from pytest_moe_parity.model.checkpoint import weight_map
    from pytest_moe_parity.model.quant import mxfp4_dequantize

    golden, model = _paths(t5)
    files = weight_map(model)

    def tensor(name: str) -> torch.Tensor:
        with safe_open(str(model / files[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    run = session(golden, model, hw="nxdi", hw_options=["build=cpu"])
    try:
        converted = run.runner.backend._unit(1)
    finally:
        run.close()
    assert not [k for k in converted if k.endswith(("_blocks", "_scales"))]
    hf = "model.layers.1.mlp.experts."
    op = "layers.0.feed_forward.moe.expert_mlps.mlp_op."
    gate_up = mxfp4_dequantize(tensor(hf + "gate_up_proj_blocks"), tensor(hf + "gate_up_proj_scales"), torch.float32)
    halves = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], -1)  # NxDI's gate half, then its up half
    assert torch.equal(converted[op + "gate_up_proj.weight"].float(), halves)
    down = mxfp4_dequantize(tensor(hf + "down_proj_blocks"), tensor(hf + "down_proj_scales"), torch.float32)
    assert torch.equal(converted[op + "down_proj.weight"].float(), down)
    bias = tensor(hf + "gate_up_proj_bias")
    assert torch.equal(converted[op + "gate_up_proj.bias"], torch.cat([bias[..., ::2], bias[..., 1::2]], -1))
    assert torch.equal(converted["layers.0.self_attn.learned_sinks.sink"], tensor("model.layers.1.self_attn.sinks"))


def _conversion_with(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """NxDI's GPT-OSS conversion, then the converted `name` of every layer zeroed (a port that drops the
    tensor and leaves its parameter at zero)."""
    from pytest_moe_parity.backends.nxdi.tables import load_module_table, resolve

    application = resolve(load_module_table("gpt_oss").application)
    convert = application.convert_hf_to_neuron_state_dict

    def lossy(state: dict, config) -> dict:
        out = convert(state, config)
        for key in [k for k in out if k.endswith(name)]:
            out[key] = torch.zeros_like(out[key])
        return out

    monkeypatch.setattr(application, "convert_hf_to_neuron_state_dict", staticmethod(lossy))


def test_a_conversion_that_drops_the_sinks_errors_at_the_attention_naming_them(
    t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sinks left out of the converted state dict altogether: NxD's loading would keep the module's
    initial values quietly; the build refuses, at layer 0's attention, naming the tensor."""
    from pytest_moe_parity.backends.nxdi.tables import load_module_table, resolve

    application = resolve(load_module_table("gpt_oss").application)
    convert = application.convert_hf_to_neuron_state_dict

    def dropping(state: dict, config) -> dict:
        return {k: v for k, v in convert(state, config).items() if not k.endswith("learned_sinks.sink")}

    monkeypatch.setattr(application, "convert_hf_to_neuron_state_dict", staticmethod(dropping))
    golden, model = _paths(t5)
    result = run_parity(pytester, golden, *CPU, "-x", model=model)
    order = GoldenStore(golden).point_ids
    before = [p for p in order[: order.index("layer_0.attention")] if not p.endswith("rotary")]
    result.assert_outcomes(passed=len(before), skipped=1, errors=1)
    result.stdout.fnmatch_lines(["*layer_0.attention*the checkpoint has no tensor for 1 of the module's (*sink)*"])


@pytest.mark.parametrize(
    "lost, where",
    [("expert_mlps.mlp_op.gate_up_proj.bias", "layer_0.experts"), ("learned_sinks.sink", "layer_0.attention")],
    ids=["expert-bias-lost", "sinks-dropped"],
)
def test_a_conversion_fault_fails_first_at_its_point(
    lost: str, where: str, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A conversion that zeroes GPT-OSS's expert gate/up biases stops the run at layer 0's experts, one
    that zeroes its attention sinks at layer 0's attention; every point before passes."""
    golden, model = _paths(t5)
    _conversion_with(monkeypatch, lost)
    report = tmp_path / "r"
    result = run_parity(pytester, golden, *CPU, "-x", "--parity-report", str(report), model=model)
    order = GoldenStore(golden).point_ids
    before = [p for p in order[: order.index(where)] if not p.endswith("rotary")]
    result.assert_outcomes(passed=len(before), skipped=1, failed=1)
    result.stdout.fnmatch_lines([f"FAILED *parity::{where} *"])
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == where


def test_a_float_checkpoint_is_a_usage_error(t5: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    """NxDI's GPT-OSS conversion reads the hub's MXFP4 experts alone: a GPT-OSS checkpoint without them
    (here the tiny model's config without its quantization) is refused in one sentence, not a KeyError
    at every point."""
    from helpers import usage_error

    golden, model = _paths(t5)
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in model.iterdir():
        if file.name != "config.json":
            (plain / file.name).symlink_to(file)
    config = json.loads((model / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    usage_error(
        run_parity(pytester, golden, *CPU, model=plain),
        f"--hw nxdi: NxDI's GPT-OSS conversion (convert_hf_format_state_dict_bf16_compute) reads the experts in "
        f"the hub's MXFP4 layout alone (gate_up_proj_blocks and _scales, down_proj_blocks and _scales), and {plain} "
        "is not quantized: pass the mxfp4 checkpoint",
    )
