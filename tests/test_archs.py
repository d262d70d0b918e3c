"""The component table and the structural fallback: MoE model types that are not in the table are
still mapped onto capture points, recorded and replayed bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_replays_bitwise, load_fp32, read_json, run_parity

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


def test_a_checkpoint_that_names_modules_otherwise_is_read_by_the_models_names(tiny_model, tmp_path: Path) -> None:
    """Sarvam-MoE's hub checkpoint names the embedding `model.word_embeddings` (transformers renames it
    when loading): the lazy reads place each key by the model's name of it, so the model-level units
    find their weights, and the golden replays bit for bit."""
    path = tiny_model("sarvam_moe")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.word_embeddings.weight" in index and "model.embed_tokens.weight" not in index
    record_golden(path, tmp_path / "g", seq_len=12)
    assert_replays_bitwise(tmp_path / "g", load_fp32(path))


def test_a_forward_that_asks_where_the_embedding_is_first_runs_streamed(tmp_path: Path) -> None:
    """Llama 4's forward sends the input ids to `embed_tokens.weight.device` before it calls the
    embedding: read one unit at a time, the embedding is read before the forward starts (its ids
    would be on meta otherwise), and the streamed forward is the full load's, bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pytest_moe_parity.model.lazy_model import LazyModel

    config = AutoConfig.for_model(
        "llama4_text", hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=256, num_local_experts=4,
        num_experts_per_tok=1, layer_types=["chunked_attention", "full_attention"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    ids = torch.arange(3, 15)[None]
    lazy = LazyModel(tmp_path / "m", dtype=torch.float32, max_layers=1)
    with torch.no_grad(), lazy.streaming() as model:
        streamed = model(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        full = load_fp32(tmp_path / "m")(input_ids=ids, use_cache=False).logits
    assert streamed.device.type == "cpu" and torch.equal(streamed, full)
    record_golden(tmp_path / "m", tmp_path / "g", seq_len=12)  # the recording streams it too
    assert {"router", "experts", "shared_experts"} <= {p.component for p in GoldenStore(tmp_path / "g").points}


@pytest.mark.usefixtures("_import_everything_once")
def test_sparse_attention_that_rounding_reselects_is_judged_against_the_reference_s_own_run(
    tmp_path: Path, pytester: pytest.Pytester
) -> None:
    """DeepSeek-V3.2's attention reads the keys an indexer's top-k picks: in bf16 rounding picks others
    (the reference's own bf16 run is 8% off at layer 2, beyond bf16's 4%). Isolated, with a noise floor,
    a clean bf16 candidate passes, judged against that run where it is beyond the dtype's limits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pytest_moe_parity.replay.noise import record_noise

    config = AutoConfig.for_model(
        "deepseek_v32", hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=4, num_hidden_layers=3, vocab_size=256, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=8,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    record_golden(tmp_path / "m", tmp_path / "g", seq_len=12)
    record_noise(tmp_path / "g", "bfloat16", model_dir=tmp_path / "m")
    report = tmp_path / "report"
    result = run_parity(pytester, tmp_path / "g", "--dtype", "bfloat16", "--parity-report", str(report))
    result.assert_outcomes(passed=len(GoldenStore(tmp_path / "g").point_ids))
    rows = {r["id"]: r for r in read_json(report / "comparison_report.json")["points"]}
    attention = rows["layer_2.attention"]
    assert any("beyond the dtype's limit here" in n for n in attention["notes"]), attention


def test_norms_and_attention_inside_one_block_are_each_their_own_point(tmp_path: Path) -> None:
    """DBRX holds a layer's two norms and its attention in one block (`norm_attn_norm`: norm_1, attn,
    norm_2): each is its own point, never the block itself as a norm; its experts (2-D matrices of
    every expert, under a child `experts`) and its router are found as the MoE block's points."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "dbrx", d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=256, tie_word_embeddings=False,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 48, "hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2},
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    plan = plan_points(load_fp32(tmp_path / "m"))
    modules = {p.id: p.module for p in plan.points}
    block = "transformer.blocks.1.norm_attn_norm"
    assert [modules[f"layer_1.{c}"] for c in ("input_norm", "attention", "post_attn_norm")] == [
        f"{block}.norm_1", f"{block}.attn", f"{block}.norm_2",
    ]  # fmt: skip
    assert len(set(modules.values())) == len(modules)  # no module is two points
    assert [modules[f"layer_1.{c}"] for c in ("router", "experts", "moe")] == [
        "transformer.blocks.1.ffn.router", "transformer.blocks.1.ffn.experts", "transformer.blocks.1.ffn",
    ]  # fmt: skip
    assert plan.notes == [] and "layer_1.mlp" not in modules
    record_golden(tmp_path / "m", tmp_path / "g", seq_len=12)
    assert_replays_bitwise(tmp_path / "g", load_fp32(tmp_path / "m"))


def test_a_short_convolution_is_the_token_mixer_of_its_layers(tiny_model) -> None:
    """LFM2-MoE mixes tokens by a short convolution on some layers and by attention on others: each
    layer's mixer is its `attention` point."""
    plan = {p.id: p.module for p in plan_points(load_fp32(tiny_model("lfm2_moe"))).points}
    assert plan["layer_0.attention"] == "model.layers.0.conv"
    assert plan["layer_1.attention"] == "model.layers.1.self_attn"
    assert plan["layer_0.mlp"] == "model.layers.0.feed_forward" and "layer_0.router" not in plan  # a dense layer


def test_a_renaming_that_would_take_a_model_key_away_leaves_it(tmp_path: Path) -> None:
    """DeepSeek-V4's conversion renames `.norm.` to `.kv_norm.` (its attention's norms, in the hub's
    names); the checkpoint transformers saves names the final norm `model.norm.weight`, which is the
    model's own name: as transformers' loading does, it stays, and the model-level read finds it (it
    stopped at "lacks weights for model.norm")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v4", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
        vocab_size=256, max_position_embeddings=512, moe_intermediate_size=48, n_routed_experts=8,
        num_experts_per_tok=2, q_lora_rank=32, qk_rope_head_dim=8, sliding_window=64, tie_word_embeddings=False,
        layer_types=["heavily_compressed_attention"] * 2, mlp_layer_types=["hash_moe"] * 2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # not its init: a lost read would show
    model.save_pretrained(tmp_path / "m")
    record_golden(tmp_path / "m", tmp_path / "g", seq_len=12)
    store = GoldenStore(tmp_path / "g")
    assert {"router", "experts", "shared_experts", "final_norm"} <= {p.component for p in store.points}
    assert_replays_bitwise(tmp_path / "g", load_fp32(tmp_path / "m"))


@pytest.mark.usefixtures("_import_everything_once")
def test_a_linear_layer_kept_in_float32_takes_its_input_as_the_model_casts_it(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """HY-V4 keeps its lm_head in float32 and casts the last hidden state to it: a bf16 candidate's
    `logits` point gets its (bf16-rounded) input in float32 too, where it raised "expected m1 and m2
    to have the same dtype" (and so did the noise floor's bf16 run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "hy_v4", hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, num_hidden_layers=2, vocab_size=256, max_position_embeddings=512,
        n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, qk_head_dim=24, v_head_dim=16, layer_types=["indexed_attention"] * 2, pad_token_id=0,
        mlp_layer_types=["dense", "sparse"], indexer_types=["full", "shared"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    from pytest_moe_parity.replay.noise import record_noise

    record_golden(tmp_path / "m", tmp_path / "g", seq_len=12)
    record_noise(tmp_path / "g", "bfloat16", model_dir=tmp_path / "m")
    result = run_parity(pytester, tmp_path / "g", "--dtype", "bfloat16", "-k", "logits or final_norm")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["logits *passed*"])
