"""`--hw nxdi --hw-option build=cpu` on NxDI's and NxD's real modules: every point of tiny Qwen3-MoE
and Mixtral models (prefill and two decode steps), at TP 1, 2 and 4, in float32 and bfloat16, from
goldens recorded under transformers 5 and replayed here under transformers 4.57."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import read_json, run_parity, usage_error

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.compat import load_config
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE

ARCHS = ("qwen3_moe", "mixtral")
CPU = ("--hw", "nxdi", "--hw-option", "build=cpu")


def points(golden: Path) -> list[str]:
    return GoldenStore(golden).point_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_clean_run_passes_every_point_on_nxdi_s_real_modules(
    arch: str, tp: int, dtype: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Every point but the rotary embedding (inside NxDI's attention) is built from NxDI's real
    modules and passes: the experts reduced over the ranks, the attention's cache write compared at
    TP 1, the decode steps on NxDI's token-generation path. The run errors on warnings, so NxD's own
    deprecation notices must not reach it."""
    golden = t5 / f"{arch}-golden"
    result = run_parity(
        pytester,
        golden,
        *CPU,
        "--hw-option",
        f"tp_degree={tp}",
        "--dtype",
        dtype,
        "--parity-report",
        str(tmp_path / "r"),
        "-W",
        "error",
        model=t5 / f"{arch}-model",
    )
    ids = points(golden)
    rotary = [p for p in ids if p.endswith("rotary")]
    result.assert_outcomes(passed=len(ids) - len(rotary), skipped=len(rotary))
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert "NxDI computes the rotary embedding inside each attention module" in rows["rotary"]["reason"]
    written = {"cache.keys", "cache.values"} <= set(rows["step_1.layer_1.attention"]["metrics"])
    assert written == (tp == 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_transformers_5_config_reads_as_written(arch: str, t5: Path) -> None:
    """transformers 5 writes the rotary theta in `rope_parameters` and Qwen3-MoE's expert count as
    `num_local_experts`; 4.57 would take its class defaults (Mixtral's theta 1e6, 128 experts)."""
    model = t5 / f"{arch}-model"
    written = json.loads((model / "config.json").read_text())
    config = load_config(model)
    assert config.rope_theta == written["rope_parameters"]["rope_theta"]
    assert getattr(config, "rope_scaling", None) is None  # 4.57's Mixtral has no such attribute
    experts = config.num_experts if arch == "qwen3_moe" else config.num_local_experts
    assert experts == written["num_local_experts"]
    hf = nxdi.nxdi_hf_config(model)
    assert hf.to_dict()["rope_scaling"] is None and hf.to_dict()["rope_theta"] == config.rope_theta


def test_a_tp_degree_nxd_cannot_shard_by_is_a_usage_error(t5: Path, pytester: pytest.Pytester) -> None:
    usage_error(
        run_parity(pytester, t5 / "qwen3_moe-golden", *CPU, "--hw-option", "tp_degree=3", model=t5 / "qwen3_moe-model"),
        "--hw-option tp_degree=3: NxD shards the vocabulary (256) and the hidden size (64) and each expert's "
        "intermediate size (64) by the TP degree, which does not divide them",
    )


def test_an_unknown_build_is_a_usage_error(t5: Path, pytester: pytest.Pytester) -> None:
    usage_error(
        run_parity(
            pytester, t5 / "mixtral-golden", "--hw", "nxdi", "--hw-option", "build=gpu", model=t5 / "mixtral-model"
        ),
        "expected one of neuron, cpu, got 'gpu'",
    )


def test_the_experts_give_the_reduced_sum_at_tp_2(t5: Path) -> None:
    """NxD's ExpertMLPsV2 leaves each rank its partial sum; the backend applies the MoE module's
    delayed all-reduce, so each rank holds the whole sum, equal to the TP 1 output."""
    from helpers import session

    outs = {}
    for tp in (1, 2):
        run = session(
            t5 / "qwen3_moe-golden", t5 / "qwen3_moe-model", hw="nxdi", hw_options=[f"tp_degree={tp}", "build=cpu"]
        )
        try:
            result = run.runner.run("layer_1.experts")
            assert result.passed, result.to_row()
            module = next(iter(run.runner.backend._built.values()))
            outs[tp] = module.rank_outputs
        finally:
            run.close()
    assert len(outs[2]) == 2 and torch.equal(outs[2][0], outs[2][1])
    torch.testing.assert_close(outs[2][0], outs[1][0], rtol=1e-5, atol=1e-6)
