"""Quantized checkpoints as they ship (`model.quant`, `record.quantized`): each layout read one unit at a
time, bit for bit what transformers' own loading gives; recorded `--stream` and replayed on themselves;
what the reference ran said in its manifest and header; bad checkpoints said in one sentence."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_replays_bitwise, cli, read_json, run_parity, usage_error
from safetensors.torch import load_file, save_file

from pytest_moe_parity.errors import CheckpointError
from pytest_moe_parity.model.lazy_model import LazyModel
from pytest_moe_parity.model.quant import (
    FP4_VALUES,
    FP8_MAX,
    Dequantizer,
    expand_scale,
    fake_quant,
    layout,
    mxfp4_dequantize,
    quantize_fp8,
    quantize_mxfp4,
)
from pytest_moe_parity.record.tiny import build_tiny_model, write_tiny_model

pytestmark = pytest.mark.usefixtures("_import_everything_once")

# Layouts as their makers ship them, on the architectures with such a release (block sizes that divide
# every dimension of the tiny models: transformers derives a block from the scale grid, see below).
LAYOUTS = [
    ("qwen3_moe", "fp8-block:32"),
    ("minimax_m2", "fp8-block:32"),
    ("deepseek_v3", "fp8-block:8"),
    ("qwen3_moe", "fp8-channel"),
    ("gpt_oss", "mxfp4"),
]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(arch, quant, kv_scales=False) -> a tiny checkpoint in that layout, written once."""
    cache: dict[tuple, Path] = {}

    def make(arch: str, quant: str, kv_scales: bool = False) -> Path:
        key = (arch, quant, kv_scales)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"q-{arch}-{quant.replace(':', '_')}")
            cache[key] = write_tiny_model(arch, out, quant=quant, kv_scales=kv_scales)
        return cache[key]

    return make


def lazy_state(model: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every unit of `model` read one at a time through LazyModel: the model's state dict."""
    lazy = LazyModel(model, dtype=dtype, max_layers=None)
    for layer in range(lazy.num_layers):
        lazy.ensure(layer)
    for unit in lazy.model_level_paths():
        lazy.ensure(unit)
    state = {k: v.clone() for k, v in lazy.model.state_dict().items()}
    lazy.close()
    return state


def transformers_state(model: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict of transformers' own `from_pretrained` (on a CPU its quantizers dequantize; for
    compressed-tensors, the decompressing load)."""
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if read_json(model / "config.json")["quantization_config"]["quant_method"] == "compressed-tensors":
        pytest.importorskip("compressed_tensors", reason="transformers needs it to load compressed-tensors")
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    with warnings.catch_warnings():  # "the model already has a quantization_config": the loading attributes are ours
        warnings.simplefilter("ignore", UserWarning)
        ref = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager", **kwargs)
    return ref.state_dict()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("arch", "quant"), LAYOUTS, ids=[f"{a}-{q}" for a, q in LAYOUTS])
def test_each_layout_reads_one_unit_at_a_time_bit_for_bit_as_transformers_loads_it(
    quantized, arch: str, quant: str, dtype: torch.dtype
) -> None:
    model = quantized(arch, quant)
    ours, theirs = lazy_state(model, dtype), transformers_state(model, dtype)
    assert set(ours) <= set(theirs)
    assert not [k for k in theirs if k not in ours and not k.endswith(("_scale", "_scale_inv"))]
    differ = [k for k in ours if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not differ, differ[:5]
    # and the weights are the model's own, within the format's rounding
    plain = build_tiny_model(arch).state_dict()
    for key in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.down_proj"):
        if key in ours:
            err = (ours[key].float() - plain[key]).abs().max().item()
            assert 0 < err <= plain[key].abs().max().item() / 4, (key, err)


def test_blocks_that_do_not_divide_a_dimension_cover_its_last_shorter_block(quantized) -> None:
    """A block of 48 on 64-wide tensors: the second block of each dimension is 16 wide. Read by the
    config's weight_block_size (transformers 5.24 derives 32 from a 2x2 grid and reads it wrong)."""
    model = quantized("qwen3_moe", "fp8-block:48")
    ours = lazy_state(model, torch.float32)
    shards = {}
    for p in sorted(model.glob("*.safetensors")):
        shards.update(load_file(str(p)))
    name = "model.layers.2.self_attn.q_proj"
    q, s = shards[f"{name}.weight"], shards[f"{name}.weight_scale_inv"]
    assert list(s.shape) == [2, 2] and list(q.shape) == [64, 64]
    expected = torch.empty(64, 64)
    for i, rows in enumerate((slice(0, 48), slice(48, 64))):
        for j, cols in enumerate((slice(0, 48), slice(48, 64))):
            expected[rows, cols] = q[rows, cols].float() * s[i, j]
    assert torch.equal(ours[f"{name}.weight"], expected)
    plain = build_tiny_model("qwen3_moe").state_dict()[f"{name}.weight"]
    assert (ours[f"{name}.weight"] - plain).abs().max() <= plain.abs().max() / 16  # one e4m3 step at most


def test_int8_channel_reads_as_compressed_tensors_dequantizes(quantized) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model = quantized("qwen3_moe", "int8-channel")
    ours = lazy_state(model, torch.bfloat16)
    raw = {}
    for p in sorted(model.glob("*.safetensors")):
        raw.update(load_file(str(p)))
    name = "model.layers.0.self_attn.k_proj"
    args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    theirs = dequantize(raw[f"{name}.weight"], raw[f"{name}.weight_scale"], args=args, dtype=torch.bfloat16)
    assert raw[f"{name}.weight"].dtype == torch.int8
    assert torch.equal(ours[f"{name}.weight"], theirs)


def test_the_writer_s_layouts_are_the_hub_s(quantized) -> None:
    """What transformers' quantizers read: the config's quantization_config, the scales' names, dtypes
    and shapes; routers, norms, embeddings and the LM head left unquantized."""
    fp8 = quantized("qwen3_moe", "fp8-block:32")
    config = read_json(fp8 / "config.json")["quantization_config"]
    assert config == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
    }
    tensors = {}
    for p in sorted(fp8.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    assert tensors["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert list(tensors["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"].shape) == [2, 2]
    for kept in ("model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[kept].dtype == torch.bfloat16, kept
    mx = quantized("gpt_oss", "mxfp4")
    tensors = load_file(str(mx / "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    ct = quantized("qwen3_moe", "fp8-channel", kv_scales=True)
    q = read_json(ct / "config.json")["quantization_config"]
    assert q["format"] == "float-quantized" and q["kv_cache_scheme"]["num_bits"] == 8
    assert layout(read_json(ct / "config.json")).describe() == (
        "compressed-tensors (fp8-channel, activations dynamic-token, KV-cache scales)"
    )


def test_the_formats_round_trips() -> None:
    """The scheme functions a writer and a noise floor share: e4m3 values at most one step (1/8 of their
    binade) off; the block scale is the block's largest value over 448; MXFP4 values on the e2m1 grid."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 50, generator=gen)
    q, s = quantize_fp8(w, "fp8-block", (32, 32))
    assert list(s.shape) == [3, 2] and q.dtype == torch.float8_e4m3fn
    assert math.isclose(s[2, 1].item(), w[64:, 32:].abs().max().item() / FP8_MAX, rel_tol=1e-6)
    back = q.float() * expand_scale(s, (70, 50), (32, 32))
    assert ((back - w).abs() <= w.abs() / 8 + s.max() * 2**-9).all()
    blocks, scales = quantize_mxfp4(w[:, :32])  # [out, in]: one group of 32 per row
    values = mxfp4_dequantize(blocks, scales, torch.float32).T  # back to [out, in]
    assert values.shape == (70, 32)
    on_grid = values / torch.exp2(scales.float() - 127)  # each value over its group's power of two
    grid = torch.tensor(FP4_VALUES)
    assert ((on_grid.unsqueeze(-1) - grid).abs().amin(-1) == 0).all()
    assert (on_grid.abs().amax(-1) >= 4).all()  # each group's largest value uses the top binade
    assert torch.equal(fake_quant(w[:, :32], "mxfp4"), values)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "quant"), LAYOUTS, ids=[f"{a}-{q}" for a, q in LAYOUTS])
def test_a_quantized_checkpoint_records_streamed_and_replays_clean_on_itself(
    pytester: pytest.Pytester, quantized, capsys, arch: str, quant: str
) -> None:
    model = quantized(arch, quant)
    golden = pytester.path / "g"
    code, _out, err = cli(capsys, "golden", "--model", model, "--out", golden, "--stream", "--decode-steps", "1")
    assert code == 0, err
    manifest = read_json(golden / "manifest.json")
    assert manifest["quantization"]["reference"] == "dequant"
    assert manifest["record"]["loading"].startswith("streamed")
    result = run_parity(pytester, golden, "--hw", "cpu", "--dtype", "float32")
    result.assert_outcomes(passed=result.parseoutcomes()["passed"])
    assert result.parseoutcomes()["passed"] > 40 and result.ret == 0
    described = layout(read_json(model / "config.json")).describe()
    result.stdout.fnmatch_lines([f"moe-parity: golden quantized: {described}: the reference ran weights dequantized*"])
    # bitwise where the same kernels run: every point on the checkpoint read whole (transformers' weights)
    lazy = LazyModel(model, dtype=torch.float32, max_layers=None)
    with lazy.streaming() as whole:
        whole(input_ids=torch.tensor([[5]]))  # every unit read
    assert_replays_bitwise(golden, whole)
    lazy.close()
    # and against its dequantized bf16 copy (what users used to write by hand), in bf16: weights included
    copy = pytester.path / "bf16"
    code, _, err = cli(capsys, "dequantize", "--model", model, "--out", copy, "--dtype", "bfloat16")
    assert code == 0, err
    result = run_parity(pytester, golden, "--hw", "cpu", "--dtype", "bfloat16", model=copy)
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes["passed"] > 40 and "failed" not in outcomes and "errors" not in outcomes
    result.stdout.fnmatch_lines(["first divergence: none"])


def edited(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose tensors (all shards) went through `edit(dict) -> dict`; one file."""
    shutil.copytree(src, dst)
    tensors = {}
    for p in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
        p.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


SCALE = "model.layers.1.self_attn.o_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: {k: v for k, v in t.items() if k != SCALE},
            "model.layers.1.self_attn.o_proj.weight is stored in float8_e4m3fn but has no "
            "model.layers.1.self_attn.o_proj.weight_scale_inv: a quantized weight needs its scale",
        ),
        (
            lambda t: {**t, SCALE: t[SCALE][:1]},
            f"{SCALE} has shape [1, 2]; its [64, 64] weight under fp8-block:32 needs [2, 2]",
        ),
    ],
    ids=["missing-scale", "scale-shape"],
)
def test_a_broken_quantized_checkpoint_is_one_sentence_naming_the_tensor(
    pytester: pytest.Pytester, quantized, golden_dir, capsys, edit, message: str
) -> None:
    bad = edited(quantized("qwen3_moe", "fp8-block:32"), pytester.path / "bad", edit)
    for stream in ((), ("--stream",)):
        code, _, err = cli(capsys, "golden", "--model", bad, "--out", pytester.path / "g", *stream)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert not (pytester.path / "g").exists()
    usage_error(run_parity(pytester, golden_dir("qwen3_moe"), model=bad), message)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "is quantized with gptq, which moe-parity cannot read"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
            "compressed-tensors format 'pack-quantized' is not read",
        ),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size [0, 128] is not two positive"),
    ],
    ids=["gptq", "pack-quantized", "block-zero"],
)
def test_a_quantization_this_cannot_read_is_said_before_anything_is_loaded(
    pytester: pytest.Pytester, quantized, golden_dir, capsys, quantization_config, message: str
) -> None:
    model = shutil.copytree(quantized("qwen3_moe", "fp8-block:32"), pytester.path / "m")
    config = read_json(model / "config.json")
    config["quantization_config"] = quantization_config
    (model / "config.json").write_text(json.dumps(config))
    code, _, err = cli(capsys, "golden", "--model", model, "--out", pytester.path / "g", "--stream")
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (pytester.path / "g").exists()
    usage_error(run_parity(pytester, golden_dir("qwen3_moe"), model=model), message)


def test_reference_quant_says_what_the_reference_ran_and_refuses_what_cannot_run_here(
    quantized, tiny_model, capsys, tmp_path: Path
) -> None:
    fp8 = quantized("qwen3_moe", "fp8-block:32")
    code, _, err = cli(capsys, "golden", "--model", fp8, "--out", tmp_path / "n", "--reference-quant", "native")
    assert code == 2 and "transformers dequantizes fp8 weights on a CPU" in err, err
    code, _, err = cli(
        capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", tmp_path / "p", "--reference-quant", "dequant"
    )
    assert code == 2 and "applies to a quantized checkpoint" in err, err
    code, _, err = cli(capsys, "golden", "--model", fp8, "--out", tmp_path / "d", "-q")
    assert code == 0, err
    manifest = read_json(tmp_path / "d" / "manifest.json")
    assert manifest["quantization"] == {
        "method": "fp8",
        "scheme": "fp8-block:32",
        "block": [32, 32],
        "activations": "dynamic-token",
        "kv_cache": False,
        "reference": "dequant",
        "matmuls": "weights dequantized into the recording's dtype, activations unquantized",
    }
    assert manifest["record"]["loading"] != "from_pretrained"


@pytest.mark.parametrize(
    "arch, quant, args, kernels, said",
    [
        ("qwen3_moe", "fp8-block:32", [], False, "come from the Hugging Face hub through the `kernels` package"),
        ("gpt_oss", "mxfp4", ["--dtype", "bfloat16"], False, "transformers' mxfp4 kernels come from the Hugging Face"),
        ("deepseek_v3", "fp8-block:8", [], True, "take blocks of at least 32, and this checkpoint's are 8x8"),
        ("gpt_oss", "mxfp4", [], True, "take bfloat16 activations, not torch.float32: add --dtype bfloat16"),
    ],
)
def test_native_on_a_gpu_refuses_what_transformers_kernels_cannot_run(
    quantized, capsys, monkeypatch, tmp_path: Path, arch: str, quant: str, args: list, kernels: bool, said: str
) -> None:
    """On a GPU (an H200, as seen there): transformers' fp8/mxfp4 kernels are fetched from the hub by the
    `kernels` package, the fp8 kernel's Triton dot needs blocks of 32 or more, the mxfp4 one bfloat16
    activations; each is one sentence before anything loads, nothing written."""
    from pytest_moe_parity.record import reference

    monkeypatch.setattr(reference.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(reference.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(reference, "hub_kernels_installed", lambda: kernels)
    argv = ["golden", "--model", quantized(arch, quant), "--out", tmp_path / "n", "--device", "cuda:0", *args]
    code, _, err = cli(capsys, *argv, "--reference-quant", "native")
    assert code == 2 and said in err and "Traceback" not in err, err
    assert not (tmp_path / "n").exists()


def test_native_refuses_a_model_transformers_dequantized_instead() -> None:
    """transformers' mxfp4 quantizer falls back to dequantizing (a warning) where its kernels do not load: a
    golden labelled native must not hold that; the fp8 and compressed-tensors configs that ran pass."""
    from types import SimpleNamespace

    from transformers import Mxfp4Config

    from pytest_moe_parity.errors import BadInput
    from pytest_moe_parity.record.reference import native_ran

    fell_back = SimpleNamespace(config=SimpleNamespace(quantization_config=Mxfp4Config(dequantize=True)))
    with pytest.raises(BadInput, match="transformers dequantized the mxfp4 weights instead of running its kernels"):
        native_ran(fell_back)
    native_ran(SimpleNamespace(config=SimpleNamespace(quantization_config=Mxfp4Config())))
    native_ran(SimpleNamespace(config=SimpleNamespace(quantization_config={"quant_method": "fp8"})))


@pytest.mark.slow
def test_native_compressed_tensors_is_transformers_w8a8_and_differs_from_dequant(
    quantized, capsys, tmp_path: Path
) -> None:
    """compressed-tensors FP8 runs its W8A8 path in transformers on a CPU (activations quantized per
    token): `native` records that, and its logits differ from the dequantized weights' by the activations'
    rounding."""
    pytest.importorskip("compressed_tensors")
    from pytest_moe_parity.golden import GoldenStore

    model = quantized("qwen3_moe", "fp8-channel")
    for how in ("native", "dequant"):
        code, _, err = cli(capsys, "golden", "--model", model, "--out", tmp_path / how, "--reference-quant", how, "-q")
        assert code == 0, err
    native, dequant = GoldenStore(tmp_path / "native"), GoldenStore(tmp_path / "dequant")
    assert native.manifest["quantization"]["reference"] == "native"
    out = next(k for k in native.tensors("logits") if "out" in k)
    a, b = native.tensors("logits")[out], dequant.tensors("logits")[out]
    assert not torch.equal(a, b) and (a - b).norm() / b.norm() < 0.2


def test_a_unit_s_scales_are_read_with_it_and_no_other_unit(quantized) -> None:
    """One layer read: its own weights and scales, nothing of the other layers (the memory bound)."""
    model = quantized("minimax_m2", "fp8-block:32")
    lazy = LazyModel(model, dtype=torch.bfloat16, max_layers=1)
    lazy.ensure(1)
    assert lazy.stats.keys and all(".layers.1." in k for k in lazy.stats.keys)
    assert any(k.endswith("weight_scale_inv") for k in lazy.stats.keys)
    assert lazy.loaded_units == {"layer_1"}
    lazy.close()


def test_dequantizer_names_and_refuses() -> None:
    quant = layout({"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}})
    deq = Dequantizer(quant, "ckpt")
    assert deq.plain_keys(["a.weight", "a.weight_scale_inv", "b.k_scale", "c.bias"]) == ["a.weight", "c.bias"]
    q = torch.ones(4, 4).to(torch.float8_e4m3fn)
    out = deq.dequantize({"a.weight": q, "a.weight_scale_inv": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, torch.float32)
    assert out["a.weight"][3, 3].item() == 4.0 and out["a.weight"][0, 0].item() == 1.0
    missing = r"ckpt: a\.weight is stored in float8_e4m3fn but has no a\.weight_scale_inv"
    with pytest.raises(CheckpointError, match=missing):
        deq.dequantize({"a.weight": q}, torch.float32)


@pytest.mark.slow
def test_a_quantized_stream_recording_holds_two_dequantized_layers(tmp_path: Path, monkeypatch) -> None:
    """The recording memory bound of benchmarks/bench_record_memory.py (in a fresh process) on an FP8
    block-scaled Mixtral-style checkpoint, --stream: the host holds two layers dequantized into the
    recording's dtype and the model-level modules, plus a bounded overhead (a layer's FP8 tensors read
    and dequantized are among its temporaries)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_record_memory import record
    from bench_replay import write_checkpoint

    model = write_checkpoint(tmp_path, 4, "fp8-block:128")
    assert read_json(model / "config.json")["quantization_config"]["quant_method"] == "fp8"
    r = record(model, tmp_path / "golden", 64, "--stream")
    mb = 2**20
    layer = 16 * 3 * 512 * 512 * 4 + 4 * 512 * 512 * 4  # one layer's experts and attention in float32
    assert 2 * layer <= r["host"] <= 2 * layer + 8 * mb, r["host"] / mb
    assert r["overhead"] <= 256 * mb, r["overhead"] / mb


def test_the_drill_reads_a_quantized_port_and_names_the_op_of_its_scale_bug(
    pytester: pytest.Pytester, quantized, capsys
) -> None:
    """Both sides of the drill read through the dequantizing reader: a port whose layer 1 q_proj scale is
    written as its inverse drills to q_proj."""
    clean = quantized("qwen3_moe", "fp8-block:32")
    scale = "model.layers.1.self_attn.q_proj.weight_scale_inv"
    port = edited(clean, pytester.path / "port", lambda t: {**t, scale: 1 / t[scale]})
    golden = pytester.path / "g"
    code, _, err = cli(capsys, "golden", "--model", clean, "--out", golden, "--stream", "-q")
    assert code == 0, err
    result = run_parity(pytester, golden, "--no-parity-weights", "--parity-drill", "layer_1.attention", model=port)
    result.stdout.fnmatch_lines([
        "first divergence: layer_1.attention  (drill: q_proj introduced the divergence*",
        "drill layer_1.attention: * ops, * failed; culprit q_proj*",
    ])  # fmt: skip
