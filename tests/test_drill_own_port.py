"""The drill on a second port with its own code (`port_own`): positions, rotary tables and the causal
mask made inside its attention, grouped-query scores without repeated K/V heads, a static KV cache
written with `index_copy_`, a router that takes its softmax over the kept logits, experts dispatched
sorted (one gather of every (token, slot) pair, each expert a slice of it, the results joined and
weighted at once). Clean, it drills clean; each of its bugs is named at an op the bug changes, an op
the table marks introduced, and substituting the ops that introduced the error recovers the
component."""

from __future__ import annotations

import pytest
import torch
from drill_port import OwnPortBackend
from helpers import NO_WEIGHTS, run_parity
from test_drill import drill, run_repro

from pytest_moe_parity import backends

pytestmark = pytest.mark.usefixtures("_import_everything_once")

PREFILL, DECODE = "layer_1.{}", "step_1.layer_1.{}"


@pytest.fixture
def own(monkeypatch: pytest.MonkeyPatch, pytester, golden_dir, tiny_model):
    monkeypatch.setitem(backends.registry(), OwnPortBackend.name, OwnPortBackend)

    def run(point: str, bugs: str = "", *more: str, raw: bool = False):
        golden = golden_dir("qwen3_moe", decode=2) if point.startswith("step_") else golden_dir("qwen3_moe")
        args = ["--hw", OwnPortBackend.name, "--hw-option", f"bugs={bugs}", *more]
        if raw:  # the run alone (a drill that cannot run has no record)
            args = ["--dtype", "bfloat16", NO_WEIGHTS, "--parity-drill", point, "-k", point, *args]
            return run_parity(pytester, golden, *args, model=tiny_model("qwen3_moe"))
        return drill(pytester, golden, point, *args, model=tiny_model("qwen3_moe"))

    return run


@pytest.mark.parametrize(
    ("point", "layout"),
    [
        (PREFILL.format("attention"), ""),
        (PREFILL.format("router"), ""),
        (PREFILL.format("experts"), ""),
        (PREFILL.format("experts"), "dispatch_masked"),  # each expert's rows taken with x[mask]
        (PREFILL.format("experts"), "dispatch_onehot"),  # rows made by a one-hot matmul: no index to trace
        (DECODE.format("attention"), ""),
    ],
)
def test_the_own_port_drills_clean(point, layout, own) -> None:
    """Every op the reference has is matched (by value, by place, rows by which token they hold), and
    none leaves its floor: no culprit, no structural difference, nothing failed."""
    result, ops, record = own(point, layout)
    assert result.ret == 0, result.stdout.str()[-2000:]
    assert record["culprit"] is None and not record["structure"] and record["unmatched"] is None, record
    assert [r["id"] for r in ops if r["status"] == "failed"] == []


ROTATED = ("apply_rotary_pos_emb.add", "apply_rotary_pos_emb.add#2")  # the rotated queries, keys


@pytest.mark.parametrize(
    ("bug", "point", "named"),
    [
        ("rope_theta_hardcoded", PREFILL.format("attention"), ROTATED),
        ("rope_exponent_halved", PREFILL.format("attention"), ROTATED),
        ("rope_interleaved", PREFILL.format("attention"), ROTATED),
        ("kv_head_modulo", PREFILL.format("attention"), ("eager_attention_forward.bmm",)),
        ("scale_by_hidden", PREFILL.format("attention"), ("eager_attention_forward.mul",)),
        ("mask_one_ahead", PREFILL.format("attention"), ("eager_attention_forward.add",)),
        ("k_norm_skipped", PREFILL.format("attention"), ("apply_rotary_pos_emb.add#2",)),
        ("gate_up_swapped", PREFILL.format("experts"), (".gate_up_proj",)),
        ("experts_reversed", PREFILL.format("experts"), (".gate_up_proj",)),
        ("dispatch_masked,gate_up_swapped", PREFILL.format("experts"), (".gate_up_proj",)),
        ("dispatch_onehot,gate_up_swapped", PREFILL.format("experts"), (".gate_up_proj",)),
        ("dispatch_onehot,silu_as_gelu", PREFILL.format("experts"), ("act_fn.silu",)),
        ("silu_as_gelu", PREFILL.format("experts"), ("act_fn.silu",)),
        ("weights_ignored", PREFILL.format("experts"), (".index_add",)),
        ("decode_position_stale", DECODE.format("attention"), ("apply_rotary_pos_emb.add",)),
        ("decode_drops_last_cached", DECODE.format("attention"), ("eager_attention_forward.add",)),  # the mask
        ("decode_cache_overwrites_last", DECODE.format("attention"), ("eager_attention_forward.bmm#2",)),
    ],
)
def test_each_bug_of_the_own_port_is_named_at_an_op_it_changes(bug, point, named, own) -> None:
    result, _, record = own(point, bug)
    rows = {r["name"]: r for r in record["rows"]}
    culprit = record["culprit"]
    assert culprit is not None and culprit.endswith(named), (culprit, record["structure"])
    assert rows[culprit]["verdict"] == "introduced"
    recovered = [x for x in (record["recovery"], record["recovery_introduced"]) if x is not None]
    assert recovered and max(recovered) >= 0.9, record
    if bug == "k_norm_skipped":  # the reference's key norm: no counterpart in the port
        assert any(s.startswith("the reference's k_norm.") for s in record["structure"]), record["structure"]
    if bug == "weights_ignored":  # the reference's weighting: no counterpart in the port
        assert any(".mul#2" in s and "no counterpart" in s for s in record["structure"]), record["structure"]
    said = culprit.replace("[", "[[]")  # fnmatch: a bracket opens a set
    result.stdout.fnmatch_lines([f"drill {point}: * culprit {said}, substituting it recovers *"])


def test_rows_no_index_traces_are_paired_as_a_set_and_said_so(own) -> None:
    """A dispatch whose rows a one-hot matmul makes (no gather: which token a row holds is in no index)
    has each expert's rows paired with the reference's by value, as a set; the rows say so, and the
    traced dispatch's rows do not."""
    _, _, record = own(PREFILL.format("experts"), "dispatch_onehot")
    as_set = {r["name"] for r in record["rows"] if "rows as a set" in (r["how"] or "")}
    assert {f"expert[{e}].gate_up_proj" for e in range(8)} <= as_set, as_set
    _, _, traced = own(PREFILL.format("experts"))
    assert not [r["name"] for r in traced["rows"] if "rows as a set" in (r["how"] or "")]


def test_a_router_that_leaves_its_weights_unnormalised_is_the_renormalisation_missing(own) -> None:
    """The port's softmax over every expert's logit, gathered at the top-k: the reference's
    renormalisation has no counterpart, said as the structural difference it is; no culprit op."""
    result, _, record = own(PREFILL.format("router"), "router_softmax_all")
    assert record["culprit"] is None and result.ret == 1
    (said,) = [s for s in record["structure"] if s.startswith("the reference's renorm")]
    # its top-k takes the logits (matched by what it selects): no place to put the weights, no recovery
    assert "recovers" not in said, said


@pytest.mark.parametrize(
    ("bug", "cand_op"), [("mask_one_ahead", "aten.where.self"), ("gate_up_swapped", "aten.mm.default")]
)
def test_the_repro_of_a_port_s_own_op_fails_alone_on_the_candidate(bug, cand_op, own, tmp_path) -> None:
    """The culprit of a port's own code: its repro runs the port's op (here `where`, which masks where
    the reference adds its mask; an expert's matmul, its rows by identity) on the reference's values of
    its inputs, and fails alone; the reference's op passes."""
    point = PREFILL.format("experts" if bug == "gate_up_swapped" else "attention")
    repro = tmp_path / "repro"
    _, _, record = own(point, bug, "--parity-repro", str(repro))
    out, meta = run_repro(repro)
    assert f"{point}::{record['culprit']}: the candidate's {cand_op} gives rel_l2" in out
    assert meta["candidate"]["op"] == cand_op


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        (lambda module, args: (module, args), "returned a tuple of 2; it returns (module, args, kwargs, same_code)*"),
        (lambda module, args: (module, next(iter(args)), {}, "no"), "returned args is a Tensor, same_code is a str; *"),
        (
            lambda module, args: (torch.jit.script(torch.nn.Identity()), args, {}, False),
            "returned a scripted (torch.jit) module*",
        ),
        (lambda module, args: (torch.compile(module), args, {}, False), "returned a compiled (torch.compile) module*"),
        (lambda module, args: (_Silent(), args, {}, False), "module ran no op the drill can capture*"),
    ],
    ids=["short", "wrong-types", "scripted", "compiled", "no-ops"],
)
@pytest.mark.usefixtures("_import_inductor_once")  # torch.compile in the inner session: imported once
def test_a_drill_call_that_breaks_its_contract_is_one_sentence(returned, said, own, monkeypatch) -> None:
    """What `drill_call` returns is checked against its contract: the `::drill` item fails with one
    sentence that says what came back and what the contract is, never a traceback or a culprit."""
    call = OwnPortBackend.drill_call
    monkeypatch.setattr(OwnPortBackend, "drill_call", lambda self, p, g: returned(*call(self, p, g)[:2]))
    result = own(PREFILL.format("router"), "", raw=True)
    result.stdout.fnmatch_lines([f"*layer_1.router: ownport's drill_call {said}"])
    assert "Traceback" not in result.stdout.str() and "INTERNALERROR" not in result.stdout.str()
    outcomes = result.parseoutcomes()  # the point passes; each item of its drill fails with the sentence
    assert outcomes["passed"] == 1 and outcomes["failed"] >= 1 and result.ret == 1, outcomes


class _Silent(torch.nn.Module):
    """A module whose forward computes nothing the dispatcher sees (a compiled graph's stand-in)."""

    def forward(self, x):
        return x
