"""Batch invariance (`--parity-batch-invariance`): each prefill point of a batch golden run on the batch
and on each row alone. Clean bf16 candidates of three architectures give each row the same output both
ways; a mask that forgets the padding changes exactly the left-padded rows, at the first attention, and
passes on a right-padded batch (where it cannot show); a router that normalises over the batch changes
every row, the unpadded one too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import IGNORE_FUTURE, PADDED_PROMPTS, read_json, run_parity, usage_error

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.replay.batch import Rows
from pytest_moe_parity.report.files import REPORT_FILE
from pytest_moe_parity.report.rows import BatchInvarianceRow, Row

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYERS = 2

FORGETS_PADDING = """
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as m

_orig = m.Qwen3MoeAttention.forward


def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    if attention_mask is not None and attention_mask.dim() == 4:  # a causal mask that forgets the padding
        q, k = attention_mask.shape[-2:]
        causal = torch.ones(q, k, dtype=torch.bool).tril(k - q)
        low = torch.tensor(torch.finfo(attention_mask.dtype).min, dtype=attention_mask.dtype)
        attention_mask = torch.where(causal, torch.zeros_like(low), low).expand_as(attention_mask)
    return _orig(self, hidden_states, position_embeddings, attention_mask, **kwargs)


def pytest_configure(config):
    m.Qwen3MoeAttention.forward = forward


def pytest_unconfigure(config):
    m.Qwen3MoeAttention.forward = _orig
"""

NORMALISES_OVER_THE_BATCH = """
from transformers.models.mixtral import modeling_mixtral as m

_orig = m.MixtralTopKRouter.forward


def forward(self, hidden_states):
    centred = hidden_states - hidden_states.mean(0, keepdim=True) * 0.5  # a statistic of every row's tokens
    return _orig(self, centred)


def pytest_configure(config):
    m.MixtralTopKRouter.forward = forward


def pytest_unconfigure(config):
    m.MixtralTopKRouter.forward = _orig
"""


@pytest.fixture(scope="module")
def batch(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    """batch(arch, side) -> a golden of PADDED_PROMPTS padded on `side`, recorded once."""
    cache: dict[tuple[str, str], Path] = {}

    def make(arch: str, side: str) -> Path:
        if (arch, side) not in cache:
            folder = tmp_path_factory.mktemp(f"batch-{arch}-{side}")
            prompts = folder / "prompts.jsonl"
            prompts.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in PADDED_PROMPTS))
            record_golden(tiny_model(arch, LAYERS), folder / "golden", prompts=prompts, padding_side=side)
            cache[arch, side] = folder / "golden"
        return cache[arch, side]

    return make


def _rows(report: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "minimax_m2"])
def test_clean_candidates_give_each_row_its_output_alone(pytester: pytest.Pytester, batch, arch: str, tmp_path: Path):
    golden = batch(arch, "left")
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-batch-invariance", "-k", "batch",
        "--parity-report", str(report),
    )  # fmt: skip
    points = [p for p in GoldenStore(golden).points if p.step is None]
    result.assert_outcomes(passed=len(points))
    result.stdout.fnmatch_lines(["layer_0.attention::batch *passed*every row as alone*", "first divergence: none"])
    row = _rows(report)["layer_0.moe::batch"]
    assert [r["row"] for r in row["batch_rows"]] == [0, 1, 2]
    assert [r["padding"] for r in row["batch_rows"]] == [0, 5, 2]
    assert all(r["status"] == "passed" and r["alone_status"] == "passed" for r in row["batch_rows"])
    read = Row.from_json(row)
    assert isinstance(read, BatchInvarianceRow) and read.to_json() == row


def test_a_mask_that_forgets_left_padding_changes_the_padded_rows(pytester: pytest.Pytester, batch, tmp_path: Path):
    pytester.makeconftest(FORGETS_PADDING)
    report = tmp_path / "r"
    result = run_parity(
        pytester, batch("qwen3_moe", "left"), "--dtype", "bfloat16", "--parity-batch-invariance", "-k", "batch",
        "--parity-report", str(report), *IGNORE_FUTURE,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "layer_0.attention::batch: batching alone changes rows 1, 2 of 3: their output in the batch differs*",
            "  row  tokens  padding  rel_l2 vs alone *alone vs golden  verdict",
            "  0 *8 *0 *pass",  # the unpadded row: as alone (to its dtype's rounding, whatever the CPU's kernels)
            "  1 *3 *5 left *FAIL",
            "  2 *6 *2 left *FAIL",
            "  hint: only the padded rows change in the batch*",
        ]
    )
    summary = read_json(report / "comparison_summary.json")
    assert summary["first_divergence"] == "layer_0.attention::batch"
    rows = _rows(report)
    attention = rows["layer_0.attention::batch"]
    assert attention["changed_rows"] == [1, 2] and attention["condition"] == "padding"
    # alone, every row is right: the batch is the condition
    assert all(r["alone_status"] == "passed" for r in attention["batch_rows"])
    # before the attention nothing depends on the batch
    assert all(rows[f"{p}::batch"]["status"] == "passed" for p in ("embedding", "rotary", "layer_0.input_norm"))


def test_a_right_padded_batch_cannot_show_a_left_padding_bug(pytester: pytest.Pytester, batch):
    pytester.makeconftest(FORGETS_PADDING)
    result = run_parity(
        pytester, batch("qwen3_moe", "right"), "--dtype", "bfloat16", "--parity-batch-invariance", "-k", "batch",
        *IGNORE_FUTURE,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["first divergence: none"])
    assert result.ret == 0


def test_a_statistic_over_the_batch_changes_every_row(pytester: pytest.Pytester, batch, tmp_path: Path):
    pytester.makeconftest(NORMALISES_OVER_THE_BATCH)
    report = tmp_path / "r"
    result = run_parity(
        pytester, batch("mixtral", "left"), "--dtype", "bfloat16", "--parity-batch-invariance", "-k",
        "layer_0 and batch", "--parity-report", str(report), *IGNORE_FUTURE,
    )  # fmt: skip
    result.stdout.fnmatch_lines(["layer_0.router::batch: batching alone changes rows 0, 1, 2 of 3*",
                                 "  hint: a row without padding changes in the batch*"])  # fmt: skip
    rows = _rows(report)
    assert rows["layer_0.router::batch"]["condition"] == "neighbours"
    assert rows["layer_0.attention::batch"]["status"] == "passed"  # before the router: nothing changes


def test_batch_invariance_bad_input(pytester: pytest.Pytester, golden_dir, batch, tmp_path: Path):
    usage_error(
        run_parity(pytester, golden_dir("qwen3_moe", LAYERS), "--parity-batch-invariance"),
        "--parity-batch-invariance: this golden holds one row; record a batch",
    )


def test_a_row_is_cut_from_the_batch_call(batch) -> None:
    store = GoldenStore(batch("qwen3_moe", "left"))
    rows = Rows.of(store)
    assert rows.real == ((0, 1, 2, 3, 4, 5, 6, 7), (5, 6, 7), (2, 3, 4, 5, 6, 7))
    attention = store.load(next(p for p in store.points if p.component == "attention"))
    kwargs = rows.cut(attention.kwargs, 1)
    assert kwargs["hidden_states"].shape == (1, 3, 64)
    assert kwargs["attention_mask"].shape == (1, 1, 3, 3)
    assert kwargs["position_ids"].tolist() == [[0, 1, 2]]  # the row's own positions, as alone
    mask = kwargs["attention_mask"][0, 0]
    upper = torch.ones(3, 3, dtype=torch.bool).triu(1)
    assert bool((mask[upper] < -1e30).all()) and bool((mask[~upper] == 0).all())  # causal over its own tokens
    router = store.load(next(p for p in store.points if p.component == "router"))
    assert rows.cut(router.args, 2)[0].shape == (6, 64)  # flattened tokens: the row's real ones
    torch.testing.assert_close(rows.cut(router.args, 2)[0], router.args[0].reshape(3, 8, 64)[2, 2:])


# -- a port's own runs, dumped: the batch's and each row's alone ---------------------------------------

DUMPED = {
    "rotary": "model.rotary_emb",
    "layer_{layer}.attention": "model.layers.{layer}.self_attn",
    "layer_{layer}.router": "model.layers.{layer}.mlp.gate",
    "layer_{layer}.moe": "model.layers.{layer}.mlp",
    "layer_{layer}.output": "model.layers.{layer}",
    "logits": "lm_head",
}


def _port_dumps(model_dir: Path, golden: Path, out: Path, *, positions: bool) -> tuple[Path, Path]:
    """The port's bf16 run of the golden's batch (with the batch's position ids, or without: then it
    counts positions from the first column, padding included), and of each row alone, dumped."""
    from transformers import AutoModelForCausalLM

    from pytest_moe_parity.dump import record

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    inputs = GoldenStore(golden).manifest["inputs"]
    names = ("input_ids", "attention_mask", "position_ids") if positions else ("input_ids", "attention_mask")
    with torch.no_grad(), record(model, out / "batch", DUMPED):
        model(**{k: torch.tensor(inputs[k]) for k in names})
    for row, ids in enumerate(PADDED_PROMPTS):
        with torch.no_grad(), record(model, out / "rows" / f"row_{row}", DUMPED):
            model(input_ids=torch.tensor([ids]))
    return out / "batch", out / "rows"


@pytest.mark.parametrize("positions", [True, False], ids=["own positions right", "positions ignore padding"])
def test_a_port_s_own_batch_and_rows_dumped(
    pytester: pytest.Pytester, batch, tiny_model, tmp_path: Path, positions: bool
) -> None:
    golden = batch("qwen3_moe", "left")
    dumped, rows = _port_dumps(tiny_model("qwen3_moe", LAYERS), golden, tmp_path, positions=positions)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--hw", "dump", "--model", str(dumped), "--hw-option", f"rows={rows}",
        "--parity-batch-invariance", "-k", "batch", "--parity-report", str(report),
    )  # fmt: skip
    if positions:
        result.stdout.fnmatch_lines(["rotary::batch *passed*every row as alone*", "first divergence: none"])
        assert result.ret == 0
        return
    result.stdout.fnmatch_lines(["rotary::batch: batching alone changes rows 1, 2 of 3*", "  hint: only the padded*"])
    assert read_json(report / "comparison_summary.json")["first_divergence"] == "rotary::batch"


def test_a_dump_needs_its_rows_own_dumps(pytester: pytest.Pytester, batch, tiny_model, tmp_path: Path) -> None:
    golden = batch("qwen3_moe", "left")
    dumped, _ = _port_dumps(tiny_model("qwen3_moe", LAYERS), golden, tmp_path, positions=True)
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", "--model", str(dumped), "--parity-batch-invariance"),
        "--parity-batch-invariance with --hw dump: give the rows' own dumps too",
    )
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", "--model", str(dumped), "--hw-option", f"rows={tmp_path}",
                   "--parity-batch-invariance"),
        f"{tmp_path} lacks row_0, row_1, row_2",
    )  # fmt: skip


def test_the_reference_s_own_batch_difference_is_recorded_with_its_noise_floor(
    pytester: pytest.Pytester, batch, tiny_model, tmp_path: Path
) -> None:
    """`--noise-dtype` on a batch golden also keeps what batching alone costs the reference in that
    dtype, per point and row; the batch items show it beside the candidate's, and allow up to
    `noise_factor` times it."""
    import shutil

    from pytest_moe_parity.replay.noise import record_noise

    golden = shutil.copytree(batch("qwen3_moe", "left"), tmp_path / "golden")
    record_noise(golden, "bfloat16", model_dir=tiny_model("qwen3_moe", LAYERS))
    store = GoldenStore(golden)
    own = store.noise("bfloat16", "batch", "layer_0.attention")
    assert len(own) == len(PADDED_PROMPTS) and all(x is not None and x >= 0 for x in own)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-batch-invariance", "-k", "layer_0 and batch",
        "--parity-report", str(report),
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()
    row = _rows(report)["layer_0.attention::batch"]
    assert [r["reference"] for r in row["batch_rows"]] == pytest.approx(own)


def test_moe_parity_compare_takes_the_rows_dumps(capsys, batch, tiny_model, tmp_path: Path) -> None:
    from helpers import cli

    golden = batch("qwen3_moe", "left")
    dumped, rows = _port_dumps(tiny_model("qwen3_moe", LAYERS), golden, tmp_path, positions=False)
    code, out, err = cli(
        capsys, "compare", str(golden), str(dumped), "--rows", str(rows), "--report", str(tmp_path / "r")
    )
    assert code == 1, out + err
    rows_of = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows_of["rotary::batch"]["changed_rows"] == [1, 2]  # the port's one position table for every row
    assert "rotary::batch" in out and "rows 1, 2 change in the batch (padding)" in out
    code, _, err = cli(capsys, "compare", str(golden), str(dumped), "--rows", str(tmp_path / "nowhere"))
    assert code == 2 and "--rows: " in err and "lacks row_0, row_1, row_2" in err


@pytest.mark.parametrize(
    ("shape", "note"),
    [
        ({"padding_side": "left", "batch_size": 4}, "(1 of padding only, not run alone)"),
        ({"padding_side": "right", "pad_to": 12}, "each of the 3 rows gives the same output"),
    ],
    ids=["a fixed batch size", "a bucket"],
)
def test_a_batch_padded_to_a_shape_is_judged_on_its_prompt_rows(
    pytester: pytest.Pytester, tiny_model, tmp_path: Path, shape: dict, note: str
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in PADDED_PROMPTS))
    record_golden(tiny_model("qwen3_moe", LAYERS), tmp_path / "golden", prompts=prompts, **shape)
    report = tmp_path / "r"
    result = run_parity(
        pytester, tmp_path / "golden", "--dtype", "bfloat16", "--parity-batch-invariance", "-k", "layer_0 and batch",
        "--parity-report", str(report),
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()
    row = _rows(report)["layer_0.attention::batch"]
    assert note in row["notes"][0]
    assert [r["row"] for r in row["batch_rows"]] == [0, 1, 2]  # the prompts' rows
