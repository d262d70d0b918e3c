"""Long contexts on a disk budget: `moe-parity golden --capture-tokens` keeps some token positions of
every prefill point's output and none of the inputs, and such a golden is judged chained on them."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import TABLE_ARCHS, assert_within_rounding, cli, model_steps, read_json, run_parity, usage_error

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


# --- eager attention a block of query rows at a time (--attention-budget) ----------------------------

ONE_ROW = 1e-9  # MiB: a budget no score array fits, so that every block is one query row


@pytest.fixture
def eager_calls(monkeypatch) -> list:
    """The attention modules the block path ran (`model.attention.eager_of`, looked up per call)."""
    from pytest_moe_parity.model import attention

    calls: list = []
    eager_of = attention.eager_of
    monkeypatch.setattr(attention, "eager_of", lambda m: calls.append(m) or eager_of(m))
    return calls


def _tensors(golden: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.name}:{k}": t for f in sorted(golden.glob("*.safetensors")) for k, t in load_file(f).items()}


def _specs(golden: Path) -> list:
    return [(p["id"], p["inputs"], p["output"], p["extras"]) for p in read_json(golden / "manifest.json")["points"]]


@pytest.mark.parametrize("arch", TABLE_ARCHS)
def test_attention_in_row_blocks_records_what_whole_eager_attention_records(
    arch: str, tmp_path: Path, tiny_model, eager_calls: list
) -> None:
    """The model's own eager attention run one query row at a time (a 16k prompt's scores would not
    fit) records the golden whole eager attention records: the same points, the same specs (the
    causal mask kept as its spec, gpt_oss's sliding-window mask made whole and stored), tensors
    within float32 rounding; over a left-padded batch, and over one prompt with decode steps."""
    calls = eager_calls
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"ids": r}) + "\n" for r in ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14])))
    for name, options in {
        "batch": {"prompts": prompts, "padding_side": "left"},
        "decode": {"seq_len": 9, "decode_steps": 2},
    }.items():
        whole, blocks = tmp_path / f"{name}-whole", tmp_path / f"{name}-blocks"
        model = tiny_model(arch)
        record_golden(model, whole, **options)
        assert not calls  # a short prompt's scores fit the default budget: eager attention whole
        record_golden(model, blocks, attention_budget_mb=ONE_ROW, **options)
        assert calls, "the attention never ran in blocks"
        calls.clear()
        assert read_json(blocks / "manifest.json")["record"]["attention_query_rows"] == 1
        assert "attention_query_rows" not in read_json(whole / "manifest.json")["record"]
        assert _specs(blocks) == _specs(whole)
        a, b = _tensors(whole), _tensors(blocks)
        assert a.keys() == b.keys()
        # one query row's scores and weighted sum are other kernels' sums than the whole matrix's:
        # float32 rounding, through every layer's longest sum (3 ulps of max |x| seen on an AMD EPYC)
        config = read_json(model / "config.json")
        steps = model_steps(config) * config["num_hidden_layers"]
        for key in a:
            assert_within_rounding(b[key], a[key], steps=steps, where=key)
    masks = [kw["attention_mask"]["t"] for _, inputs, _, _ in _specs(tmp_path / "batch-blocks")
             for kw in [inputs["kwargs"]] if "attention_mask" in kw]  # fmt: skip
    assert "causal_mask" in masks


@pytest.fixture
def whole_masks_made(monkeypatch) -> list:
    """The shapes of the golden causal masks made whole (`CausalRows.materialize`) during a run."""
    from pytest_moe_parity.golden.spec import CausalRows

    made: list = []
    materialize = CausalRows.materialize
    monkeypatch.setattr(CausalRows, "materialize", lambda self: made.append(self.shape) or materialize(self))
    return made


@pytest.mark.parametrize("budget", [None, "1e-9"])
def test_a_golden_recorded_in_row_blocks_replays_in_both_modes(
    budget: str | None, tmp_path: Path, tiny_model, pytester, eager_calls: list, whole_masks_made: list
) -> None:
    """Replayed by `--hw cpu` with its attention whole (a short prompt) or a row at a time
    (`--hw-option attention_budget`, as a long prompt's replay runs: isolated points and the chain's
    whole-model run); in blocks, the isolated points' causal mask is made a block of rows at a time,
    never whole (`T x T` floats: 1 GiB at 16k tokens)."""
    golden = tmp_path / "golden"
    record_golden(tiny_model("qwen3_moe"), golden, seq_len=24, decode_steps=1, attention_budget_mb=ONE_ROW)
    eager_calls.clear()  # (the recording ran in blocks)
    calls = eager_calls
    report = pytester.path / "report"
    options = ["--hw-option", f"attention_budget={budget}"] if budget else []
    result = run_parity(pytester, golden, "--parity-mode", "both", "--parity-report", str(report), *options)
    result.assert_outcomes(passed=len(read_json(report / REPORT_FILE)["points"]))
    assert bool(calls) == bool(budget)
    if budget:
        assert not whole_masks_made
    else:  # each layer's attention and decoder layer, on the prefill: the mask made whole for them
        assert (1, 1, 24, 24) in whole_masks_made


@pytest.mark.parametrize(
    "arch", [a if a == "qwen3_moe" else pytest.param(a, marks=pytest.mark.slow) for a in TABLE_ARCHS]
)
def test_a_padded_batch_replays_in_row_blocks_on_its_causal_mask_made_a_block_at_a_time(
    arch: str, tmp_path: Path, tiny_model, pytester, eager_calls: list, whole_masks_made: list
) -> None:
    """A left-padded batch's causal mask (over its padding) made again a block of rows at a time for
    the isolated points: every point passes (gpt_oss's sliding-window mask is stored whole and sliced),
    and a port bug still fails where it is."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"ids": r}) + "\n" for r in ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14])))
    golden = tmp_path / "golden"
    record_golden(tiny_model(arch), golden, prompts=prompts, padding_side="left")
    block = ["--hw-option", "attention_budget=1e-9"]
    result = run_parity(pytester, golden, *block, "--parity-report", str(pytester.path / "r"))
    result.assert_outcomes(passed=len(read_json(pytester.path / "r" / REPORT_FILE)["points"]))
    assert eager_calls and not whole_masks_made
    if arch != "qwen3_moe":
        return
    broken = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "broken", faults.scale("o_proj", 0, 1.5))
    result = run_parity(pytester, golden, *block, "-x", "--no-parity-weights", model=broken)
    result.stdout.fnmatch_lines(["*FAILED*::layer_0.attention*"])  # the first failure: -x stops there
    assert result.parseoutcomes()["failed"] == 1 and result.parseoutcomes()["passed"] >= 2


def test_a_golden_causal_mask_made_a_block_at_a_time_is_the_mask_made_whole() -> None:
    """`CausalRows`: its rows, its whole and its cast to a candidate's dtype are those of the causal
    mask `build` makes whole and `_cast_input` casts (float over a padded batch, and boolean)."""
    from pytest_moe_parity.golden.spec import CausalRows, build
    from pytest_moe_parity.replay.runner import _cast_input

    padding = [[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]
    for dtype, batch in ((torch.float32, padding), ("bool", padding), (torch.float32, None)):
        dtype = torch.bool if dtype == "bool" else dtype
        spec = {"t": "causal_mask", "shape": [2 if batch else 1, 1, 8, 8], "dtype": str(dtype).removeprefix("torch."),
                "padded": batch is not None}  # fmt: skip
        whole, rows = build(spec, {}, padding=padding), build(spec, {}, padding=padding, row_masks=True)
        assert isinstance(rows, CausalRows) and rows.shape == tuple(whole.shape)
        assert torch.equal(rows.materialize(), whole)
        assert torch.equal(torch.cat([rows.rows(0, 3), rows.rows(3, 8)], dim=2), whole)
        cast = _cast_input(rows, torch.bfloat16, torch.device("cpu"))
        assert torch.equal(cast.materialize(), _cast_input(whole, torch.bfloat16, torch.device("cpu")))
        assert torch.equal(cast.rows(2, 5), _cast_input(whole, torch.bfloat16, torch.device("cpu"))[:, :, 2:5])


def test_golden_says_when_attention_runs_in_row_blocks(tmp_path: Path, tiny_model, capsys) -> None:
    model = tiny_model("qwen3_moe")
    code, out, _ = cli(capsys, "golden", "--model", model, "--out", tmp_path / "g", "--seq-len", 64,
                       "--attention-budget", "0.01")  # fmt: skip
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("attention:"))
    assert fnmatch.fnmatch(line, "attention: eager, * query rows at a time (whole, its score arrays would hold "
                                 "* per layer at 64 tokens; --attention-budget 0.01 MiB)"), line  # fmt: skip
    code, _, err = cli(capsys, "golden", "--model", model, "--out", tmp_path / "h", "--attention-budget", "-1")
    assert code == 2 and not (tmp_path / "h").exists()
    said = "--attention-budget -1: give the MiB attention's scores may hold, 0 or more"
    assert err.strip() == f"moe-parity: error: {said}"


def test_a_model_without_an_eager_function_says_so_in_one_line(tmp_path: Path, tiny_model, capsys, monkeypatch) -> None:
    """A remote-code model whose modeling file has no `eager_attention_forward` cannot run its attention
    in blocks: one line naming the way out, and no golden."""
    from pytest_moe_parity.model import attention

    monkeypatch.setattr(attention, "eager_of", lambda module: None)
    out = tmp_path / "g"
    code, _, err = cli(capsys, "golden", "--model", tiny_model("qwen3_moe"), "--out", out, "--attention-budget", "0.01")
    assert code == 2 and not (out / "manifest.json").exists(), err
    assert err.strip().splitlines() == [
        "moe-parity: error: Qwen3MoeAttention: its modeling file (transformers.models.qwen3_moe.modeling_qwen3_moe) "
        "has no eager_attention_forward to run a long prompt's attention a block of query rows at a time; pass "
        "--attention-budget 0"
    ]


def test_a_row_mask_is_the_eager_mask_a_block_at_a_time() -> None:
    """`LazyMask` rows are the rows of the mask transformers gives eager attention, and a causal one
    is found causal without being made whole."""
    from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function

    from pytest_moe_parity.golden.spec import causal_mask_spec
    from pytest_moe_parity.model.attention import LazyMask

    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    kwargs = {"batch_size": 2, "q_length": 8, "kv_length": 8, "attention_mask": padding, "dtype": torch.float32}
    whole = eager_mask(**kwargs)
    lazy = LazyMask(eager_mask, kwargs)
    assert lazy.shape == tuple(whole.shape) and torch.equal(lazy.materialize(), whole)
    assert torch.equal(torch.cat([lazy.rows(0, 3), lazy.rows(3, 8)], dim=2), whole)
    assert causal_mask_spec(lazy, padding.int().tolist()) == causal_mask_spec(whole, padding.int().tolist())
    assert causal_mask_spec(lazy, padding.int().tolist())["t"] == "causal_mask"
    window = LazyMask(eager_mask, {**kwargs, "mask_function": sliding_window_causal_mask_function(3)})
    assert causal_mask_spec(window, padding.int().tolist()) is None  # not causal: stored whole
