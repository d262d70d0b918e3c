"""A real NxDI tensor capture of a left-padded batch, read and judged by the dump route: NxDI's
application class (`NeuronQwen3MoeForCausalLM`, on the CPU through its `to_cpu` path) runs the
context encoding of the three prompts of `fixtures/prompts/padded.jsonl`, left-padded to a bucket
of 16 tokens, with every module the qwen3_moe capture table names in `TensorCaptureConfig`, and
writes its capture files through `get_tensor_capture_hook`; `moe-parity compare` judges them
against the same batch recorded under transformers 5 (`qwen3_moe-bucket`), on each row's real
tokens. NxDI loads the transformers-5 checkpoint as written (its experts are saved per expert,
`mlp.experts.{e}.gate_proj`, the layout NxDI's `convert_hf_to_neuron_state_dict` reads); only its
config is read through `nxdi_hf_config`, as the backend reads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import read_json
from safetensors.torch import load_file, save_file

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.cli import main
from pytest_moe_parity.dump.nxdi_capture import MAPS_DIR
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.model.checkpoint import weight_map
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

BUCKET = "qwen3_moe-bucket"  # padded.jsonl's prompts, left-padded to 16 tokens (`moe-parity golden --pad-to 16`)
BATCH = "qwen3_moe-batch"  # the same prompts left-padded to the longest (8 tokens)
ROWS = [8, 3, 6]  # the prompts' real tokens
# NxD's and NxDI's own notices on the way (the attention's q, k, v keys left over once NxDI's conversion
# has moved them into qkv_proj; an indexing style torch deprecates, in NxDI's KV cache): about their code
upstream_notices = [
    pytest.mark.filterwarnings("ignore:Removing redundant keys from checkpoint:UserWarning"),
    pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing:UserWarning"),
]


def capture_table() -> dict:
    return json.loads((MAPS_DIR / "qwen3_moe.json").read_text())


def modules_to_capture(layers: int) -> list[str]:
    """Every NxDI module the capture table names, in every layer."""
    names = capture_table()["modules"].values()
    return [n.format(layer=i) for n in names for i in (range(layers) if "{layer}" in n else [0])]


def nxdi_capture(model: Path, golden: GoldenStore, out: Path, bucket: int | None = None) -> Path:
    """NxDI's application on `model` generates one token (the context encoding only) from the
    golden's batch left-padded to the bucket (which NxDI's padding_side="left" expects of its
    caller: the golden's own width, or `bucket` positions), and writes its tensor capture to `out`."""
    from neuronx_distributed.utils.tensor_capture import disable_tensor_capture, enable_tensor_capture
    from neuronx_distributed.utils.tensor_capture.registry import TensorRegistry
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig, TensorCaptureConfig
    from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter, load_pretrained_config
    from neuronx_distributed_inference.utils.tensor_capture_utils import get_tensor_capture_hook
    from transformers import GenerationConfig

    table = nxdi.load_module_table("qwen3_moe")
    ids = torch.tensor(golden.manifest["inputs"]["input_ids"])
    mask = torch.tensor(golden.manifest["inputs"]["attention_mask"])
    if bucket is not None:  # more padding on the left, up to the bucket
        ids = torch.nn.functional.pad(ids, (bucket - ids.shape[1], 0), value=0)
        mask = torch.nn.functional.pad(mask, (bucket - mask.shape[1], 0), value=0)
    batch, bucket = ids.shape
    hf_config = nxdi.nxdi_hf_config(model)
    capture = TensorCaptureConfig(modules_to_capture=modules_to_capture(hf_config.num_hidden_layers))
    with nxdi.upstream_warnings():
        neuron_config = nxdi.resolve(table.neuron_config)(
            tp_degree=1,
            batch_size=batch,
            max_context_length=bucket,
            seq_len=bucket,
            torch_dtype=torch.float32,
            padding_side="left",
            on_cpu=True,
            output_logits=True,  # capture returns tensors only with on-device sampling and output_logits
            on_device_sampling_config=OnDeviceSamplingConfig(do_sample=False, top_k=1),
            tensor_capture_config=capture,
        )
        config = nxdi.resolve(table.config)(neuron_config, load_config=load_pretrained_config(hf_config=hf_config))
        app = nxdi.resolve(table.application)(str(model), config)
        app.to_cpu()
        # Patch 1 of 2, replicating the trace path's hook install: NxDI calls enable_tensor_capture only when it
        # traces a model for the device (DecoderModelInstance.load_module, models/model_wrapper.py:1540), which
        # to_cpu never does; without it the CPU run writes a placeholder zeros(1) per module.
        captured = enable_tensor_capture(
            app.models[0].model,
            modules_to_capture=capture.modules_to_capture,
            max_tensors=capture.max_intermediate_tensors,
            capture_inputs=capture.capture_inputs,
        )
        for wrapper in app.models:
            wrapper.model = captured
        # Patch 2 of 2, replicating the compiled graph's capture on every run: NxDI's _get_captured_tensors ends
        # with TensorRegistry.clear() (models/model_base.py:1143), which empties the registry's modules_to_capture
        # too; on the device every traced graph has the capture built in, while the CPU re-runs the Python, so
        # the registry is configured again before each forward.
        captured.register_forward_pre_hook(
            lambda module, args: TensorRegistry.get_instance().configure(
                enabled=True,
                modules=capture.modules_to_capture,
                max_tensors=capture.max_intermediate_tensors,
                capture_inputs=capture.capture_inputs,
            )
        )
        try:
            HuggingFaceGenerationAdapter(app).generate(
                ids,
                attention_mask=mask,
                max_new_tokens=1,
                generation_config=GenerationConfig(do_sample=False, top_k=1, pad_token_id=0, eos_token_id=None),
                tensor_capture_hook=get_tensor_capture_hook(tensor_capture_save_dir=str(out)),
            )
        finally:
            disable_tensor_capture(captured)
    return out


@pytest.fixture
def cpu_process_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A one-rank gloo group on a file store, made before `to_cpu` (which would otherwise open a TCP
    store on MASTER_PORT 29500, one port for every worker); `to_cpu` sets up NxD's model parallel
    state in it."""
    from neuronx_distributed.parallel_layers import parallel_state

    monkeypatch.setenv("NXD_CPU_MODE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # with it, to_cpu opens a second group
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def compare(golden: Path, capture: Path, report: Path, capsys: pytest.CaptureFixture) -> tuple[int, str, dict]:
    """`moe-parity compare`: its exit code, its output and its report's rows by point id."""
    code = main(["compare", str(golden), str(capture), "--report", str(report), "--plots", "no"])
    return code, capsys.readouterr().out, {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}


def padding_overwritten(capture: Path, mask: torch.Tensor, out: Path) -> Path:
    """A copy of the capture whose padding positions hold 1e4 ([batch, 16, ...] and [batch * 16, ...])."""
    shutil.copytree(capture, out)
    for path in out.glob("*.pt"):
        tensor = torch.load(path)
        pads = ~mask if tensor.shape[:2] == mask.shape else ~mask.flatten()
        assert tensor.shape[: pads.dim()] == pads.shape, (path.name, tensor.shape)
        tensor[pads] = 1e4
        torch.save(tensor, path)
    return out


@upstream_notices[0]
@upstream_notices[1]
def test_a_real_capture_of_a_left_padded_batch_passes_on_each_row_s_real_tokens(
    t5: Path, tmp_path: Path, cpu_process_group, capsys: pytest.CaptureFixture
) -> None:
    """Every point the capture table names passes in float32 (the dtype read from the capture's
    metadata), each judged per row on its real tokens (8, 3 and 6); the rotary embedding and the
    logits are reported unavailable, with the table's reasons. The padding positions are not
    judged: with 1e4 written over them, the same capture passes alike."""
    golden = GoldenStore(t5 / BUCKET)
    out = nxdi_capture(t5 / "qwen3_moe-model", golden, tmp_path / "capture")
    code, text, rows = compare(t5 / BUCKET, out, tmp_path / "r", capsys)
    assert code == 0, text
    assert "first divergence: none" in text and "candidate dtype float32" in text, text
    unavailable = capture_table()["unavailable"]
    assert sorted(unavailable) == sorted(p for p, row in rows.items() if row["status"] == "skipped")
    for pid in golden.point_ids:
        row = rows[pid]
        if pid in unavailable:
            assert f"not in the NxDI capture: {unavailable[pid]}" in row["reason"], row
        else:
            assert row["status"] == "passed", row
            assert [r["tokens"] for r in row["rows"]] == ROWS, (pid, row["rows"])
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] is None

    mask = torch.tensor(golden.manifest["inputs"]["attention_mask"]).bool()
    junk = padding_overwritten(out, mask, tmp_path / "junk")
    code, text, junk_rows = compare(t5 / BUCKET, junk, tmp_path / "r2", capsys)
    assert code == 0 and "first divergence: none" in text, text
    assert {p: r["status"] for p, r in junk_rows.items()} == {p: r["status"] for p, r in rows.items()}


@upstream_notices[0]
@upstream_notices[1]
def test_a_fault_in_one_expert_of_the_checkpoint_diverges_first_at_the_experts(
    t5: Path, tmp_path: Path, cpu_process_group, capsys: pytest.CaptureFixture
) -> None:
    """NxDI runs a copy of the checkpoint in which one expert of layer 0 (the first that the real
    tokens of some rows pick and of others do not) has its down projection scaled by 1.5; the golden
    stays the reference. Every point before layer 0's experts passes (the router too: the routing is
    untouched), the experts are the first divergence, and at every point from there the rows that
    fail are those with a real token routed to that expert: the others never meet it."""
    golden = GoldenStore(t5 / BUCKET)
    mask = torch.tensor(golden.manifest["inputs"]["attention_mask"]).bool()
    picked = golden.load("layer_0.router").output[2].reshape(*mask.shape, -1)  # top-k expert ids per token
    routed = {
        e: [bool((picked[r][mask[r]] == e).any()) for r in range(len(ROWS))] for e in range(int(picked.max()) + 1)
    }
    expert = next(e for e, hit in routed.items() if any(hit) and not all(hit))
    model = shutil.copytree(t5 / "qwen3_moe-model", tmp_path / "model")
    key = f"model.layers.0.mlp.experts.{expert}.down_proj.weight"
    shard = model / weight_map(model)[key]
    state = load_file(shard)
    state[key] = state[key] * 1.5
    save_file(state, str(shard), metadata={"format": "pt"})

    out = nxdi_capture(model, golden, tmp_path / "capture")
    code, text, rows = compare(t5 / BUCKET, out, tmp_path / "r", capsys)
    assert code == 1, text
    assert "first divergence: layer_0.experts" in text, text
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == "layer_0.experts"
    order = golden.point_ids
    before = [p for p in order[: order.index("layer_0.experts")] if p != "rotary"]
    assert [rows[p]["status"] for p in before] == ["passed"] * len(before)
    unavailable = capture_table()["unavailable"]
    after = [p for p in order[order.index("layer_0.experts") :] if p not in unavailable]
    assert [rows[p]["status"] for p in after] == ["failed"] * len(after)
    assert {p: [r["failed"] for r in rows[p]["rows"]] for p in after} == dict.fromkeys(after, routed[expert])


@upstream_notices[0]
@upstream_notices[1]
def test_a_capture_at_a_larger_bucket_is_fitted_to_a_golden_padded_to_its_longest_prompt(
    t5: Path, tmp_path: Path, cpu_process_group, capsys: pytest.CaptureFixture
) -> None:
    """The golden's batch is left-padded to its longest prompt (8 tokens), and NxDI takes it
    left-padded to its bucket of 16: the capture's first 8 positions are the bucket's padding, left
    out (the golden pads on the left, so the bucket does too), and every point passes on the rows'
    real tokens."""
    golden = GoldenStore(t5 / BATCH)
    out = nxdi_capture(t5 / "qwen3_moe-model", golden, tmp_path / "capture", bucket=16)
    code, text, rows = compare(t5 / BATCH, out, tmp_path / "r", capsys)
    assert code == 0 and "first divergence: none" in text, text
    unavailable = capture_table()["unavailable"]
    judged = {p: r for p, r in rows.items() if p not in unavailable}
    assert judged and all(r["status"] == "passed" for r in judged.values()), text
    assert all([r["tokens"] for r in row["rows"]] == ROWS for row in judged.values())
    for pid in ("layer_1.moe", "layer_1.router"):  # [batch, positions, ...] and [batch * positions, ...]
        assert "the last 8 of 16 positions (bucket padding at the start left out)" in " ".join(rows[pid]["notes"])
