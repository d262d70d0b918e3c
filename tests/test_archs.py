"""The component table and the structural fallback: MoE model types that are not in the table are
still mapped onto capture points, recorded and replayed bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.golden.spec import resolve_params
from pytest_moe_parity.record.archs import ARCH_TABLE, _plan_from_spec, find_structure, parse_point_id, plan_points
from pytest_moe_parity.record.run import load_model, record_golden
from pytest_moe_parity.record.tiny import available_archs, build_tiny_model

# MoE model types of transformers that the table does not know; their tiny configs live beside the
# table's in fixtures/configs/.
NOT_IN_TABLE = [arch for arch in available_archs() if arch not in ARCH_TABLE]


def test_the_fallback_types_are_really_not_in_the_table() -> None:
    assert len(NOT_IN_TABLE) >= 5
    assert {"phimoe", "granitemoe", "hunyuan_v1_moe", "glm4_moe", "deepseek_v2", "hy_v3", "jamba"} <= set(NOT_IN_TABLE)


@pytest.mark.parametrize("model_type", NOT_IN_TABLE)
def test_structural_fallback_records_and_replays(model_type: str, tiny_model, tmp_path: Path) -> None:
    path = tiny_model(model_type)
    record_golden(path, tmp_path / "g", seq_len=12)
    store = GoldenStore(tmp_path / "g")
    assert store.manifest["arch"]["source"] == "structural"
    comps = {p["component"] for p in store.points}
    assert {"embedding", "input_norm", "attention", "post_attn_norm", "router", "experts", "moe", "output"} <= comps
    assert {"final_norm", "logits"} <= comps
    model = load_model(path, dtype=torch.float32, device="cpu", device_map=None, max_memory=None)
    for pid in store.point_ids:
        rec = store.load(pid)
        module = model.get_submodule(rec.point["module"])
        with torch.no_grad():
            out = module(*resolve_params(rec.args, model), **resolve_params(rec.kwargs, model))
        expected = rec.output if isinstance(rec.output, torch.Tensor) else rec.output[0]
        actual = out if isinstance(out, torch.Tensor) else out[0]
        assert torch.equal(actual, expected), pid


def test_structural_details() -> None:
    def points(model_type):
        return {p.id: p for p in plan_points(build_tiny_model(model_type)).points}

    hy = points("hy_v3")  # the gate receives the score-correction bias from its block, like MiniMax-M2
    assert hy["layer_1.router"].router_kind == "sigmoid_bias"
    assert hy["layer_1.router"].score_bias == "model.layers.1.mlp.e_score_correction_bias"
    glm = points("glm4_moe")  # dense first layer, shared experts
    assert "layer_0.mlp" in glm and "layer_0.router" not in glm
    assert glm["layer_1.shared_experts"].module == "model.layers.1.mlp.shared_experts"
    hunyuan = points("hunyuan_v1_moe")
    assert hunyuan["layer_2.shared_experts"].module == "model.layers.2.mlp.shared_mlp"
    granite = points("granitemoe")
    assert granite["layer_0.router"].module == "model.layers.0.block_sparse_moe.router"
    jamba = points("jamba")  # a hybrid: mamba layers stand in the attention slot; no rotary
    assert jamba["layer_0.attention"].module == "model.layers.0.mamba"
    assert jamba["layer_1.attention"].module == "model.layers.1.self_attn"
    assert "rotary" not in jamba and jamba["final_norm"].module == "model.final_layernorm"


@pytest.mark.parametrize("arch", sorted(ARCH_TABLE))
def test_structural_finder_agrees_with_the_table(arch: str) -> None:
    """The fallback alone finds the same modules the table names for the seven known types."""
    model = build_tiny_model(arch, layers=2)
    table = [(p.id, p.module) for p in plan_points(model).points]
    found = [(p.id, p.module) for p in _plan_from_spec(model, arch, find_structure(model), "structural").points]
    assert found == table


def test_point_ids_parse() -> None:
    assert parse_point_id("layer_17.attention") == (17, "attention")
    assert parse_point_id("logits") == (None, "logits")
    with pytest.raises(ValueError):
        parse_point_id("layer_x.attention")
