"""Weight items: the candidate checkpoint's weights against the golden's model, before the
activations, with what is wrong said in words (on wherever the candidate is another checkpoint;
`--no-parity-weights` leaves them out, `--parity-weights` says why there are none)."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
import torch
from helpers import read_json, run_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.judge.weights import diagnose
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")


@pytest.mark.parametrize(
    "fault, item, words",
    [
        (faults.swap_gate_up(2), "layer_2.weights", "experts.gate_up_proj: its halves along dim 1 are exchanged"),
        (faults.swap_experts(1, 3, 5), "layer_1.weights", "expert 3 holds reference expert 5, expert 5 holds"),
        (faults.permute_router_rows(1), "layer_1.weights", "mlp.gate.weight: row 0 holds reference row 7"),
        (
            faults.scale("post_attention_layernorm", 3, 2.0),
            "layer_3.weights",
            "post_attention_layernorm.weight: scaled by 2",
        ),
        (faults.lose_weight("model.norm.weight"), "weights", "model.norm.weight: every value is 1 (left at its init"),
    ],
    ids=["gate-up-swapped", "experts-swapped", "router-transposed-rows", "norm-scaled", "norm-not-loaded"],
)
def test_a_weight_fault_fails_its_weight_item_first(
    fault, item: str, words: str, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    golden = golden_dir("qwen3_moe")
    candidate = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "c", fault)
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "-x", "--parity-report", str(report), model=candidate)  # on by default
    result.stdout.fnmatch_lines(
        ["*weights checked against the golden's model*", f"first divergence: {item}  (*", f"FAILED *{item}*"]
    )
    assert words in result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 1  # -x: the weights stop the run before any activation of that unit
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == item and summary["failed"] == 1
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows[item]["component"] == "weights" and any(words in f for f in rows[item]["findings"])


def test_one_narrowed_tensor_is_a_conversion_its_activations_judge(
    pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    """One tensor stored as bf16 (the reference's values rounded): its weight item passes with the
    note; a float32 run then finds what the rounding does at the point that reads it."""
    golden = golden_dir("qwen3_moe")
    candidate = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "c", faults.narrow("o_proj", 2))
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "-x", "--parity-report", str(report), model=candidate)
    result.stdout.fnmatch_lines(
        [
            "moe-parity: the candidate checkpoint is a conversion (1 tensor(s) stored as BF16, the reference's*",
            "layer_2.weights *passed * a conversion: 1 tensor(s) stored as BF16*",
            "first divergence: layer_2.attention*",
        ]
    )
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows["layer_2.weights"]["status"] == "passed" and rows["layer_2.weights"]["findings"] == []


def test_clean_weights_pass_before_each_layer(pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model):
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), tmp_path / "c", lambda t: None)  # a copy
    report = tmp_path / "report"
    result = run_parity(pytester, golden, "-v", "--parity-layers", "1", "--parity-report", str(report), model=candidate)
    n = len([p for p in GoldenStore(golden).points if p.layer == 1])
    result.assert_outcomes(passed=n + 1)
    result.stdout.fnmatch_lines(["*layer_1.weights PASSED*", "*layer_1.input_norm PASSED*", "first divergence: none"])
    rows = read_json(report / REPORT_FILE)["points"]
    assert [r["id"] for r in rows][:2] == ["layer_1.weights", "layer_1.input_norm"]
    assert "plots not drawn" not in result.stdout.str() and (report / "heatmap.png").is_file()
    assert rows[0]["status"] == "passed" and rows[0]["findings"] == []
    plain = run_parity(pytester, golden, "--parity-weights", model=tiny_model("mixtral"))  # the golden's own model
    plain.stdout.fnmatch_lines(["*no weight items: the candidate is the golden's own model*"])
    assert "weight items" not in run_parity(pytester, golden, model=tiny_model("mixtral")).stdout.str()  # if asked
    off = run_parity(pytester, golden, "--no-parity-weights", "--parity-layers", "1", model=candidate)
    off.assert_outcomes(passed=n)
    assert "weights checked" not in off.stdout.str() and "layer_1.weights" not in off.stdout.str()


def test_diagnoses_in_words() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    assert diagnose("w", w, w.clone()) == []
    assert diagnose("w", w, None) == ["w: missing from the candidate"]
    assert "transposed" in diagnose("w", w, w.T.contiguous())[0]
    assert "scaled by 0.5" in diagnose("w", w, w * 0.5)[0]
    # stored narrower, the reference's values rounded: a conversion, no finding; wrong values too: both said
    assert diagnose("w", w, w.to(torch.bfloat16).float(), ref_dtype="F32", cand_dtype="BF16") == []
    said = diagnose("w", w, 2 * w.to(torch.bfloat16).float(), ref_dtype="F32", cand_dtype="BF16")
    assert said[0] == "w: stored as BF16, the reference as F32" and said[1].startswith("w: scaled by")
    broken = w.clone()
    broken[2] = 0
    assert diagnose("w", w, broken) == ["w: row 2 differs (1 all zeros)"]
