"""`--parity-drill` on `--hw nxdi --hw-option build=cpu`: NxDI's real modules captured op by op on
their ranks (at TP 2, the ranks' graphs joined into one), matched many-to-many to the reference's
ops, which this stack (transformers 4.57) cannot run: they were recorded with the golden under
transformers 5 by `moe-parity drill-ops` (the first CI leg: `layer_1.*` and `step_1.layer_1.*`, in
bfloat16).

A clean NxDI drills clean; a fault in NxDI's code or in its converted weights is named at its op
(the fault is patched into this process, and the ranks fork from it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import read_json, run_parity, usage_error

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.report.files import REPORT_FILE

CPU = ("--hw", "nxdi", "--hw-option", "build=cpu")


def drill(pytester, t5: Path, arch: str, points: str, *args: str, tp: int = 1, dtype: str = "bfloat16"):
    """An inner run of the points matching `points` (of the prefill unless they name a step),
    drilled; its result and the drills' records (point -> the ::drill row's record)."""
    report = pytester.path / "report"
    select = points.replace("*", "") + ("" if points.startswith("step_") else " and not step")
    result = run_parity(
        pytester, t5 / f"{arch}-golden", *CPU, "--hw-option", f"tp_degree={tp}", "--dtype", dtype,
        "--parity-drill", points, "-k", select, "--parity-report", str(report), *args, model=t5 / f"{arch}-model",
    )  # fmt: skip
    rows = read_json(report / REPORT_FILE)["points"]
    return result, {r["id"].removesuffix("::drill"): r["drill"] for r in rows if r["id"].endswith("::drill")}


@pytest.mark.parametrize("arch, tp", [("qwen3_moe", 1), ("qwen3_moe", 2), ("mixtral", 2)])
def test_a_clean_nxdi_drills_clean(arch: str, tp: int, t5: Path, pytester: pytest.Pytester) -> None:
    """Every op of every layer-1 component is matched or judged where its values arrive: the
    rotary cos and sin NxDI computes inside its attention against the reference's inputs, the
    heads split across ranks joined, the row-parallel partial sums at their all-reduce, the
    router's top-k by the experts it selects, the dense experts by their tokens' rows."""
    result, drills = drill(pytester, t5, arch, "layer_1.*", tp=tp)
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert set(drills) == {
        f"layer_1.{c}" for c in ("input_norm", "attention", "post_attn_norm", "router", "experts", "moe", "output")
    }
    for point, record in drills.items():
        assert record["culprit"] is None and not record["same_code"], point
        assert not [r for r in record["rows"] if r["verdict"] != "ok"], point
    attention = {r["name"]: r for r in drills["layer_1.attention"]["rows"]}
    assert attention["rotary_emb.cos"]["how"].startswith("value (the reference's input")
    topk = {r["name"]: r for r in drills["layer_1.router"]["rows"]}["topk"]
    assert topk["how"] == "value (the same experts selected)"
    experts = [r for r in drills["layer_1.experts"]["rows"] if r["name"].endswith("down_proj")]
    if tp == 1:  # at TP 2 each rank's rows are partial sums: judged at the all-reduce
        assert experts and all(r["how"].startswith("value (rows: expert") for r in experts)
    else:
        assert any(r["candidate"] == [f"qkv_proj.q_proj@rank{i}" for i in range(tp)] for r in attention.values())
        assert any("all_reduce" in r["note"] for r in drills["layer_1.attention"]["rows"])


@pytest.mark.parametrize("arch, tp", [("qwen3_moe", 1), ("mixtral", 2)])
def test_a_decode_step_on_nxdi_drills_clean(arch: str, tp: int, t5: Path, pytester: pytest.Pytester) -> None:
    """A decode step: NxDI's token generation (the past keys and values given, its own softmax over
    the past and the new token) against the reference's step on the golden's KV cache."""
    result, drills = drill(pytester, t5, arch, "step_1.layer_1.*", tp=tp)
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert len(drills) == 7 and all(record["culprit"] is None for record in drills.values())
    attention = drills["step_1.layer_1.attention"]["rows"]
    assert not [r for r in attention if r["verdict"] != "ok"]
    if arch == "qwen3_moe":  # NxDI's manual softmax takes a max it never reads: listed, not failed
        assert any(r["note"].startswith("computed and never used") for r in attention)


def _scores_scaled_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxDI's `scaled_qk` divides the scores by the scale squared."""
    import torch
    from neuronx_distributed_inference.modules.attention.attention_base import NeuronAttentionBase

    def scaled_qk(self, q, k, attention_mask):
        scores = torch.matmul(q, k.transpose(2, 3)) / self.softmax_scale**2
        return torch.where(attention_mask.to(torch.bool), scores, torch.finfo(scores.dtype).min)

    monkeypatch.setattr(NeuronAttentionBase, "scaled_qk", scaled_qk)


def _rope_base_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxDI's rotary embedding built with ten times the config's base (rope_theta)."""
    from neuronx_distributed_inference.modules.attention import utils

    init = utils.RotaryEmbedding.__init__

    def wrong(self, dim, *args, **kwargs):
        init(self, dim, *args, **kwargs)
        self.base = self.base * 10

    monkeypatch.setattr(utils.RotaryEmbedding, "__init__", wrong)


def _one_expert_s_down_projection_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert 3's converted down projection scaled by 1.5 (a conversion bug in one expert's slice)."""
    convert = nxdi.convert_unit

    def wrong(state, *args, **kwargs):
        out = convert(state, *args, **kwargs)
        for key, value in out.items():
            if key.endswith("mlp_op.down_proj.weight"):
                value = value.clone()
                value[3] *= 1.5
                out[key] = value
        return out

    monkeypatch.setattr(nxdi.backend, "convert_unit", wrong)


@pytest.mark.parametrize(
    "fault, point, named, verdict, tp",
    [
        # the port's op (a division) computes other values than the reference's (a product): paired
        # by its place (it reads the scores and goes into the softmax), the culprit; at tensor
        # parallelism (each rank's heads apart) the reference's op is missing there, a structural
        # difference at which the candidate departs
        (_scores_scaled_twice, "layer_1.attention", "eager_attention_forward.mul", "introduced", 1),
        (_scores_scaled_twice, "layer_1.attention", "eager_attention_forward.mul", "missing", 2),
        # what NxDI computes and the reference is given (its cos and sin): the first of its steps
        (_rope_base_off, "layer_1.attention", "rotary_emb.inv_freq", "extra", 1),
        # one expert's rows of a dense op no longer match by value
        (_one_expert_s_down_projection_off, "layer_1.experts", "expert[3].down_proj", "missing", 1),
    ],
    ids=["scores-scaled-twice", "scores-scaled-twice-tp2", "rope-base-off", "one-expert-down-proj"],
)
def test_a_fault_in_nxdi_is_named_at_its_op(
    fault, point: str, named: str, verdict: str, tp: int, t5: Path, pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The first op that fails (in the reference's forward order) follows only ops that agree; the
    op the fault changes is named, with its verdict: as the culprit where it introduced the error,
    as a structural difference where it is missing or extra (with the ops it feeds); the run fails
    at the point and at the drill."""
    fault(monkeypatch)
    result, drills = drill(pytester, t5, "qwen3_moe", point, tp=tp)
    record = drills[point]
    rows = {r["name"]: r for r in record["rows"]}
    assert rows[named]["verdict"] == verdict, json.dumps(record["rows"], indent=1)[:4000]
    if verdict == "introduced":
        assert record["culprit"] == named
        said = f"*culprit: {named.replace('[', '[[]')} introduced the divergence"
    else:  # the culprit, if any, is an op the table marks introduced
        assert record["culprit"] is None or rows[record["culprit"]]["verdict"] == "introduced", record["culprit"]
        heads = (f"the reference's {named} ", f"the reference's {named},", f"the candidate's own op {named} ")
        (sentence,) = [t for t in record["structure"] if t.startswith(heads)]
        said = f"*structure: {sentence.replace('[', '[[]')}"
    ordered = [r for r in record["rows"] if r["verdict"] != "extra"]
    first = next(i for i, r in enumerate(ordered) if r["verdict"] in ("introduced", "missing"))
    assert all(r["verdict"] == "ok" for r in ordered[:first]), "the ops before the first failing one agree"
    result.stdout.fnmatch_lines([said, f"FAILED *parity::{point} *"])
    assert result.ret == 1


def test_a_stored_capture_is_needed_on_this_stack(t5: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    """transformers 4.57 cannot run the golden's (transformers 5) modules: without stored ops, a
    drill is a usage error that names the command that records them."""
    import shutil

    golden = shutil.copytree(t5 / "qwen3_moe-golden", tmp_path / "g", ignore=shutil.ignore_patterns("drill"))
    result = run_parity(pytester, golden, *CPU, "--parity-drill", "layer_1.attention", model=t5 / "qwen3_moe-model")
    usage_error(result, "record the reference's ops with the golden where it was recorded: moe-parity drill-ops")
    # stored in bfloat16 (and float32) only, as CI records them, drilled in float16: the drill says which to record
    args = ("--dtype", "float16", "--parity-drill", "layer_1.router", "-k", "layer_1.router and not step")
    result = run_parity(pytester, t5 / "qwen3_moe-golden", *CPU, *args, model=t5 / "qwen3_moe-model")
    result.stdout.fnmatch_lines(["*the golden holds the reference's ops in bfloat16, not in the candidate's float16*"])


def test_a_traced_build_is_not_drilled(t5: Path, pytester: pytest.Pytester) -> None:
    """On a Neuron device NxDI runs one traced graph: the drill says so, and what to run instead."""
    result = run_parity(
        pytester, t5 / "qwen3_moe-golden", "--hw", "nxdi", "--parity-drill", "layer_1.router", "-k", "layer_1.router",
        model=t5 / "qwen3_moe-model",
    )  # fmt: skip
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*drills its CPU build (--hw-option build=cpu)*"])
