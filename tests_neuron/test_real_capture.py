"""The NxDI tensor-capture tables (`nxdi_maps/`, read by `--hw dump`) against NxD's real capture
hooks on NxDI's real model, on the CPU: every module a table names exists in NxDI's model, and the
tensor NxDI keeps for it (its first registered output, `NeuronBaseModel._find_first_captured_tensor_
for_module`; NxD registers tuples by index) is the point's output, not another of the module's."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.dump.nxdi_capture import MAPS_DIR
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.tree import first_tensor


@pytest.fixture
def cpu_group():
    """A one-rank gloo group in this process, as NxDI's `init_cpu_env` makes one."""
    from neuronx_distributed.parallel_layers import parallel_state

    with tempfile.TemporaryDirectory() as store:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, skip_collective_init=True)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_capture_table_names_what_nxdi_keeps(arch: str, t5: Path, cpu_group, monkeypatch) -> None:
    from neuronx_distributed.utils.tensor_capture import api
    from neuronx_distributed.utils.tensor_capture.model_modification import find_available_modules
    from neuronx_distributed.utils.tensor_capture.registry import TensorRegistry

    monkeypatch.setenv("NXD_CPU_MODE", "1")
    table = nxdi.load_module_table(arch)
    with nxdi.upstream_warnings():
        neuron_config = nxdi.resolve(table.neuron_config)(tp_degree=1, torch_dtype=torch.float32)
        adapter = nxdi.resolve("neuronx_distributed_inference.utils.hf_adapter:load_pretrained_config")
        config = nxdi.resolve(table.config)(
            neuron_config, load_config=adapter(hf_config=nxdi.nxdi_hf_config(t5 / f"{arch}-model"))
        )
        model = nxdi.resolve(table.application)._model_cls(config).eval()
    capture_map = json.loads((MAPS_DIR / f"{arch}.json").read_text())["modules"]
    names = {pid.format(layer=0): name.format(layer=0) for pid, name in capture_map.items()}
    available = set(find_available_modules(model))
    assert not [n for n in names.values() if n not in available]

    golden = GoldenStore(t5 / f"{arch}-golden")
    seq, hidden = golden.load("layer_0.input_norm").output.shape[1:]
    with nxdi.upstream_warnings():
        api.enable_tensor_capture(model, [*names.values(), "layers.0.self_attn"])
    try:
        h = torch.randn(1, seq, hidden)
        with torch.no_grad(), nxdi.upstream_warnings():
            model.embed_tokens(torch.arange(seq)[None])
            model.layers[0](
                hidden_states=h,
                attention_mask=torch.ones(seq, seq, dtype=torch.bool).tril()[None, None],
                position_ids=torch.arange(seq, dtype=torch.int32)[None],
                past_key_value=None,
            )
            model.norm(h)
        captured = TensorRegistry.get_instance().get_module_tensors()
        kept = {
            n: model._find_first_captured_tensor_for_module(captured, n, "outputs", "cpu")
            for n in captured and [*names.values(), "layers.0.self_attn"]
        }
    finally:
        api.disable_tensor_capture(model)
    for pid, name in names.items():
        expected = first_tensor(golden.load(pid).output)
        assert kept[name].shape == expected.shape, (pid, name, kept[name].shape, expected.shape)
    # self_attn's own first output is its cos cache, not its output: the table names o_proj
    attention = first_tensor(golden.load("layer_0.attention").output)
    assert kept["layers.0.self_attn"].shape != attention.shape
    assert "cos cache" in json.loads((MAPS_DIR / f"{arch}.json").read_text())["notes"]["layer_{layer}.attention"]
