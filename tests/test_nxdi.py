"""`--hw nxdi` against a test double of neuronx-distributed-inference (tests/doubles) that enforces
the documented contracts of build_module and the weight conversions, with NxD's documented MoE
numerics on the CPU: the name table, the one-layer conversion against a reference conversion of
the documented layout, the input/output adapters against transformers' modules, and whole runs."""

from __future__ import annotations

import sys
from pathlib import Path

import faults
import pytest
import torch
from helpers import read_json, run_parity, usage_error

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")
DOUBLES = Path(__file__).resolve().parent / "doubles"


@pytest.fixture
def nxdi_double(monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLES))
    yield
    for name in [m for m in sys.modules if m.startswith("neuronx_distributed_inference")]:
        del sys.modules[name]


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
            "post_attn_norm": "layers.{layer}.post_attention_layernorm",
            "router": "layers.{layer}.mlp",
            "experts": "layers.{layer}.mlp",
            "moe": "layers.{layer}.mlp",
            "final_norm": "norm",
            "logits": "lm_head",
        }
        assert {s.call for s in table.components.values()} == {"", "router", "expert_mlps"}
        assert set(table.unavailable) == {"rotary", "attention", "output"}
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
    config = type("Config", (), {"num_hidden_layers": 4, "num_local_experts": 8, "num_experts": 8})()
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
    assert torch.allclose(affinities[rows].gather(1, ids[rows]), weights[rows])


def test_the_router_output_is_judged_as_top_k_weights(nxdi_double, golden_dir, tiny_model) -> None:
    """NxD's router returns full softmax affinities; the verdict turns them into renormalised top-k
    weights and they agree with transformers' router (float32 reference, a bf16 candidate)."""
    from helpers import session

    run = session(golden_dir("qwen3_moe"), tiny_model("qwen3_moe"), hw="nxdi", dtype="bfloat16")
    try:
        result = run.runner.run("layer_1.router")
    finally:
        run.close()
    assert result.passed, result.to_row()
    assert any("every expert's affinity [T, E]" in n for n in result.notes)
    from neuronx_distributed_inference.utils.testing import CALLS

    assert CALLS[-1]["cls"] == "NxdiPoint" and CALLS[-1]["tp_degree"] == 1
    assert CALLS[-1]["signature"] == [(torch.Size([16, 64]), torch.bfloat16)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_clean_run_passes_on_nxdi_modules(
    arch: str, nxdi_double, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    from neuronx_distributed_inference.utils import testing  # imported before the inner run: its record stays

    golden = golden_dir(arch, decode=1)
    args = ("--hw", "nxdi", "--dtype", "bfloat16", "--hw-option", "tp_degree=2", "--parity-report", str(tmp_path / "r"))
    result = run_parity(pytester, golden, *args, model=tiny_model(arch))
    assert result.ret == 0, result.stdout.str()
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    built = {pid for pid, r in rows.items() if r["status"] == "passed"}
    unbuilt = {"rotary", "attention", "output"}
    assert built == {pid for pid in rows if pid.rsplit(".", 1)[-1] not in unbuilt}
    assert "not built by --hw nxdi: not built yet: NxDI's attention takes" in rows["layer_0.attention"]["reason"]
    assert {c["tp_degree"] for c in testing.CALLS} == {2}
    assert any(c["signature"][0][0][:2] == (1, 1) for c in testing.CALLS)  # decode steps trace their own graph


@pytest.mark.parametrize(
    "fault, first",
    [
        (faults.swap_gate_up(2), "layer_2.experts"),
        (faults.scale("post_attention_layernorm", 1, 1.5), "layer_1.post_attn_norm"),
        (faults.scale_rows("lm_head", [3, 5], 2.0), "logits"),
    ],
    ids=["gate-up-swapped", "norm-scaled", "lm-head-rows"],
)
def test_a_checkpoint_fault_fails_at_its_nxdi_module(
    fault, first, nxdi_double, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), tmp_path / "c", fault)
    pytester.syspathinsert(DOUBLES)
    result = run_parity(pytester, golden, "--hw", "nxdi", "--dtype", "bfloat16", "-x", model=candidate)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*first divergence: {first} *"])
    assert result.parseoutcomes()["failed"] == 1


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
    args = ("--hw", "nxdi", "--dtype", "bfloat16", "--parity-weights", "-v")
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
