"""The lazy candidate: one layer's weights read from the sharded hub-layout checkpoint, fused as
transformers fuses them, evicted again when the run moves on."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from pytest_moe_parity.backends import BackendSetup
from pytest_moe_parity.backends.hf import TorchBackend
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.model.lazy_model import SYNC_LOAD_VARIABLE, CheckpointError, LazyModel, _UnitStateDict
from pytest_moe_parity.record.reference import load_model
from pytest_moe_parity.record.tiny import available_archs
from pytest_moe_parity.replay.runner import cast_inputs


@pytest.mark.parametrize("arch", available_archs())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_layer_matches_the_full_load(arch: str, dtype: torch.dtype, tiny_model) -> None:
    """Bit for bit what transformers' own loading makes, the experts' gate and up joined in one copy
    (`model.conversion`) where transformers stacks and then concatenates."""
    path = tiny_model(arch)
    lazy = LazyModel(path, dtype=dtype)
    lazy.ensure(2)
    full = load_model(path, dtype=dtype, device="cpu", device_map=None, max_memory=None).state_dict()
    loaded = {k: v for k, v in lazy.model.state_dict().items() if v.device.type != "meta"}
    prefix = f"{lazy.unit_path(2)}."  # model.layers.2. (DBRX: transformer.blocks.2.)
    layer2 = {k for k in full if k.startswith(prefix)}
    assert layer2 and layer2 <= loaded.keys()
    for key in layer2:  # fused experts, fp32-kept buffers (DeepSeek's score bias) included
        assert loaded[key].dtype == full[key].dtype and torch.equal(loaded[key], full[key]), key
    params = {n for n, p in lazy.model.named_parameters() if p.device.type != "meta"}
    assert params and all(n.startswith(prefix) for n in params)
    assert all(k.startswith(prefix) for k in lazy.stats.keys)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert lazy.stats.files == {index[k] for k in lazy.stats.keys}


def test_a_layer_read_shows_the_loader_that_layer_not_the_whole_model(tiny_model, monkeypatch) -> None:
    """transformers' loader takes the model's state dict at every call (a walk of every module of every
    layer, per layer read): a decoder layer's read hands it the layer's own, any other name answered
    from the module it names as the whole state dict answers it."""
    lazy = LazyModel(tiny_model("qwen3_moe"), dtype=torch.bfloat16)
    whole = lazy.model.state_dict()
    walks: list[str] = []
    real = type(lazy.model).state_dict
    monkeypatch.setattr(type(lazy.model), "state_dict", lambda self, *a, **k: walks.append("") or real(self, *a, **k))
    lazy.ensure(1)
    assert walks == []  # (test_one_layer_matches_the_full_load: the weights read are transformers' own)
    scoped = _UnitStateDict(lazy.model, lazy.unit_path(1))
    assert set(scoped) == {k for k in whole if k.startswith("model.layers.1.")}
    others = ["model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight", "layers.1.mlp.gate.bias",
              "model.layers.1.nope.weight", "model.nope.weight", "model.rotary_emb.inv_freq", "nope"]  # fmt: skip
    for name in others:
        assert (name in scoped) == (name in whole), name
        assert (scoped.get(name) is None) == (whole.get(name) is None), name


@pytest.mark.parametrize("arch", available_archs())
def test_the_skeleton_computes_its_buffers_as_a_full_load_does(arch: str, tiny_model) -> None:
    """The skeleton skips transformers' weight initialisation (its parameters stay on meta until
    read), so its buffers are only what the modules' constructors compute: the same as a full load's."""
    path = tiny_model(arch)
    model = LazyModel(path, dtype=torch.bfloat16, max_layers=None)
    for unit in [*range(model.num_layers), *model.model_level_paths()]:  # buffers read with a unit too
        model.module(model.unit_path(unit))
    lazy = dict(model.model.named_buffers())
    full = dict(load_model(path, dtype=torch.bfloat16, device="cpu", device_map=None, max_memory=None).named_buffers())
    assert lazy.keys() == full.keys() and (lazy or arch == "jamba")  # Jamba has no rotary frequencies
    for name, buf in lazy.items():
        assert buf.dtype == full[name].dtype and torch.equal(buf, full[name]), name


def _resident_layers(lazy: LazyModel) -> set[int]:
    """The decoder layers whose parameters are materialised."""
    params = lazy.model.named_parameters()
    return {int(n.split(".")[2]) for n, p in params if p.device.type != "meta" and ".layers." in n}


def test_layers_are_evicted_as_the_run_moves_on(tiny_model) -> None:
    lazy = LazyModel(tiny_model("mixtral"), dtype=torch.float32, max_layers=2)
    for i in range(4):
        lazy.module(f"model.layers.{i}.self_attn")
    lazy.module("lm_head")
    assert lazy.loaded_units == {"layer_2", "layer_3", "lm_head"}
    assert lazy.evicted == ["layer_0", "layer_1"]
    assert _resident_layers(lazy) == {2, 3}
    lazy.module("model.layers.0.mlp")  # reloads on demand
    assert "layer_0" in lazy.loaded_units and "layer_2" not in lazy.loaded_units


def test_the_next_unit_of_the_plan_is_read_while_this_one_runs(tiny_model) -> None:
    lazy = LazyModel(tiny_model("mixtral"), dtype=torch.float32, max_layers=2)
    plan = ["model.embed_tokens"] + [f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn", "mlp")]
    lazy.plan([*plan, "model.norm", "lm_head"])
    resident = []
    for path in plan:
        lazy.module(path)
        lazy._join()  # the read-ahead done: at most `max_layers` layers, the current one among them
        layer = lazy.layer_of(path)
        resident.append(_resident_layers(lazy))
        assert layer is None or layer in resident[-1]
        assert len(resident[-1]) <= 2
    assert resident[0] == {0}  # read ahead after the embedding
    assert resident[1] == {0, 1} and resident[-1] == {2, 3}  # after layer 3: the norm, no layer
    assert "model.norm" in lazy.loaded_units
    # every unit was read once: no read was lost or repeated
    assert sorted(lazy.stats.keys) == sorted(set(lazy.stats.keys))
    lazy.close()


@pytest.mark.parametrize("user_setting", [None, "0"])
def test_reading_ahead_loads_on_the_reading_thread(tiny_model, monkeypatch, user_setting: str | None) -> None:
    import transformers.core_model_loading as loading

    pools: list[str] = []  # the thread of each load that materialised its tensors on transformers' pool

    class CountedPool(loading.ThreadPoolExecutor):
        def __init__(self, *args, **kwargs) -> None:
            pools.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(loading, "ThreadPoolExecutor", CountedPool)
    if user_setting is None:
        monkeypatch.delenv(SYNC_LOAD_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(SYNC_LOAD_VARIABLE, user_setting)
    lazy = LazyModel(tiny_model("mixtral"), dtype=torch.float32, max_layers=2)
    lazy.plan([f"model.layers.{i}.mlp" for i in range(4)])
    for i in range(4):
        lazy.module(f"model.layers.{i}.mlp")
    lazy.close()
    assert os.environ.get(SYNC_LOAD_VARIABLE) == user_setting  # put back, or the user's left as it was
    if user_setting is None:  # the first layer, read before anything ran, on the pool; the rest on one thread
        assert pools == [threading.current_thread().name]
    else:  # the user asked for transformers' threads
        assert len(pools) == 4


@pytest.mark.parametrize("threads", [None, 3])
def test_the_forwards_leave_a_core_to_the_reader_while_it_reads(
    golden_dir, tiny_model, monkeypatch, threads: int | None
) -> None:
    """While the next layer is read in the background, the forwards take torch's threads less one
    (the reader has a core of its own), and all of them once it is read; `--hw-option threads` sets
    them from the start, for good; the caller's setting is put back on close."""
    options = {} if threads is None else {"threads": str(threads)}
    backend = TorchBackend(BackendSetup(GoldenStore(golden_dir("mixtral")), tiny_model("mixtral"), options=options))
    release = threading.Event()
    load_keys = LazyModel._load_keys

    def held_read(self: LazyModel, keys: list[str]) -> None:
        if any(self.layer_of(k) == 1 for k in keys):
            assert release.wait(30)
        load_keys(self, keys)

    monkeypatch.setattr(LazyModel, "_load_keys", held_read)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        backend.start()
        lazy = backend.lazy
        assert lazy is not None and torch.get_num_threads() == (4 if threads is None else 3)
        lazy.plan([f"model.layers.{i}.mlp" for i in range(3)])
        lazy.module("model.layers.0.mlp")  # the read of layer 1 starts, and is held
        assert lazy._ahead is not None and torch.get_num_threads() == 3
        lazy.module("model.layers.0.self_attn")
        assert torch.get_num_threads() == 3  # still reading
        release.set()
        lazy._ahead[1].result()
        lazy.module("model.layers.0.mlp")
        assert torch.get_num_threads() == (4 if threads is None else 3)  # read: the core is the forwards' again
        lazy.module("model.layers.1.mlp")
        backend.close()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_a_model_built_while_another_reads_ahead_leaves_that_read_alone(tiny_model, monkeypatch) -> None:
    """accelerate's `init_empty_weights` puts every parameter registered in any thread on the meta
    device while a model is built on it: a layer read in the background meanwhile (the drill builds
    the reference's model while the candidate reads its next layer) must not lose its weights to it."""
    import transformers

    reading, building, loaded = threading.Event(), threading.Event(), threading.Event()
    load_keys, from_config = LazyModel._load_keys, transformers.AutoModelForCausalLM.from_config

    def read(self: LazyModel, keys: list[str]) -> None:
        if any(self.layer_of(k) == 1 for k in keys) and not building.is_set():  # the read ahead of layer 1
            reading.set()
            assert building.wait(30)
            load_keys(self, keys)
            loaded.set()
        else:
            load_keys(self, keys)

    def build(*args, **kwargs):  # inside `init_empty_weights`: the read ahead goes on meanwhile
        assert reading.wait(30)
        building.set()
        loaded.wait(2)  # (it cannot finish while the model is being built)
        return from_config(*args, **kwargs)

    path = tiny_model("jamba")
    candidate = LazyModel(path, dtype=torch.float32, max_layers=2)
    monkeypatch.setattr(LazyModel, "_load_keys", read)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", build)
    candidate.plan([candidate.unit_path(0), candidate.unit_path(1)])
    candidate.module(candidate.unit_path(0))  # layer 1 is read in the background from here
    LazyModel(path, dtype=torch.float32)  # another model built meanwhile (the drill's reference)
    layer = candidate.module(candidate.unit_path(1))
    assert not [n for n, p in layer.named_parameters() if p.device.type == "meta"]
    candidate.close()


def test_a_plan_of_one_layer_reads_that_layer_only(tiny_model) -> None:
    lazy = LazyModel(tiny_model("mixtral"), dtype=torch.float32)
    lazy.plan(["model.layers.2.self_attn", "model.layers.2.mlp.gate", "model.layers.2.mlp"])
    lazy.module("model.layers.2.self_attn")
    lazy.module("model.layers.2.mlp")
    lazy.close()
    assert lazy.stats.keys and all(".layers.2." in k for k in lazy.stats.keys)


def test_one_layer_at_a_time_reads_nothing_ahead(tiny_model) -> None:
    lazy = LazyModel(tiny_model("mixtral"), dtype=torch.float32, max_layers=1)
    lazy.plan([f"model.layers.{i}.mlp" for i in range(3)])
    lazy.module("model.layers.0.mlp")
    assert lazy._ahead is None and _resident_layers(lazy) == {0}


def _without_layer_3_q_proj(model: Path, path: Path) -> Path:
    """A copy of the checkpoint whose index lost layer 3's q_proj."""
    import shutil

    shutil.copytree(model, path)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".layers.3.self_attn.q_proj" not in k}
    index_path.write_text(json.dumps(index))
    return path


def test_a_failed_read_ahead_is_the_error_of_the_unit_it_read(tiny_model, tmp_path: Path) -> None:
    path = _without_layer_3_q_proj(tiny_model("olmoe"), tmp_path / "m")
    lazy = LazyModel(path, dtype=torch.float32)
    lazy.plan(["model.layers.2.self_attn", "model.layers.3.self_attn"])
    lazy.module("model.layers.2.self_attn")  # layer 3 is read meanwhile, and fails: not layer 2's error
    with pytest.raises(CheckpointError, match=r"lacks weights for layer_3: .*q_proj"):
        lazy.module("model.layers.3.self_attn")
    with pytest.raises(CheckpointError, match=r"lacks weights for layer_3"):  # asked again: the same error
        lazy.module("model.layers.3.self_attn")
    lazy.close()


def test_missing_layer_weights_are_a_clear_error(tiny_model, tmp_path: Path) -> None:
    path = _without_layer_3_q_proj(tiny_model("olmoe"), tmp_path / "m")
    lazy = LazyModel(path, dtype=torch.float32)
    lazy.module("model.layers.2.self_attn")
    with pytest.raises(CheckpointError, match=r"lacks weights for layer_3: .*q_proj"):
        lazy.module("model.layers.3.self_attn")


def test_not_a_safetensors_checkpoint(tmp_path: Path, tiny_model) -> None:
    import shutil

    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(tiny_model("olmoe") / "config.json", path)
    with pytest.raises(CheckpointError, match="only safetensors checkpoints can be read one layer at a time"):
        LazyModel(path, dtype=torch.float32)


def test_golden_inputs_are_cast_like_the_candidate_builds_them() -> None:
    mask = torch.tensor([[0.0, torch.finfo(torch.float32).min]])
    hidden = torch.randn(2, 3)
    ids = torch.tensor([1, 2])
    args = cast_inputs((hidden, {"mask": mask, "ids": ids, "flag": True}), torch.bfloat16, torch.device("cpu"))
    assert args[0].dtype == torch.bfloat16
    m = args[1]["mask"]
    # float32's minimum would round to -inf in bf16; the candidate's own mask uses bf16's minimum
    assert m.dtype == torch.bfloat16 and m[0, 1] == torch.finfo(torch.bfloat16).min and torch.isfinite(m).all()
    assert args[1]["ids"].dtype == torch.int64 and args[1]["flag"] is True


def test_fused_checkpoint_layout_loads_too(tmp_path: Path) -> None:
    """A checkpoint saved in transformers' own fused layout (save_original_format=False)."""
    from pytest_moe_parity.record.tiny import build_tiny_model

    model = build_tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path, save_original_format=False, max_shard_size="300KB")
    lazy = LazyModel(tmp_path, dtype=torch.float32)
    lazy.module("model.layers.1.mlp")
    assert "model.layers.1.mlp.experts.gate_up_proj" in lazy.stats.keys
    state = model.state_dict()
    loaded = {k: v for k, v in lazy.model.state_dict().items() if ".layers.1." in k}
    assert loaded and all(torch.equal(v, state[k]) for k, v in loaded.items())


def test_the_experts_gate_and_up_are_joined_in_one_copy_as_transformers_joins_them(tiny_model) -> None:
    """`model.conversion.fused` replaces exactly transformers' stack-then-concatenate pairs; their
    result is torch's, lists, stacked tensors and negative dims alike, and anything irregular is
    left to torch (its promotion and its errors)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist

    from pytest_moe_parity.model.conversion import fused, stack_concat

    lazy = LazyModel(tiny_model("qwen3_moe"), dtype=torch.float32)
    mapping = get_model_conversion_mapping(lazy.model)
    pairs = [
        i
        for i, e in enumerate(mapping)
        if [type(op) for op in getattr(e, "operations", [])] == [MergeModulelist, Concatenate]
    ]
    done = fused(mapping)
    assert pairs and len(done) == len(mapping)
    for i, (before, after) in enumerate(zip(mapping, done, strict=True)):
        if i in pairs:
            assert [type(op).__name__ for op in after.operations] == ["StackConcat"]
            assert after.source_patterns == before.source_patterns and after.target_patterns == before.target_patterns
            assert [type(op) for op in before.operations] == [MergeModulelist, Concatenate]  # the original kept
        else:
            assert after is before
    gen = torch.Generator().manual_seed(0)
    gate = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    up = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    for dim in (0, 1, 2, -1):
        want = torch.cat([torch.stack(gate), torch.stack(up)], dim=dim)
        assert torch.equal(stack_concat([list(gate), list(up)], dim), want), dim
        assert torch.equal(stack_concat([torch.stack(gate), list(up)], dim), want), dim
    mixed = [list(gate), [t.double() for t in up]]
    assert torch.equal(stack_concat(mixed, 1), torch.cat([torch.stack(gate), torch.stack([t.double() for t in up])], 1))
    with pytest.raises(RuntimeError):
        stack_concat([list(gate), [torch.randn(5, 4)] * 3], 2)


def test_a_shard_missing_or_not_safetensors_is_one_sentence_naming_it(tmp_path: Path) -> None:
    """Every reader of a checkpoint's shards (the lazy loader, the dequantizer, the quantized weight
    items) opens them through `Shards`: each once, and a bad one is the caller's error naming it."""
    from safetensors.torch import save_file

    from pytest_moe_parity.errors import BadInput
    from pytest_moe_parity.model.checkpoint import Shards

    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "b.safetensors").write_bytes(b"not a safetensors file")
    with Shards(tmp_path) as shards:
        assert shards.handle("a.safetensors") is shards.handle("a.safetensors")
        assert torch.equal(shards.handle("a.safetensors").get_tensor("w"), torch.ones(2))
        assert shards.opened == {"a.safetensors"}
        with pytest.raises(CheckpointError, match=r"c\.safetensors \(named by the checkpoint index\) is missing$"):
            shards.handle("c.safetensors")
    assert shards.opened == set()
    with (
        Shards(tmp_path, BadInput) as shards,
        pytest.raises(BadInput, match=r"b\.safetensors cannot be read as safetensors \("),
    ):
        shards.handle("b.safetensors")
