"""Quantized candidates' weights (issue 51, item 4): a quantized checkpoint's weights judged as stored,
each value within its format's rounding at its block's scale, against an unquantized reference or one
quantized alike; the classic scale bugs (`quant_bugs`) each fail the weight item of their layer naming
the tensor, the block or the experts and the bug, and each fails first, with the weight items off, at
the point that reads the tensor; a missing scale, or scales a block size does not fit, is bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import quant_bugs as qb
import torch
from helpers import NO_WEIGHTS, cli, read_json, run_parity, usage_error

from pytest_moe_parity.errors import SetupError
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.judge.quant_weights import Stored, judge_quantized
from pytest_moe_parity.model.quant import (
    expand_scale,
    fake_quant,
    mxfp4_dequantize,
    quantize_fp8,
    quantize_int8,
    quantize_mxfp4,
)
from pytest_moe_parity.record.tiny import write_tiny_model
from pytest_moe_parity.replay.setup import check_config
from pytest_moe_parity.replay.weights import WeightCheck
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

BLOCK = (32, 32)
DOUBLES = Path(__file__).resolve().parent / "doubles"
Q_PROJ = r"layers\.1\.self_attn\.q_proj\.weight$"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """tiny(arch, quant=None) -> a tiny checkpoint (quantized with `quant`), written once per module."""
    made: dict[tuple[str, str | None], Path] = {}

    def make(arch: str, quant: str | None = None) -> Path:
        if (arch, quant) not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{(quant or 'plain').replace(':', '')}")
            made[arch, quant] = write_tiny_model(arch, out, quant=quant)
        return made[arch, quant]

    return make


@pytest.fixture(scope="module")
def clean(tiny) -> Path:
    """qwen3_moe in DeepSeek's FP8 layout, blocks of 32 (112 e4m3 tensors)."""
    return tiny("qwen3_moe", "fp8-block:32")


@pytest.fixture(scope="module")
def golden(clean: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The clean quantized checkpoint's golden, recorded a layer at a time (`--stream`)."""
    from pytest_moe_parity.cli import main

    out = tmp_path_factory.mktemp("quant-golden") / "g"
    assert main(["golden", "--model", str(clean), "--out", str(out), "--stream"]) == 0
    return out


def buggy(clean: Path, tmp_path: Path, edit: qb.Edit, name: str = "bug") -> Path:
    return qb.edit_quantized(clean, tmp_path / name, edit)


def findings(reference: Path, candidate: Path, layers=(None, 0, 1, 2, 3)) -> dict[int | None, list[str]]:
    check = WeightCheck(reference.resolve(), candidate.resolve())
    try:
        return {layer: check.findings(layer)[0] for layer in layers}
    finally:
        check.close()


# -- the bound, on tensors ---------------------------------------------------------------------------


def _fp8(w: torch.Tensor, scheme: str = "fp8-block", block=BLOCK, scale_dtype=torch.float32) -> Stored:
    q, s = quantize_fp8(w, scheme, block)
    s = s.to(scale_dtype).float()
    rows, cols = w.shape[-2:]
    grid, blk = (s.reshape(1, 1), (rows, cols)) if scheme == "fp8-tensor" else (s, block or (1, cols))
    if scheme == "fp8-channel":
        blk = (1, cols)
    return Stored(q.float(), grid, blk, "e4m3", "weight_scale_inv", scheme)


def _worst(ref: torch.Tensor, stored: Stored) -> float:
    """The largest error of the stored weight, in allowances."""
    return float(((stored.dequantized() - ref).abs() / (stored.allowance() + ref.abs() * 2.0**-8)).max())


@pytest.mark.parametrize(
    "scheme",
    ["fp8-block", "fp8-block-uneven", "fp8-block-bf16-scale", "fp8-channel", "fp8-tensor", "int8", "mxfp4"],
)
def test_a_clean_quantization_is_within_one_rounding_and_little_more(scheme: str) -> None:
    """Every clean quantization holds the bound, using most of it (the bound is about one rounding: an
    error half again as large at one value fails, naming its block)."""
    torch.manual_seed(0)
    shape = (3, 40, 72) if scheme == "fp8-block-uneven" else (3, 64, 64)
    w = torch.randn(shape) * 0.05
    if scheme == "int8":
        q, s = quantize_int8(w)
        stored = Stored(q.float(), s, (1, 64), "int8", "weight_scale", "int8-channel")
    elif scheme == "mxfp4":
        blocks, exps = quantize_mxfp4(w)
        values = mxfp4_dequantize(blocks, torch.full_like(exps, 127), torch.float32).transpose(-1, -2)
        stored = Stored(values.contiguous(), torch.exp2(exps.float() - 127), (1, 32), "e2m1", "_scales", "mxfp4")
    elif scheme == "fp8-block-bf16-scale":
        stored = _fp8(w, scale_dtype=torch.bfloat16)
    else:
        stored = _fp8(w, scheme.removesuffix("-uneven"), None if scheme in ("fp8-channel", "fp8-tensor") else BLOCK)
    assert judge_quantized("w", w, stored.dequantized(), stored).findings == []
    assert judge_quantized("w", w.bfloat16().float(), stored.dequantized(), stored).findings == []  # a bf16 reference
    assert 0.75 < _worst(w, stored) <= 1.0
    off = stored.dequantized()
    i = int((stored.allowance()).flatten().argmax())
    off.view(-1)[i] += 1.5 * stored.allowance().view(-1)[i] * (1 if off.view(-1)[i] >= w.view(-1)[i] else -1)
    said = judge_quantized("w", w, off, stored).findings
    assert len(said) == 1 and said[0].startswith("w: expert ") and "1 of " in said[0]
    off.view(-1)[i] = float("nan")
    assert "1 of " in judge_quantized("w", w, off, stored).findings[0]


def test_the_scale_bugs_are_told_from_the_numbers() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 64) * 0.05
    good = _fp8(w)

    def told(stored: Stored, ref: torch.Tensor = w, **kw) -> tuple[str | None, str]:
        verdict = judge_quantized("w", ref, stored.dequantized(), stored, **kw)
        assert len(verdict.findings) == 1
        return verdict.cause, verdict.findings[0]

    def with_scale(scale: torch.Tensor, block=BLOCK) -> Stored:
        return Stored(good.values, scale, block, "e4m3", "weight_scale_inv", "fp8-block:32")

    cause, words = told(with_scale(1 / good.scale))
    assert cause == "inverse" and "w: every block (4, a 2x2 grid): 4096 of 4096 values" in words
    assert "the scale used where its inverse is meant" in words
    cause, words = told(with_scale(good.scale.T.contiguous()))
    assert cause == "transposed" and words.startswith("w: block (0, 1), block (1, 0) (of 4 blocks)")
    assert told(with_scale(good.scale, (48, 48)))[1].endswith("fits blocks of 32x32, where the layout says 48x48 "
                                                             "(weight_block_size)")  # fmt: skip
    assert told(with_scale(torch.ones_like(good.scale)))[0] == "unapplied"
    # twice, against the unquantized weight: two roundings where the scales fit the values
    again = _fp8(fake_quant(w, "fp8-block", (16, 16)))
    cause, words = told(again)
    assert cause == "twice" and "rounded twice?" in words
    # twice, against the same weight quantized in the same layout: its scale differs, its values are the
    # reference's rounded again at it
    scale = good.scale * 1.25
    q = (good.dequantized() / expand_scale(scale, (64, 64), BLOCK)).to(torch.float8_e4m3fn)
    twice = Stored(q.float(), scale, BLOCK, "e4m3", "weight_scale_inv")
    cause, words = told(twice, good.dequantized(), ref_stored=good, same_layout=True)
    assert cause == "twice" and "its weight_scale_inv differs from the reference's (1.25 times it" in words
    # stacked experts holding expert 0's scales; GPT-OSS's groups too
    experts = torch.randn(4, 64, 64) * 0.05
    one = _fp8(experts)
    shared = Stored(one.values, one.scale[:1].expand(4, -1, -1).contiguous(), BLOCK, "e4m3", "weight_scale_inv")
    cause, words = told(shared, experts)
    assert cause == "shared" and words.startswith("w: expert 1: every block") and "holds expert 0's" in words
    blocks, exps = quantize_mxfp4(experts)
    values = mxfp4_dequantize(blocks, torch.full_like(exps, 127), torch.float32).transpose(-1, -2).contiguous()
    mx = Stored(values, torch.exp2(exps.float() - 127)[:1].expand(4, -1, -1).contiguous(), (1, 32), "e2m1", "_scales")
    cause, words = told(mx, experts)
    assert cause == "shared" and "expert 1: row " in words and "(inputs 0-31)" in words
    q8, s8 = quantize_int8(w)
    cause, words = told(Stored(q8.float(), 1 / s8, (1, 64), "int8", "weight_scale"))
    assert cause == "inverse" and words.startswith("w: every channel (64, a 64x1 grid)")


# -- checkpoints ------------------------------------------------------------------------------------

BUGS = {  # bug: (edit, its layer, words of the weight item, the first point it fails with the weight items off)
    "inverse": (
        qb.inverse(Q_PROJ),
        1,
        "model.layers.1.self_attn.q_proj.weight: every block (4, a 2x2 grid): 4096 of 4096 values beyond e4m3's "
        "rounding at their block's scale",
        "layer_1.attention",
    ),
    "block-size": (
        qb.block_size(48),
        0,
        "a block size off: its weight_scale_inv fits blocks of 32x32, where the layout says 48x48",
        "layer_0.attention",
    ),
    "transposed": (
        qb.transposed(r"layers\.2\.self_attn\.o_proj\.weight$"),
        2,
        "model.layers.2.self_attn.o_proj.weight: block (0, 1), block (1, 0) (of 4 blocks): ",
        "layer_2.attention",
    ),
    "one-expert-scale": (
        qb.one_expert_scale(1, "gate_proj"),
        1,
        "model.layers.1.mlp.experts.*.gate_proj.weight: experts 1, 2, 3, 4, 5, 6, 7 (7 of 8) fail: one expert's "
        "scale read for every expert: every expert holds expert 0's weight_scale_inv",
        "layer_1.experts",
    ),
    "unapplied": (
        qb.unapplied(r"layers\.2\.self_attn\.k_proj\.weight$"),
        2,
        "model.layers.2.self_attn.k_proj.weight: every block (2, a 1x2 grid): 2048 of 2048 values beyond e4m3's "
        "rounding at their block's scale (up to ",
        "layer_2.attention",
    ),
    "twice": (
        qb.twice(r"layers\.3\.mlp\.experts\.\d+\.down_proj\.weight$"),
        3,
        "model.layers.3.mlp.experts.0.down_proj.weight: every block (4, a 2x2 grid): its weight_scale_inv differs "
        "from the reference's (1.25 times it at block (0, 0)): quantized twice",
        "layer_3.experts",
    ),
}
CAUSE_WORDS = {
    "inverse": "the scale used where its inverse is meant",
    "transposed": "its weight_scale_inv is transposed",
    "unapplied": "a scale not applied: its weight_scale_inv is 1 everywhere",
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_scale_bug_fails_the_weights_of_its_layer_at_its_tensor(bug: str, clean: Path, tmp_path: Path) -> None:
    edit, layer, words, _ = BUGS[bug]
    said = findings(clean, buggy(clean, tmp_path, edit))
    assert [unit for unit, found in said.items() if found] == ([0, 1, 2, 3] if bug == "block-size" else [layer])
    assert any(words in f for f in said[layer]), said[layer]
    assert all(CAUSE_WORDS.get(bug, "") in f for f in said[layer])


@pytest.mark.parametrize("bug", ["inverse", "transposed", "one-expert-scale", "unapplied", "block-size"])
def test_the_bugs_read_alike_against_the_unquantized_model(bug: str, clean: Path, tiny, tmp_path: Path) -> None:
    """Against the model the checkpoint was quantized from, each bug is the same finding (a second
    rounding then shows as more than one: `test_a_weight_quantized_twice_...`)."""
    edit, layer, words, _ = BUGS[bug]
    said = findings(tiny("qwen3_moe"), buggy(clean, tmp_path, edit), layers=(None, layer))
    assert said[None] == [] and any(words.split(" (up to")[0] in f for f in said[layer]), said[layer]


def test_a_weight_quantized_twice_shows_against_the_unquantized_model(clean: Path, tiny, tmp_path: Path) -> None:
    """Quantized from a copy quantized already (blocks of 16, then the checkpoint's 32): off by up to two
    roundings where each block's scale fits. Against the once-quantized checkpoint it is one rounding
    of that checkpoint's values at the same scales, within the format's rounding, and passes."""
    weight = "model.layers.3.self_attn.v_proj.weight"
    candidate = buggy(clean, tmp_path, qb.twice_from(tiny("qwen3_moe"), weight))
    said = findings(tiny("qwen3_moe"), candidate, layers=(2, 3))
    assert said[2] == [] and len(said[3]) == 1
    assert said[3][0].startswith(f"{weight}: every block (2, a 1x2 grid): ") and "rounded twice?" in said[3][0]
    assert findings(clean, candidate, layers=(3,))[3] == []


@pytest.mark.parametrize(
    "arch, quant",
    [
        ("qwen3_moe", "fp8-block:32"),
        ("deepseek_v3", "fp8-block:32"),
        ("minimax_m2", "fp8-block:32"),
        ("qwen3_moe", "fp8-channel"),
        ("qwen3_moe", "fp8-tensor"),
        ("qwen3_moe", "int8-channel"),
        ("gpt_oss", "mxfp4"),
    ],
)
def test_a_clean_quantized_checkpoint_passes_against_its_unquantized_model(arch: str, quant: str, tiny) -> None:
    check = WeightCheck(tiny(arch).resolve(), tiny(arch, quant).resolve())
    try:
        for layer in (None, 0, 1, 2, 3):
            found, notes = check.findings(layer)
            assert found == [], (layer, found)
            assert layer is None or any("quantized tensor(s) within their format's rounding" in n for n in notes)
        assert check.quantized_line().startswith("moe-parity: quantized weights (candidate ")
    finally:
        check.close()


@pytest.mark.parametrize(
    "arch, quant, edit, layer, words",
    [
        ("deepseek_v3", "fp8-block:32", qb.one_expert_scale(2, "up_proj", 3), 2,
         "model.layers.2.mlp.experts.*.up_proj.weight: experts 0, 1, 2, 4, 5, 6, 7 (7 of 8) fail: one expert's scale "
         "read for every expert: every expert holds expert 3's weight_scale_inv"),
        ("minimax_m2", "fp8-block:32", qb.one_expert_scale(1, "w1"), 1,
         "model.layers.1.block_sparse_moe.experts.*.w1.weight: experts 1, 2, 3, 4, 5, 6, 7 (7 of 8) fail"),
        ("qwen3_moe", "fp8-channel", qb.inverse(r"layers\.0\.self_attn\.v_proj\.weight$"), 0,
         "model.layers.0.self_attn.v_proj.weight: every channel (32, a 32x1 grid): 2048 of 2048 values"),
        ("gpt_oss", "mxfp4", qb.one_expert_scale(3, "down_proj"), 3,
         "model.layers.3.mlp.experts.down_proj: experts 1, 2, 3, 4, 5, 6, 7 (7 of 8) fail"),
        ("gpt_oss", "mxfp4", qb.inverse(r"layers\.1\.mlp\.experts\.gate_up_proj_scales$"), 1,
         "model.layers.1.mlp.experts.gate_up_proj (expert 0): every group (256, a 128x2 grid): "),
    ],
    ids=["deepseek_v3-expert-scale", "minimax_m2-expert-scale", "fp8-channel-inverse", "mxfp4-expert-scale",
         "mxfp4-inverse"],
)  # fmt: skip
def test_scale_bugs_of_other_layouts_are_named_too(arch, quant, edit, layer, words, tiny, tmp_path: Path) -> None:
    candidate = qb.edit_quantized(tiny(arch, quant), tmp_path / "bug", edit)
    said = findings(tiny(arch, quant), candidate, layers=(None, layer))
    assert said[None] == [] and said[layer][0].startswith(words), said[layer]
    if "inverse" in str(edit):
        assert all("the scale used where its inverse is meant" in f for f in said[layer][:-1])
        stacked = "model.layers.1.mlp.experts.gate_up_proj: and 5 more of its 8 experts beyond it (3, 4, 5, 6, 7)"
        assert len(said[layer]) == 1 or said[layer][3:] == [stacked]
    else:
        assert len(said[layer]) == 1 and "one expert's scale read for every expert" in said[layer][0]


def test_an_unquantized_candidate_against_a_quantized_reference(clean: Path, tiny, tmp_path: Path) -> None:
    """The model the golden's FP8 checkpoint was quantized from passes: the reference's values are its
    own rounded; a tensor of it scaled by 1.1 does not."""
    plain = tiny("qwen3_moe")
    assert findings(clean, plain, layers=(0, 1)) == {0: [], 1: []}

    def scaled(t: qb.Tensors, config: dict) -> None:
        t["model.layers.1.self_attn.q_proj.weight"] *= 1.1

    said = findings(clean, qb.edit_quantized(plain, tmp_path / "scaled", scaled), layers=(1,))[1]
    assert len(said) == 1 and said[0].startswith("model.layers.1.self_attn.q_proj.weight: every block")
    assert said[0].endswith("(the reference's quantized model.layers.1.self_attn.q_proj.weight against the "
                            "candidate's)")  # fmt: skip


@pytest.mark.parametrize(
    "edit, words",
    [
        (qb.missing_scale("model.layers.1.mlp.experts.3.down_proj.weight"),
         "model.layers.1.mlp.experts.3.down_proj.weight is stored in float8_e4m3fn but has no "
         "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv: a quantized weight needs its scale"),
        (qb.block_size(64),
         "weight_block_size [64, 64] does not match the scales: "
         "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv has shape [2, 2], and a [64, 64] weight in "
         "blocks of 64x64 needs [1, 1]; they fit blocks of 32x32"),
    ],
    ids=["missing-scale", "block-size-misfit"],
)  # fmt: skip
def test_a_scale_that_cannot_be_read_is_bad_input_naming_the_tensor(
    edit, words: str, clean: Path, golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    candidate = buggy(clean, tmp_path, edit)
    with pytest.raises(SetupError) as exc:
        check_config(GoldenStore(golden), candidate)
    assert str(exc.value) == f"candidate {candidate}: {words}"
    code, _, err = cli(capsys, "golden", "--model", candidate, "--out", tmp_path / "g", "--stream")
    assert code == 2 and err.strip().splitlines()[-1].endswith(words) and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists()


# -- pytest runs ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("_import_everything_once")
def test_a_missing_scale_stops_the_run_as_a_usage_error(
    clean: Path, golden: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    candidate = buggy(clean, tmp_path, qb.missing_scale("model.layers.2.self_attn.q_proj.weight"))
    usage_error(
        run_parity(pytester, golden, model=candidate),
        f"candidate {candidate}: model.layers.2.self_attn.q_proj.weight is stored in float8_e4m3fn but has no "
        "model.layers.2.self_attn.q_proj.weight_scale_inv",
    )


@pytest.mark.usefixtures("_import_everything_once")
def test_a_clean_quantized_candidate_passes_every_point(
    clean: Path, golden: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    candidate = qb.edit_quantized(clean, tmp_path / "copy", lambda t, c: None)
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "--parity-report", str(report), model=candidate)
    n = len(GoldenStore(golden).points)
    result.assert_outcomes(passed=n + 6)  # the points, the config and the five weight items
    result.stdout.fnmatch_lines(
        [
            "moe-parity: quantized weights (candidate fp8 (fp8-block:32, activations dynamic-token); reference fp8 "
            "(fp8-block:32, activations dynamic-token)) are judged as stored*",
            "layer_0.weights *passed*28 quantized tensor(s) within*",
            "first divergence: none",
        ]
    )
    assert read_json(report / SUMMARY_FILE)["failed"] == 0


@pytest.mark.usefixtures("_import_everything_once")
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_scale_bug_fails_its_weight_item_then_its_first_activation_point(
    bug: str, clean: Path, golden: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The weight item of the bug's layer fails first, naming the tensor; with the weight items off, the
    first point to fail is the one that reads the tensor (-x: nothing after it runs)."""
    edit, layer, words, point = BUGS[bug]
    candidate = buggy(clean, tmp_path, edit)
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "-x", "--parity-report", str(report), model=candidate)
    item = f"layer_{layer}.weights"
    result.stdout.fnmatch_lines([f"first divergence: {item}  (*", f"FAILED *{item}*"])
    assert words in result.stdout.str()
    if bug == "block-size":  # every tensor of the layer: said once, how many and the first in full
        result.stdout.fnmatch_lines(
            ["2? tensors (model.layers.0.*and 2? more): its weight_scale_inv fits blocks of 32x32*"]
        )
    assert result.parseoutcomes()["failed"] == 1
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == item
    assert any(words in f for f in rows[item]["findings"])
    off = run_parity(pytester, golden, "-x", NO_WEIGHTS, "--parity-report", str(tmp_path / "off"), model=candidate)
    off.stdout.fnmatch_lines([f"first divergence: {point}  (*"])
    assert off.parseoutcomes()["failed"] == 1
    assert read_json(tmp_path / "off" / SUMMARY_FILE)["first_divergence"] == point
    ran = [r["id"] for r in read_json(tmp_path / "off" / REPORT_FILE)["points"] if r["status"] != "not run"]
    assert not [i for i in ran if i.endswith("weights")] and ran[-1] == point, ran


# -- --hw nxdi: NxDI's conversion dequantizes the FP8 checkpoint (its `maybe_dequantize_layer`) ----------

NXDI_INVERTED = """
from neuronx_distributed_inference.models.qwen3_moe import modeling_qwen3_moe as m

dequantize = m.maybe_dequantize_layer


def inverted(state_dict, config):  # a port's conversion that divides by weight_scale_inv
    for key in [k for k in state_dict if k.endswith("_scale_inv")]:
        state_dict[key] = 1 / state_dict[key]
    dequantize(state_dict, config)


m.maybe_dequantize_layer = inverted
"""


@pytest.mark.usefixtures("_import_everything_once", "nxdi_double")
def test_nxdi_s_conversion_of_the_quantized_checkpoint_is_judged_against_transformers_dequantization(
    clean: Path, golden: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Under --hw nxdi the weights are what NxDI's conversion made of the checkpoint: the checkpoint is
    judged as stored, and NxDI's dequantization against transformers'. A clean checkpoint through a
    clean conversion passes; one that inverts the scales fails the first layer's weight item, naming
    the tensor; a scale bug of the checkpoint itself fails where it is, as without NxDI."""
    pytester.syspathinsert(DOUBLES)
    candidate = qb.edit_quantized(clean, tmp_path / "copy", lambda t, c: None)
    args = ("--hw", "nxdi", "--dtype", "bfloat16", "-x", "-k", "weights")
    result = run_parity(pytester, golden, *args, model=candidate)
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        ["*are judged as stored*; the nxdi backend's conversion of them against transformers'*"]
    )
    bug = qb.edit_quantized(clean, tmp_path / "bug", qb.inverse(Q_PROJ))
    result = run_parity(pytester, golden, *args, model=bug)
    result.stdout.fnmatch_lines(["first divergence: layer_1.weights  (model.layers.1.self_attn.q_proj.weight: every*"])
    assert "the scale used where its inverse is meant" in result.stdout.str()
    pytester.makeconftest(NXDI_INVERTED)
    result = run_parity(pytester, golden, *args, model=candidate)
    result.stdout.fnmatch_lines(
        ["first divergence: layer_0.weights  (model.layers.0.mlp.experts.down_proj: differs*(the backend's conversion, "
         "against the checkpoint dequantized as transformers does)*"]
    )  # fmt: skip
