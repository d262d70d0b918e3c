"""Decode steps of a padded batch: recorded as generate() decodes it (each row at its own position, the
mask grown a column per step), replayed isolated and chained, and a port whose decode positions ignore
the padding caught at the first step's point that has it, on the padded rows alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import IGNORE_FUTURE, NO_CONFIG, PADDED_PROMPTS, read_json, run_parity

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.replay.noise import record_noise
from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYERS = 2

# a port whose decode step puts every row at the batch's one position (the longest row's): right for
# an unpadded batch, wrong for a padded row at every step
ONE_POSITION = """
from transformers.models.qwen3_moe import modeling_qwen3_moe as m

_orig = m.Qwen3MoeRotaryEmbedding.forward


def forward(self, x, position_ids):
    if position_ids.shape[-1] == 1:
        position_ids = position_ids.max().expand_as(position_ids)
    return _orig(self, x, position_ids)


def pytest_configure(config):
    m.Qwen3MoeRotaryEmbedding.forward = forward


def pytest_unconfigure(config):
    m.Qwen3MoeRotaryEmbedding.forward = _orig
"""


@pytest.fixture(scope="module")
def decoded(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A left-padded batch of PADDED_PROMPTS with two decode steps and the reference's own bf16 error."""
    folder = tmp_path_factory.mktemp("padded-decode")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in PADDED_PROMPTS))
    model = tiny_model("qwen3_moe", LAYERS)
    record_golden(model, folder / "golden", prompts=prompts, padding_side="left", decode_steps=2)
    record_noise(folder / "golden", "bfloat16", model_dir=model)
    return folder / "golden"


def test_each_row_decodes_as_it_would_alone(decoded: Path, tiny_model) -> None:
    from transformers import AutoModelForCausalLM

    store = GoldenStore(decoded)
    tokens = store.decode_tokens
    assert len(tokens) == 2 and all(len(step) == len(PADDED_PROMPTS) for step in tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3_moe", LAYERS), dtype=torch.float32)
    for row, ids in enumerate(PADDED_PROMPTS):
        alone = model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert alone[0, len(ids) :].tolist() == [step[row] for step in tokens], row
    # each step's calls hold every row, at its own position
    rotary = store.load(next(p for p in store.points if p.step == 1 and p.component == "rotary"))
    assert rotary.kwargs["position_ids"].tolist() == [[8], [3], [6]]
    attention = store.load(next(p for p in store.points if p.step == 2 and p.component == "attention"))
    assert attention.kwargs["hidden_states"].shape == (3, 1, 64)


def test_a_clean_candidate_passes_isolated_and_chained(pytester: pytest.Pytester, decoded: Path) -> None:
    result = run_parity(pytester, decoded, "--dtype", "bfloat16", "--parity-mode", "both")
    result.stdout.fnmatch_lines(
        ["first isolated divergence: none", "first chain divergence: none",
         "decode: the next token agrees with the golden at every step judged (2)"]
    )  # fmt: skip
    assert result.ret == 0


def test_decode_positions_that_ignore_the_padding_fail_on_the_padded_rows(
    pytester: pytest.Pytester, decoded: Path, tmp_path: Path
) -> None:
    pytester.makeconftest(ONE_POSITION)
    report = tmp_path / "r"
    result = run_parity(
        pytester, decoded, "--dtype", "bfloat16", NO_CONFIG, "--parity-report", str(report), *IGNORE_FUTURE
    )
    result.stdout.fnmatch_lines(["step_1.rotary *failed*rows 1, 2 of 3*", "first divergence: step_1.rotary *"])
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert all(r["status"] == "passed" for r in rows.values() if r["step"] is None)  # the prefill is right
    assert [r["row"] for r in rows["step_1.rotary"]["rows"] if r["failed"]] == [1, 2]


def test_a_batch_still_refuses_decode_at(tiny_model, tmp_path: Path, capsys) -> None:
    from helpers import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"ids": [5]}\n{"ids": [6, 7]}\n')
    code, _, err = cli(
        capsys, "golden", "--model", tiny_model("qwen3_moe", LAYERS), "--out", tmp_path / "g", "--prompts", prompts,
        "--decode-at", "3",
    )  # fmt: skip
    assert code == 2 and "--decode-at names positions of one unpadded prompt" in err


def test_a_row_that_ends_its_sequence_is_fed_padding_as_generate_feeds_it(
    pytester: pytest.Pytester, tiny_model, tmp_path: Path
) -> None:
    """A row fed its end-of-sequence token is finished: the next steps feed it padding, as generate()
    does for a batch, and judge it no more."""
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = tiny_model("qwen3_moe", LAYERS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in PADDED_PROMPTS))
    first = record_golden(model_dir, tmp_path / "probe", prompts=prompts, padding_side="left", decode_steps=1)
    eos = GoldenStore(first.out).decode_tokens[0][1]  # what row 1 is fed at step 1 becomes its end of sequence
    ending = shutil.copytree(model_dir, tmp_path / "ending")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((ending / name).read_text())
        config["eos_token_id"] = eos
        (ending / name).write_text(json.dumps(config))
    golden = record_golden(ending, tmp_path / "golden", prompts=prompts, padding_side="left", decode_steps=3).out
    store = GoldenStore(golden)
    assert store.manifest["decode"]["finished"] == {"1": 1}
    assert [step[1] for step in store.decode_tokens] == [eos, 0, 0]
    model = AutoModelForCausalLM.from_pretrained(ending, dtype=torch.float32)
    batch = {k: torch.tensor(store.manifest["inputs"][k]) for k in ("input_ids", "attention_mask")}
    generated = model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated[:, batch["input_ids"].shape[1] :].T.tolist() == store.decode_tokens
    assert store.padding("step_2.logits") == ([1], 3) and store.padding("step_1.logits") is None
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "--parity-mode", "isolated")
    assert result.ret == 0, result.stdout.str()
