"""The precision search (`--parity-precision-search`): a port whose router computes its score (softmax,
top-k, renormalisation) in bfloat16 flips a token's experts that transformers' own bfloat16 router (its
softmax in float32) keeps; under a tolerance that forgives no flip, the search names exactly that op
group. A point that passed has nothing to search; a weight fault fails with every op raised (a defect,
not precision); a backend without the knob, a float32 candidate and a pattern matching no point are
usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faults import edit_checkpoint
from helpers import NO_CONFIG, NO_WEIGHTS, read_json, run_parity, usage_error
from safetensors.torch import save_file

from pytest_moe_parity.model.raised import op_group
from pytest_moe_parity.replay.precision import search
from pytest_moe_parity.report.files import REPORT_FILE
from pytest_moe_parity.report.rows import PrecisionRow, Row

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYERS = 2
STRICT = ("--parity-tol", "layer_*.router:tie_factor=0")  # every flip of the top-k counts, near ties too

# A port whose router computes its score in the logits' dtype (bfloat16), where transformers' casts to
# float32 for the softmax: the same weights, the same logits.
SCORE_IN_BF16 = """
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe import modeling_qwen3_moe as m

_orig = m.Qwen3MoeTopKRouter.forward


def forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = F.softmax(logits, dim=-1)
    top, ids = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), ids


def pytest_configure(config):
    m.Qwen3MoeTopKRouter.forward = forward


def pytest_unconfigure(config):
    m.Qwen3MoeTopKRouter.forward = _orig
"""


def _rows(report: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}


def test_a_router_score_in_bf16_is_named_by_the_search(pytester: pytest.Pytester, golden_dir, tmp_path: Path) -> None:
    pytester.makeconftest(SCORE_IN_BF16)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden_dir("qwen3_moe", LAYERS), "--dtype", "bfloat16", *STRICT, NO_WEIGHTS, NO_CONFIG,
        "--parity-precision-search", "layer_*.router", "-k", "router", "--parity-report", str(report), "-rs",
    )  # fmt: skip
    # layer_1's router flips a token's experts; layer_0's does not: nothing to search there
    result.assert_outcomes(passed=1, failed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "*layer_1.router::precision: layer_1.router passes with its score op in float32; nothing else needs it",
        "*runs of the point*",
    ])  # fmt: skip
    result.stdout.fnmatch_lines(["*layer_0.router passed: nothing to search*"])
    rows = _rows(report)
    row = rows["layer_1.router::precision"]
    assert row["precision_verdict"] == "precision" and row["raised"] == ["score"], row
    assert row["units"] == ["matmul", "score", "elementwise"]
    runs = {tuple(r["raised"]): r["status"] for r in row["runs"]}
    assert runs[()] == "failed" and runs[("score",)] == "passed"
    assert runs[("matmul",)] == "failed"  # the logits' float32 alone does not recover it: the score does
    assert len(row["runs"]) <= 5 and row["search_seconds"] > 0
    assert rows["layer_0.router::precision"]["status"] == "skipped"
    assert isinstance(Row.from_json(row), PrecisionRow) and Row.from_json(row).to_json() == row


def test_transformers_own_bf16_router_passes_the_same_tolerance(pytester: pytest.Pytester, golden_dir) -> None:
    """The control: the same weights in bfloat16 with transformers' float32 softmax keep every top-k."""
    result = run_parity(
        pytester, golden_dir("qwen3_moe", LAYERS), "--dtype", "bfloat16", *STRICT, NO_WEIGHTS, NO_CONFIG,
        "--parity-precision-search", "layer_*.router", "-k", "router",
    )  # fmt: skip
    result.assert_outcomes(passed=2, skipped=2)


def test_a_search_whose_point_did_not_run_here_runs_it(pytester: pytest.Pytester, golden_dir) -> None:
    """`-k precision`: the point's own item is deselected; the search's run with nothing raised says it passes."""
    pytester.makeconftest(SCORE_IN_BF16)
    result = run_parity(
        pytester, golden_dir("qwen3_moe", LAYERS), "--dtype", "bfloat16", *STRICT, NO_WEIGHTS, NO_CONFIG,
        "--parity-precision-search", "layer_*.router", "-k", "precision", "-rs",
    )  # fmt: skip
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*layer_0.router passes on the golden's call: nothing to search*"])
    result.stdout.fnmatch_lines(["*layer_1.router passes with its score op in float32; nothing else needs it"])


def test_a_weight_fault_fails_with_everything_raised(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        key = next(k for k in t if k.startswith("model.layers.1.") and k.endswith("mlp.gate.weight"))
        t[key] = t[key].flip(0)  # the experts' rows in another order

    port = edit_checkpoint(tiny_model("qwen3_moe", LAYERS), tmp_path / "port", edit)
    result = run_parity(
        pytester, golden_dir("qwen3_moe", LAYERS), "--dtype", "bfloat16", NO_WEIGHTS, NO_CONFIG,
        "--parity-precision-search", "layer_1.router", "-k", "layer_1 and router", model=port,
    )  # fmt: skip
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*layer_1.router::precision: layer_1.router still fails with every op group raised to float32 (3): a defect, "
        "not precision",
    ])  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--hw", "dump", "--dtype", "bfloat16"), "the dump backend has no precision knob"),
        (("--dtype", "float32"), "the candidate runs in float32: there is nothing narrower to raise"),
        (("--dtype", "bfloat16", "--parity-precision-search", "layer_9.*"), "'layer_9.*' matches no point"),
    ],
)
def test_bad_input_is_one_sentence(
    pytester: pytest.Pytester, golden_dir, tmp_path: Path, args: tuple, message: str
) -> None:
    if "dump" in args:  # a dump of the candidate's run: its tensors, no module to raise an op of
        save_file({"embedding": torch.zeros(1)}, str(tmp_path / "dump.safetensors"))
        args = (*args, "--model", str(tmp_path))
    result = run_parity(pytester, golden_dir("qwen3_moe", LAYERS), "--parity-precision-search", "layer_0.router", *args)
    usage_error(result, message)


def test_op_groups_and_the_bisection() -> None:
    assert [op_group(n) for n in ("mm", "_softmax", "topk", "rsqrt", "silu", "add", "view", "_to_copy", "eq")] == [
        "matmul", "score", "score", "variance", "activation", "elementwise", None, None, None,
    ]  # fmt: skip
    asked: list[set] = []

    def needs(required: set) -> object:
        def passes(raised: set) -> bool:
            asked.append(raised)
            return required <= raised

        return passes

    units = [(f"m{i}", "matmul") for i in range(16)]
    assert search(needs({units[5]}), units) == [units[5]]
    assert len(asked) <= 4 + 5  # log2(16) bisection steps, then the five earlier units of the prefix
    asked.clear()
    assert search(needs({units[2], units[11]}), units) == [units[2], units[11]]


def test_a_write_into_a_view_leaves_no_stale_wide_value() -> None:
    """A tensor written through a view (a base filled slice by slice) is read by a raised op as written."""
    from torch import nn

    from pytest_moe_parity.model.raised import raised_ops

    class Fill(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            base = torch.zeros_like(x)
            base[:, :4] = x[:, :4] * 2
            return base * 3

    wide = torch.randn(2, 8)
    x = wide.to(torch.bfloat16)
    fill = Fill()
    with torch.no_grad(), raised_ops(fill, {("", "elementwise")}, [(x, wide)]) as mode:
        out = fill(x)
    assert mode.seen == [("", "elementwise")]
    torch.testing.assert_close(out[:, :4].float(), wide[:, :4] * 6, rtol=1e-2, atol=1e-2)
    assert not out[:, 4:].any()
