"""`--parity-parallel A:B` where NxDI is not installed: the plans' spelling, and the backends that run one
plan only, each a usage error in one line. (The differential itself runs on NxDI's real modules in
tests_neuron/test_real_nxdi.py: clean plans agree, TP-only bugs fail at their point naming the
parallelism, expert parallelism says why it does not run on the CPU build.)"""

from __future__ import annotations

import pytest
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
