"""Recording: every point of every architecture replays bitwise from its golden record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_replays_bitwise, cache_kwarg, load_fp32
from safetensors import safe_open

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.golden.spec import ParamRef, resolve_params
from pytest_moe_parity.record.tiny import available_archs, build_tiny_model
from pytest_moe_parity.tree import map_structure

ARCHS = available_archs()

REQUIRED_ARCHS = {"mixtral", "qwen3_moe", "deepseek_v3", "minimax_m2", "gpt_oss", "qwen2_moe", "olmoe"}


def test_all_required_archs_have_tiny_configs() -> None:
    assert set(ARCHS) >= REQUIRED_ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_every_point_replays_bitwise(arch: str, tiny_model, golden_dir) -> None:
    store = GoldenStore(golden_dir(arch))
    components = {p.component for p in store.points}
    assert {"embedding", "attention", "router", "experts", "moe", "output", "final_norm", "logits"} <= components
    if arch in REQUIRED_ARCHS:
        assert "rotary" in components
    assert store.point_ids[0] == "embedding" and store.point_ids[-1] == "logits"
    assert_replays_bitwise(golden_dir(arch), load_fp32(tiny_model(arch)))


def test_points_per_architecture(golden_dir) -> None:
    ds = GoldenStore(golden_dir("deepseek_v3"))
    layer0 = [p.component for p in ds.points if p.layer == 0]
    layer1 = [p.component for p in ds.points if p.layer == 1]
    assert layer0 == ["input_norm", "attention", "post_attn_norm", "mlp", "output"]  # first_k_dense_replace
    assert layer1 == [
        "input_norm", "attention", "post_attn_norm", "router", "experts", "shared_experts", "moe", "output",
    ]  # fmt: skip
    q2 = GoldenStore(golden_dir("qwen2_moe"))
    assert q2.point("layer_2.shared_experts").module == "model.layers.2.mlp.shared_expert"
    gpt = GoldenStore(golden_dir("gpt_oss"))
    assert gpt.point("layer_1.router").module == "model.layers.1.mlp.router"
    # gpt_oss sliding and full layers get different masks, each stored with its own layer
    m0 = gpt.load("layer_0.output").kwargs["attention_mask"]
    m1 = gpt.load("layer_1.output").kwargs["attention_mask"]
    assert m0.shape == m1.shape and not torch.equal(m0, m1)


def test_parameters_passed_as_arguments_come_from_the_candidate(tiny_model, golden_dir) -> None:
    """MiniMax-M2's gate receives the score-correction bias from its MoE block: the golden records
    it by name, and replay takes it from the model under test, so a lost bias is visible."""
    store = GoldenStore(golden_dir("minimax_m2"))
    rec = store.load("layer_1.router")
    assert rec.args[1] == ParamRef("model.layers.1.mlp.e_score_correction_bias")
    assert not any(".e_score_correction_bias" in k for k in store.entry(rec.point)["tensors"])
    model = load_fp32(tiny_model("minimax_m2"))
    gate = model.get_submodule(rec.point.module)
    with torch.no_grad():
        good = gate(*resolve_params(rec.args, model))
        model.get_buffer("model.layers.1.mlp.e_score_correction_bias").zero_()
        lost = gate(*resolve_params(rec.args, model))
    assert torch.equal(good[2], rec.output[2])
    assert not torch.equal(lost[2], rec.output[2]), "dropping the bias must change the routing"


def test_masks_and_no_cache_are_recorded(golden_dir) -> None:
    store = GoldenStore(golden_dir("mixtral"))
    rec = store.load("layer_2.output")
    mask = rec.kwargs["attention_mask"]
    assert mask.shape == (1, 1, 16, 16) and mask.dtype == torch.float32
    assert mask[0, 0, 0, 1] == torch.finfo(torch.float32).min and mask[0, 0, 1, 0] == 0
    assert rec.kwargs.get("use_cache") is False and rec.kwargs[cache_kwarg(rec.kwargs)] is None
    manifest = store.manifest
    assert manifest["record"]["use_cache"] is False
    assert manifest["record"]["experts_implementation"] == "eager"
    assert manifest["inputs"]["seq_len"] == 16 and len(manifest["inputs"]["input_ids"][0]) == 16
    for key in ("torch", "transformers", "safetensors"):
        assert manifest["versions"][key]


def test_experts_get_golden_routing(golden_dir) -> None:
    store = GoldenStore(golden_dir("qwen3_moe"))
    router = store.load("layer_1.router").output
    experts = store.load("layer_1.experts")
    hidden, index, weights = experts.args
    assert hidden.shape == (16, 64)
    assert torch.equal(index, router[2]) and torch.equal(weights, router[1])


# -- tiny models --------------------------------------------------------------------------------


def _state(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    return out


def test_tiny_model_is_deterministic_and_in_hub_layout(tmp_path: Path, tiny_model) -> None:
    from pytest_moe_parity.record.tiny import write_tiny_model

    a = _state(tiny_model("qwen3_moe"))
    b = _state(write_tiny_model("qwen3_moe", tmp_path / "again"))
    c = _state(write_tiny_model("qwen3_moe", tmp_path / "seed1", seed=1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # published layout: per-expert tensors and a shard index
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in a
    assert not any(k.endswith("experts.gate_up_proj") for k in a)
    index = json.loads((tiny_model("qwen3_moe") / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_has_no_trivial_norms_or_biases(arch: str) -> None:
    model = build_tiny_model(arch, layers=2)
    state = model.state_dict()
    for name, t in state.items():
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        if "norm" in name or name.endswith("bias"):
            assert not bool((t == t.reshape(-1)[0]).all()), f"{name} left at a constant init"
    if arch in ("minimax_m2", "deepseek_v3"):
        biases = [t for n, t in state.items() if n.endswith("e_score_correction_bias")]
        assert biases and all(b.abs().sum() > 0 for b in biases)


def test_tiny_model_layers_option(tiny_model) -> None:
    path = tiny_model("gpt_oss", layers=3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and len(cfg["layer_types"]) == 3
    model = load_fp32(path)
    assert len(model.model.layers) == 3
    for name, t in _state(path).items():
        assert torch.equal(model.state_dict()[name], t) or "experts" in name  # fused on load


def test_no_pickle_anywhere(monkeypatch, golden_dir) -> None:
    import pickle

    def refuse(*a, **k):
        raise AssertionError("unpickling is not allowed")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    store = GoldenStore(golden_dir("olmoe"))
    for pid in store.point_ids:
        map_structure(store.load(pid).output, lambda x: x)
