"""`--hw nxdi --hw-option build=cpu` on NxDI's real DBRX and Llama 4 text modules, from tiny goldens
recorded under transformers 5 (prefill and two decode steps). DBRX (models/dbrx: its fused-QKV attention
with clip_qkv, its bias-free LayerNorms, the older modules/moe MoE with a softmax router whose top-k
affinities are renormalised): every point clean at TP 1 and 2 in float32 and bfloat16. Llama 4
(models/llama4/modeling_llama4_text: chunked attention with an L2 QK norm after the rotary, NoPE
layers, a sigmoid top-1 router, a shared expert): NxDI 2.29 builds its QK norm with eps 1e-6 where the
model's is `rms_norm_eps` (`L2Norm(config.rms_norm_eps)` passes the eps as L2Norm's `dim`), which float32
finds at the first attention with a QK norm, and bfloat16's rounding hides; with that eps corrected (as a
fixed port would build it), every point is clean at TP 1 and 2 in both. For each, a fault in NxDI's weight
conversion fails first at its point."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import read_json, run_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

CPU = ("--hw", "nxdi", "--hw-option", "build=cpu")
# the points NxDI's modules do not build, per architecture, and why (the table's `unavailable`)
UNAVAILABLE = {
    "dbrx": {"rotary": "NxDI computes the rotary embedding inside each attention module"},
    "llama4_text": {
        "rotary": "NxDI computes the rotary embedding inside each attention module",
        "experts": "transformers' Llama4TextExperts is called on every expert's copy of the tokens",
    },
}


@pytest.fixture
def qk_norm_eps_corrected(monkeypatch: pytest.MonkeyPatch):
    """NxDI's Llama 4 attention with its QK norm's eps the config's `rms_norm_eps` (NxDI 2.29's
    `L2Norm(config.rms_norm_eps)` leaves it L2Norm's default 1e-6); the CPU build's ranks started
    afresh, so that they fork with the correction, and closed after, so that none outlives it."""
    from neuronx_distributed_inference.models.llama4 import modeling_llama4_text

    from pytest_moe_parity.backends.nxdi.cpu import ranks

    attention = modeling_llama4_text.NeuronLlama4Attention
    init = attention.__init__

    def corrected(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        if self.qk_norm is not None:
            self.qk_norm.eps = config.rms_norm_eps

    ranks.close_pools()
    monkeypatch.setattr(attention, "__init__", corrected)
    yield
    ranks.close_pools()


def points(golden: Path) -> list[str]:
    return GoldenStore(golden).point_ids


def unavailable(arch: str, ids: list[str]) -> list[str]:
    return [p for p in ids if p.rpartition(".")[2] in UNAVAILABLE[arch]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", list(UNAVAILABLE))
def test_a_clean_run_passes_every_point_on_nxdi_s_real_modules(
    arch: str, tp: int, dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every point NxDI builds passes, prefill and decode (Llama 4's chunked layers' decode steps on
    NxDI's chunk-sized cache); the others are skipped with the table's reason. Llama 4: its QK norm's
    eps corrected."""
    if arch == "llama4_text":
        request.getfixturevalue("qk_norm_eps_corrected")
    golden = t5 / f"{arch}-golden"
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", dtype, "--parity-report", str(report),
        "-W", "error", model=t5 / f"{arch}-model",
    )  # fmt: skip
    ids = points(golden)
    skipped = unavailable(arch, ids)
    result.assert_outcomes(passed=len(ids) - len(skipped), skipped=len(skipped))
    rows = {r["id"]: r for r in read_json(report / "comparison_report.json")["points"]}
    for pid in skipped:
        assert UNAVAILABLE[arch][pid.rpartition(".")[2]] in rows[pid]["reason"], rows[pid]
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None
    assert any(p.endswith("layer_1.experts") for p in ids) and any(p.startswith("step_2.") for p in ids)


@pytest.mark.parametrize("tp", [1, 2])
def test_nxdi_s_llama4_qk_norm_eps_fails_float32_first_at_the_first_qk_normed_attention(
    tp: int, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """NxDI 2.29's Llama 4 as shipped: its QK norm's eps (1e-6 for the model's 1e-5) puts the first
    attention with a QK norm (layer 0: chunked, with rotary) past float32's limit, by an error of that
    eps's size (its direction right); every point before it passed."""
    golden = t5 / "llama4_text-golden"
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", "float32", "-x",
        "--parity-report", str(report), model=t5 / "llama4_text-model",
    )  # fmt: skip
    ids = points(golden)
    before = ids[: ids.index("layer_0.attention")]
    skipped = unavailable("llama4_text", before)
    result.assert_outcomes(passed=len(before) - len(skipped), skipped=len(skipped), failed=1)
    result.stdout.fnmatch_lines(["first divergence: layer_0.attention *"])
    row = {r["id"]: r for r in read_json(report / "comparison_report.json")["points"]}["layer_0.attention"]
    out = row["metrics"]["out"]
    assert 1e-5 < out["rel_l2"] < 1e-3 and out["cosine"] > 0.9999, out


@pytest.mark.parametrize("tp", [1, 2])
def test_nxdi_s_llama4_as_shipped_passes_in_bfloat16(
    tp: int, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The QK norm's eps is under bfloat16's rounding: NxDI's Llama 4 as shipped passes every point."""
    golden = t5 / "llama4_text-golden"
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", "bfloat16",
        "--parity-report", str(report), model=t5 / "llama4_text-model",
    )  # fmt: skip
    ids = points(golden)
    skipped = unavailable("llama4_text", ids)
    result.assert_outcomes(passed=len(ids) - len(skipped), skipped=len(skipped))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None


def _dbrx_gate_and_up_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxDI's DBRX conversion concatenates the experts' up projection (v1) before the gate (w1)."""
    from neuronx_distributed_inference.models.dbrx import modeling_dbrx

    convert = modeling_dbrx.convert_dbrx_to_neuron_state_dict

    def swapped(state, config):
        out = convert(state, config)
        for key in [k for k in out if k.endswith("expert_mlps.mlp_op.gate_up_proj.weight")]:
            gate, up = out[key].chunk(2, dim=-1)
            out[key] = torch.cat([up, gate], dim=-1)
        return out

    monkeypatch.setattr(modeling_dbrx, "convert_dbrx_to_neuron_state_dict", swapped)


def _llama4_shared_gate_and_up_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxDI's Llama 4 conversion maps the shared expert's gate projection where its up projection goes."""
    from neuronx_distributed_inference.models.llama4 import modeling_llama4_text

    application = modeling_llama4_text.NeuronLlama4TextForCausalLM
    convert = application.convert_hf_to_neuron_state_dict

    def swapped(state, config):
        out = convert(state, config)
        for gate in [k for k in out if k.endswith("shared_experts.gate_proj.weight")]:
            up = gate.replace("gate_proj", "up_proj")
            out[gate], out[up] = out[up], out[gate]
        return out

    monkeypatch.setattr(application, "convert_hf_to_neuron_state_dict", staticmethod(swapped))


@pytest.mark.parametrize(
    ("arch", "fault", "where"),
    [
        ("dbrx", _dbrx_gate_and_up_swapped, "layer_0.experts"),
        ("llama4_text", _llama4_shared_gate_and_up_swapped, "layer_0.shared_experts"),
    ],
    ids=["dbrx-gate-up-swapped", "llama4-shared-gate-up-swapped"],
)
def test_a_conversion_fault_fails_first_at_its_point(
    arch: str,
    fault,
    where: str,
    t5: Path,
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A fault in NxDI's own weight conversion: the run stops at the first point whose module holds the
    faulty tensors, every point before it passed (those NxDI does not build skipped). Llama 4: its QK
    norm's eps corrected, so that the fault is the run's one divergence."""
    if arch == "llama4_text":
        request.getfixturevalue("qk_norm_eps_corrected")
    golden = t5 / f"{arch}-golden"
    fault(monkeypatch)
    report = tmp_path / "r"
    result = run_parity(pytester, golden, *CPU, "-x", "--parity-report", str(report), model=t5 / f"{arch}-model")
    ids = points(golden)
    before = ids[: ids.index(where)]
    skipped = unavailable(arch, before)
    result.assert_outcomes(passed=len(before) - len(skipped), skipped=len(skipped), failed=1)
    result.stdout.fnmatch_lines([f"first divergence: {where} *"])
    result.stdout.fnmatch_lines([f"FAILED *parity::{where} *"])
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == where
