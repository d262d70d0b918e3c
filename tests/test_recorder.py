"""`pytest_moe_parity.dump.record` inside a hand-written plain-PyTorch Qwen3-MoE port (its own
modules, fused experts): the glue is the point map; a clean bf16 port passes, and each code-level
port bug first fails at the component that has it."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import cli, read_json, run_parity
from port_qwen3 import POINTS, Bugs, load_port
from safetensors import safe_open

from pytest_moe_parity import dump
from pytest_moe_parity.dump import record
from pytest_moe_parity.errors import BadInput
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def _ids(golden: Path) -> torch.Tensor:
    return torch.tensor(json.loads((golden / "manifest.json").read_text())["inputs"]["input_ids"])


def _record_port(golden: Path, model: Path, out: Path, bugs: Bugs | None = None) -> Path:
    port = load_port(model, bugs=bugs or Bugs())
    with torch.no_grad(), record(port, out, POINTS):
        port(_ids(golden))
    return out


def _names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as fh:
        return set(fh.keys())


def test_a_clean_bf16_port_passes_with_its_point_map_as_the_only_glue(
    pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    golden = golden_dir("qwen3_moe")
    out = _record_port(golden, tiny_model("qwen3_moe"), tmp_path / "dump")
    assert [p.name for p in out.iterdir()] == ["prefill.safetensors"]
    n = len(GoldenStore(golden).point_ids)
    code, stdout, err = cli(capsys, "compare", golden, out, "--dtype", "bfloat16")
    assert code == 0, stdout + err
    assert f"compared {n} of {n} points, candidate dtype bfloat16 (from --dtype)" in stdout
    run_parity(pytester, golden, "--hw", "dump", "--dtype", "bfloat16", model=out).assert_outcomes(passed=n)


@pytest.mark.parametrize(
    "bugs, first",
    [
        (Bugs(rope_interleaved=True), "layer_0.attention"),
        (Bugs(gqa_repeat=True), "layer_0.attention"),
        (Bugs(no_renormalise=True), "layer_0.router"),
        (Bugs(scale_by_hidden=True), "layer_0.attention"),
        (Bugs(mask_one_ahead=True), "layer_0.attention"),
        (None, "layer_1.experts"),  # one expert's weights zeroed: an expert the prompt routes to
    ],
    ids=[
        "rope-interleaved",
        "gqa-repeat",
        "topk-not-renormalised",
        "scaled-by-hidden",
        "mask-off-by-one",
        "zero-expert",
    ],
)
def test_each_port_bug_first_fails_where_it_is(bugs, first, tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("qwen3_moe")
    if bugs is None:
        bugs = Bugs(zero_expert=(1, faults._used_experts(golden, 1)[0]))
    out = _record_port(golden, tiny_model("qwen3_moe"), tmp_path / "dump", bugs)
    code, stdout, _ = cli(capsys, "compare", golden, out, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 1
    summary = read_json(tmp_path / "r" / SUMMARY_FILE)
    assert summary["first_divergence"] == first, stdout
    assert summary["error"] == 0


def test_each_call_of_the_model_is_the_next_step(tmp_path: Path, golden_dir, tiny_model) -> None:
    golden = golden_dir("qwen3_moe")
    port = load_port(tiny_model("qwen3_moe"))
    ids = _ids(golden)
    with torch.no_grad(), record(port, tmp_path / "d", POINTS) as rec:
        port(ids)
        port(ids[:, :1])
        rec.next_step()  # a runtime that does not call the root model says so itself
        port.layers[0](port.embed(ids[:, :1]), *port.rotary(port.embed(ids[:, :1]), torch.zeros(1, 1)))
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["prefill.safetensors", "step_1.safetensors", "step_2.safetensors"]
    assert "step_1.layer_3.output" in _names(tmp_path / "d" / "step_1.safetensors")
    assert {"step_1.layer_0.router.0", "step_1.layer_0.router.2"} <= _names(tmp_path / "d" / "step_1.safetensors")
    step_2 = _names(tmp_path / "d" / "step_2.safetensors")
    assert "step_2.layer_0.output" in step_2 and "step_2.layer_1.output" not in step_2


def test_ranks_write_their_own_directories(monkeypatch, tmp_path: Path, golden_dir, tiny_model) -> None:
    monkeypatch.setattr(dump, "_rank", lambda: (3, 8))
    out = _record_port(golden_dir("qwen3_moe"), tiny_model("qwen3_moe"), tmp_path / "d")
    assert [p.relative_to(out).as_posix() for p in out.rglob("*.safetensors")] == ["rank3/prefill.safetensors"]


@pytest.mark.parametrize(
    "points, message",
    [
        ({}, "must map point ids"),
        ({"layer_{layer}.atention": "layers.{layer}.attn"}, "'layer_{layer}.atention' is not a point id"),
        ({"layer_{layer}.attention": "layers.0.attn"}, "both or neither must hold {layer}"),
        ({"embedding": "embedding"}, "the model has no module 'embedding' (for embedding)"),
        (
            {"layer_{layer}.attention": "blocks.{layer}.attn"},
            "no module of the model is named like 'blocks.{layer}.attn'",
        ),
    ],
)
def test_a_bad_point_map_is_one_sentence(points, message, tmp_path: Path, tiny_model) -> None:
    port = load_port(tiny_model("qwen3_moe"))
    with pytest.raises(BadInput) as err, record(port, tmp_path / "d", points):
        pass
    assert message in str(err.value)


def test_nothing_is_written_when_the_block_fails_or_runs_nothing(tmp_path: Path, golden_dir, tiny_model) -> None:
    golden = golden_dir("qwen3_moe")
    port = load_port(tiny_model("qwen3_moe"))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), record(port, tmp_path / "d", POINTS):
        port(_ids(golden))
        raise RuntimeError("boom")
    assert not (tmp_path / "d").exists()
    assert not port._forward_pre_hooks and not port.layers[0]._forward_hooks  # the hooks are gone
    with pytest.raises(BadInput, match="no named module ran inside the block"), record(port, tmp_path / "d", POINTS):
        pass
    out = _record_port(golden, tiny_model("qwen3_moe"), tmp_path / "d")
    with pytest.raises(BadInput, match="already holds a dump"), record(port, out, POINTS):
        pass
    with torch.no_grad(), record(port, out, POINTS, overwrite=True):
        port(_ids(golden))
