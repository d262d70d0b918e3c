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
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

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
    # what NxDI ran: its module, its dtype, the stage's config, its MoE path and its attention kernels
    attention, decode, experts = (rows[p]["ran"] for p in ("layer_0.attention", "step_1.layer_1.attention",
                                                          "layer_0.experts"))  # fmt: skip
    assert attention["weights"] == dtype and attention["stage"] == "context encoding"
    assert attention["attention"] == "NxDI's native attention (no kernel)" and decode["stage"] == "token generation"
    if arch == "qwen3_moe":
        assert attention["module"] == "NeuronQwen3MoEAttention"
        # Qwen3-MoE's config declares its router float32, but NxDI's default cast_type=config casts every module to
        # --dtype (ModelWrapper.load_module): the router runs in it
        assert experts["moe"] == "dropless, blockwise block_size 512" and experts["router"] == f"softmax in {dtype}"


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
        "--hw-option tp_degree=3: NxD shards the vocabulary (256), the hidden size (64) and each expert's "
        "intermediate size (64) by the TP degree (3), which does not divide them",
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
    from helpers import assert_within_rounding, session

    outs = {}
    for tp in (1, 2):
        run = session(
            t5 / "qwen3_moe-golden", t5 / "qwen3_moe-model", hw="nxdi", hw_options=[f"tp_degree={tp}", "build=cpu"]
        )
        try:
            result = run.runner.run("layer_1.experts")
            assert result.passed, result.checks
            module = next(iter(run.runner.backend._built.values()))
            outs[tp] = module.rank_outputs
        finally:
            run.close()
    assert len(outs[2]) == 2 and torch.equal(outs[2][0], outs[2][1])
    # two half-width partial sums added (the all-reduce) against one whole sum: float32 rounding over
    # the down projection's input width (the experts' intermediate size)
    steps = read_json(t5 / "qwen3_moe-model" / "config.json")["moe_intermediate_size"]
    assert_within_rounding(outs[2][0], outs[1][0], steps=steps, where="layer_1.experts at TP 2 vs TP 1")


def _missing_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD's row-parallel layers (the attention's o_proj) return each rank's partial sum."""
    from neuronx_distributed.parallel_layers import layers

    monkeypatch.setattr(layers, "reduce_from_tensor_model_parallel_region", lambda t, *a, **k: t)


def _every_rank_takes_rank_0_s_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank loads rank 0's shard of every sharded tensor."""
    from neuronx_distributed.trace import trace

    shard = trace.shard_children
    monkeypatch.setattr(
        trace, "shard_children", lambda m, c, p, d, rank, tp, *a, **k: shard(m, c, p, d, 0, tp, *a, **k)
    )


def _column_shard_of_the_wrong_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column-parallel weights (split along their output dimension: the attention's q, k, v heads)
    take the other rank's half, while the row-parallel o_proj keeps its own."""
    from neuronx_distributed.trace import trace

    local = trace.create_local_weight

    def wrong(rank, world_size, full_weight, partition_dim, *args, **kwargs):
        if partition_dim == 0 and full_weight.dim() == 2:
            rank = (rank + 1) % world_size
        return local(rank, world_size, full_weight, partition_dim, *args, **kwargs)

    monkeypatch.setattr(trace, "create_local_weight", wrong)


PARTED = "TP 1 of the same candidate matches the golden where TP 2 does not"


@pytest.mark.parametrize(
    "fault, where, cause",
    [
        (_missing_all_reduce, "layer_0.attention", "the ranks hold partial sums whose total is the expected output"),
        (_every_rank_takes_rank_0_s_shard, "embedding", PARTED),
        (_column_shard_of_the_wrong_half, "layer_0.attention", PARTED),
    ],
    ids=["missing-all-reduce", "rank-0-shard-everywhere", "column-shard-wrong-half"],
)
def test_a_tp_only_bug_fails_at_its_point_naming_the_parallelism(
    fault, where: str, cause: str, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The classic TP-only bugs in NxD's real layers (the ranks fork from this process, so they
    carry the fault): the run stops at the first point whose module the fault touches (a rank-0
    shard everywhere: the sharded embedding; the others: the attention), and its failure text names
    the tensor parallelism, from the ranks' own outputs or from the same candidate at TP 1, never
    weight order. At TP 1 the same fault is harmless (one rank, one shard, nothing to reduce)."""
    golden, model = t5 / "mixtral-golden", t5 / "mixtral-model"
    fault(monkeypatch)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", "tp_degree=2", "-x", "--parity-report", str(report), model=model
    )
    order = points(golden)
    before = [p for p in order[: order.index(where)] if not p.endswith("rotary")]
    result.assert_outcomes(passed=len(before), skipped=int(where != "embedding"), failed=1)
    result.stdout.fnmatch_lines([f"first divergence: {where}  (tensor parallelism (tp_degree=2): {cause}*"])
    result.stdout.fnmatch_lines([f"FAILED *parity::{where} *"])
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == where
    assert "weight order" not in summary["hint"] and "gate/up" not in summary["hint"]
    single = run_parity(pytester, golden, *CPU, "--hw-option", "tp_degree=1", "-x", "-k", where, model=model)
    assert single.ret == 0 and single.parseoutcomes()["passed"] >= 1, single.stdout.str()


NEEDS_5 = "this runs transformers' own modules of the golden's architecture, as transformers 5 lays them out"


def test_transformers_own_modules_are_a_usage_error_on_the_neuron_stack(t5: Path, pytester: pytest.Pytester) -> None:
    """`--hw cpu` (and trace, compile, neuron) replay transformers' modules, laid out as the golden's
    transformers 5 lays them out: on 4.57 one line says so, with what to do."""
    usage_error(run_parity(pytester, t5 / "qwen3_moe-golden", "--hw", "cpu"), f"--hw cpu: {NEEDS_5}")


def test_recording_is_bad_input_on_the_neuron_stack(t5: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from pytest_moe_parity.cli import main

    assert main(["golden", "--model", str(t5 / "qwen3_moe-model"), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert f"moe-parity golden: {NEEDS_5}" in err and "transformers 4.57" in err
    assert not (tmp_path / "g").exists()


def test_weight_items_say_why_they_are_left_out_on_the_neuron_stack(
    t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Another candidate checkpoint would get weight items; here they would read the reference as
    transformers 4.57 lays it out, so they are left out, and the run says so unasked."""
    import shutil

    candidate = shutil.copytree(t5 / "mixtral-model", tmp_path / "candidate")
    result = run_parity(pytester, t5 / "mixtral-golden", *CPU, "-k", "layer_0", model=candidate)
    result.stdout.fnmatch_lines(["moe-parity: no weight items: they read the golden's model as transformers 5 lays*"])
    assert (
        result.ret == 0
        and ".weights" not in result.stdout.str().split("moe-parity: no weight items")[1].split("\n", 1)[1]
    )


def test_a_tensor_the_checkpoint_lacks_is_an_error_not_an_initial_value(
    t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NxD's loading (`load_state_dict(strict=False)`, as NxDI's CPU path calls it) keeps a module's
    initial values for what the checkpoint lacks, quietly; the CPU build refuses at that point."""
    under = nxdi.under
    monkeypatch.setattr(
        nxdi.backend,
        "under",
        lambda converted, prefix: {k: v for k, v in under(converted, prefix).items() if k != "weight"},
    )
    result = run_parity(
        pytester, t5 / "qwen3_moe-golden", *CPU, "-k", "layer_0.input_norm", model=t5 / "qwen3_moe-model"
    )
    result.assert_outcomes(errors=3)  # the prefill's and the two decode steps'
    lacks = "the checkpoint has no tensor for 1 of the module's (inner.weight): NxD would leave them at their initial"
    result.stdout.fnmatch_lines([f"*layer_0.input_norm: the backend raised RankFailure: rank 0: RankFailure: {lacks}*"])


def test_a_dump_compares_on_the_neuron_stack(t5: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`moe-parity compare` (the dump route) and `show` on a transformers-5 golden under 4.57: a dump
    of the golden's own prefill outputs, under the points' module names, passes every point it holds."""
    from safetensors.torch import save_file

    from pytest_moe_parity.cli import main

    golden = GoldenStore(t5 / "mixtral-golden")
    tensors = {}
    for point in (p for p in golden.points if p.step is None):  # the prefill's points
        output = golden.load(point).output
        leaves = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
        if len(leaves) == 1:
            tensors[point.module] = leaves[0].contiguous()
        else:
            tensors.update({f"{point.module}.{i}": t.contiguous() for i, t in enumerate(leaves)})
    (tmp_path / "dump").mkdir()
    save_file(tensors, str(tmp_path / "dump" / "dump.safetensors"))
    assert main(["show", str(t5 / "mixtral-golden")]) == 0
    capsys.readouterr()
    assert main(["compare", str(t5 / "mixtral-golden"), str(tmp_path / "dump")]) == 0
    out = capsys.readouterr().out
    assert "first divergence: none" in out and " 0 failed, 0 errors" in out


@pytest.mark.parametrize("tp", [1, 2])
def test_a_left_padded_batch_passes_on_nxdi_s_real_modules(
    tp: int, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Three prompts of unequal length padded on the left into one batch (`moe-parity golden
    --prompts`): NxDI's modules take the batch with its mask, and every point passes in bfloat16,
    judged on the real tokens of each row."""
    golden = t5 / "qwen3_moe-batch"
    report = tmp_path / "r"
    result = run_parity(pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", "bfloat16",
                        "--parity-report", str(report), "-W", "error", model=t5 / "qwen3_moe-model")  # fmt: skip
    ids = points(golden)
    result.assert_outcomes(passed=len(ids) - 1, skipped=1)  # the rotary embedding: inside NxDI's attention
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert [row["tokens"] for row in rows["layer_1.attention"]["rows"]] == [8, 3, 6]
    assert any("padding token(s) of the batch are not judged" in n for n in rows["layer_1.moe"]["notes"])


# -- --parity-parallel: the same candidate under two plans, point by point ---------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_two_tp_plans_of_a_clean_candidate_agree_at_every_point(arch: str, t5: Path, pytester: pytest.Pytester):
    golden = t5 / f"{arch}-golden"
    result = run_parity(
        pytester, golden, *CPU, "--parity-parallel", "tp=1:tp=2", "-k", "parallel and not rotary", "-W", "error",
        model=t5 / f"{arch}-model",
    )  # fmt: skip
    ids = [p for p in points(golden) if not p.endswith("rotary")]
    result.assert_outcomes(passed=len(ids))
    result.stdout.fnmatch_lines([f"{len(ids)} points: {len(ids)} passed, 0 failed, 0 errors", "first divergence: none"])


@pytest.mark.parametrize(
    "fault, where",
    [
        (_missing_all_reduce, "layer_0.attention"),
        (_column_shard_of_the_wrong_half, "layer_0.attention"),
        (_every_rank_takes_rank_0_s_shard, "embedding"),
    ],
    ids=["missing-all-reduce", "column-shard-wrong-half", "rank-0-shard-everywhere"],
)
def test_a_tp_only_bug_is_where_plan_b_leaves_plan_a(
    fault, where: str, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The backend's own TP degree is 1, so every point passes; only the parallel differential, which
    builds each point at TP 1 and TP 2, sees the fault, at its first point, and names the parallelism."""
    golden, model = t5 / "mixtral-golden", t5 / "mixtral-model"
    fault(monkeypatch)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, "--parity-parallel", "tp=1:tp=2", "--parity-report", str(report), model=model
    )
    result.stdout.fnmatch_lines(
        [f"{where}::parallel: the parallelism alone changes it: tp=2 against tp=1, rel_l2 *",
         "  hint: tensor parallelism (tp=2 against tp=1): the same candidate under tp=1 gives another output*",
         f"first divergence: {where}::parallel  (tensor parallelism (tp=2 against tp=1)*"]
    )  # fmt: skip
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert all(r["status"] == "passed" for r in rows.values() if "::" not in r["id"] and r["status"] != "skipped")
    row = rows[f"{where}::parallel"]
    assert row["plans"] == ["tp=1", "tp=2"] and row["figures"]["a_vs_golden"] < 1e-4 < row["figures"]["b_vs_golden"]


# Expert parallelism: NxDI lays out tp=N,ep=E as N ranks whose MoE splits its experts over E groups and
# shards them over N/E (moe_ep_degree, moe_tp_degree); every other layer stays at TP N, so tp=N:tp=N,ep=E
# changes the MoE alone. NxD's expert-parallel MoE takes its blockwise path (a prefill of tokens x top_k
# at least the block size: 16 tokens x 2 here, block 16) and its all-experts path in token generation
# with tokens x top_k / experts >= 1; below that it raises (see the test of what it does not run).
EP = ("--hw-option", "block_size=16")


@pytest.mark.parametrize("plans", ["tp=2:tp=2,ep=2", "tp=4:tp=4,ep=2"])
def test_two_plans_that_differ_in_expert_parallelism_agree_on_a_clean_candidate(
    plans: str, t5: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """NxD's expert parallelism runs on the CPU build (its mesh groups made of gloo groups): every
    prefill point of a clean candidate agrees under both plans, the MoE's experts split over two
    groups of ranks (tp=4,ep=2: four ranks, the MoE at TP 2 x EP 2)."""
    golden = t5 / "qwen3_moe-golden"
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, *EP, "--parity-parallel", plans, "-k", "parallel and not rotary and not step_",
        "--parity-report", str(report), model=t5 / "qwen3_moe-model",
    )  # fmt: skip
    ids = [p for p in points(golden) if not p.endswith("rotary") and not p.startswith("step_")]
    result.assert_outcomes(passed=len(ids))
    summary = f"{len(ids)} points: {len(ids)} passed, 0 failed, 0 errors*"
    result.stdout.fnmatch_lines([summary, "first divergence: none"])
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    plan_a, plan_b = plans.split(":")
    assert rows["layer_0.moe::parallel"]["plans"] == [plan_a, plan_b]
    # B's MoE sums its experts' shares in another order (the experts split), by float32 rounding; every
    # other layer is the same build under both plans, bit for bit
    assert 0 < rows["layer_0.moe::parallel"]["figures"]["b_vs_a"] < 1e-5
    assert rows["layer_0.attention::parallel"]["figures"]["b_vs_a"] == 0


def _every_rank_is_expert_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank takes expert-parallel rank 0's experts (loaded and routed to): the others' are lost."""
    from neuronx_distributed.parallel_layers import parallel_state

    monkeypatch.setattr(parallel_state, "get_expert_parallel_rank_from_global_rank", lambda rank, **_: 0)


def _a_rank_s_expert_tokens_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokens sent to the second expert-parallel group's experts come back empty (an exchange
    that drops a rank's tokens): that group's experts add nothing to the closing reduce."""
    import torch.distributed as dist
    from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2

    forward = ExpertMLPsV2.forward

    def dropping(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        group = self.moe_expert_model_parallel_group
        return torch.zeros_like(out) if group.size() > 1 and dist.get_rank(group) == 1 else out

    monkeypatch.setattr(ExpertMLPsV2, "forward", dropping)


@pytest.mark.parametrize(
    "fault", [_every_rank_is_expert_rank_0, _a_rank_s_expert_tokens_dropped], ids=["expert-rank-0", "dropped-tokens"]
)
def test_an_expert_parallel_only_bug_is_where_plan_b_leaves_plan_a(
    fault, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Faults that exist only under expert parallelism (both plans at TP 2, so the ranks, the attention
    and every other shard are the same): the backend's own run passes every point, the differential
    fails first at the first point NxD's experts run in (`layer_0.experts`), naming expert
    parallelism, with TP 2 alone matching the golden there."""
    golden, model = t5 / "qwen3_moe-golden", t5 / "qwen3_moe-model"
    fault(monkeypatch)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, *CPU, *EP, "--parity-parallel", "tp=2:tp=2,ep=2", "-k", "not step_",
        "--parity-report", str(report), model=model,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        ["layer_0.experts::parallel: the parallelism alone changes it: tp=2,ep=2 against tp=2, rel_l2 *",
         "  hint: expert parallelism (tp=2,ep=2 against tp=2): the same candidate under tp=2 gives another output*",
         "first divergence: layer_0.experts::parallel  (expert parallelism (tp=2,ep=2 against tp=2)*"]
    )  # fmt: skip
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert all(r["status"] == "passed" for r in rows.values() if "::" not in r["id"] and r["status"] != "skipped")
    failed = [i for i, r in rows.items() if r["status"] == "failed"]
    # only the items whose module holds NxD's experts: the experts, the MoE block and the decoder layer
    assert failed and all(i.endswith(("experts::parallel", "moe::parallel", "output::parallel")) for i in failed), (
        failed
    )
    row = rows["layer_0.experts::parallel"]
    assert row["figures"]["a_vs_golden"] < 1e-4 < row["figures"]["b_vs_golden"]
    # the points themselves under EP (--hw-option ep_degree): the run stops at the same point
    own = run_parity(
        pytester, golden, *CPU, *EP, "--hw-option", "tp_degree=2", "--hw-option", "ep_degree=2", "-x",
        "-k", "not step_", model=model,
    )  # fmt: skip
    own.stdout.fnmatch_lines(["first divergence: layer_0.experts *"])
    assert own.parseoutcomes()["failed"] == 1


def test_what_nxd_s_expert_parallelism_does_not_run_fails_as_plan_b_raising(t5: Path, pytester: pytest.Pytester):
    """NxD's expert-parallel MoE raises on calls its EP paths do not serve: a prefill below the block
    size (its all-experts path indexes every expert on a rank's share: IndexError) and token generation
    of fewer tokens x top_k than experts (NotImplementedError). Plan A runs them: a finding of plan B,
    named as such, never an error of the tool nor a pass."""
    result = run_parity(
        pytester, t5 / "qwen3_moe-golden", *CPU, "--parity-parallel", "tp=2:tp=2,ep=2", "-k", "layer_0.moe::parallel",
        model=t5 / "qwen3_moe-model",
    )  # fmt: skip
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        ["layer_0.moe::parallel: tp=2,ep=2 raises where tp=2 runs: *IndexError: * (expert_mlps_v2.py:*)*",
         "step_1.layer_0.moe::parallel: tp=2,ep=2 raises where tp=2 runs: *NotImplementedError: Selective Loading with "
         "Expert parallelism is not supported in token generation*",
         "step_1.layer_0.moe::parallel * failed * tp=2,ep=2 vs tp=2 raises*",
         "first divergence: layer_0.moe::parallel  (expert parallelism (tp=2,ep=2 against tp=2): the candidate does "
         "not run this call under tp=2,ep=2*"]
    )  # fmt: skip


def test_a_parallel_plan_nxd_cannot_lay_out_is_a_usage_error_that_says_why(t5: Path, pytester: pytest.Pytester):
    golden, model = t5 / "qwen3_moe-golden", t5 / "qwen3_moe-model"
    usage_error(
        run_parity(pytester, golden, *CPU, "--parity-parallel", "tp=1:tp=1,ep=2", model=model),
        "--parity-parallel tp=1:tp=1,ep=2: ep=2: NxDI splits the 1 rank(s) of tp=1 into moe_tp_degree x moe_ep_degree, "
        "so the expert-parallel degree divides the TP degree; e.g. tp=4 with ep=2",
    )
    usage_error(
        run_parity(pytester, golden, *CPU, "--parity-parallel", "tp=2,ep=2:tp=6,ep=3", model=model),
        "the experts (8) by the EP degree (3)",
    )
    usage_error(
        run_parity(pytester, golden, *CPU, "--parity-parallel", "tp=1:tp=3", model=model),
        "--parity-parallel tp=1:tp=3: tp=3: NxD shards",
    )
    usage_error(
        run_parity(pytester, golden, *CPU, "--hw-option", "ep_degree=2", model=model),
        "--hw-option ep_degree=2: NxDI splits the 1 rank(s) of --hw-option tp_degree=1 into",
    )
    # NxDI's Mixtral builds a MoE that never splits its experts: an EP plan there would compare a build with itself
    usage_error(
        run_parity(pytester, t5 / "mixtral-golden", *CPU, "--parity-parallel", "tp=2:tp=2,ep=2",
                   model=t5 / "mixtral-model"),
        "--parity-parallel tp=2:tp=2,ep=2: ep=2: NxDI's Mixtral builds the older modules/moe.initialize_moe_module, "
        "which does not read moe_ep_degree",
    )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2])
def test_each_row_of_a_batch_gives_nxdi_s_modules_what_it_gives_alone(tp: int, t5: Path, pytester: pytest.Pytester):
    """`--parity-batch-invariance` on NxDI's real modules: each prefill point of the left-padded batch
    golden, run on the batch and on each row's real tokens alone, agrees (the rotary embedding, which
    NxDI computes inside its attention, skipped with its point)."""
    golden = t5 / "qwen3_moe-batch"
    result = run_parity(
        pytester, golden, *CPU, "--hw-option", f"tp_degree={tp}", "--parity-batch-invariance", "-k", "batch",
        "-W", "error", model=t5 / "qwen3_moe-model",
    )  # fmt: skip
    prefill = [p for p in points(golden) if not p.startswith("step_")]
    result.assert_outcomes(passed=len(prefill) - 1, skipped=1)
    result.stdout.fnmatch_lines(["first divergence: none"])


# -- --parity-routing on NxDI's own MoE module: its router's output replaced inside it -------------------


def _selection_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD's top-k router picks its experts by biased logits (a lost score correction), its affinities
    the true ones."""
    from neuronx_distributed.modules.moe import routing

    forward = routing.RouterTopK.forward

    def biased(self, hidden_states):
        logits, affinities, _ = forward(self, hidden_states)
        bias = torch.linspace(0.0, 2.0, logits.shape[-1], dtype=logits.dtype)
        return logits, affinities, torch.topk(logits + bias, self.top_k).indices.to(torch.long)

    monkeypatch.setattr(routing.RouterTopK, "forward", biased)


def _weights_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD's top-k router gives sharpened affinities (its activation applied twice), the same experts."""
    from neuronx_distributed.modules.moe import routing

    forward = routing.RouterTopK.forward

    def sharpened(self, hidden_states):
        logits, affinities, index = forward(self, hidden_states)
        return logits, torch.softmax(affinities.float() * 8, dim=-1).to(affinities.dtype), index

    monkeypatch.setattr(routing.RouterTopK, "forward", sharpened)


@pytest.mark.parametrize(
    ("fault", "level"), [(None, None), (_selection_off, "ids"), (_weights_off, "ids+weights")],
    ids=["clean", "selection", "weights"],
)  # fmt: skip
@pytest.mark.parametrize("arch", ARCHS)
def test_the_routing_levels_on_nxdi_s_own_moe(
    arch: str, fault, level, t5: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The MoE block replayed in NxDI's own module with its router's output replaced (the golden's ids,
    then ids and weights): clean, every level passes; a selection fault is recovered by the ids, a
    weights fault only by ids and weights."""
    if fault is not None:
        fault(monkeypatch)
    report = tmp_path / "r"
    result = run_parity(
        pytester, t5 / f"{arch}-golden", *CPU, "--parity-routing", "ids+weights", "-k", "layer_0.moe",
        "--parity-report", str(report), model=t5 / f"{arch}-model",
    )  # fmt: skip
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    routing = rows["layer_0.moe::routing"]
    assert routing["recovered"] == level, routing["notes"]
    assert routing["status"] == ("passed" if level is None else "failed")
    said = "layer_0.moe::routing *own routing within limits*" if level is None else f"*recovered by {level} *"
    result.stdout.fnmatch_lines([said])
