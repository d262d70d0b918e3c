"""Long contexts on a disk budget: `moe-parity golden --capture-tokens` keeps some token positions of
every prefill point's output and none of the inputs, and such a golden is judged chained on them."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import faults
import pytest
from helpers import cli, read_json, run_parity, usage_error

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.golden.spec import parse_token_spec, select_tokens
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.replay.noise import record_noise
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

SEQ = 48
KEPT = "0-3,last-4"


@pytest.fixture(scope="module")
def kept_golden(tiny_model, tmp_path_factory) -> Path:
    """A qwen3_moe golden of 48 tokens keeping positions 0-3 and 44-47, one decode step, and the
    reference's own bf16 error (recorded chained only: the golden has no inputs to replay)."""
    out = tmp_path_factory.mktemp("kept") / "golden"
    record_golden(tiny_model("qwen3_moe"), out, seq_len=SEQ, capture_tokens=KEPT, decode_steps=1)
    record_noise(out, "bfloat16", model_dir=tiny_model("qwen3_moe"))
    return out


def test_token_specs_name_positions() -> None:
    assert parse_token_spec("0-3,last-4", 48) == [0, 1, 2, 3, 44, 45, 46, 47]
    assert parse_token_spec("5, 2-3, last-1", 10) == [2, 3, 5, 9]
    for bad, said in (("x", "'x' is not a position"), ("40-60", "not within the 48 tokens"), (",", "names no")):
        with pytest.raises(ValueError, match=said):
            parse_token_spec(bad, 48)
    import torch

    hidden = torch.arange(2 * 5 * 3).reshape(2, 5, 3)
    assert torch.equal(select_tokens(hidden, 2, 5, [0, 4]), hidden[:, [0, 4]])
    flat = hidden.reshape(10, 3)  # [batch * tokens, ...]
    assert torch.equal(select_tokens(flat, 2, 5, [0, 4]), hidden[:, [0, 4]].reshape(4, 3))
    assert select_tokens(torch.zeros(7, 3), 2, 5, [0]).shape == (7, 3)  # no token dimension: as it is


def test_a_kept_golden_holds_the_positions_outputs_and_no_inputs(kept_golden: Path, golden_dir) -> None:
    store = GoldenStore(kept_golden)
    assert store.captured_tokens == [0, 1, 2, 3, 44, 45, 46, 47]
    assert store.describe_captured() == "tokens 0-3, 44-47 of 48"
    record = store.load("layer_1.attention")
    assert record.args == [] and record.kwargs == {} and record.output[0].shape[:2] == (1, 8)
    assert store.load("layer_1.router").output[0].shape[0] == 8  # [tokens, experts]: flattened tokens
    assert store.load("step_1.layer_1.attention").kwargs  # a decode step keeps its inputs (one token)
    full = GoldenStore(golden_dir("qwen3_moe", seq_len=SEQ))
    size = lambda g: sum(f.stat().st_size for f in g.root.glob("layer_*.safetensors"))  # noqa: E731
    assert size(store) < size(full) / 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_clean_candidate_passes_a_kept_golden_chained(kept_golden: Path, dtype: str, pytester) -> None:
    report = pytester.path / "report"
    result = run_parity(pytester, kept_golden, "--dtype", dtype, "--parity-report", str(report))
    rows = read_json(report / REPORT_FILE)["points"]
    result.assert_outcomes(passed=len(rows))
    judged = [r for r in rows if "verdicts" in r and r["step"] is None]
    assert judged and all(r["mode"] == "chain" for r in judged)  # chained without being asked
    assert all("judged on the tokens 0-3, 44-47 of 48 the golden keeps (--capture-tokens)" in r["notes"]
               for r in judged)  # fmt: skip


def test_a_port_bug_fails_at_its_point_on_the_kept_tokens(kept_golden: Path, pytester) -> None:
    report = pytester.path / "report"
    with faults.code_fault("causal_mask_one_ahead"):
        result = run_parity(pytester, kept_golden, "--parity-report", str(report))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "layer_0.attention"
    rows = read_json(report / REPORT_FILE)["points"]
    before = {"embedding", "rotary", "layer_0.input_norm"}
    assert {r["id"]: r["status"] for r in rows if r["id"] in before} == dict.fromkeys(before, "passed")
    result.stdout.fnmatch_lines(["first divergence: layer_0.attention*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--parity-mode", "isolated"],
            "--parity-mode isolated: * keeps only the tokens 0-3, 44-47 of 48 in its "
            "points' outputs, and none of their inputs *",
        ),
        (["--parity-drill", "layer_0.attention"], "--parity-drill runs a point on its recorded inputs, which *"),
    ],
)
def test_what_a_kept_golden_cannot_do_is_a_usage_error(kept_golden: Path, args, message: str, pytester) -> None:
    result = run_parity(pytester, kept_golden, *args)
    usage_error(result, message.split("*")[0].rstrip())
    assert fnmatch.fnmatch(result.stderr.str().strip().splitlines()[-1], f"*{message}*")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("40-60", "--capture-tokens 40-60: '40-60' is not within the 16 tokens (positions 0-15)"),
        ("first-3", "--capture-tokens first-3: 'first-3' is not a position, a range A-B or last-K"),
    ],
)
def test_a_bad_capture_spec_says_so_in_one_line(spec: str, message: str, tmp_path: Path, tiny_model, capsys) -> None:
    out = tmp_path / "g"
    code, _, err = cli(capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", out, "--capture-tokens", spec)
    assert code == 2 and not out.exists() and err.strip() == f"moe-parity: error: {message}", err


def test_a_padded_batch_keeps_its_padding_out_of_the_kept_tokens(tmp_path: Path, tiny_model, pytester) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"ids": r}) + "\n" for r in ([5, 6, 7, 8, 9, 10], [11, 12])))
    golden = tmp_path / "golden"
    record_golden(tiny_model("qwen3_moe"), golden, prompts=prompts, padding_side="left", capture_tokens="0-1,last-2")
    store = GoldenStore(golden)
    assert store.padding("layer_0.attention") == ([4, 5], 8)  # row 1's positions 0 and 1 are padding
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "--parity-report", str(report))
    rows = read_json(report / REPORT_FILE)["points"]
    result.assert_outcomes(passed=len(rows))
    attention = next(r for r in rows if r["id"] == "layer_0.attention")
    assert [row["tokens"] for row in attention["rows"]] == [4, 2]


def test_a_dump_of_every_token_is_judged_on_the_kept_ones(tmp_path: Path, tiny_model, golden_dir, capsys) -> None:
    """A port's dump holds every token (and, from NxDI, a bucket's padding): fitted to the golden's
    every-token shape, then judged on the positions the golden keeps."""
    from test_dump import write_dump

    model = tiny_model("qwen3_moe")
    kept = tmp_path / "kept"
    record_golden(model, kept, seq_len=SEQ, capture_tokens=KEPT)
    record_noise(kept, "bfloat16", model_dir=model)
    dump = write_dump(golden_dir("qwen3_moe", seq_len=SEQ), model, tmp_path / "dump")
    code, out, err = cli(capsys, "compare", kept, dump, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 0, out + err
    n = len(GoldenStore(kept).point_ids)
    assert f"{n} points: {n} passed, 0 failed, 0 errors" in out
    rows = read_json(tmp_path / "r" / REPORT_FILE)["points"]
    assert all(r["mode"] == "chain" for r in rows)
