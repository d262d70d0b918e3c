"""Deeper diagnosis on real tiny models: per-token damage, the per-expert breakdown, experts that
follow the candidate's own routing, and next-token agreement of the logits."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
import torch
from helpers import NO_CONFIG, NO_WEIGHTS, assert_stops_at, read_json, run_parity
from safetensors.torch import save_file

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.judge.metrics import tie_tolerance
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

MANY_EXPERTS = {"num_experts": 64, "num_experts_per_tok": 8}


def test_one_broken_expert_of_64_fails_its_experts_point_and_is_named(
    pytester: pytest.Pytester, tiny_model, tmp_path: Path
) -> None:
    model = tiny_model("qwen3_moe", **MANY_EXPERTS)
    golden = record_golden(model, tmp_path / "golden", seq_len=32).out
    index = GoldenStore(golden).load("layer_1.router").output[2]
    counts = index.flatten().bincount(minlength=64)
    rare = int(torch.where(counts > 0, counts, 10**6).argmin())  # used by the fewest tokens
    candidate = faults.edit_checkpoint(model, tmp_path / "c", faults.zero_expert(1, rare))
    report = tmp_path / "r"
    args = ("--dtype", "bfloat16", "-x", NO_WEIGHTS, NO_CONFIG, "--parity-report", str(report))
    result = run_parity(pytester, golden, *args, model=candidate)
    assert_stops_at(result, golden, "layer_1.experts")
    result.stdout.fnmatch_lines(
        [
            "*out      max_token_rel_l2*FAIL",
            f"*worst experts (each one's own share of the error; rel error over its tokens): #{rare} *",
            "first divergence: layer_1.experts*",
        ]
    )
    row = next(r for r in read_json(report / REPORT_FILE)["points"] if r["id"] == "layer_1.experts")
    assert row["worst_experts"][0][:2] == [rare, int(counts[rare])]
    served = (index == rare).any(dim=-1).nonzero().flatten().tolist()
    assert {t for t, _ in row["worst_tokens"][: len(served)]} == set(served)


def test_dumped_experts_leave_out_the_tokens_the_candidate_routed_elsewhere(
    pytester: pytest.Pytester, golden_dir, tmp_path: Path
) -> None:
    """A dump holds the candidate's own routing: the experts' output of a token it sent to other
    experts differs by design, and is left out (said in a note) instead of failing the experts."""
    golden = golden_dir("qwen3_moe", seq_len=32)
    store = GoldenStore(golden)
    router, experts = store.load("layer_1.router").output, store.load("layer_1.experts").output
    logits, weights, index = (t.clone() for t in router[:3])
    token = 9
    others = [e for e in logits[token].argsort().tolist() if e not in index[token].tolist()][:2]
    index[token] = torch.tensor(others)  # the candidate's least likely experts: a real flip
    out = experts.clone()
    out[token] = torch.randn(out.shape[-1])
    dump = tmp_path / "dump"
    dump.mkdir()
    save_file(
        {"layer_1.router.0": logits, "layer_1.router.1": weights, "layer_1.router.2": index, "layer_1.experts": out},
        str(dump / "d.safetensors"),
    )
    args = ("--hw", "dump", "-k", "layer_1 and (router or experts)", "--parity-report", str(tmp_path / "r"))
    result = run_parity(pytester, golden, *args, "--parity-tol", "layer_1.router:max_flip_share=0.05", model=dump)
    result.assert_outcomes(passed=2)
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows["layer_1.router"]["routing"]["flipped_tokens"] == [token]
    assert rows["layer_1.experts"]["excluded_tokens"] == [token]
    assert "1 token(s) whose routing flipped are excluded from the verdict: [9]" in rows["layer_1.experts"]["notes"]
    # the same experts output without the dumped routing is blamed on the experts, at that token
    (dump / "d.safetensors").unlink()
    save_file({"layer_1.experts": out}, str(dump / "d.safetensors"))
    result = run_parity(pytester, golden, "--hw", "dump", "-k", "layer_1 and experts", model=dump)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*worst tokens (position, rel error): {token} (*"])


def test_a_next_token_flip_fails_the_logits_when_every_tensor_figure_passes(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    """lm_head rows of the golden's runner-up tokens slightly scaled up: the logits tensor stays
    within bf16 limits, but the predicted next tokens change, which is what a user sees."""
    golden = golden_dir("mixtral", seq_len=32)
    logits = GoldenStore(golden).load("logits").output[0]
    top = logits.topk(2, dim=-1)
    gap = top.values[:, 0] - top.values[:, 1]
    # the closest runner-up that is clearly not a tie, and the scale that lifts it past the top-1
    clear = torch.where(gap > 3 * tie_tolerance(logits, torch.bfloat16), gap, float("inf"))
    token = int(clear.argmin())
    runner_up, (first, second) = int(top.indices[token, 1]), top.values[token].tolist()
    assert second > 0, "the fixture's runner-up logit is expected to be positive"
    factor = (first + 0.5 * float(gap[token])) / second
    candidate = faults.edit_checkpoint(
        tiny_model("mixtral"), tmp_path / "c", faults.scale_rows("lm_head.weight", [runner_up], factor)
    )
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "-m", "logits", "--parity-report", str(report), model=candidate
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*top1     flip_share*FAIL", f"*token {token}: golden top-1 *, candidate {runner_up}, *"]
    )
    row = read_json(report / REPORT_FILE)["points"][0]
    assert [c["name"] for c in row["checks"] if not c["passed"]] == ["flip_share"]
    assert token in row["logits"]["top1"]["flipped_tokens"]
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == "logits"
