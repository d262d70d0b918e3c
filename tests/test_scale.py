"""Recording at scale (`moe-parity golden --max-memory --offload-folder --layers`): accelerate disk
offload gives the same golden bit for bit, parameters passed as arguments stay parameters; a slice
of layers records, replays and says what it is; the placement and memory reports; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import NO_CONFIG, NO_WEIGHTS, cli, read_json, run_parity
from safetensors.torch import load_file

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record import run as record_run

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def _golden(capsys, model: Path, out: Path, *extra) -> tuple[int, str, str]:
    return cli(capsys, "golden", "--model", model, "--out", out, *extra)


def _params(manifest: dict) -> set[str]:
    """The names of every parameter the golden records by name (not by value)."""
    text = json.dumps(manifest["points"])
    found = set()
    for chunk in text.split('"t": "param", "name": "')[1:]:
        found.add(chunk.split('"', 1)[0])
    return found


def assert_same_golden(a: Path, b: Path, ids: list[str] | None = None) -> None:
    """Same points (or the given ones of `a`), same call structures, same tensors bit for bit."""
    ma, mb = read_json(a / "manifest.json"), read_json(b / "manifest.json")
    pa = {p["id"]: p for p in ma["points"]}
    pb = {p["id"]: p for p in mb["points"]}
    wanted = ids if ids is not None else list(pa)
    assert list(pb) == wanted
    for pid in wanted:
        for key in ("inputs", "output", "extras", "tensors"):
            assert pa[pid][key] == pb[pid][key], f"{pid} {key}"
    files = sorted({pb[pid]["file"] for pid in wanted})
    for file in files:
        ta, tb = load_file(a / file), load_file(b / file)
        assert sorted(tb) == sorted(k for k in ta if k.split("/")[0] in pb), file
        for key, tensor in tb.items():
            assert tensor.dtype == ta[key].dtype and torch.equal(tensor, ta[key]), key


# -- disk offload ------------------------------------------------------------------------------------


def test_disk_offload_records_the_in_memory_golden_bit_for_bit(tmp_path: Path, tiny_model, golden_dir, capsys):
    model, reference = tiny_model("minimax_m2"), golden_dir("minimax_m2")
    offload = tmp_path / "offload"  # created by the run, so removed after it
    code, _, err = _golden(
        capsys, model, tmp_path / "g", "--max-memory", "cpu:600KB", "--offload-folder", offload, "-q"
    )
    assert code == 0, err
    manifest = read_json(tmp_path / "g" / "manifest.json")
    placed = manifest["record"]["placement"]
    assert placed["disk"]["modules"] >= 1 and placed["cpu"]["modules"] >= 1, placed
    assert manifest["record"]["device_map"] == "auto" and manifest["record"]["devices"] == ["cpu", "disk"]
    assert manifest["record"]["loading"] == "by unit, placed by accelerate"
    assert_same_golden(reference, tmp_path / "g")
    # MiniMax-M2's score bias reaches its router as an argument: recorded as a parameter, by name.
    assert _params(manifest) == {f"model.layers.{i}.mlp.e_score_correction_bias" for i in range(4)}
    assert not offload.exists()


def test_offloaded_buffers_are_named_and_read_back_from_the_offload(
    tmp_path: Path, tiny_model, golden_dir, monkeypatch
) -> None:
    """With the buffers offloaded too, the score bias is a fresh tensor in each forward (and meta
    outside it): still named as the parameter, and its values read from accelerate's copy."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def offloading_buffers(*args, **kwargs):
        return load(*args, **kwargs, offload_buffers=True)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offloading_buffers)
    monkeypatch.setattr(record_run, "reader", lambda *args, **kwargs: "from_pretrained")  # accelerate's own loading
    offload = tmp_path / "kept"
    offload.mkdir()  # the user's own folder: left in place
    record_run.record_golden(tiny_model("minimax_m2"), tmp_path / "g", max_memory="cpu:1KB", offload_folder=offload)
    manifest = read_json(tmp_path / "g" / "manifest.json")
    assert set(manifest["record"]["placement"]) == {"disk"}
    assert_same_golden(golden_dir("minimax_m2"), tmp_path / "g")
    assert offload.is_dir()


def test_an_offloaded_golden_replays(pytester: pytest.Pytester, tiny_model) -> None:
    golden = pytester.path / "g"
    record_run.record_golden(
        tiny_model("qwen3_moe"), golden, max_memory="cpu:300KB", offload_folder=pytester.path / "off"
    )
    result = run_parity(pytester, golden, "--dtype", "bfloat16", model=tiny_model("qwen3_moe"))
    n = len(GoldenStore(golden).point_ids)
    result.assert_outcomes(passed=n)
    result.stdout.fnmatch_lines(["first divergence: none"])


# -- reading the reference one unit at a time -------------------------------------------------------


@pytest.mark.parametrize("arch", ["minimax_m2", "deepseek_v3", "gpt_oss"])
def test_streaming_two_layers_at_a_time_records_the_same_golden(arch: str, tmp_path: Path, tiny_model, capsys):
    model = tiny_model(arch)
    code, out, err = _golden(capsys, model, tmp_path / "whole", "--decode-steps", "1")
    assert code == 0, err
    assert "placement: the whole model on cpu, " in out
    code, out, err = _golden(capsys, model, tmp_path / "s", "--stream", "--decode-steps", "1")
    assert code == 0, err
    assert "placement: streamed from the checkpoint onto cpu, 2 decoder layers at a time" in out
    assert_same_golden(tmp_path / "whole", tmp_path / "s")
    manifest = read_json(tmp_path / "s" / "manifest.json")
    assert manifest["record"]["loading"] == "streamed, 2 decoder layers at a time"
    whole = read_json(tmp_path / "whole" / "manifest.json")["stats"]["host_weight_bytes"]
    streamed = manifest["stats"]["host_weight_bytes"]
    assert 0 < streamed < whole


def test_a_pytorch_bin_checkpoint_goes_through_from_pretrained_to_the_same_golden(tmp_path: Path, tiny_model) -> None:
    import shutil

    model = tiny_model("qwen3_moe")
    record_run.record_golden(model, tmp_path / "units")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(model / "config.json", bin_dir)
    state = {k: v for shard in sorted(model.glob("*.safetensors")) for k, v in load_file(shard).items()}
    torch.save(state, bin_dir / "pytorch_model.bin")  # the same keys, in the older format
    record_run.record_golden(bin_dir, tmp_path / "pretrained")
    assert read_json(tmp_path / "pretrained" / "manifest.json")["record"]["loading"] == "from_pretrained"
    assert read_json(tmp_path / "units" / "manifest.json")["record"]["loading"] == "by unit"
    assert_same_golden(tmp_path / "units", tmp_path / "pretrained")
    with pytest.raises(record_run.BadInput, match="--stream reads safetensors checkpoints"):
        record_run.record_golden(bin_dir, tmp_path / "s", stream=True)


# -- slices --------------------------------------------------------------------------------------


def test_a_slice_holds_its_layers_points_as_the_whole_recording_does(tmp_path: Path, tiny_model, golden_dir, capsys):
    model, whole = tiny_model("minimax_m2"), golden_dir("minimax_m2")
    code, out, err = _golden(capsys, model, tmp_path / "s", "--layers", "1-2")
    assert code == 0, err
    ids = [pid for pid in GoldenStore(whole).point_ids if pid.startswith(("layer_1.", "layer_2."))]
    assert_same_golden_values(whole, tmp_path / "s", ids)
    manifest = read_json(tmp_path / "s" / "manifest.json")
    assert manifest["record"]["layers"] == [1, 2] and manifest["model"]["num_hidden_layers"] == 4
    first = next(p for p in manifest["points"] if p["id"] == "layer_1.input_norm")
    # the layer before the slice was not recorded: its input has no origin to chain from
    assert "from" not in first["inputs"]["args"][0]
    assert "recording" in out and "layers 1-2 of 4, 14 points" in out
    assert "note: the slice ends at layer_2; the rest of the forward was not run" in out


def assert_same_golden_values(whole: Path, part: Path, ids: list[str]) -> None:
    """A slice's points hold what the whole recording holds, except where an input's origin lies
    outside the slice (no "from" then)."""

    def inside(origin: dict) -> bool:
        return all(inside(o) for o in origin["sum"]) if "sum" in origin else origin["point"].split(".")[0] in layers

    def strip(spec):
        if isinstance(spec, dict):
            return {k: strip(v) for k, v in spec.items() if k != "from" or inside(v)}
        if isinstance(spec, list):
            return [strip(v) for v in spec]
        return spec

    layers = {pid.split(".")[0] for pid in ids}
    mw, mp = read_json(whole / "manifest.json"), read_json(part / "manifest.json")
    pw = {p["id"]: p for p in mw["points"]}
    pp = {p["id"]: p for p in mp["points"]}
    assert list(pp) == ids
    for pid in ids:
        assert strip(pw[pid]["inputs"]) == pp[pid]["inputs"], pid
        assert pw[pid]["output"] == pp[pid]["output"] and pw[pid]["tensors"] == pp[pid]["tensors"], pid
        tw, tp = load_file(whole / pw[pid]["file"]), load_file(part / pp[pid]["file"])
        for key in pp[pid]["tensors"]:
            assert torch.equal(tw[key], tp[key]), key


def test_slices_that_cover_every_layer_cover_every_point(tmp_path: Path, tiny_model, golden_dir, capsys) -> None:
    model, whole = tiny_model("qwen3_moe"), golden_dir("qwen3_moe")
    ids = GoldenStore(whole).point_ids
    got = []
    for name, layers in (("a", "0"), ("b", "1-3")):
        code, _, err = _golden(capsys, model, tmp_path / name, "--layers", layers, "-q")
        assert code == 0, err
        got += GoldenStore(tmp_path / name).point_ids
    assert got == ids
    assert GoldenStore(tmp_path / "a").point_ids[:2] == ["embedding", "rotary"]
    assert GoldenStore(tmp_path / "b").point_ids[-2:] == ["final_norm", "logits"]


def test_a_slice_replays_and_says_so_in_the_header(pytester: pytest.Pytester, tiny_model) -> None:
    model = tiny_model("mixtral")
    golden = pytester.path / "g"
    record_run.record_golden(model, golden, layers="1-2", decode_steps=1)
    n = len(GoldenStore(golden).point_ids)
    result = run_parity(pytester, golden, "--dtype", "bfloat16", model=model)
    result.assert_outcomes(passed=n)
    result.stdout.fnmatch_lines(
        ["moe-parity: golden * (mixtral, a slice: layers 1-2 of 4 layers, *", "first divergence: none"]
    )
    result = run_parity(pytester, golden, "--parity-layers", "0", model=model)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-layers 0: the golden has no layer 0; its layers are 1-2*"])


def test_a_fault_inside_a_slice_fails_at_its_point(pytester: pytest.Pytester, tiny_model) -> None:
    model = tiny_model("qwen3_moe")
    golden = pytester.path / "g"
    record_run.record_golden(model, golden, layers="2-3")
    candidate = faults.edit_checkpoint(model, pytester.path / "c", faults.swap_gate_up(2))
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", NO_WEIGHTS, NO_CONFIG, model=candidate)
    result.assert_outcomes(failed=1, passed=GoldenStore(golden).point_ids.index("layer_2.experts"))
    result.stdout.fnmatch_lines(["first divergence: layer_2.experts*"])
    weights = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", "-v", model=candidate)  # the slice's weights
    weights.stdout.fnmatch_lines(["*layer_2.weights FAILED*", "first divergence: layer_2.weights  (*halves*"])
    assert "layer_0.weights" not in weights.stdout.str() and "layer_1.weights" not in weights.stdout.str()


def test_chain_mode_on_a_slice_starts_from_the_golden_inputs(pytester: pytest.Pytester, tiny_model) -> None:
    model = tiny_model("qwen3_moe")
    golden = pytester.path / "g"
    record_run.record_golden(model, golden, layers="1-2")
    result = run_parity(pytester, golden, "--hw", "trace", "--parity-mode", "chain", model=model)
    result.assert_outcomes(passed=len(GoldenStore(golden).point_ids))


# -- reports -----------------------------------------------------------------------------------------


def test_placement_before_the_forward_and_memory_after(tmp_path: Path, tiny_model, capsys) -> None:
    code, out, _ = _golden(capsys, tiny_model("olmoe"), tmp_path / "g")
    assert code == 0
    lines = out.splitlines()
    placed = next(i for i, line in enumerate(lines) if line.startswith("placement: the whole model on cpu, "))
    memory = next(i for i, line in enumerate(lines) if line.startswith("memory: peak host RSS "))
    first_layer = next(i for i, line in enumerate(lines) if line.startswith("  layer_0:"))
    assert placed < first_layer < memory
    stats = read_json(tmp_path / "g" / "manifest.json")["stats"]
    assert stats["peak_memory_bytes"]["host_rss"] > 100 * 2**20


def test_the_placement_counts_each_device_maps_modules(tmp_path: Path, tiny_model) -> None:
    from pytest_moe_parity.record.memory import placement, placement_line

    model = record_run.load_model(
        tiny_model("mixtral"), dtype=torch.float32, device=None, device_map="auto",
        max_memory={"cpu": 1_000_000}, offload_folder=tmp_path,
    )  # fmt: skip
    placed = placement(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    assert sum(entry["bytes"] for entry in placed.values()) == total
    assert sum(entry["modules"] for entry in placed.values()) == len(model.hf_device_map)
    assert placement_line(placed).startswith("placement: cpu ") and "disk" in placed
    # read one unit at a time, the reference is placed as from_pretrained places it
    record_run.record_golden(
        tiny_model("mixtral"), tmp_path / "g", max_memory="cpu:1000000B", offload_folder=tmp_path / "off"
    )
    assert read_json(tmp_path / "g" / "manifest.json")["record"]["placement"] == placed


@pytest.mark.parametrize(
    ("spec", "gpus", "expected"),
    [
        ("40GB", 2, {0: 40 * 10**9, 1: 40 * 10**9}),
        ("0:1GiB,cpu:2GiB", 1, {0: 2**30, "cpu": 2 * 2**30}),
        ("cpu:512MB", 0, {"cpu": 512 * 10**6}),
    ],
)
def test_max_memory_specs(spec, gpus, expected, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert record_run.parse_max_memory(spec) == expected


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "4-5"], "--layers 4-5: the model has 4 decoder layers (0-3)"),
        (["--layers", "x"], "--layers x: 'x' is not a layer number"),
        (["--max-memory", "cpu:lots"], "--max-memory 'cpu:lots': 'lots' is not a size"),
        (["--max-memory", "1:1GB"], "--max-memory '1:1GB' names GPU 1, and no GPU is visible"),
        (["--max-memory", "disk:1TB"], "pass --offload-folder DIR for disk offload"),
        (["--max-memory", "cpu:100KB"], "does not fit in the memory --max-memory gives; pass --offload-folder DIR"),
        (["--device-map", "everywhere"], "--device-map 'everywhere' is neither a placement"),
        (["--offload-folder", "{out}/offload"], "is inside --out"),
        (["--offload-folder", "{file}"], "exists and is not a directory"),
        (["--offload-folder", "{readonly}/sub"], "is not writable"),
        (["--stream", "--max-memory", "cpu:1GB"], "--stream loads one decoder layer at a time on one --device"),
    ],
)
def test_bad_recording_input_is_one_line_and_writes_nothing(args, message, tmp_path: Path, tiny_model, capsys):
    import os

    out = tmp_path / "g"
    (tmp_path / "file").write_text("x")
    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o500)
    if os.geteuid() == 0 and "{readonly}" in args[1]:
        readonly = Path("/proc/1")  # root writes anywhere on a normal filesystem
    args = [a.format(out=out, file=tmp_path / "file", readonly=readonly) for a in args]
    code, _, err = _golden(capsys, tiny_model("qwen3_moe"), out, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("broken", ["missing shard", "no weights"])
def test_a_checkpoint_without_its_weights_is_one_line(broken, tmp_path: Path, tiny_model, capsys) -> None:
    import shutil

    model = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "m")
    shards = sorted(model.glob("*.safetensors"))
    if broken == "missing shard":
        shards[1].unlink()
        message = f"names {shards[1].name}, which is not in"
    else:
        for shard in shards:
            shard.unlink()
        (model / "model.safetensors.index.json").unlink()
        message = "holds no .safetensors files; point --model at a checkpoint with its weights"
    code, _, err = _golden(capsys, model, tmp_path / "g")
    assert code == 2 and message in err, err
    assert not (tmp_path / "g").exists()


def test_a_quantized_checkpoint_is_read_one_unit_at_a_time_with_its_scales(tmp_path: Path, capsys, monkeypatch):
    """An fp8 checkpoint is read by the per-unit reader, its scales with its weights (`model.quant`), in
    memory or --stream: from_pretrained (the whole model at once) is never asked."""
    from pytest_moe_parity.record.tiny import write_tiny_model

    model = write_tiny_model("qwen3_moe", tmp_path / "m", quant="fp8-block:32")

    def from_pretrained_only(*args, **kwargs):
        raise record_run.BadInput("from_pretrained was asked")

    monkeypatch.setattr(record_run, "load_model", from_pretrained_only)
    for stream in ((), ("--stream",)):
        code, _, err = _golden(capsys, model, tmp_path / f"g{len(stream)}", *stream)
        assert code == 0, err
        loading = read_json(tmp_path / f"g{len(stream)}" / "manifest.json")["record"]["loading"]
        assert "from_pretrained" not in loading, loading


@pytest.mark.slow
def test_the_noise_floor_holds_no_more_than_the_recording(tmp_path: Path, monkeypatch) -> None:
    """`--noise-dtype` within the recording's memory bound (benchmarks/bench_record_memory.py, in a
    fresh process): a Mixtral-style checkpoint with Qwen3's vocabulary of 151936 tokens, recorded
    --stream at 256 tokens: the noise floor's peak (measured from its start) is the recording's, give or
    take 64 MB. (Its logits judge alone used to add ~1.2 GB here: a float64 copy of [256, 151936] and
    its masks; its chained runs held every point's output twice.)"""
    from transformers import AutoModelForCausalLM, MixtralConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_record_memory import record

    config = MixtralConfig(
        vocab_size=151936, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model", max_shard_size="200MB")
    mb = 2**20
    r = record(tmp_path / "model", tmp_path / "golden", 256, "--stream", "--noise-dtype", "bfloat16")
    assert r["noise_peak"] <= r["peak"] + 64 * mb, (r["noise_peak"] / mb, r["peak"] / mb)
    assert 0 < r["noise_host"] < r["host"]  # two bf16 layers and the model-level modules, against fp32 ones
