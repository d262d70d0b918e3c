"""Several prompts as one padded batch (`moe-parity golden --prompts FILE`): recorded with their
attention mask and positions, judged on the real tokens only, and the rows that fail named."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import (
    TABLE_ARCHS,
    assert_replays_bitwise,
    cli,
    load_fp32,
    read_json,
    run_parity,
    session,
    with_word_tokenizer,
)

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record.prompts import Prompt, make_batch, positions_of, read_prompts
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

# three prompts of unequal length (the first the longest: its row holds no padding), as JSONL ids
PROMPTS = [[5, 17, 23, 42, 8, 99, 64, 7], [11, 12, 13], [30, 31, 32, 33, 34, 35]]


def _prompts_file(folder: Path, rows: list[list[int]] = PROMPTS) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in rows))
    return path


@pytest.fixture(scope="module")
def batch_golden(tiny_model, tmp_path_factory):
    """batch_golden(arch, side, noise=None) -> a golden of the three PROMPTS padded on `side` (with the
    reference's own error in `noise`), recorded once."""
    from pytest_moe_parity.replay.noise import record_noise

    cache: dict[tuple, Path] = {}

    def make(arch: str, side: str, noise: str | None = None) -> Path:
        if (arch, side, noise) not in cache:
            folder = tmp_path_factory.mktemp(f"batch-{arch}-{side}")
            out = folder / "golden"
            record_golden(tiny_model(arch), out, prompts=_prompts_file(folder), padding_side=side)
            if noise is not None:
                record_noise(out, noise, model_dir=tiny_model(arch))
            cache[arch, side, noise] = out
        return cache[arch, side, noise]

    return make


def test_a_prompts_file_reads_text_and_ids_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text('The capital of France is\n\n{"ids": [1, 2, 3]}\n{"text": "2 + 2 ="}\n')
    expected = [Prompt(text="The capital of France is"), Prompt(ids=(1, 2, 3)), Prompt(text="2 + 2 =")]
    assert read_prompts(path) == expected


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_batch_is_padded_with_its_mask_and_positions_counted_over_real_tokens(side: str) -> None:
    batch = make_batch([Prompt(ids=(5, 6, 7)), Prompt(ids=(8,))], None, vocab=50, pad_id=0, padding_side=side,
                       pad_to=4, batch_size=3)  # fmt: skip
    assert (batch.rows, batch.length) == (3, 4)
    if side == "left":
        assert batch.input_ids == [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]]
        assert batch.attention_mask == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
        assert batch.position_ids[:2] == [[1, 0, 1, 2], [1, 1, 1, 0]]
    else:
        assert batch.input_ids == [[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0]]
        assert batch.position_ids[:2] == [[0, 1, 2, 1], [0, 1, 1, 1]]
    assert positions_of(__import__("torch").tensor([[1, 1, 1]])).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", TABLE_ARCHS)
def test_padded_batches_replay_bitwise_in_fp32(arch: str, side: str, batch_golden, tiny_model) -> None:
    golden = batch_golden(arch, side)
    store = GoldenStore(golden)
    assert store.sequences == 3 and store.padded and store.prefill_tokens == 8
    pads, tokens = store.padding("layer_0.attention")
    assert tokens == 24 and len(pads) == (8 - 3) + (8 - 6)
    assert store.manifest["inputs"]["padding_side"] == side
    assert_replays_bitwise(golden, load_fp32(tiny_model(arch)))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "arch", ["qwen3_moe", *(pytest.param(a, marks=pytest.mark.slow) for a in TABLE_ARCHS if a != "qwen3_moe")]
)
def test_a_clean_bf16_candidate_passes_a_padded_batch_in_both_modes(
    arch: str, side: str, batch_golden, pytester: pytest.Pytester
) -> None:
    golden = batch_golden(arch, side, "bfloat16")
    report = pytester.path / "report"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-mode", "both", "--parity-report", str(report)
    )
    rows = read_json(report / REPORT_FILE)["points"]
    result.assert_outcomes(passed=len(rows))
    judged = [r for r in rows if "verdicts" in r]
    assert judged and all(len(r["rows"]) == 3 for r in judged)
    attention = next(r for r in judged if r["id"] == "layer_0.attention")
    assert [row["tokens"] for row in attention["rows"]] == [8, 3, 6]  # real tokens only
    assert attention["rows"][1]["prompt"] == "ids 11, 12, 13"
    assert any("padding token(s) of the batch are not judged" in n for n in attention["notes"])


def test_positions_counted_from_the_pad_fail_only_the_padded_rows_at_rotary(
    batch_golden, pytester: pytest.Pytester
) -> None:
    """A port whose model counts positions from the first column, pads included (it ignores the
    position ids it is given): right on the golden's inputs, wrong on its own from the rotary point
    on, in the left-padded rows only."""
    golden = batch_golden("qwen3_moe", "left")
    report = pytester.path / "report"
    with faults.code_fault("positions_from_the_pad"):
        result = run_parity(pytester, golden, "--parity-mode", "both", "--no-parity-weights",
                            "--parity-report", str(report), "--junit-xml", str(pytester.path / "j.xml"))  # fmt: skip
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_isolated_divergence"] is None
    assert summary["first_chain_divergence"] == "rotary"
    rows = read_json(report / REPORT_FILE)["points"]
    rotary = next(r for r in rows if r["id"] == "rotary")["chain"]
    assert [row["failed"] for row in rotary["rows"]] == [False, True, True]
    assert rotary["rows"][0]["rel_l2"] == 0  # the row without padding is bitwise right
    junit = (pytester.path / "j.xml").read_text()
    assert '<property name="chain_failing_rows" value="1,2"' in junit
    result.stdout.fnmatch_lines(
        [
            "rotary: candidate (float32) diverges from the golden (float32) on its own inputs",
            "  rows 1, 2 of 3 fail:",
            '    row 1: prompt "ids 11, 12, 13", 3 tokens, rel_l2 *',
            "rotary * failed * rows 1, 2 of 3",
            "first chain divergence: rotary*",
        ]
    )


def test_a_right_padded_batch_is_not_touched_by_positions_counted_from_the_pad(
    batch_golden, pytester: pytest.Pytester
) -> None:
    """Right padding puts every row's real tokens first: positions counted from the first column are
    right for them (only the excluded padding's differ), so the same port passes."""
    golden = batch_golden("qwen3_moe", "right")
    with faults.code_fault("positions_from_the_pad"):
        result = run_parity(pytester, golden, "--parity-mode", "chain", "--no-parity-weights")
    result.assert_outcomes(passed=len(GoldenStore(golden).points))


@pytest.mark.parametrize(
    ("lines", "args", "message"),
    [
        ("", [], "--prompts * holds no prompt; give one prompt per line*"),
        ('{"ids": [1, 900]}\n', [], "--prompts: prompt 0 has token ids [[]900] outside the vocabulary of 256 tokens"),
        ('{"ids": [5, 6, 7, 8]}\n', ["--pad-to", "3"], "--pad-to 3 is shorter than prompt 0 (4 tokens)*"),
        ('{"ids": [5]}\n{"ids": [6]}\n', ["--batch-size", "1"], "--batch-size 1 is smaller than the 2 prompts*"),
        ('{"ids": [5, 6, 7, 8]}\n', ["--seq-len", "2"], "--prompts: prompt 0 has 4 tokens, beyond --seq-len 2*"),
        ('{"ids": 5}\n', [], '--prompts *, line 1: a JSON line needs a "text" string or an "ids" list of token ids'),
        ("{oops\n", [], "--prompts *, line 1: not valid JSON*"),
        ("hello\n", [], "--prompts: prompt 0 is text and the model has no tokenizer*"),
        ('{"ids": [5]}\n{"ids": [6, 7]}\n', ["--decode-at", "2"], "--decode-at names positions of one unpadded *"),
        ('{"ids": [5, 6]}\n', ["--pad-to", "4", "--decode-at", "5"], "*--prompts gives a padded prompt (each row *"),
    ],
)
def test_bad_prompts_say_so_in_one_line(
    lines: str, args: list[str], message: str, tmp_path: Path, tiny_model, capsys
) -> None:
    prompts, out = tmp_path / "prompts.txt", tmp_path / "golden"
    prompts.write_text(lines)
    code, _, err = cli(capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", out, "--prompts", prompts, *args)
    assert code == 2 and not out.exists()
    said = err.strip().splitlines()
    assert len(said) == 1 and fnmatch.fnmatch(said[0], f"moe-parity: error: {message}"), err


def test_pad_to_without_prompts_says_what_to_add(tmp_path: Path, tiny_model, capsys) -> None:
    code, _, err = cli(capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", tmp_path / "g", "--pad-to", "8")
    assert code == 2 and "--pad-to and --batch-size shape a batch of --prompts FILE; add --prompts" in err


def test_text_prompts_are_tokenized_and_padded_with_the_tokenizer_s_pad_id(tmp_path: Path, tiny_model) -> None:
    model = with_word_tokenizer(tiny_model("qwen3_moe"), tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('the capital of france is paris\n{"text": "1 + 2 = 3"}\n{"ids": [9, 9]}\n')
    record_golden(model, tmp_path / "golden", prompts=prompts, padding_side="left")
    inputs = GoldenStore(tmp_path / "golden").manifest["inputs"]
    assert inputs["input_ids"] == [[4, 6, 5, 7, 8, 9], [1, 10, 13, 11, 14, 12], [1, 1, 1, 1, 9, 9]]
    assert inputs["pad_token_id"] == 1
    assert inputs["prompts"] == ["the capital of france is paris", "1 + 2 = 3", "ids 9, 9"]


def test_a_causal_mask_is_made_again_not_stored(batch_golden, golden_dir, tiny_model) -> None:
    """A `[B, 1, T, T]` mask is T^2 values a layer (1 GiB at 16k tokens in float32): where it is exactly
    the causal mask over the batch's padding, the golden keeps a spec of it and makes it again on load;
    any other mask (gpt_oss's sliding window) is stored as it is."""
    from pytest_moe_parity.golden.spec import causal_mask

    for golden in (batch_golden("qwen3_moe", "left"), golden_dir("qwen3_moe")):
        store = GoldenStore(golden)
        entry = store.entry("layer_0.attention")
        assert entry["inputs"]["kwargs"]["attention_mask"]["t"] == "causal_mask"
        assert not any("attention_mask" in key for key in entry["tensors"])
        mask = store.load("layer_0.attention").kwargs["attention_mask"]
        padding = store.manifest["inputs"].get("attention_mask")
        assert torch.equal(mask, causal_mask(tuple(mask.shape), mask.dtype, padding))
    sliding = GoldenStore(golden_dir("gpt_oss"))
    specs = {p.id: sliding.entry(p)["inputs"]["kwargs"].get("attention_mask", {}).get("t") for p in sliding.points
             if p.component == "attention"}  # fmt: skip
    assert set(specs.values()) == {"causal_mask", "tensor"}  # full layers made again, sliding ones stored


@pytest.mark.parametrize("side", ["left", "right"])
def test_last_token_logits_are_judged_at_each_row_s_last_real_token(side: str, batch_golden) -> None:
    """What NxDI's context encoding returns, [B, 1, V]: judged against the golden's logits at each
    row's last real token. A port that takes the last position instead is right on left-padded rows
    and wrong on the right-padded rows that are shorter: those rows are named."""
    from pytest_moe_parity.backends import CandidateOutput
    from pytest_moe_parity.tree import first_tensor

    s = session(batch_golden("qwen3_moe", side), dtype="bfloat16")
    try:
        point, record = s.golden.point("logits"), s.golden.load("logits")
        logits = first_tensor(record.output)
        last = [max(i for i, m in enumerate(row) if m) for row in s.golden.manifest["inputs"]["attention_mask"]]
        right = logits[torch.arange(3), torch.tensor(last)].unsqueeze(1).to(torch.bfloat16)
        result = s.runner.judge_output(point, record, CandidateOutput(right), "isolated", None)
        assert result.passed, result.checks
        assert (
            f"judged against the golden's logits at each row's last real token (positions {', '.join(map(str, last))})"
            in result.notes[-1]
        )
        wrong = logits[:, -1:, :].to(torch.bfloat16)  # the last position: padding, on a right-padded shorter row
        result = s.runner.judge_output(point, record, CandidateOutput(wrong), "isolated", None)
        shorter = [row for row, end in enumerate(last) if end != logits.shape[1] - 1]
        assert result.passed == (side == "left")
        assert side == "left" or [r.row for r in result.rows if r.failed] == shorter
        other = logits[:, :2, :].to(torch.bfloat16)  # another shape: said as such, not blamed on the lm_head
        result = s.runner.judge_output(point, record, CandidateOutput(other), "isolated", None)
        assert not result.passed and result.hint.startswith("the candidate's output has another shape"), result.hint
    finally:
        s.close()
