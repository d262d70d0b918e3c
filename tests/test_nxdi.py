"""`--hw nxdi` against a test double of neuronx-distributed-inference (tests/doubles) that enforces
the documented contracts of build_module and the weight conversions, with NxD's documented MoE
numerics on the CPU: the name table, the one-layer conversion against a reference conversion of
the documented layout, the input/output adapters against transformers' modules, and whole runs."""

from __future__ import annotations

import functools
from pathlib import Path

import faults
import pytest
import torch
from helpers import NO_WEIGHTS, assert_within_rounding, cache_kwarg, read_json, run_parity, usage_error

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")
DOUBLES = Path(__file__).resolve().parent / "doubles"


def test_without_nxdi_the_run_is_a_usage_error_with_the_install_command(pytester, golden_dir) -> None:
    usage_error(
        run_parity(pytester, golden_dir("qwen3_moe"), "--hw", "nxdi"),
        "--hw nxdi needs neuronx-distributed-inference, which is not installed: pip install --extra-index-url "
        "https://pip.repos.neuron.amazonaws.com",
    )


def test_the_tables_are_data_for_each_architecture() -> None:
    assert {"qwen3_moe", "mixtral"} <= set(nxdi.tables())
    for model_type in ("qwen3_moe", "mixtral"):
        table = nxdi.load_module_table(model_type)
        assert table is not None
        assert {c: s.module for c, s in table.components.items()} == {
            "embedding": "embed_tokens",
            "input_norm": "layers.{layer}.input_layernorm",
            "attention": "layers.{layer}.self_attn",
            "post_attn_norm": "layers.{layer}.post_attention_layernorm",
            "router": "layers.{layer}.mlp",
            "experts": "layers.{layer}.mlp",
            "moe": "layers.{layer}.mlp",
            "output": "layers.{layer}",
            "final_norm": "norm",
            "logits": "lm_head",
        }
        assert {s.call for s in table.components.values()} == {"", "router", "expert_mlps"}
        assert {c for c, s in table.components.items() if s.inputs == "attention"} == {"attention", "output"}
        assert table.components["output"].routing == "mlp.router"
        assert set(table.unavailable) == {"rotary"}
    assert nxdi.load_module_table("olmoe") is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_one_layer_converts_as_the_documented_layout(arch: str, nxdi_double, tiny_model) -> None:
    """Layer 2 alone, renamed to layer 0 and converted with a one-layer config by NxDI's function:
    the documented [E, H, 2I] / [E, I, H] layout of that layer's experts, its router, nothing else."""
    from safetensors.torch import load_file

    model = tiny_model(arch)
    table = nxdi.load_module_table(arch)
    state = nxdi.unit_state(model, 2)
    assert state and all(k.startswith("layers.0.") for k in state)
    neuron_config = type("NeuronConfig", (), {"tp_degree": 2})()
    config = type(
        "Config", (), {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts": 8, "neuron_config": neuron_config}
    )()
    convert = nxdi.resolve(table.application).convert_hf_to_neuron_state_dict
    got = nxdi.under(nxdi.convert_unit(state, convert, config, 1), "layers.0.mlp.")
    assert config.num_hidden_layers == 4  # the caller's config is left as it was
    hf = {}
    for shard in model.glob("*.safetensors"):
        hf.update({k: v for k, v in load_file(str(shard)).items() if ".layers.2." in k})
    moe = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    names = ("gate_proj", "up_proj", "down_proj") if arch == "qwen3_moe" else ("w1", "w3", "w2")
    w = {n: torch.stack([hf[f"model.layers.2.{moe}.experts.{e}.{n}.weight"] for e in range(8)]) for n in names}
    gate, up, down = (w[n] for n in names)
    assert torch.equal(got["expert_mlps.mlp_op.gate_up_proj.weight"], torch.cat([gate, up], dim=1).transpose(1, 2))
    assert torch.equal(got["expert_mlps.mlp_op.down_proj.weight"], down.transpose(1, 2))
    assert torch.equal(got["router.linear_router.weight"], hf[f"model.layers.2.{moe}.gate.weight"])
    assert set(got) == {
        "router.linear_router.weight",
        "expert_mlps.mlp_op.gate_up_proj.weight",
        "expert_mlps.mlp_op.down_proj.weight",
    }


def test_deepseek_v3_s_table_lays_a_layer_out_for_nxd_and_back(tiny_model) -> None:
    """NxDI ships no DeepSeek-V3 application: the table's own conversion renames the router's weight and
    score-correction bias to NxD's GroupLimitedRouter, stacks the per-expert weights as ExpertMLPsV2 holds
    them and leaves the rest (MLA, shared experts, the dense MLP) as transformers names them; its inverse
    gives back transformers 5's own tensors of that layer, bit for bit."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("deepseek_v3")
    table = nxdi.load_module_table("deepseek_v3")
    assert table is not None and not table.application and set(table.unavailable) == {"rotary", "moe", "output"}
    config = type("Config", (), {"num_hidden_layers": 4})()
    convert = functools.partial(nxdi.table_conversion, rules=table.conversion)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for layer in (0, 2):  # the dense first layer, a MoE layer
        got = nxdi.convert_unit(nxdi.unit_state(model_dir, layer), convert, config, 1)
        mlp = {k.removeprefix("layers.0.mlp.") for k in got if k.startswith("layers.0.mlp.")}
        if layer == 0:
            assert mlp == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
        else:
            parts = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
            assert mlp == {"router.linear_router.weight", "router.e_score_correction_bias"} | {
                f"expert_mlps.mlp_op.{p}" for p in ("gate_up_proj.weight", "down_proj.weight")
            } | {f"shared_experts.{p}" for p in parts}
            assert got["layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"].shape == (8, 64, 64)  # [E, H, 2I]
        back = nxdi.back_to_reference(got, table.weights, layer)
        mine = {k: v for k, v in reference.items() if k.startswith(f"model.layers.{layer}.")}
        assert set(back) == set(mine)
        assert all(torch.equal(back[k], mine[k]) for k in mine), [k for k in mine if not torch.equal(back[k], mine[k])]


def test_the_rotary_k_of_transformers_deepseek_cache_is_laid_out_as_nxdi_rotates_it() -> None:
    """transformers' interleaved rotary (`rope_interleave`) writes each pair's halves as [evens, odds];
    NxDI's rotate_fn keeps the pairs interleaved: the same rotation, another layout, inverted exactly."""
    from pytest_moe_parity.backends.nxdi.calls import deinterleaved, interleaved

    x = torch.arange(16.0).reshape(2, 8)
    assert interleaved(x)[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(deinterleaved(interleaved(x)), x)


def test_the_experts_adapter_feeds_nxd_what_transformers_routed(nxdi_double, tiny_model) -> None:
    """The golden experts call (hidden, top-k ids, top-k weights) -> NxD's (hidden, affinities
    [T, E], ids): the weights land at their expert ids, and NxD's renormalisation keeps them."""
    torch.manual_seed(0)
    hidden = torch.randn(5, 64)
    ids = torch.tensor([[0, 3], [7, 1], [2, 2], [4, 5], [6, 0]])
    weights = torch.softmax(torch.randn(5, 2), -1)
    _, affinities, index = nxdi.experts_inputs(hidden, ids, weights, 8)
    assert affinities.shape == (5, 8) and torch.equal(index, ids)
    rows = [0, 1, 3, 4]  # token 2 names one expert twice: no top-k does
    # NxD renormalises weights that already sum to 1: a division by a two-term sum's rounding
    assert_within_rounding(affinities[rows].gather(1, ids[rows]), weights[rows], steps=2, where="top-k weights")


def test_attention_inputs_take_nxdi_s_form(golden_dir) -> None:
    """transformers' additive mask, int64 positions and the DynamicCache of a decode step become
    what NxDI's attention takes: a boolean causal mask [B, 1, S, S] and int32 positions for context
    encoding; for token generation the mask over the past [B, 1, 1, past] and the cache as (K, V)."""
    from pytest_moe_parity.golden import GoldenStore

    store = GoldenStore(golden_dir("qwen3_moe", decode=1))
    hidden, mask, positions = nxdi.attention_inputs(store.load("layer_1.attention"))
    assert hidden.shape == (1, 16, 64) and mask.dtype == torch.bool and positions.dtype == torch.int32
    assert torch.equal(mask, torch.ones(16, 16, dtype=torch.bool).tril().expand(1, 1, 16, 16))
    assert torch.equal(positions, torch.arange(16, dtype=torch.int32)[None])
    record = store.load("step_1.layer_1.output")
    hidden, mask, positions, keys, values = nxdi.attention_inputs(record)
    assert hidden.shape == (1, 1, 64) and torch.equal(positions, torch.tensor([[16]], dtype=torch.int32))
    assert mask.shape == (1, 1, 1, 16) and bool(mask.all())
    cache = record.kwargs[cache_kwarg(record.kwargs)]
    assert keys is cache.keys and values is cache.values and keys.shape == (1, 2, 16, 16)
    # without a recorded mask or positions: causal, counted on from the cache's length
    record.kwargs.pop("attention_mask"), record.kwargs.pop("position_ids")
    _, mask2, positions2, *_ = nxdi.attention_inputs(record)
    assert torch.equal(mask2, mask) and torch.equal(positions2, positions)


def test_a_sliding_window_cache_is_not_fed_to_nxdi(nxdi_double, golden_dir, tiny_model) -> None:
    """NxDI's windowed attention keeps its own rolling cache layout: a decode step whose cache is a
    sliding window's is skipped with the reason, not fed as if it were a full cache."""
    from dataclasses import replace

    from helpers import session

    from pytest_moe_parity.errors import PointUnavailable

    run = session(golden_dir("qwen3_moe", decode=1), tiny_model("qwen3_moe"), hw="nxdi", dtype="bfloat16")
    try:
        record = run.golden.load("step_1.layer_0.attention")
        name = cache_kwarg(record.kwargs)
        record.kwargs[name] = replace(record.kwargs[name], window=8, seen=16)
        spec = run.runner.backend.table.components["attention"]
        with pytest.raises(PointUnavailable, match="a sliding-window layer's cache"):
            run.runner.backend._inputs(record.point, spec, record)
    finally:
        run.close()


def test_the_router_output_is_judged_as_top_k_weights(nxdi_double, golden_dir, tiny_model) -> None:
    """NxD's router returns full softmax affinities; the verdict turns them into renormalised top-k
    weights and they agree with transformers' router (float32 reference, a bf16 candidate)."""
    from helpers import session

    run = session(golden_dir("qwen3_moe"), tiny_model("qwen3_moe"), hw="nxdi", dtype="bfloat16")
    try:
        result = run.runner.run("layer_1.router")
    finally:
        run.close()
    assert result.passed, result.checks
    assert any("every expert's affinity [T, E]" in n for n in result.notes)
    from neuronx_distributed_inference.utils.testing import CALLS

    assert CALLS[-1]["cls"] == "NxdiPoint" and CALLS[-1]["tp_degree"] == 1
    assert CALLS[-1]["signature"] == [(torch.Size([16, 64]), torch.bfloat16)]


@pytest.mark.parametrize("arch, tp", [("qwen3_moe", 1), ("mixtral", 1), ("qwen3_moe", 2), ("mixtral", 4)])
def test_a_clean_run_passes_on_nxdi_modules(
    arch: str, tp: int, nxdi_double, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    """Every point but the rotary embedding is built from NxDI's modules and passes in bf16: the
    attention and whole decoder layers too, at a decode step with each rank holding its kv heads of
    the cache (the double runs one thread per rank, each computing its own heads). At tp_degree=1
    the attention's cache write is compared; at more, rank 0's K and V are not the whole cache."""
    from neuronx_distributed_inference.utils import testing  # imported before the inner run: its record stays

    golden = golden_dir(arch, decode=1)
    args = ("--hw", "nxdi", "--dtype", "bfloat16", "--hw-option", f"tp_degree={tp}")
    result = run_parity(pytester, golden, *args, "--parity-report", str(tmp_path / "r"), model=tiny_model(arch))
    assert result.ret == 0, result.stdout.str()
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    built = {pid for pid, r in rows.items() if r["status"] == "passed"}
    assert built == {pid for pid in rows if not pid.endswith("rotary")}
    assert "NxDI computes the rotary embedding inside each attention module" in rows["rotary"]["reason"]
    written = {"cache.keys", "cache.values"} <= set(rows["step_1.layer_1.attention"]["metrics"])
    assert written == (tp == 1)  # what the attention wrote, compared where the backend holds all of it
    assert not [r["id"] for r in rows.values() if any("does not expose" in n for n in r.get("notes", []))]
    assert {c["tp_degree"] for c in testing.CALLS} == {tp}
    assert any(c["signature"][0][0][:2] == (1, 1) for c in testing.CALLS)  # decode steps trace their own graph


def test_each_rank_holds_the_kv_heads_nxd_gives_it() -> None:
    """NxD's GQA sharding: kv heads kept where the TP degree divides them, repeated up to the TP
    degree (or to the attention heads where it is not a multiple), then split; none where NxDI
    would pad the attention heads."""
    assert nxdi.rank_kv_heads(2, 8, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # MHA
    assert nxdi.rank_kv_heads(2, 8, 4) == [[0, 1], [2, 3]]
    assert nxdi.rank_kv_heads(4, 8, 2) == [[0], [0], [1], [1]]  # REPLICATE_TO_TP_DEGREE
    assert nxdi.rank_kv_heads(2, 6, 3) == [[0, 0, 1], [1, 2, 2]]  # CONVERT_TO_MHA
    assert nxdi.rank_kv_heads(1, 4, 2) == [[0, 1]]
    assert nxdi.rank_kv_heads(4, 6, 3) is None  # 6 heads padded to 8


@pytest.mark.parametrize(
    "fault, first",
    [
        (faults.swap_gate_up(2), "layer_2.experts"),
        (faults.scale("post_attention_layernorm", 1, 1.5), "layer_1.post_attn_norm"),
        (faults.scale("self_attn.v_proj", 1, 1.5), "layer_1.attention"),
        (faults.scale_rows("lm_head", [3, 5], 2.0), "logits"),
    ],
    ids=["gate-up-swapped", "norm-scaled", "v-proj-scaled", "lm-head-rows"],
)
def test_a_checkpoint_fault_fails_at_its_nxdi_module(
    fault, first, nxdi_double, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), tmp_path / "c", fault)
    pytester.syspathinsert(DOUBLES)
    result = run_parity(pytester, golden, "--hw", "nxdi", "--dtype", "bfloat16", "-x", NO_WEIGHTS, model=candidate)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*first divergence: {first} *"])
    assert result.parseoutcomes()["failed"] == 1


SWAPPED_QK_NORMS = """
from neuronx_distributed_inference.models.qwen3_moe import modeling_qwen3_moe as m

application = m.NeuronQwen3MoeForCausalLM
convert = application.convert_hf_to_neuron_state_dict


def buggy(state_dict, config):  # a port's conversion that gives q's norm weight to k and k's to q
    out = convert(state_dict, config)
    for key in [k for k in out if k.endswith("q_layernorm.weight")]:
        other = key.replace("q_layernorm", "k_layernorm")
        out[key], out[other] = out[other], out[key]
    return out


application.convert_hf_to_neuron_state_dict = staticmethod(buggy)
"""


def test_a_conversion_bug_in_the_attention_fails_at_the_attention(
    nxdi_double, pytester: pytest.Pytester, golden_dir, tiny_model
) -> None:
    """The checkpoint is clean; the port's conversion swaps the q and k norm weights: NxDI's
    attention, fed the golden's inputs, is the first point to diverge; the norms and the MoE before
    and after it pass."""
    pytester.syspathinsert(DOUBLES)
    pytester.makeconftest(SWAPPED_QK_NORMS)
    result = run_parity(
        pytester, golden_dir("qwen3_moe"), "--hw", "nxdi", "--dtype", "bfloat16", "-v", model=tiny_model("qwen3_moe")
    )
    result.stdout.fnmatch_lines(["*first divergence: layer_0.attention *"])
    assert "layer_0.input_norm PASSED" in result.stdout.str() and "layer_0.moe PASSED" in result.stdout.str()


TKG_SOFTMAX_BUG = """
from neuronx_distributed_inference.modules.attention import attention_base


def buggy(prior_scores, active_scores):  # token generation's softmax leaves the new token out of the sum
    top = prior_scores.max(dim=-1, keepdim=True)[0]
    exp_prior, exp_active = (prior_scores - top).exp(), (active_scores - top).exp()
    return exp_prior / exp_prior.sum(dim=-1, keepdim=True), exp_active / exp_prior.sum(dim=-1, keepdim=True)


attention_base.manual_softmax = buggy
"""


def test_a_token_generation_bug_fails_at_the_decode_step_s_attention(
    nxdi_double, pytester: pytest.Pytester, golden_dir, tiny_model
) -> None:
    """A bug on NxDI's token-generation path only (the softmax split into a prior and an active
    part): every prefill point passes, and the decode step's attention is the first divergence."""
    pytester.syspathinsert(DOUBLES)
    pytester.makeconftest(TKG_SOFTMAX_BUG)
    golden = golden_dir("mixtral", decode=1)
    result = run_parity(pytester, golden, "--hw", "nxdi", "--dtype", "bfloat16", "-v", model=tiny_model("mixtral"))
    result.stdout.fnmatch_lines(["*first divergence: step_1.layer_0.attention *"])
    prefill = [line for line in result.stdout.lines if "::layer_" in line or "::logits" in line]
    assert prefill and not [line for line in prefill if "FAILED" in line], prefill


FROZEN_RANK = """
import torch
from neuronx_distributed.parallel_layers import layers

layers.SPMDRank.get_rank = lambda self: torch.zeros_like(self.rank)  # the rank a trace froze: 0 on every rank
"""


def test_a_bug_that_only_tp_shows_fails_at_the_attention_at_tp_2(
    nxdi_double, pytester: pytest.Pytester, golden_dir, tiny_model
) -> None:
    """Every rank computing rank 0's heads (the rank a trace froze to a constant, as in a public
    MiniMax-M2 port): a clean run at tp_degree=1, and at tp_degree=2 the first layer's attention is
    the first divergence."""
    pytester.syspathinsert(DOUBLES)
    pytester.makeconftest(FROZEN_RANK)
    golden, model = golden_dir("qwen3_moe"), tiny_model("qwen3_moe")
    args = ("--hw", "nxdi", "--dtype", "bfloat16", "-x")
    assert run_parity(pytester, golden, *args, "--hw-option", "tp_degree=1", model=model).ret == 0
    result = run_parity(pytester, golden, *args, "--hw-option", "tp_degree=2", model=model)
    result.stdout.fnmatch_lines(["*first divergence: layer_0.attention *"])


BUGGY_CONVERSION = """
import torch
from neuronx_distributed_inference.models.{arch} import modeling_{arch} as m

application = m.{application}
convert = application.convert_hf_to_neuron_state_dict


def buggy(state_dict, config):  # a port's conversion that puts the up half first
    out = convert(state_dict, config)
    for key in [k for k in out if k.endswith("gate_up_proj.weight")]:
        gate, up = out[key].chunk(2, dim=-1)
        out[key] = torch.cat([up, gate], dim=-1)
    return out


application.convert_hf_to_neuron_state_dict = staticmethod(buggy)
"""
APPLICATIONS = {"qwen3_moe": "NeuronQwen3MoeForCausalLM", "mixtral": "NeuronMixtralForCausalLM"}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_weight_items_check_what_nxdi_converted_mapped_back(
    arch: str, nxdi_double, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    """The inverse rules of the table give transformers' names and layout back: a clean conversion
    passes every weight item; a conversion that swaps the gate and up halves (the checkpoint itself
    is clean) fails the first layer's weight item, before any activation."""
    golden = golden_dir(arch)
    candidate = faults.edit_checkpoint(tiny_model(arch), tmp_path / "c", lambda t: None)  # a copy
    pytester.syspathinsert(DOUBLES)
    args = ("--hw", "nxdi", "--dtype", "bfloat16", "-v")
    clean = run_parity(pytester, golden, *args, model=candidate)
    clean.stdout.fnmatch_lines(
        ["*weights (the nxdi backend's converted weights, mapped back) checked against*", "*layer_0.weights PASSED*"]
    )
    assert "weights FAILED" not in clean.stdout.str(), clean.stdout.str()
    pytester.makeconftest(BUGGY_CONVERSION.format(arch=arch, application=APPLICATIONS[arch]))
    buggy = run_parity(pytester, golden, *args, "-x", "--parity-report", str(tmp_path / "r"), model=candidate)
    buggy.stdout.fnmatch_lines(
        ["first divergence: layer_0.weights  (*gate_up_proj: its halves along dim 1 are exchanged*"]
    )
    assert read_json(tmp_path / "r" / "comparison_summary.json")["first_divergence"] == "layer_0.weights"
