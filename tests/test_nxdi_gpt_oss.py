"""`--hw nxdi`'s GPT-OSS table and what it needs of the backend, without NxDI (tests_neuron/
test_real_nxdi_gpt_oss.py runs it on NxDI's real modules): the table's data, a sliding layer's cache
after a decode step, the YaRN length NxDI's GPT-OSS config reads, a float checkpoint refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.backends.nxdi.calls import cache_after
from pytest_moe_parity.tree import CacheState

GPT_OSS = "neuronx_distributed_inference.models.gpt_oss.modeling_gpt_oss"


def test_the_gpt_oss_table_builds_nxdi_s_gpt_oss_modules() -> None:
    table = nxdi.load_module_table("gpt_oss")
    assert table is not None and "gpt_oss" in nxdi.tables()
    assert table.application == f"{GPT_OSS}:NeuronGptOssForCausalLM"
    assert table.layer_configs == f"{GPT_OSS}:get_updated_configs"
    assert table.window_cache and table.checkpoint["model_level"] == ["norm.weight"]
    assert table.checkpoint_quant["quant_method"] == "mxfp4"
    parts = table.components
    assert {c: s.call for c, s in parts.items() if s.module == "layers.{layer}.feed_forward"} == {
        "router": "moe.router",
        "experts": "moe.expert_mlps",
        "moe": "",
    }
    assert parts["output"].literals["layer_idx"] == "$layer"
    assert parts["output"].call_kwargs == {"cos_cache": None, "sin_cache": None}
    assert parts["output"].before_call == "rotary_cache_manager.clear_cache"
    assert set(table.unavailable) == {"rotary"}


def _cache(positions: int, window: int | None = None, seen: int | None = None) -> CacheState:
    keys = torch.arange(positions, dtype=torch.float32).reshape(1, 1, positions, 1)
    return CacheState(0, keys, keys + 100, window, seen)


def test_a_sliding_layer_s_cache_after_a_step_keeps_its_window() -> None:
    """The window - 1 latest positions (what transformers' sliding layer and NxDI's rolling buffer keep),
    one more seen; a full layer's cache grows by the step."""
    past = _cache(7, window=8, seen=16)
    new = torch.full((1, 1, 1, 1), 7.0)
    after = cache_after(past, past.keys, past.values, new, new + 100)
    assert after.keys.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert after.values.flatten().tolist() == [101, 102, 103, 104, 105, 106, 107]
    assert (after.window, after.seen) == (8, 17)
    full = cache_after(_cache(16), _cache(16).keys, _cache(16).values, new, new)
    assert full.keys.shape[2] == 17 and full.window is None


def test_nxdi_reads_yarn_s_pre_extension_length_as_initial_context_length(tiny_model) -> None:
    """transformers 5 writes it in rope_parameters alone; NxDI's GPT-OSS config requires it by its
    release's other name."""
    import warnings

    model = tiny_model("gpt_oss")
    written = json.loads((model / "config.json").read_text())
    with warnings.catch_warnings():  # NxDI's names, set under transformers 5: its deprecation of rope_scaling
        warnings.simplefilter("ignore", FutureWarning)
        config = nxdi.nxdi_hf_config(model)
    assert config.initial_context_length == written["rope_parameters"]["original_max_position_embeddings"]


@pytest.mark.parametrize("quant", [None, "fp8-block"])
def test_a_checkpoint_nxdi_s_gpt_oss_conversion_cannot_read_is_refused(quant: str | None, tmp_path: Path) -> None:
    """Checked before NxDI is needed: the table's layout against the checkpoint's config."""
    from types import SimpleNamespace

    from pytest_moe_parity.backends.nxdi.backend import NxdiBackend
    from pytest_moe_parity.errors import BackendError

    config = {"model_type": "gpt_oss"}
    if quant:
        config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    backend = SimpleNamespace(table=nxdi.load_module_table("gpt_oss"))
    held = "is quantized with fp8" if quant else "is not quantized"
    with pytest.raises(BackendError, match=f"reads the experts in the hub's MXFP4 layout alone .*{held}: pass the"):
        NxdiBackend._check_layout(backend, tmp_path)
