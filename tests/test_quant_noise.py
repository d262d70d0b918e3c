"""A noise floor of the candidate's own quantization (`moe-parity golden --noise-quant SPEC`), a candidate
run under an emulated quantization (`--hw-option quant=SPEC`), and batch invariance under dynamic scales.

The emulation (`model.emulate`) rounds every projection of the decoder layers through the weight scheme
as its layer loads (routers, norms, embeddings and the LM head as they are), and activations and K/V
through e4m3 by hooks. A clean FP8 candidate (the same model in bf16 under the same scheme) passes every
point, isolated and chained, prefill and decode, against the golden's floor of that scheme; judged by
its dtype alone it fails most of its projections. A scale bug in one expert fails at that expert's
layer first. Per-tensor dynamic activation scales make a row's output depend on its batch: the batch
items fail at the first projection and name the shared scale; per-token scales pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from faults import edit_checkpoint
from helpers import PADDED_PROMPTS, cli, read_json, run_parity, usage_error

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.model.emulate import (
    Emulation,
    fake_quant_activation,
    find_targets,
    parse_spec,
    resolves,
)
from pytest_moe_parity.model.lazy_model import LazyModel
from pytest_moe_parity.model.quant import fake_quant
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.record.tiny import write_tiny_model
from pytest_moe_parity.replay.floors import combined, combined_tokens
from pytest_moe_parity.replay.noise import record_noise
from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYERS = 2
SPEC = "fp8-block:32+dynamic-token"  # the tiny models' 64-wide projections: two blocks a side


# -- the spec ---------------------------------------------------------------------------------------


def test_a_spec_is_weights_then_activations_then_kv() -> None:
    spec = parse_spec("fp8-block:32+dynamic-token+kv-fp8")
    assert (spec.weights, spec.block, spec.activations, spec.kv) == ("fp8-block", (32, 32), "dynamic-token", True)
    assert spec.key == "quant:fp8-block:32+dynamic-token+kv-fp8" and spec.group == 32
    assert parse_spec("fp8-block").name == "fp8-block:128"  # DeepSeek-V3's block by default
    assert parse_spec("mxfp4+dynamic-tensor").batch_invariant is False
    assert parse_spec("int8-channel+dynamic-token").int8


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("fp8-block:0", "--noise-quant fp8-block:0: 'fp8-block:0': a block size is N or RxC, positive integers"),
        ("fp9-block", "--noise-quant fp9-block: 'fp9-block' is not a weight scheme (one of fp8-block"),
        (
            "fp8-channel+per-token",
            "'per-token' is neither an activation scheme (dynamic-token, dynamic-tensor",
        ),
        ("fp8-tensor+static+dynamic-token", "'dynamic-token' is given twice (one activation scheme, one kv-fp8)"),
        ("+dynamic-token", "give a weight scheme first"),
        ("mxfp4:32", "only fp8-block takes a block size"),
    ],
)
def test_a_bad_spec_is_one_sentence(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        parse_spec(text)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_dtype_holds_a_scheme_three_bits_finer() -> None:
    """bf16's rounding (eps 2^-7) is 16x finer than e4m3's step (2^-3): it can hold an fp8 floor; int8's
    step (1/127) is as coarse as bf16's own rounding: only float16 and float32 hold it."""
    assert resolves(torch.bfloat16, parse_spec("fp8-block"))
    assert not resolves(torch.bfloat16, parse_spec("int8-channel"))
    assert resolves(torch.float16, parse_spec("int8-channel")) and resolves(torch.float32, parse_spec("int8-channel"))


# -- the emulation ----------------------------------------------------------------------------------


def test_per_tensor_scales_tie_a_row_to_its_batch() -> None:
    """One scale over the whole input (dynamic-tensor) rounds a row on a grid its neighbours set; a scale
    per token rounds it as alone; a static scale clips what exceeds it."""
    torch.manual_seed(0)
    small, big = torch.randn(1, 4, 64), 50 * torch.randn(1, 4, 64)
    batch = torch.cat([small, big])
    for how, same in (("dynamic-token", True), ("dynamic-tensor", False)):
        alone = fake_quant_activation(small, how)
        together = fake_quant_activation(batch, how)[:1]
        assert torch.equal(alone, together) is same, how
    spiky = torch.randn(1, 64)
    spiky[0, 0] = 100.0  # a token's second group of 32 gets a finer scale of its own
    by_group = fake_quant_activation(spiky, "dynamic-token", group=32)
    assert not torch.equal(by_group, fake_quant_activation(spiky, "dynamic-token"))
    clipped = fake_quant_activation(torch.tensor([1.0, 1000.0]), "static", scale=torch.tensor(1.0))
    assert clipped.tolist() == [1.0, 448.0]


def test_the_emulated_weights_are_the_hub_checkpoint_s(tiny_model, tmp_path: Path) -> None:
    """fp8-block:32 emulated on the float32 checkpoint gives, bit for bit, the weights the hub's fp8-block:32
    layout of the same model dequantizes to (the experts' gate and up quantized as two tensors); routers,
    norms, embeddings and the LM head stay as they are."""
    plain = tiny_model("qwen3_moe", LAYERS)
    hub = write_tiny_model("qwen3_moe", tmp_path / "hub", layers=LAYERS, quant="fp8-block:32")
    emulated = LazyModel(plain, dtype=torch.float32, max_layers=None)
    emulation = Emulation(parse_spec("fp8-block:32"), emulated.model)
    emulated.on_load.append(emulation.quantize_unit)
    stored = LazyModel(hub, dtype=torch.float32, max_layers=None)
    original = LazyModel(plain, dtype=torch.float32, max_layers=None)
    for lazy in (emulated, stored, original):
        lazy.module("model.layers.0")
    ours, theirs, before = (
        dict(lazy.module("model.layers.0").named_parameters()) for lazy in (emulated, stored, original)
    )
    for name in (
        "self_attn.q_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    ):
        assert torch.equal(ours[name], theirs[name]), name
        assert not torch.equal(ours[name], before[name]), name
    for name in ("mlp.gate.weight", "input_layernorm.weight", "self_attn.q_norm.weight"):
        assert torch.equal(ours[name], before[name]), name
    assert set(emulation.targets.linears) >= {"model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.o_proj"}
    assert not any(".gate" in p.rsplit(".", 1)[-1] for p in emulation.targets.linears)  # no router


def test_mxfp4_groups_along_the_input_dimension(tiny_model) -> None:
    """GPT-OSS's experts are stored `[E, in, out]` (`is_transposed`): MXFP4's groups of 32 run along `in`,
    the first of the two; a model whose experts' input is not a multiple of 32 cannot take the scheme."""
    lazy = LazyModel(tiny_model("gpt_oss", LAYERS), dtype=torch.float32, max_layers=None)
    emulation = Emulation(parse_spec("mxfp4"), lazy.model)
    assert not emulation.targets.linears  # GPT-OSS's release: the experts alone
    lazy.on_load.append(emulation.quantize_unit)
    down = lazy.module("model.layers.0").mlp.experts.down_proj  # [E, I, H]
    assert torch.equal(down, fake_quant(down.detach().transpose(-1, -2), "mxfp4").transpose(-1, -2))
    narrow = LazyModel(tiny_model("gpt_oss", LAYERS, intermediate_size=48), dtype=torch.float32)
    with pytest.raises(ValueError, match="down_proj has an input dimension of 48, not a multiple of 32"):
        find_targets(narrow.model, parse_spec("mxfp4"))


def test_static_and_kv_scales_come_from_the_checkpoint_where_it_has_them(tmp_path: Path, golden_dir) -> None:
    """A checkpoint's `k_scale` / `v_scale` (calibrated on a handful of tokens) are its KV scales; what it
    lacks (every input_scale here) is computed from the golden's own prompt; the closing line says which."""
    from helpers import session

    model = write_tiny_model("qwen3_moe", tmp_path / "q", layers=LAYERS, quant="fp8-block:32", kv_scales=True)
    run = session(golden_dir("qwen3_moe", LAYERS), model, hw_options=["quant=fp8-block:32+static+kv-fp8"])
    try:
        run.runner.run("layer_0.attention")
        emulation = run.backend.emulation
        assert not emulation.weights  # the checkpoint's own fp8-block:32 weights, not rounded twice
        assert {emulation.sources[s] for s in emulation.kv_sites()} == {"checkpoint"}
        assert {emulation.sources[s] for s in emulation.activation_sites()} == {"computed"}
        (line,) = run.backend.closing_lines([])
        assert "static activation scales: 0 of 12 from the checkpoint's input_scale, 12 computed" in line
        assert "K/V scales: 4 of 4 from the checkpoint's k_scale / v_scale" in line
    finally:
        run.close()


def test_two_floors_add_in_quadrature() -> None:
    """A bf16 candidate under fp8 rounds as both do: the two floors' errors add as independent errors."""
    a = {"out": {"rel_l2": 3.0, "max_token_rel_l2": 6.0}, "top_k": {"flip_share": 0.25}}
    b = {"out": {"rel_l2": 4.0, "max_token_rel_l2": 8.0}, "top_k": {"flip_share": 0.5}, "other": {"rel_l2": 1.0}}
    assert combined(a, b) == {"out": {"rel_l2": 5.0, "max_token_rel_l2": 10.0}, "top_k": {"flip_share": 0.75}}
    assert combined(a, None) is a and combined(None, b) is None  # the scheme's floor or none: never b's alone
    tokens = combined_tokens({"out": torch.tensor([1.0, float("nan")])}, {"out": torch.tensor([2.0, 3.0])})
    assert tokens["out"][0] == 3.0 and torch.isnan(tokens["out"][1])


# -- the floor: recorded, picked, judged ------------------------------------------------------------


@pytest.fixture(scope="module")
def quant_golden(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 golden of qwen3_moe (a decode step) with its bf16 floor and its fp8-block:32 floor."""
    out = tmp_path_factory.mktemp("quant-golden") / "golden"
    model = tiny_model("qwen3_moe", LAYERS)
    record_golden(model, out, seq_len=16, decode_steps=1)
    record_noise(out, "bfloat16", model_dir=model)
    record_noise(out, None, quant=SPEC, model_dir=model)
    return out


def _first(report: Path) -> str | None:
    return read_json(report / "comparison_summary.json")["first_divergence"]


def test_golden_noise_quant_records_the_floor_of_the_scheme(capsys, tiny_model, tmp_path: Path) -> None:
    golden = tmp_path / "g"
    code, out, _ = cli(
        capsys, "golden", "--model", str(tiny_model("qwen3_moe", LAYERS)), "--out", str(golden), "--seq-len", "8",
        "--noise-quant", SPEC, "--noise-quant", "fp8-channel+dynamic-tensor+kv-fp8", "-q",
    )  # fmt: skip
    assert code == 0 and "quantization floor fp8-block:32+dynamic-token, quantization floor fp8-channel" in out
    noise = read_json(golden / "manifest.json")["noise"]
    assert sorted(noise) == ["quant:fp8-block:32+dynamic-token", "quant:fp8-channel+dynamic-tensor+kv-fp8"]
    entry = noise["quant:fp8-channel+dynamic-tensor+kv-fp8"]
    assert entry["quant"]["dtype"] == "float32" and entry["quant"]["sites"]["kv"] == 4
    assert "K/V scales: 0 of 4 from the checkpoint's k_scale / v_scale, 4 computed" in entry["quant"]["scales"][0]
    assert {"isolated", "chain", "free"} <= set(entry) and (golden / entry["tokens"]["file"]).is_file()
    assert entry["isolated"]["layer_0.attention"]["out"]["rel_l2"] > 1e-2  # e4m3: a step of 2^-3
    assert entry["isolated"]["layer_0.router"]["logits"]["rel_l2"] == 0  # the router is not quantized


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--noise-quant", "fp8-block:0"], "--noise-quant fp8-block:0: 'fp8-block:0': a block size is N or RxC"),
        (["--noise-quant", "int8-channel", "--dtype", "bfloat16"],
         "--noise-quant int8-channel: the reference would run in bfloat16, whose own rounding"),
        (["--noise-quant", "fp8-tensor+kv-fp9"], "'kv-fp9' is neither an activation scheme"),
    ],
)  # fmt: skip
def test_golden_noise_quant_bad_input(capsys, tiny_model, tmp_path: Path, args: list[str], said: str) -> None:
    out = tmp_path / "g"
    code, _, err = cli(capsys, "golden", "--model", str(tiny_model("qwen3_moe", LAYERS)), "--out", str(out), *args)
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()  # checked before anything is recorded


def test_golden_noise_quant_a_scheme_the_model_cannot_take(capsys, tiny_model, tmp_path: Path) -> None:
    model = tiny_model("gpt_oss", LAYERS, intermediate_size=48)
    code, _, err = cli(capsys, "golden", "--model", str(model), "--out", str(tmp_path / "g"), "--noise-quant", "mxfp4")
    assert code == 2 and "--noise-quant mxfp4:" in err and "not a multiple of 32" in err
    assert not (tmp_path / "g").exists()


@pytest.mark.slow
def test_a_clean_fp8_candidate_passes_every_point_against_its_floor(
    pytester: pytest.Pytester, quant_golden: Path, tmp_path: Path
) -> None:
    """The model in bf16 under fp8-block:32 with per-token activations: every point passes, isolated and
    chained, prefill and decode; the header and the report say which floor; without it the same run fails."""
    report = tmp_path / "r"
    result = run_parity(
        pytester, quant_golden, "--dtype", "bfloat16", "--hw-option", f"quant={SPEC}", "--noise-quant", SPEC,
        "--parity-mode", "both", "--parity-report", str(report),
    )  # fmt: skip
    points = len(GoldenStore(quant_golden).points)
    result.assert_outcomes(passed=points)
    floor = (
        "moe-parity: noise floor: the reference's own error under fp8-block:32+dynamic-token (weights fp8-block:32, "
        "activations e4m3, a dynamic scale per token and group of 32), with its own bfloat16 rounding added "
        "(--noise-quant fp8-block:32+dynamic-token)"
    )
    result.stdout.fnmatch_lines([floor, "*", "first divergence: none", "*", floor])
    meta = read_json(report / REPORT_FILE)
    assert meta["noise_floor"] == {
        "key": "quant:fp8-block:32+dynamic-token", "scheme": SPEC, "combined_with": "bfloat16",
        "source": "--noise-quant fp8-block:32+dynamic-token",
    }  # fmt: skip
    attention = next(p for p in meta["points"] if p["id"] == "layer_0.attention")
    assert attention["noise"]["floor"] == SPEC
    # judged by its dtype alone (the bf16 floor), the quantization's own error fails it
    without = run_parity(
        pytester, quant_golden, "--dtype", "bfloat16", "--hw-option", f"quant={SPEC}", "--noise-quant", "none",
        "--parity-report", str(tmp_path / "none"),
    )  # fmt: skip
    failed = without.parseoutcomes()["failed"]
    assert failed >= 8, without.stdout.str()
    assert _first(tmp_path / "none") == "layer_0.attention"


@pytest.mark.slow
def test_a_clean_fp8_port_of_a_hub_layout_passes_and_a_scaled_lm_head_still_fails(
    pytester: pytest.Pytester, capsys, tmp_path: Path
) -> None:
    """DeepSeek-V3 written as the hub writes it (fp8, blocks of 8), judged in bf16 under fp8-block:32 with
    per-token activations: every point passes, chained too, its next-token flips within what the scheme's
    own error moves (3 real flips of 13 by the dtype's ties, seen on a CPU and an H200); an LM head
    scaled by 1.3 still fails, at the logits and nowhere before."""
    model, golden = tmp_path / "m", tmp_path / "g"
    assert cli(capsys, "tiny-model", "--arch", "deepseek_v3", "--quant", "fp8-block:8", "--out", model)[0] == 0
    argv = ("golden", "--model", model, "--out", golden, "--noise-dtype", "bfloat16", "--noise-quant", SPEC, "-q")
    assert cli(capsys, *argv)[0] == 0
    args = ("--dtype", "bfloat16", "--hw-option", f"quant={SPEC}", "--noise-quant", SPEC, "--parity-mode", "both")
    result = run_parity(pytester, golden, *args, model=model)
    result.assert_outcomes(passed=len(GoldenStore(golden).points))

    def edit(t: dict) -> None:
        t["lm_head.weight"] = t["lm_head.weight"] * 1.3

    port = edit_checkpoint(model, tmp_path / "port", edit)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *args, "--no-parity-weights", "--parity-report", str(report), model=port
    )  # fmt: skip
    assert result.parseoutcomes()["failed"] == 1 and result.ret == 1
    assert _first(report) == "logits"


def test_a_scale_off_in_one_expert_fails_at_its_layer_first(
    pytester: pytest.Pytester, quant_golden: Path, tiny_model, tmp_path: Path
) -> None:
    """One expert of layer 1 whose down projection's scale is read 2x (another expert's scale): every point
    before layer 1's experts passes against the floor; they fail first, beyond noise_factor 2."""

    def edit(t: dict) -> None:
        key = "model.layers.1.mlp.experts.3.down_proj.weight"
        t[key] = t[key] * 2.0

    port = edit_checkpoint(tiny_model("qwen3_moe", LAYERS), tmp_path / "port", edit)
    report = tmp_path / "r"
    result = run_parity(
        pytester, quant_golden, "--dtype", "bfloat16", "--hw-option", f"quant={SPEC}", "--noise-quant", SPEC,
        "--no-parity-weights", "--no-parity-config", "--parity-report", str(report), "-k", "not step_1",
        model=port,
    )  # fmt: skip
    assert _first(report) == "layer_1.experts"
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert all(rows[p]["status"] == "passed" for p in rows if p.startswith(("embedding", "rotary", "layer_0")))
    assert rows["layer_1.experts"]["noise"]["ratio"] > 2.0 == rows["layer_1.experts"]["limits"]["noise_factor"]
    assert result.ret == 1


def test_a_floor_the_golden_lacks_is_a_usage_error(pytester: pytest.Pytester, quant_golden: Path) -> None:
    usage_error(
        run_parity(pytester, quant_golden, "--dtype", "bfloat16", "--noise-quant", "fp8-channel+dynamic-token"),
        "--noise-quant fp8-channel+dynamic-token: " + str(quant_golden) + " holds no noise floor under "
        "fp8-channel+dynamic-token (its quantization floors: fp8-block:32+dynamic-token); record it with "
        "`moe-parity golden ... --noise-quant fp8-channel+dynamic-token`",
    )
    usage_error(run_parity(pytester, quant_golden, "--noise-quant", "fp8-block:0"), "--noise-quant fp8-block:0:")
    usage_error(
        run_parity(pytester, quant_golden, "--hw", "trace", "--hw-option", f"quant={SPEC}"),
        "--hw-option quant: a quantization is emulated on --hw cpu and cuda, not trace",
    )


def test_a_coarser_candidate_needs_its_dtype_s_floor_too(pytester: pytest.Pytester, quant_golden: Path, tmp_path: Path):
    """The fp8 floor ran in float32: a bf16 candidate also rounds as bf16 does, so the golden must hold the
    bf16 floor to add (`--noise-dtype bfloat16`)."""
    golden = shutil.copytree(quant_golden, tmp_path / "g")
    manifest = json.loads((golden / "manifest.json").read_text())
    del manifest["noise"]["bfloat16"]
    (golden / "manifest.json").write_text(json.dumps(manifest))
    usage_error(
        run_parity(pytester, golden, "--dtype", "bfloat16", "--noise-quant", SPEC, "-k", "embedding"),
        f"--noise-quant {SPEC}: the floor ran in float32 and the candidate runs in bfloat16, whose own rounding it "
        "lacks: record the golden with `moe-parity golden ... --noise-dtype bfloat16` too",
    )


def test_a_quantized_candidate_checkpoint_picks_the_golden_s_one_floor(
    pytester: pytest.Pytester, quant_golden: Path, tmp_path: Path
) -> None:
    port = write_tiny_model("qwen3_moe", tmp_path / "fp8", layers=LAYERS, quant="fp8-block:32")
    result = run_parity(
        pytester, quant_golden, "--dtype", "bfloat16", "--no-parity-weights", "--no-parity-config", "-k",
        "layer_0.attention", model=port,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "moe-parity: noise floor: the reference's own error under fp8-block:32+dynamic-token (*), with its own "
            "bfloat16 rounding added (the candidate checkpoint is quantized (fp8 (fp8-block:32, activations "
            "dynamic-token)) and the golden holds this one quantization floor)"
        ]
    )


# -- batch invariance under dynamic scales ----------------------------------------------------------


@pytest.fixture(scope="module")
def batch_golden(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quant-batch")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in PADDED_PROMPTS))
    record_golden(tiny_model("qwen3_moe", LAYERS), folder / "golden", prompts=prompts, padding_side="left")
    return folder / "golden"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_scale_shared_over_the_batch_fails_at_the_first_projection(
    pytester: pytest.Pytester, batch_golden: Path, tmp_path: Path, dtype: str
) -> None:
    """Per-tensor dynamic activation scales: a row's rounding is set by the batch's largest activation, so
    the first point with a projection (the first attention) changes in the batch, and the item names the
    shared scale; the points before it (embedding, rotary, the first norm) pass."""
    report = tmp_path / "r"
    result = run_parity(
        pytester, batch_golden, "--dtype", dtype, "--hw-option", "quant=fp8-channel+dynamic-tensor",
        "--parity-batch-invariance", "-k", "batch", "--parity-report", str(report),
    )  # fmt: skip
    assert _first(report) == "layer_0.attention::batch"
    result.stdout.fnmatch_lines(
        [
            "layer_0.attention::batch: batching alone changes rows * of 3*",
            "  hint: a row's output depends on the other rows of the batch: an activation scale shared over the batch "
            "(per-tensor dynamic quantization) does this*; per-token scales do not (--hw-option "
            "quant=fp8-channel+dynamic-tensor: each projection's input is rounded with one scale over the whole batch)",
        ]
    )
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows["layer_0.attention::batch"]["condition"] == "shared_scale"
    assert all(rows[f"{p}::batch"]["status"] == "passed" for p in ("embedding", "rotary", "layer_0.input_norm"))


def test_per_token_scales_keep_each_row_its_own(pytester: pytest.Pytester, batch_golden: Path) -> None:
    result = run_parity(
        pytester, batch_golden, "--dtype", "float32", "--hw-option", "quant=fp8-channel+dynamic-token",
        "--parity-batch-invariance", "-k", "batch",
    )  # fmt: skip
    result.assert_outcomes(passed=len([p for p in GoldenStore(batch_golden).points if p.step is None]))
    result.stdout.fnmatch_lines(["first divergence: none"])


def test_compare_judges_a_dumped_fp8_port_against_the_floor_of_its_scheme(
    capsys, quant_golden: Path, tiny_model, tmp_path: Path
) -> None:
    """`moe-parity compare --noise-quant SPEC`: a clean FP8 port's dump (the model in bf16 under the scheme,
    every point on the golden's inputs) passes against the scheme's floor and fails without it."""
    from safetensors.torch import save_file

    from pytest_moe_parity.session import ParitySession, RunOptions

    run = ParitySession(RunOptions(
        golden_dir=quant_golden, model=tiny_model("qwen3_moe", LAYERS), dtype="bfloat16", hw_options=[f"quant={SPEC}"],
    ))  # fmt: skip
    dump = tmp_path / "dump"
    dump.mkdir()
    tensors = {}
    try:
        for point in (p for p in run.points if not p.id.endswith("rotary")):  # the tables: no quantization
            output = run.prepare(point).candidate.output
            leaves = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
            tensors.update({f"{point.id}.{i}": t.contiguous() for i, t in enumerate(leaves)})
    finally:
        run.close()
    save_file(tensors, str(dump / "dump.safetensors"))
    names = {p.id: [f"{p.id}.{i}" for i in range(8) if f"{p.id}.{i}" in tensors] for p in run.points}
    names = {pid: keys for pid, keys in names.items() if keys}
    (tmp_path / "map.json").write_text(
        json.dumps({pid: keys[0] if len(keys) == 1 else keys for pid, keys in names.items()})
    )
    argv = ("compare", quant_golden, dump, "--map", tmp_path / "map.json", "--dtype", "bfloat16", "--plots", "no")
    code, out, err = cli(capsys, *argv, "--noise-quant", SPEC, "--report", tmp_path / "r")
    assert code == 0 and "first divergence: none" in out, out + err
    assert read_json(tmp_path / "r" / REPORT_FILE)["noise_floor"]["scheme"] == SPEC
    code, out, err = cli(capsys, *argv, "--noise-quant", "none", "--report", tmp_path / "none")
    assert code == 1 and _first(tmp_path / "none") == "layer_0.attention", out + err


def test_a_kv_cache_whose_scales_clip_fails_at_the_attention_of_its_layer(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """An FP8 KV cache calibrated on too few tokens: its k_scale / v_scale cover half the range the prompt
    needs (layer 1), so K / V clip at 448 x scale. Judged against the floor of the checkpoint's own scales,
    the clean checkpoint passes every point and the clipped one fails first at layer_1.attention."""
    kv_spec = "fp8-channel+dynamic-token+kv-fp8"
    clean = write_tiny_model("qwen3_moe", tmp_path / "ct", layers=LAYERS, quant="fp8-channel", kv_scales=True)
    golden = tmp_path / "golden"
    record_golden(clean, golden, seq_len=16)
    record_noise(golden, None, quant=kv_spec, model_dir=clean)

    def halved(tensors) -> None:
        for key in [k for k in tensors if k.endswith(("k_scale", "v_scale")) and ".layers.1." in k]:
            tensors[key] = tensors[key] / 2

    clipped = edit_checkpoint(clean, tmp_path / "clipped", halved)
    argv = ("--hw-option", f"quant={kv_spec}", "--no-parity-weights", "--parity-report")
    ok = run_parity(pytester, golden, *argv, str(tmp_path / "ok"), model=clean)
    ok.stdout.fnmatch_lines(["first divergence: none", "*K/V scales: 4 of 4 from the checkpoint's k_scale / v_scale*"])
    assert ok.ret == 0
    bad = run_parity(pytester, golden, *argv, str(tmp_path / "bad"), model=clipped)
    bad.stdout.fnmatch_lines(["first divergence: layer_1.attention  (*"])
    assert _first(tmp_path / "bad") == "layer_1.attention"
