"""`--hw-option quantized=int8|f8e4m3` on NxDI's and NxD's real code (issue 51, item 4): the quantized
state dict NxDI's `save_quantized_state_dict` writes (NxD's `quantize_pytorch_model_per_channel_symmetric`
over transformers 4.57's model, every nn.Linear: attention, router, each expert, lm_head), read back
per unit under the checkpoint's names and judged as stored against the checkpoint's float tensors. Weight
items are off on this stack (they read the reference as transformers 5 lays it out), so the backend's
`held_quantized` is judged here directly, as the items judge it where transformers 5 runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CPU = ["build=cpu"]


def _reference(model: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from pytest_moe_parity.model.checkpoint import weight_map

    files = weight_map(model)
    out = {}
    for name in names:
        with safe_open(str(model / files[name]), framework="pt") as fh:
            out[name] = fh.get_tensor(name).float()
    return out


def _judged(t5: Path, dtype: str, layer: int | None) -> dict[str, list[str]]:
    """Each quantized tensor of the unit, as NxDI's quantized state dict stores it, judged: its findings."""
    from helpers import session

    from pytest_moe_parity.judge.quant_weights import judge_quantized

    run = session(t5 / "qwen3_moe-golden", t5 / "qwen3_moe-model", hw="nxdi", hw_options=[*CPU, f"quantized={dtype}"])
    try:
        stored = run.runner.backend.held_quantized(layer)
    finally:
        run.close()
    assert stored, f"no quantized tensor of unit {layer}"
    ref = _reference(t5 / "qwen3_moe-model", list(stored))
    return {name: judge_quantized(name, ref[name], s.dequantized(), s).findings for name, s in stored.items()}


@pytest.mark.parametrize("dtype", ["int8", "f8e4m3"])
def test_nxdi_s_own_quantization_is_within_one_rounding_per_channel(dtype: str, t5: Path) -> None:
    """Every linear NxD quantizes (q/k/v/o, the router, each expert's projections; lm_head at model
    level) is within one rounding of its format at its output channel's scale."""
    judged = _judged(t5, dtype, 1)
    assert "model.layers.1.self_attn.q_proj.weight" in judged
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in judged), sorted(judged)
    assert not {n: f for n, f in judged.items() if f}
    assert not {n: f for n, f in _judged(t5, dtype, None).items() if f}


def test_a_scale_inverted_in_nxdi_s_quantized_state_dict_names_its_tensor(
    t5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One layer's q_proj scales inverted in the state dict NxDI writes: that tensor fails, naming the
    channels and the bug; the layer's other tensors pass."""
    from pytest_moe_parity.backends.nxdi.tables import load_module_table, resolve

    application = resolve(load_module_table("qwen3_moe").application)
    prepare = application.prepare_quantized_state_dict.__func__

    def inverted(cls, model):
        state = prepare(cls, model)
        state["layers.1.self_attn.q_proj.scale"] = 1 / state["layers.1.self_attn.q_proj.scale"]
        return state

    monkeypatch.setattr(application, "prepare_quantized_state_dict", classmethod(inverted))
    judged = _judged(t5, "int8", 1)
    failing = {n: f for n, f in judged.items() if f}
    assert list(failing) == ["model.layers.1.self_attn.q_proj.weight"], failing
    finding = failing["model.layers.1.self_attn.q_proj.weight"][0]
    assert "channel" in finding and "the scale used where its inverse is meant" in finding, finding
