"""`--hw dump` on the vLLM Neuron plugin's tensor captures (`dump.neuron_plugin`), written by a writer built
from the plugin's `CaptureWriter` (`neuron_plugin_writer`), and the plugin's own acceptance terms beside the
verdict (`judge.neuron_terms`, `report.neuron_terms`)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import faults
import pytest
import torch
from helpers import cli, read_json, run_parity, usage_error
from neuron_plugin_writer import Writer, point_outputs, write_capture

from pytest_moe_parity.dump.neuron_plugin import Layout, PluginCapture
from pytest_moe_parity.errors import PointUnavailable
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.judge import neuron_terms
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")
ARCH, FAULT_AT = "qwen3_moe", "layer_1.attention"


@pytest.fixture(scope="module")
def captures(tmp_path_factory, golden_dir, tiny_model) -> dict[str, Path]:
    """A golden with a decode step; the port's captures at TP 1 and TP 2 (bf16), one of a port whose layer 1
    o_proj is scaled (TP 2), and the plugin's capture of the HF reference run in bf16 (its 'expected')."""
    root = tmp_path_factory.mktemp("neuron-captures")
    golden = golden_dir(ARCH, layers=2, decode=1)
    clean = point_outputs(golden, tiny_model(ARCH, 2), "bfloat16")
    faulty_model = faults.edit_checkpoint(tiny_model(ARCH, 2), root / "faulty", faults.scale("o_proj", 1, 1.5))
    faulty = point_outputs(golden, faulty_model, "bfloat16")
    return {
        "golden": golden,
        "tp1": write_capture(golden, clean, root / "tp1"),
        "tp2": write_capture(golden, clean, root / "tp2", tp=2, bucket=24),
        "fault": write_capture(golden, faulty, root / "fault" / "target", tp=2).parent,  # ModelCapture's subdirectory
        "expected": write_capture(golden, clean, root / "expected", hf=True),
    }


def _run(pytester, captures, which: str, report: Path, *more: str):
    return run_parity(
        pytester, captures["golden"], "--hw", "dump", "--hw-option", f"expected={captures['expected']}",
        "--parity-report", str(report), *more, model=captures[which],
    )  # fmt: skip


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_a_clean_capture_passes(tp: str, pytester: pytest.Pytester, captures, tmp_path: Path) -> None:
    n = len(GoldenStore(captures["golden"]).point_ids)
    result = _run(pytester, captures, tp, tmp_path / "r", "-rs")
    result.assert_outcomes(passed=n - 2, skipped=2)  # the rotary table's, whose sin the plugin's hook drops
    result.stdout.fnmatch_lines(
        [
            f"vLLM Neuron plugin capture: 1 request as the golden's prompts, 1 prefill and 1 decode passes, "
            f"TP {tp[-1]}",
            f"the vLLM Neuron plugin's terms: assert_close_three_way passes {n - 2} of {n - 2} points; "
            "logit validation over 2 generated tokens: sigma-ratio 1, agg_bc PASS: passes",
            "SKIPPED*rotary: the vLLM Neuron plugin's capture hook keeps a module's first output only*",
        ]
    )
    summary = read_json(tmp_path / "r" / SUMMARY_FILE)
    assert summary["first_divergence"] is None and summary["failed"] == 0
    terms = summary["vllm_neuron"]
    assert (terms["points"], terms["passed"], terms["agree_with_verdict"]) == (n - 2, n - 2, n - 2)
    assert terms["logit_validation"]["passed"] and terms["logit_validation"]["agg_bc"] == "PASS"


def test_requests_are_the_golden_s_prompts(pytester: pytest.Pytester, tiny_model, tmp_path: Path) -> None:
    """Two prompts scheduled together (one prefill pass of both, one decode pass of both): request "9" is the
    first prompt and "10" the second (their ids' natural order; as strings "10" sorts first)."""
    from pytest_moe_parity.record.run import record_golden

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"ids": ids}) + "\n" for ids in ([5, 17, 23, 42, 8, 99], [11, 12, 13, 14, 15, 16]))
    )
    golden = tmp_path / "golden"
    record_golden(tiny_model(ARCH, 1), golden, prompts=prompts, decode_steps=1)
    outputs = point_outputs(golden, tiny_model(ARCH, 1), "bfloat16")
    cap = write_capture(golden, outputs, tmp_path / "cap", req_ids=["9", "10"])
    expected = write_capture(golden, outputs, tmp_path / "expected", hf=True, req_ids=["9", "10"])
    meta = json.loads((cap / "dp0" / "prefill_s13_0" / "prefill_s13_0_meta.json").read_text())
    assert meta["req_ids"] == ["9", "10"] and meta["positions"] == [*range(6), *range(6), 0]
    n = len(GoldenStore(golden).point_ids)
    result = run_parity(pytester, golden, "--hw", "dump", "--hw-option", f"expected={expected}", model=cap)
    result.assert_outcomes(passed=n - 2, skipped=2)
    result.stdout.fnmatch_lines(["vLLM Neuron plugin capture: 2 requests as the golden's prompts, 1 prefill and 1 *"])


def test_tp2_ranks_make_the_tp1_tensors(captures) -> None:
    """Sequence-parallel norms, the vocabulary-parallel lm_head and all-reduced outputs, each joined back."""
    from pytest_moe_parity.backends.neuron_plugin import plugin_layout

    store = GoldenStore(captures["golden"])
    layout = plugin_layout(store, 1)
    one, two = PluginCapture(captures["tp1"], layout), PluginCapture(captures["tp2"], layout)
    assert (one.tp, two.tp) == (1, 2) and one.names == two.names
    joins = {module: how for (_, _, module), (how, _) in two._joins.items()}
    assert {joins["model.layers.0.input_layernorm"], joins["lm_head"], joins["model.layers.0.self_attn"]} == {
        "tokens", "columns", "replicated",
    }  # fmt: skip
    for name in ("model.layers.0.input_layernorm", "lm_head", "model.layers.1.mlp", "step_1.lm_head", "model.norm"):
        assert torch.equal(one.tensor(name), two.tensor(name)), name
    shape = store.entry("logits")["tensors"]["logits/out"]["shape"]
    assert list(two.tensor("lm_head").shape) == shape


def test_a_chunked_prefill_and_what_cannot_be_compared(tmp_path: Path) -> None:
    """A prefill in two chunks is joined back; a prefill lm_head of each request's last position only, and
    ranks that hold the whole shape with other values (partial sums), are not comparable, each said so."""
    layout = Layout(1, 6, (), {"model.norm": (1, 6, 4), "lm_head": (1, 6, 10), "model.layers.0.mlp": (1, 6, 4)})
    h, partial = torch.randn(6, 4), torch.randn(2, 8, 4)
    writer = Writer(tmp_path / "cap", tp=1)
    for chunk, positions in ((h[:4], [0, 1, 2, 3]), (torch.cat([h[4:], torch.zeros(2, 4)]), [4, 5, 0, 0])):
        writer.write({"model.norm": chunk, "lm_head": torch.randn(1, 10)}, ["r"], positions, True)
    capture = PluginCapture(tmp_path / "cap", layout)
    assert torch.equal(capture.tensor("model.norm"), h[None])
    with pytest.raises(PointUnavailable, match="holds one row per request"):
        capture.tensor("lm_head")
    other = Writer(tmp_path / "sums", tp=1)  # layer 0's MoE output before its all-reduce, on each of 2 ranks
    other.write({"model.layers.0.mlp": partial[0]}, ["r"], [*range(6), 0, 0], True)
    torch.save(partial[1], tmp_path / "sums" / "dp0" / "prefill_s8_0" / "model.layers.0.mlp" / "rank1.pt")
    with pytest.raises(PointUnavailable, match="TP rank 1 holds other values than rank 0 in the whole shape"):
        PluginCapture(tmp_path / "sums", layout).tensor("model.layers.0.mlp")


def test_a_fault_fails_first_at_its_layer(pytester: pytest.Pytester, captures, tmp_path: Path) -> None:
    result = _run(pytester, captures, "fault", tmp_path / "r")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    summary = read_json(tmp_path / "r" / SUMMARY_FILE)
    assert summary["first_divergence"] == FAULT_AT
    terms = summary["vllm_neuron"]
    assert terms["first_failing"] == FAULT_AT, terms["failing"]
    assert all(pid.startswith(("layer_1.", "final_norm", "logits", "step_1.")) for pid in terms["failing"])
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    failing = rows[FAULT_AT]["backend"]["vllm_neuron"]["module"]
    assert not failing["passed"] and failing["tokens_within"] < failing["inputs"]
    assert rows["layer_0.attention"]["backend"]["vllm_neuron"]["module"]["passed"]
    result.stdout.fnmatch_lines([f"*assert_close_three_way passes * points (first failing {FAULT_AT}: sigma-ratio *"])
    page = (tmp_path / "r" / "report.html").read_text()
    assert "vLLM Neuron plugin&#x27;s terms" in page and "assert_close_three_way" in page


def test_the_plugin_s_formulas() -> None:
    """A target with twice the dtype's error everywhere: ratios 2, sigma-ratio 2, and BC < 0.99 (the error
    histograms apart): assert_close_three_way's rule fails on its first clause; the target = expected passes."""
    torch.manual_seed(0)
    baseline = torch.randn(6, 64)
    expected = baseline + 1e-3 * torch.randn(6, 64)
    doubled = baseline + 2 * (expected - baseline)
    terms = neuron_terms.module_terms(baseline, expected, doubled)
    assert math.isclose(terms["sigma_ratio"], 2.0, rel_tol=1e-4)
    assert math.isclose(terms["worst_linf_ratio"], 2.0, rel_tol=1e-4)
    assert math.isclose(terms["worst_l2_ratio"], 2.0, rel_tol=1e-4)
    assert terms["bc"] < neuron_terms.BC_THRESHOLD and not terms["passed"] and terms["tokens_within"] == 0
    same = neuron_terms.module_terms(baseline, expected, expected)
    assert same["passed"] and same["sigma_ratio"] == 1.0 and same["tokens_within"] == 6
    logits = neuron_terms.logit_validation([neuron_terms.logit_terms(baseline, expected, doubled)])
    assert math.isclose(logits["agg_sigma_ratio"], 2.0, rel_tol=1e-4) and not logits["passed"]


def _copy(captures, tmp_path: Path) -> Path:
    return Path(shutil.copytree(captures["tp1"], tmp_path / "cap"))


def _renamed(cap: Path) -> None:
    for d in [d for d in cap.glob("dp0/*/*") if d.is_dir()]:
        d.rename(d.with_name(d.name.replace("model.", "decoder.")))


def _narrowed(cap: Path) -> None:
    path = cap / "dp0" / "prefill_s17_0" / "model.layers.0.self_attn" / "rank0.pt"
    torch.save(torch.load(path)[:, :-8].clone(), path)


def _other_prompt(cap: Path) -> None:
    meta = cap / "dp0" / "prefill_s17_0" / "prefill_s17_0_meta.json"
    said = json.loads(meta.read_text())
    said["positions"] = list(range(12)) + [0] * 5
    meta.write_text(json.dumps(said))


@pytest.mark.parametrize(
    "spoil, message",
    [
        (_renamed, "and 17 that are no module of the golden's model (decoder.embed_tokens"),
        (_narrowed, "do not make the golden's model.layers.0.self_attn, [64] per token"),
        (_other_prompt, "prefills positions 0-11 (12 tokens), the golden's prompt is 16 tokens"),
        (lambda cap: (cap / "dp0" / "decode_b2_0" / "decode_b2_0_meta.json").unlink(), "its metadata"),
    ],
    ids=["names", "shapes", "prompt", "metadata"],
)
def test_a_capture_of_another_model_is_one_line(spoil, message, captures, tmp_path: Path, capsys) -> None:
    cap = _copy(captures, tmp_path)
    spoil(cap)
    code, out, err = cli(capsys, "compare", captures["golden"], cap, "--expected", captures["expected"])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, out + err


def test_bad_input_under_pytest(pytester: pytest.Pytester, captures, tmp_path: Path) -> None:
    cap = _copy(captures, tmp_path)
    _narrowed(cap)
    usage_error(run_parity(pytester, captures["golden"], "--hw", "dump", model=cap), "a capture of another model?")
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save(torch.zeros(2), plain / "x.pt")  # a dump, but no capture of the plugin's
    result = run_parity(pytester, captures["golden"], "--hw", "dump", "--hw-option", f"expected={plain}",
                        model=captures["tp1"])  # fmt: skip
    usage_error(result, "is not a vLLM Neuron plugin capture")
