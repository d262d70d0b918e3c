"""What each point ran (issue 55, item 4): the rows of a run say the module, the dtypes of its weights and
compute, and the attention and experts implementations the candidate ran (`--dtype`, `--hw-option
attention|experts|attention_budget` change them), a compiled candidate's graph breaks; a failure's text,
the closing lines and report.html show it; `moe-parity diff` gives a point that ran otherwise a line of
its own, and nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import faults
import pytest
from helpers import NO_CONFIG, NO_WEIGHTS, cli, read_json, run_parity
from test_html import parse

from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE
from pytest_moe_parity.report.html import HTML_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYER = ("-k", "layer_0 and not weights", "--parity-plots", "no")


def _ran(report: Path) -> dict[str, dict[str, str]]:
    return {p["id"]: p.get("ran") for p in read_json(report / REPORT_FILE)["points"]}


def test_cpu_rows_say_what_ran_and_the_options_change_it(
    pytester: pytest.Pytester, golden_dir, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    golden = golden_dir("qwen3_moe")
    plain, other = tmp_path / "plain", tmp_path / "other"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", *LAYER, NO_CONFIG, "--parity-report", str(plain))
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines(["ran: weights bfloat16 (7 points); compute bfloat16 (7); attention eager (2); "
                                 "experts eager (3)"])  # fmt: skip
    ran = _ran(plain)
    assert ran["layer_0.attention"] == {
        "module": "Qwen3MoeAttention", "weights": "bfloat16", "compute": "bfloat16", "attention": "eager",
    }  # fmt: skip
    assert ran["layer_0.experts"]["experts"] == "eager" and "attention" not in ran["layer_0.experts"]
    assert ran["layer_0.moe"]["module"] == "Qwen3MoeSparseMoeBlock" and ran["layer_0.moe"]["experts"] == "eager"
    assert ran["layer_0.output"]["attention"] == "eager" and ran["layer_0.output"]["experts"] == "eager"
    assert "experts" not in ran["layer_0.router"] and "attention" not in ran["layer_0.input_norm"]
    assert read_json(plain / SUMMARY_FILE)["ran"] == {
        "weights": {"bfloat16": 7}, "compute": {"bfloat16": 7}, "attention": {"eager": 2}, "experts": {"eager": 3},
    }  # fmt: skip

    result = run_parity(
        pytester, golden, "--dtype", "float32", "--hw-option", "attention=sdpa", "--hw-option", "experts=batched_mm",
        *LAYER, NO_CONFIG, "--parity-report", str(other),
    )  # fmt: skip
    result.assert_outcomes(passed=7)
    ran = _ran(other)
    assert ran["layer_0.attention"] == {
        "module": "Qwen3MoeAttention", "weights": "float32", "compute": "float32", "attention": "sdpa",
    }  # fmt: skip
    assert ran["layer_0.experts"]["experts"] == ran["layer_0.output"]["experts"] == "batched_mm"
    assert ran["layer_0.output"]["attention"] == "sdpa"

    # eager attention a block of query rows at a time (a budget below the prompt's scores) says so
    blocks = tmp_path / "blocks"
    result = run_parity(pytester, golden, "--hw-option", "attention_budget=0.0001", "-k", "layer_0.attention",
                        NO_CONFIG, "--parity-report", str(blocks))  # fmt: skip
    result.assert_outcomes(passed=1)
    assert _ran(blocks)["layer_0.attention"]["attention"].startswith("eager in blocks of ")

    # a quantization emulated (--hw-option quant): the points whose projections it rounds say it
    quant = tmp_path / "quant"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "--hw-option", "quant=fp8-channel", "-k",
                        "layer_0.attention or layer_0.router", NO_CONFIG, "--parity-report", str(quant))  # fmt: skip
    assert _ran(quant)["layer_0.attention"]["quant"] == "emulated fp8-channel"
    assert "quant" not in _ran(quant)["layer_0.router"]  # the router's gate is never quantized

    # moe-parity diff: every point of the other run ran otherwise, a line each
    code, out, _ = cli(capsys, "diff", plain, other)
    assert code == 0, out
    assert "ran otherwise: 7 points" in out
    assert "  layer_0.attention            isolated  weights bfloat16 -> float32; compute bfloat16 -> float32; " \
           "attention eager -> sdpa" in out  # fmt: skip


def test_diff_gives_a_point_that_ran_otherwise_a_line_and_nothing_else(
    pytester: pytest.Pytester, golden_dir, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The same run, one point's attention implementation changed (and where its graph came from, which is
    said but not compared): the diff is the diff of the run with itself plus that point's line; report.html
    shows the column, a passed point's paragraph and the diff's line."""
    old, new = tmp_path / "old", tmp_path / "new"
    result = run_parity(
        pytester, golden_dir("qwen3_moe"), "--dtype", "bfloat16", *LAYER, NO_CONFIG, "--parity-report", str(old)
    )
    result.assert_outcomes(passed=7)
    shutil.copytree(old, new)
    report = read_json(new / REPORT_FILE)
    for point in report["points"]:
        if point["id"] == "layer_0.attention":
            point["ran"] = {**point["ran"], "attention": "sdpa", "cache": "compiled"}
        if point["id"] == "layer_0.router":
            point["ran"] = {**point["ran"], "cache": "compiled"}  # provenance alone: no line
    (new / REPORT_FILE).write_text(json.dumps(report))
    capsys.readouterr()  # the inner session's output
    code, same, _ = cli(capsys, "diff", old, old)
    assert code == 0 and "ran otherwise" not in same
    code, out, _ = cli(capsys, "diff", old, new, "--json", new / "diff.json")
    assert code == 0
    line = "  layer_0.attention            isolated  attention eager -> sdpa"
    assert out.splitlines()[1:] == [*same.splitlines()[1:], "ran otherwise: 1 point", line]
    assert read_json(new / "diff.json")["ran"] == [
        {
            "id": "layer_0.attention",
            "mode": "isolated",
            "changes": [{"what": "attention", "old": "eager", "new": "sdpa"}],
        }
    ]
    # the page: a ran column, each passed point's paragraph, the diff's point that ran otherwise
    assert cli(capsys, "report", new)[0] == 0
    root = parse((new / HTML_FILE).read_text(encoding="utf-8"))
    table = root.one("table", id="all-points")
    names = [th.text() for th in table.find("th")]
    row = next(tr for tr in table.find("tr") if tr.attrs.get("data-point") == "layer_0.experts")
    cells = [td.text() for td in row.find("td")]
    assert cells[names.index("ran")] == "weights bfloat16, compute bfloat16, experts eager"
    said = root.one("details", id="p-layer_0.attention").one("p", class_="ran").text()
    assert said == "ran: module Qwen3MoeAttention, weights bfloat16, compute bfloat16, attention sdpa, cache compiled"
    moved = root.one("table", class_="ran-diff")
    assert [td.text() for td in moved.find("td")] == ["layer_0.attention", "isolated", "attention eager → sdpa"]


def test_a_failure_says_what_its_point_ran(pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path) -> None:
    port = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "port", faults.zero_expert(0, 1))
    report = tmp_path / "r"
    result = run_parity(pytester, golden_dir("qwen3_moe"), "--dtype", "bfloat16", "-k", "layer_0.experts", NO_WEIGHTS,
                        NO_CONFIG, "--parity-report", str(report), model=port)  # fmt: skip
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["  ran: module Qwen3MoeExperts, weights bfloat16, compute bfloat16, experts eager"])
    failure = parse((report / HTML_FILE).read_text(encoding="utf-8")).one("details", id="p-layer_0.experts")
    assert "ran: module Qwen3MoeExperts, weights bfloat16" in failure.find("pre")[0].text()


def test_a_row_keeps_what_ran_written_and_read_back() -> None:
    from test_rows import _judged

    from pytest_moe_parity.report.rows import Row, point_row

    result = _judged(broken=False)
    result.ran = {"module": "Qwen3MoeAttention", "weights": "bfloat16", "attention": "sdpa"}
    row = point_row(result)
    data = json.loads(json.dumps(row.to_json()))
    assert data["ran"] == result.ran and Row.from_json(data) == row


BREAK = """
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3

_forward = qwen3.Qwen3MoeRMSNorm.forward


def _breaks(self, hidden_states):
    out = _forward(self, hidden_states)
    torch._dynamo.graph_break()
    return out + 0


def pytest_configure(config):
    qwen3.Qwen3MoeRMSNorm.forward = _breaks


def pytest_unconfigure(config):
    qwen3.Qwen3MoeRMSNorm.forward = _forward
"""


def test_compile_records_a_module_s_graph_breaks(pytester: pytest.Pytester, golden_dir, tmp_path: Path) -> None:
    """A norm that breaks torch.compile's graph: its points say the break and its reason, the others none."""
    pytester.makeconftest(BREAK)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden_dir("qwen3_moe"), "--hw", "compile", "--hw-option", "compiler=eager", "--hw-option",
        f"cache_dir={tmp_path / 'cache'}", "-k", "layer_0.input_norm or layer_0.router", NO_CONFIG,
        "--parity-report", str(report),
    )  # fmt: skip
    result.assert_outcomes(passed=2)
    ran = _ran(report)
    norm, router = ran["layer_0.input_norm"], ran["layer_0.router"]
    assert int(norm["graph_breaks"]) >= 1 and norm["break"] == "Call to `torch._dynamo.graph_break()`"
    assert norm["graph"] == "torch.compile" and norm["compiler"] == "eager"
    assert router["graph_breaks"] == "0" and "break" not in router
    result.stdout.fnmatch_lines(["ran: *graph torch.compile (2); compiler eager (2); graph_breaks *"])
