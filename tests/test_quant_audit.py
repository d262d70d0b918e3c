"""Quantized checkpoints before anything is loaded: `moe-parity audit` (layout, quantized tensors and
unquantized ones by class, the conversion's memory, the header checks), `moe-parity estimate` (the
weights as the run holds them, dequantized), and `moe-parity dequantize` (an unquantized copy written
one layer at a time, bitwise what LazyModel reads of the quantized checkpoint)."""

from __future__ import annotations

import gc
import json
import math
import shutil
import struct
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import cli
from safetensors.torch import load_file, save_file

from pytest_moe_parity.host import gib
from pytest_moe_parity.record.audit import tensor_class

# (arch, --quant, --kv-scales): the layouts the hub ships, on the architectures that ship them
LAYOUTS = {
    "qwen3_moe-fp8-block": ("qwen3_moe", "fp8-block:32", False),
    "deepseek_v3-fp8-block": ("deepseek_v3", "fp8-block:32", False),
    "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", False),
    "qwen3_moe-fp8-channel-kv": ("qwen3_moe", "fp8-channel", True),
}
SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "U8": 1}
WEIGHT_SCALES = ("weight_scale_inv", "weight_scale", "_scales")
KV_SCALES = ("k_scale", "v_scale")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """quantized(layout) -> a tiny quantized checkpoint of LAYOUTS, written once per module."""
    from pytest_moe_parity.record.tiny import write_tiny_model

    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            arch, quant, kv = LAYOUTS[name]
            cache[name] = write_tiny_model(arch, tmp_path_factory.mktemp(name), quant=quant, kv_scales=kv)
        return cache[name]

    return make


def _headers(model: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape), from each safetensors file's header, read here by hand."""
    out = {}
    for path in sorted(model.glob("*.safetensors")):
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        out.update({k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * SIZE[dtype]


def _unit(name: str) -> str:
    parts = name.split(".")
    return f"layer_{parts[parts.index('layers') + 1]}" if "layers" in parts else "model"


def _expected(model: Path) -> dict:
    """The audit's figures, summed here from the headers: quantized weights by class (and their bf16
    bytes), scales, unquantized tensors by class, and the conversion per unit."""
    quantized: dict[str, dict[str, int]] = {}
    plain: dict[str, dict[str, int]] = {}
    scales = {"weight": 0, "kv_cache": 0}
    read: dict[str, int] = {}
    written: dict[str, int] = {}
    largest = 0
    for name, (dtype, shape) in _headers(model).items():
        stored = _nbytes(dtype, shape)
        unit = _unit(name)
        read[unit] = read.get(unit, 0) + stored
        converted = 0
        if name.endswith(WEIGHT_SCALES) or name.endswith(KV_SCALES):
            scales["kv_cache" if name.endswith(KV_SCALES) else "weight"] += 1
        elif dtype in ("F8_E4M3", "I8") or name.endswith("_blocks"):
            converted = math.prod(shape) * (2 if name.endswith("_blocks") else 1) * 2
            largest = max(largest, converted * 2)  # its float32 copy
            slot = quantized.setdefault(tensor_class(name), {"tensors": 0, "bytes": 0, "bfloat16_bytes": 0})
            slot["tensors"] += 1
            slot["bytes"] += stored
            slot["bfloat16_bytes"] += converted
        else:
            converted = stored
            slot = plain.setdefault(tensor_class(name), {"tensors": 0, "bytes": 0})
            slot["tensors"] += 1
            slot["bytes"] += stored
        written[unit] = written.get(unit, 0) + converted
    peak = max(read[u] + written[u] for u in read)
    return {
        "quantized": quantized,
        "unquantized": plain,
        "scales": scales,
        "per_unit": {u: {"read_bytes": read[u], "written_bytes": written[u]} for u in read},
        "stored": sum(read.values()),
        "converted": sum(written.values()),
        "peak": peak,
        "all_at_once": sum(read.values()) + sum(written.values()),
        "largest_float32": largest,
    }


# -- moe-parity audit ---------------------------------------------------------------------------------
# each layout's scheme and block as the audit gives them, and its line
SAID = {
    "qwen3_moe-fp8-block": ("fp8-block:32", [32, 32], "quantization: fp8, fp8-block:32: a scale per 32x32 block"),
    "deepseek_v3-fp8-block": ("fp8-block:32", [32, 32], "quantization: fp8, fp8-block:32: a scale per 32x32 "),
    "gpt_oss-mxfp4": ("mxfp4", [1, 32], "quantization: mxfp4, mxfp4: an e8m0 exponent per 32 values"),
    "qwen3_moe-fp8-channel-kv": ("fp8-channel", None, "compressed-tensors, fp8-channel: a scale per output channel"),
}


@pytest.mark.parametrize("name", list(SAID))
def test_the_audit_of_a_quantized_checkpoint_sums_its_headers(name: str, quantized, tmp_path: Path, capsys) -> None:
    scheme, block, line = SAID[name]
    model = quantized(name)
    code, out, err = cli(capsys, "audit", "--model", model, "--json", tmp_path / "a.json")
    assert code == 0, out + err
    data = json.loads((tmp_path / "a.json").read_text())
    q, want = data["quantization"], _expected(model)
    assert (q["scheme"], q["block"]) == (scheme, block)
    assert q["kv_cache"] is LAYOUTS[name][2]
    assert q["quantized"] == want["quantized"]
    assert q["unquantized"] == want["unquantized"]
    assert {k: v["tensors"] for k, v in q["scales"].items()} == {k: n for k, n in want["scales"].items() if n}
    assert q["unexpected_unquantized"] == [] and data["findings"] == []
    conversion = q["conversion"]
    assert conversion["per_unit"] == want["per_unit"]
    assert (conversion["stored_bytes"], conversion["converted_bytes"]) == (want["stored"], want["converted"])
    assert conversion["one_layer_at_a_time_peak_bytes"] == want["peak"]
    assert conversion["largest_tensor_float32_bytes"] == want["largest_float32"]
    assert conversion["all_at_once_peak_bytes"] == want["all_at_once"] == data["total_bytes"] + want["converted"]
    # the scales are their own class, never an unexpected dtype; the unquantized tensors by class
    assert "scales" in data["census"] and "float8_e4m3fn" not in str(data["findings"])
    assert {"embedding", "norms", "router", "lm_head"} <= set(q["unquantized"])
    assert line in out and "every unquantized tensor is in the expected dtype" in out
    assert f"converting to bfloat16 one layer at a time: peak {gib(want['peak'])}" in out
    assert f"all at once: {gib(want['all_at_once'])}" in out


def test_the_all_at_once_conversion_of_a_large_fp8_checkpoint_is_a_figure_before_loading(tmp_path: Path) -> None:
    """A MiniMax-M2-sized FP8 layer (256 experts, hidden 3072, expert intermediate 1536, 128x128 blocks) as
    a sparse file: one layer at a time holds its FP8 bytes and their bf16 bytes; all at once, the whole."""
    from pytest_moe_parity.record.audit import audit

    E, H, I = 256, 3072, 1536  # noqa: E741
    tensors = {}
    for e in range(E):
        for proj, shape in (("w1", [I, H]), ("w3", [I, H]), ("w2", [H, I])):
            key = f"model.layers.0.block_sparse_moe.experts.{e}.{proj}.weight"
            tensors[key] = ("F8_E4M3", shape)
            tensors[key + "_scale_inv"] = ("F32", [math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)])
    tensors["model.layers.0.block_sparse_moe.gate.weight"] = ("BF16", [E, H])
    model = _sparse(tmp_path / "m", tensors)
    config = {
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    (model / "config.json").write_text(json.dumps(config))
    q = audit(model).quantization
    fp8 = E * 3 * I * H
    scales = E * 3 * 12 * 24 * 4
    conversion = q["conversion"]
    assert q["quantized"]["experts"] == {"tensors": 3 * E, "bytes": fp8, "bfloat16_bytes": 2 * fp8}
    assert conversion["one_layer_at_a_time_peak_bytes"] == fp8 + scales + E * H * 2 + 2 * fp8 + E * H * 2
    assert conversion["one_layer_at_a_time_peak_bytes"] / 2**30 == pytest.approx(10.13, abs=0.01)


def _sparse(out: Path, tensors: dict[str, tuple[str, list[int]]]) -> Path:
    """A checkpoint directory whose one file has this header and no data written (a sparse file)."""
    out.mkdir()
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    with (out / "model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)
    return out


def _edited(model: Path, out: Path, edit=None, config_edit=None) -> Path:
    """A copy of `model` in one file, its tensors through `edit(state)` and its config through `config_edit`."""
    out.mkdir()
    state = {}
    for shard in model.glob("*.safetensors"):
        state.update(load_file(str(shard)))
    if edit is not None:
        edit(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    if config_edit is not None:
        config_edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


def _unquantize_q_proj(state: dict[str, torch.Tensor]) -> None:
    scale = state.pop(Q_PROJ + "_scale_inv")
    state[Q_PROJ] = (state[Q_PROJ].float() * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)).bfloat16()


def test_a_projection_left_unquantized_is_named_unless_the_config_leaves_it(quantized, tmp_path: Path, capsys) -> None:
    model = quantized("qwen3_moe-fp8-block")
    odd = _edited(model, tmp_path / "odd", _unquantize_q_proj)
    code, out, _ = cli(capsys, "audit", "--model", odd, "--json", tmp_path / "a.json")
    assert code == 1
    rows = json.loads((tmp_path / "a.json").read_text())["quantization"]["unexpected_unquantized"]
    assert [(r["name"], r["class"], r["dtype"], r["bytes"]) for r in rows] == [
        (Q_PROJ, "attention", "bfloat16", 64 * 64 * 2)
    ]
    assert "1 projections are stored unquantized, and the config does not leave them so:" in out
    assert f"  {Q_PROJ}: bfloat16" in out

    def leave(q: dict) -> None:
        q["modules_to_not_convert"] = ["lm_head", "model.layers.1.self_attn.q_proj"]

    named = _edited(model, tmp_path / "named", _unquantize_q_proj, leave)
    code, out, _ = cli(capsys, "audit", "--model", named)
    assert code == 0 and "projections are stored unquantized" not in out


def _drop(key: str):
    return lambda state: state.pop(key)


def _reshape(key: str, shape: tuple[int, ...]):
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[key] = torch.ones(shape, dtype=state[key].dtype)

    return edit


EXPERT = "model.layers.0.mlp.experts.3.down_proj.weight"
BAD = {
    "a missing scale": (
        "qwen3_moe-fp8-block",
        _drop(EXPERT + "_scale_inv"),
        None,
        f"{EXPERT} is stored in float8_e4m3fn but has no {EXPERT}_scale_inv: a quantized weight needs its scale",
    ),
    "a scale without its weight": (
        "qwen3_moe-fp8-block",
        _drop(EXPERT),
        None,
        f"{EXPERT}_scale_inv is there but its weight {EXPERT} is not",
    ),
    "a scale of the wrong shape": (
        "qwen3_moe-fp8-block",
        _reshape(EXPERT + "_scale_inv", (2, 1)),
        None,
        f"{EXPERT}_scale_inv has shape [2, 1]; its [64, 64] weight under fp8-block:32 needs [2, 2]",
    ),
    "a block size the scales do not fit": (
        "qwen3_moe-fp8-block",
        None,
        lambda q: q.update(weight_block_size=[16, 16]),
        "weight_block_size [16, 16] does not match the scales: ",
    ),
    "a per-channel scale transposed": (
        "qwen3_moe-fp8-channel-kv",
        _reshape(EXPERT + "_scale", (1, 64)),
        None,
        f"{EXPERT}_scale has shape [1, 64]; its [64, 64] weight under fp8-channel needs [64, 1]",
    ),
    "MXFP4 blocks without their scales": (
        "gpt_oss-mxfp4",
        _drop("model.layers.2.mlp.experts.down_proj_scales"),
        None,
        "model.layers.2.mlp.experts.down_proj_blocks has no model.layers.2.mlp.experts.down_proj_scales beside it",
    ),
    "an unknown quant_method": (
        "qwen3_moe-fp8-block",
        None,
        lambda q: q.update(quant_method="awq"),
        "is quantized with awq, which moe-parity cannot read",
    ),
    "an unknown compressed-tensors format": (
        "qwen3_moe-fp8-channel-kv",
        None,
        lambda q: q.update(format="pack-quantized"),
        "compressed-tensors format 'pack-quantized' is not read",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_checkpoint_its_layout_cannot_read_is_one_line_naming_the_tensor(
    case: str, quantized, tmp_path: Path, capsys
) -> None:
    """The audit, the estimate and dequantize say it before anything is read: exit 2, one line, and
    dequantize leaves nothing behind."""
    name, edit, config_edit, message = BAD[case]
    bad = _edited(quantized(name), tmp_path / "bad", edit, config_edit)
    for argv in (("audit",), ("estimate",), ("dequantize", "--out", tmp_path / "copy")):
        code, out, err = cli(capsys, argv[0], "--model", bad, *argv[1:])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv[0], err)
        assert "Traceback" not in err + out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_the_block_size_the_scales_fit_is_said(quantized, tmp_path: Path, capsys) -> None:
    bad = _edited(
        quantized("qwen3_moe-fp8-block"), tmp_path / "bad", None, lambda q: q.update(weight_block_size=[16, 16])
    )
    code, _, err = cli(capsys, "audit", "--model", bad)
    assert code == 2 and err.strip().endswith("they fit blocks of 32x32"), err


# -- moe-parity estimate ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_moe-fp8-block", "gpt_oss-mxfp4", "qwen3_moe-fp8-channel-kv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_estimate_counts_what_the_lazy_model_holds(name: str, dtype: torch.dtype, quantized) -> None:
    """Each unit's weights are what LazyModel holds of it in the run's dtype (dequantized, scales gone),
    and reading a unit holds its stored tensors too."""
    from pytest_moe_parity.model.lazy_model import LazyModel
    from pytest_moe_parity.record.audit import estimate

    model = quantized(name)
    dtype_name = str(dtype).removeprefix("torch.")
    result = estimate(model, 16, dtype_name, None)
    lazy = LazyModel(model, dtype=dtype)  # on the meta device: its units' sizes without reading a byte
    weights = result["weights_bytes"]
    assert [weights[f"layer_{i}"] for i in range(lazy.num_layers)] == [
        lazy.unit_bytes(i) for i in range(lazy.num_layers)
    ]
    assert weights["embed"] + weights["lm_head"] == sum(lazy.unit_bytes(u) for u in lazy.model_level_paths())
    want = _expected(model)
    transient = max(v["read_bytes"] for v in want["per_unit"].values())
    per = result["per_layer"]
    assert per["dequantize_bytes"] == transient
    layers = sorted((v for u, v in weights.items() if u.startswith("layer_")), reverse=True)
    held = weights["embed"] + weights["lm_head"] + sum(layers[:2]) + per["activations_bytes"] + 2 * per["capture_bytes"]
    assert result["stream_bytes"] == held + transient
    assert result["quantization"]["stored_bytes"] == want["stored"]


def test_the_estimate_runs_a_quantized_checkpoint_in_its_config_dtype(quantized, capsys) -> None:
    model = quantized("gpt_oss-mxfp4")
    code, out, _ = cli(capsys, "estimate", "--model", model)
    assert code == 0 and "weights bfloat16" in out
    assert "quantized (mxfp4, mxfp4): " in out and "dequantized into bfloat16 as each unit is read" in out
    want = _expected(model)
    # an unquantized copy in bf16 holds exactly what the run holds: the converted bytes, scales gone
    assert f"weights: {gib(want['converted'])}" in out


# -- moe-parity dequantize ----------------------------------------------------------------------------
def _lazy_state(model: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every unit of a LazyModel of `model` loaded, as its state dict."""
    from pytest_moe_parity.model.lazy_model import LazyModel

    lazy = LazyModel(model, dtype=dtype, max_layers=None)
    for path in lazy.model_level_paths():
        lazy.module(path)
    for layer in range(lazy.num_layers):
        lazy.ensure(layer)
    return lazy.model.state_dict()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_dequantized_copy_loads_and_is_the_lazy_models_weights(
    name: str, quantized, tmp_path: Path, capsys
) -> None:
    from transformers import AutoModelForCausalLM

    model = shutil.copytree(quantized(name), tmp_path / "q")
    (model / "tokenizer.json").write_text('{"a tokenizer": true}')
    (model / "original").mkdir()  # another copy of the weights (GPT-OSS's hub repo has one): not copied
    (model / "original" / "model.safetensors").write_bytes(b"not this")
    copy = tmp_path / "d"
    code, out, err = cli(capsys, "dequantize", "--model", model, "--out", copy, "--json", tmp_path / "d.json")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "d.json", "q"]  # no temporary directory left
    config = json.loads((copy / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (copy / "tokenizer.json").read_text() == '{"a tokenizer": true}'
    assert (copy / "generation_config.json").is_file() and not (copy / "original").exists()
    # one shard per decoder layer (and one for the tensors outside them), the key names an unquantized checkpoint's
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    by_shard: dict[str, set[str]] = {}
    for key, shard in index["weight_map"].items():
        by_shard.setdefault(shard, set()).add(_unit(key))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert len(by_shard) == layers + 1 and all(len(units) == 1 for units in by_shard.values())
    assert not [k for k in index["weight_map"] if k.endswith(("_scale_inv", "_scale", "_scales", "_blocks"))]
    # what it wrote and held is what the audit said the conversion would
    audit_json = tmp_path / "a.json"
    cli(capsys, "audit", "--model", model, "--json", audit_json)
    conversion = json.loads(audit_json.read_text())["quantization"]["conversion"]
    result = json.loads((tmp_path / "d.json").read_text())
    written = {
        u: {"read_bytes": v["read_bytes"], "written_bytes": v["written_bytes"]} for u, v in result["units"].items()
    }
    assert written == conversion["per_unit"]
    assert index["metadata"]["total_size"] == conversion["converted_bytes"] == result["written_bytes"]
    assert result["peak_bytes"] == conversion["one_layer_at_a_time_peak_bytes"]
    assert f"{len(written)} shards, {gib(result['written_bytes'])}" in out
    # transformers loads it, and it holds bit for bit what LazyModel reads of the quantized checkpoint
    loaded = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.bfloat16).state_dict()
    lazy = _lazy_state(model, torch.bfloat16)
    assert loaded.keys() == lazy.keys()
    for key, tensor in loaded.items():
        assert tensor.dtype == lazy[key].dtype and tensor.shape == lazy[key].shape, key
        assert torch.equal(_bits(tensor), _bits(lazy[key])), key
    # and it audits as an unquantized checkpoint
    code, out, _ = cli(capsys, "audit", "--model", copy)
    assert code == 0 and "every tensor is in the expected dtype" in out and "quantization:" not in out


def test_dequantize_holds_one_unit_at_a_time(quantized, tmp_path: Path, capsys, monkeypatch) -> None:
    """Each unit's tensors are gone before the next unit is read."""
    from pytest_moe_parity.record import dequantize

    read = dequantize._read_unit
    alive: list[weakref.ref] = []
    units = []

    def tracked(*args, **kwargs):
        gc.collect()  # held, not merely uncollected: an earlier test's cycles may hold a frame a while
        assert all(ref() is None for ref in alive), (
            f"tensors of an earlier unit are alive while unit {len(units)} is read"
        )
        state, nbytes = read(*args, **kwargs)
        alive.extend(weakref.ref(t) for t in state.values())
        units.append(sorted(state))
        return state, nbytes

    monkeypatch.setattr(dequantize, "_read_unit", tracked)
    code, _, err = cli(capsys, "dequantize", "--model", quantized("deepseek_v3-fp8-block"), "--out", tmp_path / "d")
    assert code == 0, err
    assert len(units) == 5 and len({_unit(k) for k in units[1]}) == 1


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda tmp, q, plain: (q, _nonempty(tmp / "out")), "already exists and is not empty: name a new directory"),
        (lambda tmp, q, plain: (plain, tmp / "out"), "is already unquantized"),
        (lambda tmp, q, plain: (q, tmp / "out", "--dtype", "int8"), "--dtype 'int8' is not one of bfloat16"),
    ],
    ids=["existing --out", "unquantized", "bad dtype"],
)
def test_dequantize_refuses_in_one_line(setup, message: str, quantized, tiny_model, tmp_path: Path, capsys) -> None:
    model, out, *more = setup(tmp_path, quantized("qwen3_moe-fp8-block"), tiny_model("qwen3_moe"))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, _, err = cli(capsys, "dequantize", "--model", model, "--out", out, *more)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def _nonempty(out: Path) -> Path:
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return out


def test_a_failed_dequantize_leaves_nothing(quantized, tmp_path: Path, capsys, monkeypatch) -> None:
    from pytest_moe_parity.errors import CheckpointError
    from pytest_moe_parity.record import dequantize

    read = dequantize._read_unit
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise CheckpointError("the third unit cannot be read")
        return read(*args, **kwargs)

    monkeypatch.setattr(dequantize, "_read_unit", failing)
    (tmp_path / "out").mkdir()  # an empty --out is taken, and stays as it was
    code, _, err = cli(capsys, "dequantize", "--model", quantized("qwen3_moe-fp8-block"), "--out", tmp_path / "out")
    assert code == 2 and "the third unit cannot be read" in err
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("name", ["qwen3_moe-fp8-block", "gpt_oss-mxfp4", "qwen3_moe-fp8-channel-kv"])
def test_a_golden_of_the_quantized_checkpoint_and_of_its_copy_are_bitwise_equal(
    name: str, quantized, tmp_path: Path, capsys
) -> None:
    """Dequantized into float32, the copy records the same golden as the quantized checkpoint in float32."""
    model, copy = quantized(name), tmp_path / "d"
    assert cli(capsys, "dequantize", "--model", model, "--out", copy, "--dtype", "float32")[0] == 0
    for source, golden in ((model, tmp_path / "gq"), (copy, tmp_path / "gd")):
        code, _, err = cli(capsys, "golden", "--model", source, "--out", golden, "--dtype", "float32")
        assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "gq").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "gd").glob("*.safetensors")) and len(files) > 4
    for file in files:
        a, b = load_file(str(tmp_path / "gq" / file)), load_file(str(tmp_path / "gd" / file))
        assert a.keys() == b.keys(), file
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(_bits(a[key]), _bits(b[key])), f"{file}: {key}"


def _large_fp8(out: Path, layers: int = 4, experts: int = 32, hidden: int = 1024, inter: int = 512) -> Path:
    """A qwen3_moe FP8 checkpoint (128x128 blocks) of random bytes, one shard per layer, written without
    building the model: about 50 MB of FP8 experts a layer."""
    from pytest_moe_parity.record.tiny import tiny_config_dict

    out.mkdir()
    gen = torch.Generator().manual_seed(0)

    def fp8(*shape: int) -> dict[str, torch.Tensor]:
        q = torch.randint(0, 0x7E, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return {"": q, "_scale_inv": torch.rand(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128), generator=gen)}

    weight_map = {}
    for layer in range(-1, layers):
        state: dict[str, torch.Tensor] = {}
        if layer < 0:
            state = {"model.embed_tokens.weight": torch.zeros(256, hidden, dtype=torch.bfloat16),
                     "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                     "lm_head.weight": torch.zeros(256, hidden, dtype=torch.bfloat16)}  # fmt: skip
        else:
            p = f"model.layers.{layer}."
            mats = {f"{p}self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"}
            for e in range(experts):
                for n, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                    mats[f"{p}mlp.experts.{e}.{n}_proj.weight"] = shape
            for name, shape in mats.items():
                state.update({name + suffix: t for suffix, t in fp8(*shape).items()})
            state[f"{p}mlp.gate.weight"] = torch.zeros(experts, hidden, dtype=torch.bfloat16)
            for n in ("input_layernorm", "post_attention_layernorm"):
                state[f"{p}{n}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        shard = f"model-{layer + 2:05d}-of-{layers + 1:05d}.safetensors"
        save_file(state, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = tiny_config_dict("qwen3_moe", layers, {"hidden_size": hidden, "moe_intermediate_size": inter,
                                                    "num_experts": experts, "head_dim": 64, "num_attention_heads": 16,
                                                    "num_key_value_heads": 16})  # fmt: skip
    config.update(torch_dtype="bfloat16", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (out / "config.json").write_text(json.dumps(config))
    return out


MEASURE = """
import resource, sys
import torch, safetensors.torch
from pytest_moe_parity.cli import main
from pytest_moe_parity.record import dequantize
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
code = main(["dequantize", "--model", sys.argv[1], "--out", sys.argv[2]])
print("measured", code, base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_dequantize_peaks_at_the_audits_one_layer_figure(tmp_path: Path) -> None:
    """In a fresh process, dequantizing a checkpoint of 4 layers of ~50 MB FP8 each raises the peak by about
    the audit's one-layer figure (a layer's FP8 + its bf16 bytes, one tensor's float32 temporaries on top),
    a fraction of the all-at-once figure."""
    import subprocess
    import sys

    from pytest_moe_parity.record.audit import audit

    model = _large_fp8(tmp_path / "q")
    conversion = audit(model).quantization["conversion"]
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model), str(tmp_path / "d")], capture_output=True, text=True, check=True
    )
    line = next(li for li in run.stdout.splitlines() if li.startswith("measured"))
    _, code, base, peak = line.split()
    assert code == "0", run.stderr
    grown = int(peak) - int(base)
    one = conversion["one_layer_at_a_time_peak_bytes"]
    assert grown < 1.25 * one, (grown, one)
    assert grown < 0.4 * conversion["all_at_once_peak_bytes"], (grown, conversion["all_at_once_peak_bytes"])
