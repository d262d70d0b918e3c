"""`--parity-drill`: below a component, op by op. Each fault of the list is named as the culprit op
(the first failing op in forward order), its successors are marked inherited, and substituting the
culprit's golden output (or every op that introduced error) recovers at least 90% of the
component's error; clean candidates drill clean; the repro file fails alone."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from drill_port import PortBackend
from faults import (
    _router_softmax_in_its_dtype,
    _used_experts,
    drop_score_bias,
    edit_checkpoint,
    edit_config,
    scale,
    zero_expert,
)
from helpers import NO_CONFIG, NO_WEIGHTS, cli, read_json, rounding_bound, run_parity, usage_error

from pytest_moe_parity import backends
from pytest_moe_parity.backends.hf import TorchBackend
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.record.tiny import available_archs
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def drill(pytester: pytest.Pytester, golden: Path, point: str, *args: str, model: Path | None = None):
    """Drill `point` alone: (the run, its op rows in forward order, the drill's own record)."""
    report = pytester.path / "report"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, "--parity-drill", point, "-k", point,
        "--parity-report", str(report), *args, model=model,
    )  # fmt: skip
    rows = sorted(read_json(report / REPORT_FILE)["points"], key=lambda r: r["order"])
    ops = [r for r in rows if r.get("op")]
    (record,) = [r["drill"] for r in rows if r.get("drill") and r["id"] == f"{point}::drill"]
    return result, ops, record


def assert_culprit(ops: list[dict], record: dict, point: str, named: str, recovery: float = 0.9) -> None:
    """The drill names `named`, the op the fault changes, and it is the first failing op, everything
    before it passed, the failing ops after it are marked (inherited, introduced, missing, extra).
    An op the table marks introduced is the culprit; a missing one (the candidate goes on without
    it) is a structural difference, said with the op it feeds (the culprit, where one is). The
    substitution at what the drill names recovers."""
    failing = [r["id"] for r in ops if r["status"] == "failed"]
    assert failing and failing[0] == f"{point}::{named}", failing
    row = next(r for r in record["rows"] if r["name"] == named)
    recovered = [record["recovery"], record["recovery_introduced"]]
    if row["verdict"] == "introduced":
        assert record["culprit"] == named and row["recovery"] == record["recovery"]
    else:
        assert row["verdict"] == "missing" and record["culprit"] != named, row
        (said,) = [t for t in record["structure"] if t.startswith(f"the reference's {named}")]
        assert " no counterpart in the candidate" in said, said
        assert record["culprit"] is None or f"{record['culprit']}, the culprit" in said, (said, record["culprit"])
        recovered += [r["recovery"] for r in record["rows"] if r["verdict"] == "missing"]
    first = next(i for i, r in enumerate(ops) if r["status"] == "failed")
    assert all(r["op"]["verdict"] == "ok" for r in ops[:first])
    after = [r["op"]["verdict"] for r in ops[first + 1 :] if r["status"] == "failed"]
    marked = all(v in ("inherited", "introduced", "missing", "extra") for v in after)
    assert (after and marked) or len(ops) - first <= 2
    recovered = [x for x in recovered if x is not None]
    assert recovered and max(recovered) >= recovery, record


def _norm_eps(tiny_model, golden_dir, tmp):
    cand = edit_checkpoint(tiny_model("qwen3_moe"), tmp / "cand", lambda t: None)
    edit_config(cand, lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * 1000))
    return golden_dir("qwen3_moe"), cand, "layer_1.input_norm", "add"


def _no_renormalisation(tiny_model, golden_dir, tmp):
    cand = edit_checkpoint(tiny_model("qwen3_moe"), tmp / "cand", lambda t: None)
    edit_config(cand, lambda c: c.update(norm_topk_prob=False))
    return golden_dir("qwen3_moe"), cand, "layer_1.router", "renorm"


def _score_bias_ignored(tiny_model, golden_dir, tmp):
    cand = edit_checkpoint(tiny_model("deepseek_v3"), tmp / "cand", drop_score_bias(1))
    return golden_dir("deepseek_v3"), cand, "layer_1.router", "bias"


def _expert_down_transposed(tiny_model, golden_dir, tmp):
    model = tiny_model("qwen3_moe", moe_intermediate_size=64)  # square: the transposed weight loads
    golden = tmp / "golden"
    record_golden(model, golden)
    expert = _used_experts(golden, 1)[0]

    def edit(t):
        key = f"model.layers.1.mlp.experts.{expert}.down_proj.weight"
        t[key] = t[key].T.contiguous()

    return golden, edit_checkpoint(model, tmp / "cand", edit), "layer_1.experts", f"expert[{expert}].down_proj"


CPU_FAULTS = {
    "norm_eps": _norm_eps,
    "no_renormalisation": _no_renormalisation,
    "score_bias_ignored": _score_bias_ignored,
    "expert_down_transposed": _expert_down_transposed,
}


# the same candidate run eagerly, each op traced, each op through torch.compile (dynamo's eager backend:
# what dynamo captures, without inductor's compile time)
HW = {
    "cpu": [],
    "trace": ["--hw", "trace"],
    "compile": ["--hw", "compile", "--hw-option", "compiler=eager"],
}


@pytest.mark.parametrize("hw", sorted(HW))
@pytest.mark.parametrize("fault", sorted(CPU_FAULTS))
def test_a_weight_or_config_fault_is_named_at_its_op(
    fault, hw, pytester, tiny_model, golden_dir, tmp_path, _import_inductor_once
) -> None:
    golden, candidate, point, culprit = CPU_FAULTS[fault](tiny_model, golden_dir, tmp_path)
    args = [*HW[hw], "--hw-option", f"cache_dir={tmp_path / 'cache'}"] if HW[hw] else []
    result, ops, record = drill(pytester, golden, point, *args, model=candidate)
    assert_culprit(ops, record, point, culprit)
    named = culprit.replace("[", "[[]")  # the culprit, or the missing op of a structural difference
    result.stdout.fnmatch_lines([f"drill {point}: * failed; *{named}*"])


def _softmax_in_bf16(module) -> None:
    module.forward = types.MethodType(_router_softmax_in_its_dtype, module)


def _scaled_twice(module) -> None:
    module.scaling = module.scaling * module.scaling


# The candidate's own modules patched (the reference, another instance of the same classes, is not):
# the code of the candidate differs from the reference's, as in a fork of the modeling file.
CANDIDATE_CODE_FAULTS = {
    "router_softmax_bf16": ("Qwen3MoeTopKRouter", _softmax_in_bf16, "layer_1.router", "score"),
    "scores_scaled_twice": ("Qwen3MoeAttention", _scaled_twice, "layer_1.attention", "eager_attention_forward.mul"),
}


@pytest.mark.parametrize("fault", sorted(CANDIDATE_CODE_FAULTS))
def test_a_code_fault_is_named_at_its_op(fault, pytester, golden_dir, monkeypatch) -> None:
    cls, patch, point, culprit = CANDIDATE_CODE_FAULTS[fault]
    start = TorchBackend.start

    def start_patched(self) -> None:
        start(self)
        for module in self.lazy.model.modules():
            if type(module).__name__ == cls:
                patch(module)

    monkeypatch.setattr(TorchBackend, "start", start_patched)
    _, ops, record = drill(pytester, golden_dir("qwen3_moe"), point)
    assert_culprit(ops, record, point, culprit)


def _scaled_twice_in_decode(module) -> None:
    """The scores scaled twice in one-token steps only (a decode graph of its own, as a port's)."""
    forward = module.forward

    def decode_only(hidden_states, *args, **kwargs):
        scaling = module.scaling
        if hidden_states.shape[-2] == 1:
            module.scaling = scaling * scaling
        try:
            return forward(hidden_states, *args, **kwargs)
        finally:
            module.scaling = scaling

    module.forward = decode_only


def test_a_decode_step_is_drilled_past_its_kv_cache(pytester, golden_dir, monkeypatch) -> None:
    """A decode step's component reads the KV cache of the golden (the past keys and values, the
    reference's as recorded): drilled like a prefill's, its ops named alike. A fault in one-token
    steps only is named at its op in the step, while the prefill's drill of the same component is clean."""
    start = TorchBackend.start

    def start_patched(self) -> None:
        start(self)
        for module in self.lazy.model.modules():
            if type(module).__name__ == "Qwen3MoeAttention":
                _scaled_twice_in_decode(module)

    monkeypatch.setattr(TorchBackend, "start", start_patched)
    golden = golden_dir("qwen3_moe", decode=2)
    point = "step_1.layer_1.attention"
    _, ops, record = drill(pytester, golden, point)
    assert_culprit(ops, record, point, "eager_attention_forward.mul")
    assert any(r["name"] == "cat" or r["name"].endswith(".cat") for r in record["rows"])  # the cache's update
    _, ops, record = drill(pytester, golden, "layer_1.attention")  # (-k also runs the steps' points, which fail)
    assert record["culprit"] is None and ops and all(r["status"] == "passed" for r in ops)


def softmax_off(gm, example_inputs):
    """A torch.compile backend that miscompiles softmax (its output 3% high) and nothing else."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and "softmax" in str(node.target):
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.mul, (node, 1.03))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user, scaled=scaled: user is not scaled)
    gm.recompile()
    return gm.forward


def test_a_miscompiled_op_is_named_on_compile(pytester, golden_dir, cache_dir, _import_inductor_once) -> None:
    pytester.makepyfile(drill_compiler="from test_drill import softmax_off  # noqa: F401")
    pytester.syspathinsert(Path(__file__).parent)
    pytester.syspathinsert()
    point = "layer_1.attention"
    args = ["--hw", "compile", "--hw-option", "compiler=drill_compiler:softmax_off"]
    result, ops, record = drill(
        pytester, golden_dir("qwen3_moe"), point, *args, "--hw-option", f"cache_dir={cache_dir}"
    )
    assert_culprit(ops, record, point, "eager_attention_forward.softmax")
    # 3% off in one op is within the component's fixed bf16 limit: the drill sees what it cannot
    result.stdout.fnmatch_lines([f"drill {point}: * culprit eager_attention_forward.softmax, *recovers 100%"])


def _perturb_softmax(traced):
    """A TorchScript graph whose softmax output is 3% high: a miscompile of one op kind."""
    graph = traced.graph
    for node in list(graph.nodes()):
        if node.kind() in ("aten::softmax", "aten::_softmax"):
            out = node.output()
            graph.setInsertPoint(node)
            factor = graph.insertConstant(1.03)
            mul = graph.create("aten::mul", [out, factor])
            mul.insertAfter(node)
            out.replaceAllUsesWith(mul.output())
            mul.replaceInput(0, out)
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    return torch.jit.load(buffer)


def test_a_miscompiled_op_is_named_on_trace(pytester, golden_dir, tmp_path, monkeypatch) -> None:
    real = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: _perturb_softmax(real(*a, **k)))
    point = "layer_1.attention"
    args = ["--hw", "trace", "--hw-option", f"cache_dir={tmp_path / 'cache'}"]
    result, ops, record = drill(pytester, golden_dir("qwen3_moe"), point, *args)
    assert_culprit(ops, record, point, "eager_attention_forward.softmax")
    result.stdout.fnmatch_lines([f"drill {point}: * culprit eager_attention_forward.softmax, *recovers 100%"])


# -- a port with its own code: matched many-to-many --------------------------------------------------


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(backends.registry(), PortBackend.name, PortBackend)


PORT_LAYOUT = "fused_qkv,split_heads,other_rounding"


def test_a_port_laid_out_otherwise_is_matched_and_drills_clean(pytester, golden_dir, tiny_model, port) -> None:
    args = ["--hw", "port", "--hw-option", f"bugs={PORT_LAYOUT}"]
    result, ops, record = drill(pytester, golden_dir("qwen3_moe"), "layer_1.attention", *args,
                                model=tiny_model("qwen3_moe"))  # fmt: skip
    assert record["culprit"] is None and all(r["status"] == "passed" for r in ops), record
    how = {r["id"].split("::")[1]: r["op"]["how"] for r in ops if r["op"]}
    assert how["q_proj"] == how["k_proj"] == how["v_proj"] == "value (fused: 3 in one)"
    assert how["eager_attention_forward.bmm"] == "value (split: one in 4)"
    assert how["eager_attention_forward.add"] == "value"  # the port masks with masked_fill
    result.stdout.fnmatch_lines(["drill layer_1.attention: * 0 failed; no culprit"])


@pytest.mark.parametrize(
    ("bug", "point", "culprit"),
    [
        ("rope_interleaved", "layer_1.attention", "rotate_half.neg"),
        ("scale_by_hidden", "layer_1.attention", "eager_attention_forward.mul"),
        ("mask_one_ahead", "layer_1.attention", "eager_attention_forward.add"),
        ("no_renormalise", "layer_1.router", "renorm"),
    ],
)
def test_a_port_bug_is_named_at_its_op(bug, point, culprit, pytester, golden_dir, tiny_model, port) -> None:
    args = ["--hw", "port", "--hw-option", f"bugs={bug},{PORT_LAYOUT}"]
    _, ops, record = drill(pytester, golden_dir("qwen3_moe"), point, *args, model=tiny_model("qwen3_moe"))
    assert_culprit(ops, record, point, culprit)


@pytest.mark.parametrize(
    ("bug", "op"),
    [
        ("zero_expert", "expert[{expert}].down_proj"),  # its down projection lost in conversion: zeros
        ("gate_up_swapped", ".gate_up_proj"),
        ("experts_reversed", ".gate_up_proj .down_proj"),  # every expert reads another's weights: both
        ("down_not_transposed", ".down_proj"),
    ],
)
def test_a_port_s_experts_bug_is_named_at_its_op_whatever_order_it_gathers_in(
    bug, op, pytester, golden_dir, tiny_model, port, tmp_path
) -> None:
    """The port's expert loop takes each expert's tokens in token order (transformers: by top-k
    slot, then token), its gate and up in one fused matmul: its rows are matched by which token and
    slot they hold, so a conversion bug in its experts' weights is named at the expert's op that reads
    them, introduced, and substituting the ops that introduced it recovers the component."""
    golden = golden_dir("qwen3_moe")
    expert = _used_experts(golden, 1)[0]
    model, bugs = tiny_model("qwen3_moe"), f"{bug},{PORT_LAYOUT}"
    if bug == "zero_expert":
        model, bugs = edit_checkpoint(model, tmp_path / "cand", zero_expert(1, expert)), PORT_LAYOUT
    args = ["--hw", "port", "--hw-option", f"bugs={bugs}"]
    _, ops, record = drill(pytester, golden, "layer_1.experts", *args, model=model)
    failed = {r["id"].split("::")[1]: r["op"]["verdict"] for r in ops if r["status"] == "failed"}
    introduced = [n for n, v in failed.items() if v == "introduced"]
    assert introduced and all(n.endswith(tuple(op.format(expert=expert).split())) for n in introduced), failed
    assert set(failed.values()) <= {"introduced", "inherited"}, failed  # every row matched: none missing or extra
    assert record["culprit"] == introduced[0] and not record["structure"], record["structure"]
    recovered = [x for x in (record["recovery"], record["recovery_introduced"]) if x is not None]
    assert recovered and max(recovered) >= 0.9, record


def test_a_port_that_repeats_kv_heads_in_another_order_is_a_structural_difference_at_the_culprit(
    pytester, golden_dir, tiny_model, port
) -> None:
    """The port tiles its K/V heads with `repeat` where the reference expands each head in place:
    `repeat` is the port's own op (no reference op matches it), said as a structural difference that
    feeds the culprit, an op the table marks introduced; no recovery is claimed for `repeat` itself."""
    args = ["--hw", "port", "--hw-option", f"bugs=gqa_repeat,{PORT_LAYOUT}"]
    result, _, record = drill(
        pytester, golden_dir("qwen3_moe"), "layer_1.attention", *args, model=tiny_model("qwen3_moe")
    )
    rows = {r["name"]: r for r in record["rows"]}
    culprit = record["culprit"]
    assert culprit and rows[culprit]["verdict"] == "introduced", culprit
    assert rows["repeat"]["verdict"] == "extra" and rows["repeat"]["recovery"] is None
    said = [
        t
        for t in record["structure"]
        if t.startswith("the candidate's own op repeat matches no reference op and feeds ")
    ]
    assert said and f"{culprit}, the culprit" in said[0], record["structure"]
    assert max(x for x in (record["recovery"], record["recovery_introduced"]) if x is not None) >= 0.9, record
    result.stdout.fnmatch_lines([f"  culprit: {culprit} introduced the divergence", f"  structure: {said[0][:50]}*"])


def test_a_port_s_own_rounding_is_not_a_finding(pytester, golden_dir, tiny_model, port) -> None:
    """A port whose router takes its softmax in bf16 (the reference: float32) rounds where the
    reference does not; its ops are judged against at least one rounding of their dtype (a port's
    own code rounds in its own order), and the router's outputs stay within their noise: the
    point passes and so does the drill."""
    args = ["--hw", "port", "--hw-option", f"bugs=router_softmax_bf16,{PORT_LAYOUT}"]
    result, _, record = drill(pytester, golden_dir("qwen3_moe"), "layer_1.router", *args, model=tiny_model("qwen3_moe"))
    assert result.ret == 0 and record["culprit"] is None and not record["same_code"]
    score = next(r for r in record["rows"] if r["name"] == "score")
    assert score["verdict"] == "ok" and score["error"] > score["noise"]  # it does round more than the reference


def test_a_failing_point_whose_ops_each_stay_within_their_floor_says_the_error_accumulates(
    pytester, golden_dir, tiny_model, port
) -> None:
    """The port's router softmax in bf16, against a golden with the reference's own bf16 error: the
    point fails its noise check, and no single op leaves one rounding of its dtype. The drill names no
    culprit and says so: the error accumulates, over how many ops, and which op ran in another dtype
    than the reference's (the finding: the reference takes its softmax in float32)."""
    args = ["--hw", "port", "--hw-option", f"bugs=router_softmax_bf16,{PORT_LAYOUT}"]
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    result, _, record = drill(pytester, golden, "layer_1.router", *args, model=tiny_model("qwen3_moe"))
    result.stdout.fnmatch_lines(["FAILED *parity::layer_1.router *"])  # the point fails its noise check
    assert record["culprit"] is None and not record["structure"] and not record["unmatched"], record
    assert not [r for r in record["rows"] if r["verdict"] != "ok"]
    said = record["accumulation"]
    found = re.match(r"no single op leaves its dtype's floor: the error accumulates over (\d+) of the (\d+) ops", said)
    assert found and 0 < int(found[1]) <= int(found[2]), said  # how many compared, how many above their own
    assert "the largest ratios: " in said, said
    assert said.endswith("; ran in another dtype than the reference's: score in bfloat16 (the reference: float32)")
    closing = "drill layer_1.router: * 0 failed; no culprit (the error accumulates*"
    result.stdout.fnmatch_lines([closing, "FAILED *parity::layer_1.router::drill *"])  # it fails with its finding
    assert f"  {said}" in result.stdout.str()


def test_a_drill_whose_ops_mostly_match_nothing_names_no_culprit(pytester, golden_dir, tiny_model, port, monkeypatch):
    """A port's attention that computes something else altogether (a gated projection, no scores):
    most of the reference's ops match nothing, so no op's verdict means anything; the drill says
    that matching failed and why, and names no culprit (never one made up from nothing)."""
    import port_qwen3

    def elsewise(self, x, *args, **kwargs):
        return self.o_proj(torch.sigmoid(self.q_proj(x)) * torch.tanh(self.v_proj(x).repeat(1, 1, 2)))

    monkeypatch.setattr(port_qwen3.Attention, "forward", elsewise)
    result, _, record = drill(pytester, golden_dir("qwen3_moe"), "layer_1.attention", "--hw", "port",
                              model=tiny_model("qwen3_moe"))  # fmt: skip
    assert record["culprit"] is None and record["recovery"] is None, record["culprit"]
    said = record["unmatched"]
    assert re.match(r"\d+ of \d+ reference ops match no candidate op \(", said), said
    result.stdout.fnmatch_lines(
        [f"  matching failed: {said[:60]}*", "drill layer_1.attention: * no culprit (matching failed)"]
    )
    assert result.ret == 1


def test_an_op_matched_to_nothing_fails_the_drill_with_its_name(
    pytester, golden_dir, tiny_model, port, monkeypatch
) -> None:
    """A port's own op that the reference has nothing like, whose value goes on into the
    component's: listed as extra, and said as a structural difference with the op it feeds, the
    culprit (an op the table marks introduced). An op computed and thrown away is listed too, as
    unused: the component cannot depend on it."""
    import port_qwen3

    forward = port_qwen3.Attention.forward

    def with_a_stray_op(self, x, *args, **kwargs):
        torch.sigmoid(x)  # computed and thrown away
        return forward(self, torch.erf(x), *args, **kwargs)  # nothing in the reference matches it

    monkeypatch.setattr(port_qwen3.Attention, "forward", with_a_stray_op)
    result, _, record = drill(pytester, golden_dir("qwen3_moe"), "layer_1.attention", "--hw", "port",
                              model=tiny_model("qwen3_moe"))  # fmt: skip
    extra = [r["name"] for r in record["rows"] if r["verdict"] == "extra"]
    assert "with_a_stray_op.erf" in extra  # named by the function it runs in
    rows = {r["name"]: r for r in record["rows"]}
    culprit = record["culprit"]
    assert rows[culprit]["verdict"] == "introduced" and rows[culprit]["recovery"] == record["recovery"]
    assert rows["with_a_stray_op.erf"]["recovery"] is None  # it has no reference output to substitute
    (said,) = [t for t in record["structure"] if "with_a_stray_op.erf" in t]
    # it feeds q, k and v: their reference values together recover the component
    assert re.fullmatch(r"the candidate's own op with_a_stray_op.erf matches no reference op and feeds "
                        r"q_proj, the culprit, k_proj, v_proj \(the reference's values of the ops it feeds "
                        r"recover (\d+)%\)", said) and int(said.rsplit(" ", 1)[1][:-2]) >= 90, said  # fmt: skip
    assert culprit == "q_proj" and record["recovery"] < 0.5  # q alone: part of it
    assert record["partial"] is not None or (record["recovery_introduced"] or 0) >= 0.9
    unused = next(r for r in record["rows"] if r["name"] == "with_a_stray_op.sigmoid")
    assert unused["verdict"] == "ok" and unused["note"].startswith("computed and never used")
    result.stdout.fnmatch_lines(["*EXTRA      with_a_stray_op.erf *(a candidate op that matches no reference op)"])
    result.stdout.fnmatch_lines([f"  culprit: {culprit} introduced the divergence", f"  structure: {said}"])
    assert result.ret == 1


# -- clean drills, auto, repro, usage ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", available_archs())
def test_a_clean_bf16_candidate_drills_clean(arch, pytester, golden_dir) -> None:
    """Every point of every architecture transformers has a tiny model of here (the seven of the
    table and more), drilled: no culprit, no failing op."""
    report = pytester.path / "report"
    result = run_parity(
        pytester, golden_dir(arch), "--dtype", "bfloat16", NO_WEIGHTS,
        "--parity-drill", "layer_*,embedding,final_norm,logits", "--parity-report", str(report),
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()[-3000:]
    drills = read_json(report / SUMMARY_FILE)["drills"]
    assert drills and all(d["culprit"] is None and d["failed_ops"] == 0 for d in drills.values()), drills


def test_auto_drills_the_first_failing_component(pytester, tiny_model, golden_dir, tmp_path) -> None:
    golden, candidate, _, culprit = _norm_eps(tiny_model, golden_dir, tmp_path)
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, NO_CONFIG, "--parity-drill", "auto", "-x",
                        "--parity-report", str(report), model=candidate)  # fmt: skip
    result.assert_outcomes(failed=1, passed=2)  # embedding and rotary, then layer_0.input_norm stops the run
    result.stdout.fnmatch_lines(
        [
            "layer_0.input_norm: drilled into * ops (bfloat16, noise factor 1.5)",
            f"  culprit: {culprit} introduced the divergence",
            f"collect these ops as items: pytest --golden-dir {golden} --hw cpu --model {candidate} --dtype bfloat16 "
            "--parity-drill layer_0.input_norm -k layer_0.input_norm",
        ]
    )
    result.stdout.fnmatch_lines([f"drill layer_0.input_norm: * failed; culprit {culprit}, substituting it recovers *"])
    row = next(r for r in read_json(report / REPORT_FILE)["points"] if r["id"] == "layer_0.input_norm")
    assert row["drill"]["culprit"] == culprit
    drills = read_json(report / SUMMARY_FILE)["drills"]  # the summary holds an auto drill too
    assert list(drills) == ["layer_0.input_norm"] and drills["layer_0.input_norm"]["culprit"] == culprit


def test_the_repro_fails_alone_on_the_candidate_and_passes_on_the_reference(
    pytester, tiny_model, golden_dir, tmp_path
) -> None:
    golden, candidate, point, culprit = _norm_eps(tiny_model, golden_dir, tmp_path)
    repro = tmp_path / "repro"
    result, _, record = drill(pytester, golden, point, "--parity-repro", str(repro), model=candidate)
    assert len(list(repro.iterdir())) == 2  # the test and its safetensors, nothing of the golden
    out, meta = run_repro(repro)
    assert "FAILED test_layer_1_input_norm_add.py::test_candidate" in out
    assert meta["candidate"]["op"] == "aten.add.Tensor" and meta["runner"]["kind"] == "eager"
    # the culprit is the norm's epsilon, a constant the port gives `add`: the repro, its file and the drill's
    # line say so, with both values, and call it no kernel bug
    eps = json.loads((golden / "manifest.json").read_text())["model"]["config"]["rms_norm_eps"]
    (constant,) = meta["constants"]
    assert constant["reference"] == pytest.approx(eps) and constant["candidate"] == pytest.approx(eps * 1000)
    given = (
        f"{constant['where']} is {constant['candidate']!r} in the candidate, {constant['reference']!r} in the reference"
    )
    cause = f"a constant that differs, not a kernel bug: {given}"
    assert f"{point}::{culprit}: the candidate's aten.add.Tensor ({cause}) gives rel_l2" in out
    text = next(repro.glob("test_*.py")).read_text()
    assert f"Its cause is {cause}." in text and "there is no kernel bug to report" in text
    assert "Attach it to a compiler or kernel bug report" not in text
    assert record["repro_cause"] == cause
    result.stdout.fnmatch_lines([f"  repro: {repro}/test_layer_1_input_norm_add.py ({cause})"])


def run_repro(repro: Path) -> tuple[str, dict]:
    """The repro file in `repro` run alone (without this plugin): its output, which says its reference
    test passed and its candidate test failed, and its metadata."""
    (test_file,) = repro.glob("test_*.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:moe-parity", test_file.name],
        cwd=repro, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    return run.stdout, json.loads(test_file.read_text().split('META = json.loads(r"""')[1].split('""")')[0])


def test_drill_usage_errors(pytester, golden_dir) -> None:
    golden = golden_dir("qwen3_moe")
    usage_error(run_parity(pytester, golden, "--parity-drill", "layer_9.attention"),
                "--parity-drill 'layer_9.attention' matches no point of this golden")  # fmt: skip
    usage_error(run_parity(pytester, golden, "--parity-repro", "out"),
                "--parity-repro writes the repro file of a drill's culprit: add --parity-drill")  # fmt: skip

    class Outputs(backends.Backend):  # a backend of outputs only: nothing to drill into
        name = "outputs-only"

        def run(self, point, golden):  # pragma: no cover - the run stops at configure
            raise AssertionError

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(backends.registry(), Outputs.name, Outputs)
        usage_error(
            run_parity(pytester, golden, "--hw", Outputs.name, "--parity-drill", "layer_0.attention"),
            "--parity-drill: the outputs-only backend gives no torch modules to drill into",
        )


def test_a_reference_that_does_not_reproduce_the_golden_fails_the_drill(pytester, tiny_model, tmp_path) -> None:
    """The golden's model changed after the recording: the drill's reference is no longer the golden's."""
    model = edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "model", lambda t: None)
    golden = tmp_path / "golden"
    record_golden(model, golden)
    shutil.rmtree(model)
    edit_checkpoint(tiny_model("qwen3_moe"), model, scale("input_layernorm.weight", 1, 1.5))
    result, ops, record = drill(pytester, golden, "layer_1.input_norm")  # the candidate: the model as it is now
    assert record["reference_error"] > 0.1
    result.stdout.fnmatch_lines(["*the reference's rerun here does not reproduce the golden at layer_1.input_norm*"])
    assert all(r["status"] == "passed" for r in ops)  # the candidate agrees with the changed reference...
    result.assert_outcomes(failed=2, passed=len(ops))  # ...and the point and the drill fail


def test_a_drill_on_neuron_compiles_each_op_once_then_reads_the_cache(
    pytester, golden_dir, tiny_model, tmp_path, monkeypatch
) -> None:
    """`--hw neuron` against the torch_neuronx double: every computing op traced alone, once per op,
    shape and arguments, placed on the device; a second run traces nothing."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "doubles"))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    import torch_neuronx

    torch_neuronx.calls.clear()
    golden = golden_dir("minimax_m2")
    candidate = edit_checkpoint(tiny_model("minimax_m2"), tmp_path / "cand", drop_score_bias(1))
    args = ["--hw", "neuron", "--hw-option", "devices=1", "--hw-option", f"cache_dir={tmp_path / 'c'}"]
    _, ops, record = drill(pytester, golden, "layer_1.router", *args, model=candidate)
    assert_culprit(ops, record, "layer_1.router", "bias")
    workdirs = [Path(d["compiler_workdir"]).name for n, d in torch_neuronx.calls if n == "trace"]
    per_op = [w for w in workdirs if w.startswith("op-")]
    assert per_op and len(per_op) == len(set(per_op)), workdirs  # each op, shape and arguments once
    torch_neuronx.calls.clear()
    drill(pytester, golden, "layer_1.router", *args, model=candidate)
    assert not [n for n, _ in torch_neuronx.calls if n == "trace"]  # all from the cache
    os.environ.pop("NEURON_RT_VISIBLE_CORES", None)


def test_drill_items_are_diffed_and_reported_as_their_table(pytester, tiny_model, golden_dir, tmp_path, capsys) -> None:
    golden, candidate, point, culprit = _no_renormalisation(tiny_model, golden_dir, tmp_path)
    args = ["--dtype", "bfloat16", NO_WEIGHTS, "--parity-drill", point, "-k", point]
    run_parity(pytester, golden, *args, "--parity-report", str(tmp_path / "clean"))
    run_parity(pytester, golden, *args, "--parity-report", str(tmp_path / "port"), model=candidate)
    code, out, _ = cli(capsys, "diff", tmp_path / "clean", tmp_path / "port")
    assert code == 1
    assert f"  {point}::{culprit}" in out and f"{point}::drill" in out, out
    code, out, _ = cli(capsys, "report", tmp_path / "port")
    assert code == 0 and "1 point: 0 passed, 1 failed" in out, out  # the drill's ops are not points
    # no op introduced it: the candidate leaves the renormalisation out (a structural difference)
    said = (
        f"drill {point}: 5 ops, 2 failed; no culprit (structure: the reference's {culprit} (sum), {culprit}#2 (div) "
        f"have no counterpart in the candidate (the reference's value of {culprit}#2 in the candidate's run "
        "recovers 100%))"
    )
    assert said in out, out


# -- the reference's ops stored with the golden (moe-parity drill-ops) -----------------------------------


def test_stored_reference_ops_drill_where_the_golden_s_model_is_not(pytester, tiny_model, tmp_path, capsys) -> None:
    """`moe-parity drill-ops` captures the reference's ops once, where the golden was recorded; a
    drill elsewhere reads them (no model, no transformers 5 needed for the reference) and names the
    same culprit as a drill that captures them itself."""
    model = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "model")
    golden = tmp_path / "golden"
    record_golden(model, golden)
    code, out, err = cli(capsys, "drill-ops", golden, "--points", "layer_1.input_norm,layer_1.router")
    assert code == 0, err
    assert out.splitlines()[0].startswith("layer_1.input_norm: 6 ops in float32, bfloat16, ")
    assert out.splitlines()[-1].startswith("drill ops written: 2 points, ") and str(golden / "drill") in out
    stored = json.loads((golden / "drill" / "layer_1.input_norm.json").read_text())  # data, not pickle
    assert set(stored["graphs"]) == {"float32", "bfloat16"} and stored["graphs"]["float32"]["nodes"][0]["func"]
    cand = edit_checkpoint(model, tmp_path / "cand", lambda t: None)
    edit_config(cand, lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * 1000))
    shutil.rmtree(model)  # the golden's model is gone: only the stored ops are the reference
    result, ops, record = drill(pytester, golden, "layer_1.input_norm", model=cand)
    # the stored ops rerun in float32 reproduce the golden's output up to float32 rounding (the norm's
    # 64-wide sum), whatever this CPU's kernels
    assert record["culprit"] == "add" and record["reference_error"] <= rounding_bound(torch.float32, 1.0, steps=64)
    assert [r["id"].split("::")[1] for r in ops] == [n["name"] for n in stored["graphs"]["float32"]["nodes"]
                                                     if n["func"] != "aten._to_copy.default"]  # fmt: skip
    # a point with no stored ops and no model to capture them from: the ::drill item says what to do
    result = run_parity(pytester, golden, NO_WEIGHTS, "--parity-drill", "layer_1.attention", "-k", "layer_1.attention",
                        model=cand)  # fmt: skip
    result.stdout.fnmatch_lines(["*no ops of the reference are stored with the golden for it*moe-parity drill-ops*"])
    # stored in bfloat16 only, drilled in float16: which to record
    result = run_parity(pytester, golden, NO_WEIGHTS, "--dtype", "float16", "--parity-drill", "layer_1.router",
                        "-k", "layer_1.router", model=cand)  # fmt: skip
    result.stdout.fnmatch_lines(["*the golden holds the reference's ops in bfloat16, not in the candidate's float16*"])


def test_drill_ops_refuses_bad_input(tiny_model, golden_dir, tmp_path, capsys) -> None:
    golden = shutil.copytree(golden_dir("qwen3_moe"), tmp_path / "golden")
    code, _, err = cli(capsys, "drill-ops", golden, "--points", "layer_9.*")
    assert code == 2 and "--points layer_9.* matches no point of this golden" in err
    code, _, err = cli(capsys, "drill-ops", golden, "--points", "layer_1.router", "--model", tmp_path / "nowhere")
    assert code == 2 and "the golden's model is not at" in err
    other = edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "other", scale("mlp.gate.weight", 1, 2.0))
    code, _, err = cli(capsys, "drill-ops", golden, "--points", "layer_1.router", "--model", other)
    assert code == 2 and "layer_1.router: the model at" in err and "does not reproduce the golden" in err
    assert not (golden / "drill" / "layer_1.router.json").exists()  # nothing half-written
    code, _, err = cli(capsys, "drill-ops", golden, "--points", "layer_1.router", "--dtype", "int8")
    assert code == 2 and "int8" in err


def test_a_stored_op_this_torch_lacks_is_one_sentence(pytester, golden_dir, tmp_path, capsys) -> None:
    golden = shutil.copytree(golden_dir("qwen3_moe"), tmp_path / "golden")
    assert cli(capsys, "drill-ops", golden, "--points", "layer_1.input_norm")[0] == 0
    meta = golden / "drill" / "layer_1.input_norm.json"
    stored = json.loads(meta.read_text())
    stored["graphs"]["float32"]["nodes"][1]["func"] = "aten.no_such_op.default"
    meta.write_text(json.dumps(stored))
    result = run_parity(pytester, golden, NO_WEIGHTS, "--dtype", "bfloat16", "--parity-drill", "layer_1.input_norm",
                        "-k", "layer_1.input_norm")  # fmt: skip
    result.stdout.fnmatch_lines(
        ["*layer_1.input_norm: the stored op aten.no_such_op.default is not in this torch's op registry*"]
    )
    assert "Traceback" not in result.stdout.str()


def test_masked_entries_compare_as_masks() -> None:
    """Attention scores with the dtype's lowest at masked positions: the unmasked entries decide."""
    from pytest_moe_parity.judge.distance import rel_l2, unmasked_norm

    ref = torch.tensor([1.0, 2.0, torch.finfo(torch.float32).min, -float("inf")])
    assert rel_l2(ref.clone(), ref) == 0.0
    half = torch.tensor([2.0, 4.0, torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min])
    # the scores doubled: not hidden by the masks' magnitude (two-term norms: float32 rounding)
    assert rel_l2(half, ref) == pytest.approx(1.0, rel=rounding_bound(torch.float32, 1.0, steps=2))
    unmasked = torch.tensor([1.0, 2.0, 0.0, -float("inf")])
    assert rel_l2(unmasked, ref) == float("inf")  # a mask missing where the reference has one
    assert rel_l2(torch.tensor([1.0, -float("inf"), -float("inf"), -float("inf")]), ref) == float("inf")  # one extra
    assert rel_l2(torch.tensor([1.0, 2.0, float("inf"), -float("inf")]), ref) == float("inf")  # a mask's sign
    assert rel_l2(torch.tensor([1.0, float("nan"), -float("inf"), -float("inf")]), ref) == float("inf")
    # ||ref|| over its entries that are not masks, as a reference op's norm is kept: the same figures
    norm = unmasked_norm(ref)
    assert norm == pytest.approx(5**0.5)
    assert rel_l2(half, ref, norm) == rel_l2(half, ref)
    assert rel_l2(half.bfloat16(), ref, norm) == pytest.approx(1.0, rel=rounding_bound(torch.float32, 1.0, steps=2))
    assert rel_l2(unmasked, ref, norm) == float("inf")


def test_matching_tells_masks_apart_before_comparing() -> None:
    """The cheap test before a comparison counts the masks of each sign: other masks cannot be the
    same values; the same masks leave it to the comparison."""
    from pytest_moe_parity.drill.match import _Norms

    low = -float("inf")
    ref = torch.tensor([1.0, 2.0, low, low])
    # values by identity (a graph's outputs, alive while it matches): each case its own
    cases = {
        "other masks alike": ([torch.tensor([1.0, 2.0, low, torch.finfo(torch.float32).min])], True),
        "a mask more": ([torch.tensor([1.0, low, low, low])], False),
        "a mask of the other sign": ([torch.tensor([1.0, 2.0, low, -low])], False),
        "the values doubled": ([torch.tensor([2.0, 4.0, low, low])], False),
        "pieces: their masks added": ([torch.tensor([1.0, 2.0]), torch.tensor([low, low])], True),
    }
    norms = _Norms()
    assert {name: norms.close(parts, ref) for name, (parts, _) in cases.items()} == {
        name: close for name, (_, close) in cases.items()
    }


def test_rows_as_a_set_pair_each_row_with_its_nearest_one_to_one() -> None:
    """Rows no index traces are paired by value: each reference row with the candidate's nearest,
    one to one, all within the matching tolerance; else not paired at all."""
    from pytest_moe_parity.drill.rows import _set_order

    torch.manual_seed(0)
    rows = torch.randn(6, 16)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = torch.empty_like(rows)
    shuffled[order] = rows  # the candidate's row order[j] holds the reference's row j
    found = _set_order(shuffled.bfloat16(), rows)
    assert found is not None and torch.equal(found, order)
    assert torch.equal(shuffled[found], rows)
    assert _set_order(shuffled * 2, rows) is None  # other values: no pairing is within tolerance
    twice = rows.clone()
    twice[1] = twice[0]  # two reference rows alike: both nearest the same candidate row
    assert _set_order(shuffled, twice) is None
