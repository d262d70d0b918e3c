"""The component table and the structural fallback: MoE model types that are not in the table are
still mapped onto capture points, recorded and replayed bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_replays_bitwise, load_fp32

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.model.archs import ARCH_TABLE, _plan_from_spec, find_structure, plan_points
from pytest_moe_parity.points import LAYER_COMPONENTS
from pytest_moe_parity.record.run import record_golden
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
    comps = {p.component for p in store.points}
    assert {"embedding", "input_norm", "attention", "post_attn_norm", "router", "experts", "moe", "output"} <= comps
    assert {"final_norm", "logits"} <= comps
    assert_replays_bitwise(tmp_path / "g", load_fp32(path))


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


def test_forward_order_is_the_component_table(golden_dir) -> None:
    """Points are planned by walking LAYER_COMPONENTS: within a layer, the golden's order is the table's."""
    store = GoldenStore(golden_dir("deepseek_v3"))
    for layer in store.layers:
        comps = [p.component for p in store.points if p.layer == layer]
        assert comps == sorted(comps, key=LAYER_COMPONENTS.index)
    assert [p.order for p in store.points] == list(range(len(store.points)))
