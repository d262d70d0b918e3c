"""`--parity-parallel A:B` where NxDI is not installed: the plans' spelling, the backends that run one plan
only (a usage error in one line), and dumps of the runs under two plans (`--hw dump --hw-option
plans=DIR`): clean plans agree, a TP-only and an EP-only fault part at their point, naming the
parallelism. (On NxDI's real modules: tests_neuron/test_real_nxdi.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_parity, usage_error

from pytest_moe_parity.replay.parallel import parse_plans

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def test_plans_are_spelled_a_colon_b() -> None:
    assert parse_plans("tp=1:tp=2,ep=2") == ({"tp": 1}, {"tp": 2, "ep": 2})
    for text, message in [
        ("tp=1", "expected two plans, A:B"),
        ("tp=1:tp=1", "the two plans are the same"),
        ("tp=1:pp=2", "'pp=2' is not KEY=DEGREE with KEY one of tp, ep"),
        ("tp=1:tp=0", "tp=0: expected a whole number of at least 1, got 0"),
        ("tp=1:", "a plan is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_plans(text)


@pytest.mark.parametrize("hw", ["cpu", "trace"])
def test_a_backend_of_one_plan_is_a_usage_error(pytester: pytest.Pytester, golden_dir, hw: str) -> None:
    usage_error(
        run_parity(pytester, golden_dir("qwen3_moe", 2), "--hw", hw, "--parity-parallel", "tp=1:tp=2"),
        f"--parity-parallel tp=1:tp=2: the {hw} backend runs the candidate in one process, under one plan",
    )
    usage_error(
        run_parity(pytester, golden_dir("qwen3_moe", 2), "--hw", hw, "--parity-parallel", "tp=2"),
        "--parity-parallel tp=2: expected two plans, A:B",
    )


# -- dumps of the runs under each plan (e.g. NxDI captures at TP 1 and TP 8, taken on a device) ------

DUMPED = {
    "layer_{layer}.attention": "model.layers.{layer}.self_attn",
    "layer_{layer}.moe": "model.layers.{layer}.mlp",
    "layer_{layer}.output": "model.layers.{layer}",
    "logits": "lm_head",
}


def _dump_run(model_dir: Path, golden: Path, out: Path, fault=None) -> Path:
    """The model's bf16 run of the golden's prompt, dumped (with `fault` applied to the model first)."""
    from transformers import AutoModelForCausalLM

    from pytest_moe_parity.dump import record
    from pytest_moe_parity.golden import GoldenStore

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if fault is not None:
        with torch.no_grad():
            fault(model)
    ids = torch.tensor(GoldenStore(golden).manifest["inputs"]["input_ids"])
    with torch.no_grad(), record(model, out, DUMPED):
        model(input_ids=ids)
    return out


def _missing_all_reduce(model) -> None:
    """Layer 1's attention output is one rank's partial sum: half of o_proj's input heads."""
    weight = model.model.layers[1].self_attn.o_proj.weight
    weight[:, weight.shape[1] // 2 :] = 0


def _a_rank_s_experts_dropped(model) -> None:
    """Layer 0's tokens routed to the second rank's experts come back empty (a dropped all-to-all)."""
    experts = model.model.layers[0].mlp.experts
    experts.down_proj[experts.down_proj.shape[0] // 2 :] = 0


@pytest.mark.parametrize(
    ("plans", "fault", "where", "parallelism"),
    [
        ("tp=1:tp=2", None, None, None),
        ("tp=1:tp=2", _missing_all_reduce, "layer_1.attention", "tensor parallelism (tp=2 against tp=1)"),
        ("tp=2:tp=2,ep=2", _a_rank_s_experts_dropped, "layer_0.moe", "expert parallelism (tp=2,ep=2 against tp=2)"),
    ],
    ids=["clean", "missing-all-reduce", "ep-drops-a-rank"],
)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "minimax_m2"])
def test_dumps_of_two_plans_part_where_the_parallelism_is_wrong(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path, arch: str, plans: str, fault, where, parallelism
) -> None:
    model, golden = tiny_model(arch, 2), golden_dir(arch, 2)
    a, b = plans.split(":")
    _dump_run(model, golden, tmp_path / "plans" / a)
    candidate = _dump_run(model, golden, tmp_path / "plans" / b, fault)
    result = run_parity(
        pytester, golden, "--hw", "dump", "--hw-option", f"plans={tmp_path / 'plans'}", "--parity-parallel", plans,
        "-k", "parallel", model=candidate,
    )  # fmt: skip
    if fault is None:
        result.stdout.fnmatch_lines(["first divergence: none"])
        assert result.ret == 0
        return
    result.stdout.fnmatch_lines(
        [f"{where}::parallel: the parallelism alone changes it: {b} against {a}, rel_l2 *",
         f"first divergence: {where}::parallel  ({parallelism}*"]
    )  # fmt: skip


def test_a_plan_whose_dump_is_missing_is_a_usage_error(pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path):
    model, golden = tiny_model("qwen3_moe", 2), golden_dir("qwen3_moe", 2)
    candidate = _dump_run(model, golden, tmp_path / "plans" / "tp=2")
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", "--hw-option", f"plans={tmp_path / 'plans'}",
                   "--parity-parallel", "tp=1:tp=2", model=candidate),
        f"--parity-parallel tp=1:tp=2: {tmp_path / 'plans' / 'tp=1'} does not exist: put the dump of the run under "
        "tp=1 there",
    )  # fmt: skip
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", "--parity-parallel", "tp=1:tp=2", model=candidate),
        "--parity-parallel tp=1:tp=2: the dumps of the runs under each plan are not given: --hw-option plans=DIR",
    )
