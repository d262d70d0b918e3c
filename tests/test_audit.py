"""`moe-parity audit`: dtypes and expert-fusion memory from safetensors headers alone."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import cli
from safetensors.torch import load_file, save_file

from pytest_moe_parity.record.audit import audit, tensor_class


def _bf16_copy(model: Path, out: Path, keep_float32=()) -> Path:
    """The checkpoint in one bf16 file, but for the tensors named in `keep_float32`."""
    out.mkdir()
    state = {}
    for shard in model.glob("*.safetensors"):
        state.update(load_file(str(shard)))
    save_file(
        {k: v if k in keep_float32 else v.to(torch.bfloat16) for k, v in state.items()}, str(out / "model.safetensors")
    )
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_float32_tensors_among_bf16_ones_are_named_with_their_bytes(tmp_path: Path, tiny_model, capsys) -> None:
    model = tiny_model("deepseek_v3")
    clean = _bf16_copy(model, tmp_path / "clean")
    code, out, _ = cli(capsys, "audit", "--model", clean)
    assert code == 0 and "every tensor is in the expected dtype" in out
    assert "expected dtype bfloat16 (from config.json)" in out
    # DeepSeek keeps its score-correction bias in float32 by design: said, not a finding
    bias = next(k for k in load_file(str(clean / "model.safetensors")) if "e_score_correction_bias" in k)
    experts = "model.layers.1.mlp.experts.3.down_proj.weight"
    odd = _bf16_copy(model, tmp_path / "odd", keep_float32={bias, experts, "model.norm.weight"})
    report = tmp_path / "audit.json"
    code, out, _ = cli(capsys, "audit", "--model", odd, "--json", report)
    assert code == 1
    data = json.loads(report.read_text())
    found = {r["name"]: (r["dtype"], r["bytes"], r["class"]) for r in data["findings"]}
    shape = load_file(str(odd / "model.safetensors"))[experts].shape
    assert found == {
        experts: ("float32", shape.numel() * 4, "experts"),
        "model.norm.weight": ("float32", 64 * 4, "norms"),
    }
    assert [r["name"] for r in data["float32_by_design"]] == [bias]
    assert f"  {experts}: float32" in out and "2 tensors are not bfloat16" in out
    assert data["census"]["experts"]["float32"]["tensors"] == 1
    code, _, _ = cli(capsys, "audit", "--model", odd, "--expect-dtype", "float32")
    assert code == 1  # now every bf16 tensor is the finding


def _sparse_checkpoint(out: Path, tensors: dict[str, tuple[str, list[int]]]) -> Path:
    """A safetensors file with the given header and no data written (a sparse file of the right size)."""
    out.mkdir()
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "F32": 4}[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path = out / "model.safetensors"
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)
    return path


def test_the_fusion_estimate_of_a_minimax_m2_layer_is_the_hand_formula(tmp_path: Path) -> None:
    """MiniMax-M2: 256 experts, hidden 3072, expert intermediate 1536, bf16. Fusing a layer writes
    gate_up [256, 3072, 3072] and down [256, 1536, 3072]: E*H*2I + E*I*H elements, held with the
    per-expert tensors it reads."""
    E, H, I = 256, 3072, 1536  # noqa: E741
    tensors = {}
    for e in range(E):
        for name, shape in (("w1", [I, H]), ("w3", [I, H]), ("w2", [H, I])):
            tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight"] = ("BF16", shape)
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = ("F32", [E, H])
    _sparse_checkpoint(tmp_path / "m", tensors)
    result = audit(tmp_path / "m", "bfloat16")
    elements = E * H * 2 * I + E * I * H
    stored = elements * 2
    assert result.layers[0]["expert_elements"] == elements
    bf16, fp32 = result.fusion["bfloat16"], result.fusion["float32"]
    assert bf16["largest_layer_peak_bytes"] == stored + elements * 2  # 13.5 GiB
    assert fp32["largest_layer_peak_bytes"] == stored + elements * 4  # 20.25 GiB: the user's 1 TB over 62 layers
    assert fp32["largest_layer_peak_bytes"] / 2**30 == pytest.approx(20.25)
    assert result.findings[0]["name"] == "model.layers.0.block_sparse_moe.gate.weight"  # a float32 router


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda tmp: tmp, "holds no .safetensors files"),
        (lambda tmp: _index(tmp, {"a.weight": "model-00001-of-00002.safetensors"}), "names model-00001-of-00002"),
        (lambda tmp: _truncated(tmp), "is truncated"),
        (lambda tmp: tmp / "nope", "is not a directory"),
    ],
)
def test_bad_input_is_one_line(setup, message, tmp_path: Path, capsys) -> None:
    code, _, err = cli(capsys, "audit", "--model", setup(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_bad_expected_dtype_is_one_line(tmp_path: Path, tiny_model, capsys) -> None:
    code, _, err = cli(capsys, "audit", "--model", tiny_model("olmoe"), "--expect-dtype", "int8")
    assert code == 2 and "--expect-dtype 'int8' is not a floating-point dtype" in err


def _index(tmp: Path, weight_map: dict[str, str]) -> Path:
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp


def _truncated(tmp: Path) -> Path:
    path = _sparse_checkpoint(tmp / "m", {"x": ("F32", [1000])})
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size - 10)
    return tmp / "m"


@pytest.mark.parametrize(
    "name, cls",
    [
        ("model.embed_tokens.weight", "embedding"),
        ("lm_head.weight", "lm_head"),
        ("model.layers.0.self_attn.q_norm.weight", "norms"),
        ("model.layers.0.self_attn.q_proj.weight", "attention"),
        ("model.layers.0.mlp.gate.weight", "router"),
        ("model.layers.0.mlp.gate.e_score_correction_bias", "router"),
        ("model.layers.0.mlp.router.weight", "router"),
        ("model.layers.0.mlp.experts.4.gate_proj.weight", "experts"),
        ("model.layers.0.mlp.experts.gate_up_proj", "experts"),
        ("model.layers.0.mlp.shared_experts.up_proj.weight", "shared_experts"),
        ("model.layers.0.mlp.gate_proj.weight", "mlp"),
    ],
)
def test_tensor_classes(name: str, cls: str) -> None:
    assert tensor_class(name) == cls


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_the_golden_size_estimate_is_close_to_a_recorded_golden(arch: str, golden_dir, tiny_model) -> None:
    from pytest_moe_parity.record.audit import estimate

    golden = golden_dir(arch)
    result = estimate(tiny_model(arch), 16, None, None)
    recorded = sum(p.stat().st_size for p in golden.glob("*.safetensors"))
    assert 0.8 < recorded / result["golden_bytes"] < 1.25, (recorded, result["golden_bytes"])


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_the_stream_estimate_holds_what_a_streamed_recording_keeps(arch: str, tmp_path: Path, tiny_model) -> None:
    from pytest_moe_parity.record.audit import estimate
    from pytest_moe_parity.record.run import record_golden

    model = tiny_model(arch)
    result = estimate(model, 16, "float32", None)
    record_golden(model, tmp_path / "g", stream=True)
    kept = json.loads((tmp_path / "g" / "manifest.json").read_text())["stats"]["host_weight_bytes"]
    per = result["per_layer"]
    weights = result["stream_bytes"] - per["activations_bytes"] - 2 * per["capture_bytes"]
    assert 0.95 < kept / weights < 1.05, (kept, weights)


def test_a_placement_fits_offloads_or_does_not(tmp_path: Path, tiny_model, capsys) -> None:
    model = tiny_model("mixtral")
    code, out, _ = cli(capsys, "estimate", "--model", model, "--dtype", "bfloat16", "--json", tmp_path / "e.json")
    assert code == 0
    result = json.loads((tmp_path / "e.json").read_text())
    stored = sum(t.numel() * 4 for t in _state(model).values())
    assert result["total_weights_bytes"] == stored // 2  # float32 stored, run in bf16
    layer = result["weights_bytes"]["layer_1"]
    half = 2 * layer + result["per_layer"]["activations_bytes"] + 1024
    spec = f"0:{half + result['weights_bytes']['embed']}B,1:{half}B,cpu:{10 * layer}B"
    code, out, _ = cli(capsys, "estimate", "--model", model, "--dtype", "bfloat16", "--max-memory", spec)
    assert code == 0 and "the placement fits" in out and "  0: " in out and "(embed .. layer_1)" in out
    code, out, _ = cli(
        capsys, "estimate", "--model", model, "--dtype", "bfloat16", "--max-memory", f"0:{half}B,disk:1GB"
    )
    assert code == 0 and "the placement fits with offload to disk" in out
    code, out, _ = cli(capsys, "estimate", "--model", model, "--dtype", "bfloat16", "--max-memory", f"0:{half}B")
    assert code == 1 and "the placement does not fit: from " in out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0:60XB", "'60XB' is not a size"),
        ("gpu0:60GiB", "'gpu0:60GiB' is not DEVICE:SIZE"),
        ("60GiB", "'60GiB' is not DEVICE:SIZE"),
    ],
)
def test_a_bad_memory_spec_is_one_line(spec: str, message: str, tiny_model, capsys) -> None:
    code, _, err = cli(capsys, "estimate", "--model", tiny_model("olmoe"), "--max-memory", spec)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def _state(model: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in model.glob("*.safetensors"):
        state.update(load_file(str(shard)))
    return state
