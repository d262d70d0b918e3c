"""The drill on a second port with its own code (`port_own`): positions, rotary tables and the causal
mask made inside its attention, grouped-query scores without repeated K/V heads, a static KV cache
written with `index_copy_`, a router that takes its softmax over the kept logits, experts dispatched
sorted (one gather of every (token, slot) pair, each expert a slice of it, the results joined and
weighted at once). Clean, it drills clean; each of its bugs is named at an op the bug changes, an op
the table marks introduced, and substituting the ops that introduced the error recovers the
component."""

from __future__ import annotations

import json
import types
from pathlib import Path

import port_own
import pytest
import torch
from drill_port import OwnPortBackend
from helpers import NO_WEIGHTS, run_parity
from test_drill import drill, run_repro

from pytest_moe_parity import backends
from pytest_moe_parity.drill.capture import capture_ops
from pytest_moe_parity.drill.verdicts import _accumulation
from pytest_moe_parity.golden.store import GoldenStore
from pytest_moe_parity.report.drill import OpRow

pytestmark = pytest.mark.usefixtures("_import_everything_once")

PREFILL, DECODE = "layer_1.{}", "step_1.layer_1.{}"


@pytest.fixture
def own(monkeypatch: pytest.MonkeyPatch, pytester, golden_dir, tiny_model):
    monkeypatch.setitem(backends.registry(), OwnPortBackend.name, OwnPortBackend)

    def run(point: str, bugs: str = "", *more: str, raw: bool = False, golden: Path | None = None):
        if golden is None:
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
    assert record["made"] is None, record["made"]  # its positions and mask are the golden's
    assert [r["id"] for r in ops if r["status"] == "failed"] == []


ROTATED = ("apply_rotary_pos_emb.add", "apply_rotary_pos_emb.add#2")  # the rotated queries, keys


MADE = {
    "mask_one_ahead": "the candidate's attention mask (le), made inside the call, lets query 0 see key 1; the "
    "golden's attention_mask does not",
    "decode_position_stale": "the candidate's positions (arange), made inside the call, start at 15; the golden's "
    "position_ids at 16",
}


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
    recovered = [record[k] for k in ("recovery", "recovery_introduced", "group_recovery") if record[k] is not None]
    assert recovered and max(recovered) >= 0.9, record
    if bug == "k_norm_skipped":  # the reference's key norm: no counterpart in the port
        assert any(s.startswith("the reference's k_norm.") for s in record["structure"]), record["structure"]
    if bug in MADE:  # a value made inside the call that differs from the golden's of its meaning
        assert record["made"].startswith(MADE[bug]), record["made"]
        assert record["made"].endswith("(giving the golden's in its place recovers 100% of the error)")
    if bug == "weights_ignored":  # the reference's weighting: no counterpart in the port
        assert any(".mul#2" in s and "no counterpart" in s for s in record["structure"]), record["structure"]
    said = culprit.replace("[", "[[]")  # fnmatch: a bracket opens a set
    result.stdout.fnmatch_lines([f"drill {point}: * culprit {said}, substituting it recovers *"])


ALL = "in all 8 experts"  # the test input routes tokens to every expert of layer 1


@pytest.mark.parametrize(
    ("bug", "group"),
    [
        ("gate_up_swapped", f"gate_up_proj {ALL}"),
        ("dispatch_masked,gate_up_swapped", f"gate_up_proj {ALL}"),
        ("dispatch_onehot,gate_up_swapped", f"gate_up_proj {ALL}"),
        # w13 and w2 both reversed: gate_up_proj's group alone recovers nothing, down_proj still wrong
        ("experts_reversed", f"gate_up_proj, down_proj {ALL}"),
        # one expert: its own ops (its down_proj zero too: its gate_up_proj alone recovers nothing)
        ("expert_zeroed", f"gate_up_proj, down_proj in expert {port_own.ZEROED_EXPERT}"),
        # each expert's own combine: the zeroed expert's adds nothing, and is still its own op
        ("dispatch_masked,expert_zeroed", f"gate_up_proj, down_proj in expert {port_own.ZEROED_EXPERT}"),
    ],
)
def test_a_bug_in_many_experts_is_one_culprit_the_group(bug, group, own) -> None:
    """The same op introducing error in many experts (a conversion that swaps gate and up, or
    reverses the experts) is one culprit, the group: substituting the first expert's op alone
    recovers an eighth, the group's substitution all of it. A bug in one expert is that expert's ops,
    by its index."""
    point = PREFILL.format("experts")
    result, _, record = own(point, bug)
    rows = {r["name"]: r for r in record["rows"]}
    assert record["culprit_group"] == group, record
    assert record["group_ops"][0] == record["culprit"] and rows[record["culprit"]]["verdict"] == "introduced"
    assert all(rows[n]["verdict"] == "introduced" for n in record["group_ops"])
    expert = f"expert[{port_own.ZEROED_EXPERT}]." if "expert_zeroed" in bug else "expert[0]."
    assert record["culprit"] == f"{expert}gate_up_proj"
    if bug == "dispatch_masked,expert_zeroed":  # its ops matched (values differ), none without a counterpart
        assert not [n for n, r in rows.items() if n.startswith(expert) and r["verdict"] == "missing"], rows
        assert not [s for s in record["structure"] if "no counterpart" in s], record["structure"]
    assert record["group_recovery"] >= 0.9, record
    if "gate_up_swapped" in bug:  # each expert's op alone: its share
        assert record["recovery"] < 0.5, record
    result.stdout.fnmatch_lines([f"drill {point}: * culprit {group}, substituting them recovers *"])
    result.stdout.fnmatch_lines([f"  substituting the reference's outputs of {group} (* ops) recovers *"])


def test_a_capacity_dispatch_says_which_tokens_each_expert_dropped(own, golden_dir) -> None:
    """A dispatch that keeps at most its capacity of each expert's tokens: the experts that ran on
    fewer tokens than the reference's, and which tokens they dropped (as the port's own dispatch
    drops them), are the culprit; no recovery is claimed (the rows are others), and the expert's
    ops with no counterpart inherit it instead of standing as structural differences."""
    point = PREFILL.format("experts")
    ids = GoldenStore(golden_dir("qwen3_moe")).load(point).args[1]
    flat, k = ids.reshape(-1), ids.shape[1]
    kept, _ = port_own.capacity_dispatch(flat, int(flat.max()) + 1)
    dropped = sorted(set(range(flat.numel())) - set(kept.tolist()))
    by_expert: dict[int, list[int]] = {}
    for pair in dropped:
        by_expert.setdefault(int(flat[pair]), []).append(pair // k)
    assert by_expert, "the test input must overflow an expert's capacity"
    expected = []
    for expert, tokens in sorted(by_expert.items()):
        total = int((flat == expert).sum())
        listed = ", ".join(map(str, sorted(tokens)))
        said = f"tokens {listed} were" if len(tokens) > 1 else f"token {listed} was"
        expected.append(f"expert {expert} ran on {total - len(tokens)} of its {total} tokens: {said} dropped")
    result, _, record = own(point, "capacity_truncated")
    assert record["row_sets"] == expected, (record["row_sets"], expected)
    experts = ", ".join(map(str, sorted(by_expert)))
    assert record["culprit_group"] == f"the dispatch of expert{'s' * (len(by_expert) > 1)} {experts}"
    assert record["recovery"] is None and record["group_recovery"] is None
    culprit = next(r for r in record["rows"] if r["name"] == record["culprit"])
    assert culprit["verdict"] == "introduced" and culprit["note"] == expected[0]
    for expert in by_expert:  # its ops run on other rows: inherited, not "no counterpart"
        assert not [s for s in record["structure"] if f"expert[{expert}].gate_up_proj" in s], record["structure"]
    more = "; ..." if len(expected) > 1 else ""
    line = f"drill {point}: * culprit {record['culprit_group']} ({expected[0]}{more})".replace("[", "[[]")
    first = min(by_expert)  # the culprit's op is the gather of the first of them
    head = f"  culprit: {record['culprit_group']} introduced the divergence (the first: *, expert {first}'s gather)"
    result.stdout.fnmatch_lines([head, *(f"  rows differ: {e}" for e in expected), line])


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
    # the op's own computation, no constant: a kernel's (or the port's op's) to report
    assert meta["constants"] == [] and record["repro_cause"] is None
    assert "Attach it to a compiler or kernel bug report." in next(repro.glob("test_*.py")).read_text()


def test_the_repro_of_a_constant_says_it_is_a_constant(own, golden_dir, tmp_path) -> None:
    """`scale_by_hidden`: the port scales its scores by hidden_size ** -0.5 where the reference scales
    by head_dim ** -0.5. The culprit `mul` computes right on what it is given: the repro says it is a
    constant that differs, with both values, and no kernel bug, in its message and the drill's line."""
    config = json.loads((golden_dir("qwen3_moe") / "manifest.json").read_text())["model"]["config"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    point = PREFILL.format("attention")
    repro = tmp_path / "repro"
    result, _, record = own(point, "scale_by_hidden", "--parity-repro", str(repro))
    out, meta = run_repro(repro)
    (constant,) = meta["constants"]
    assert constant["reference"] == pytest.approx(head_dim**-0.5)
    assert constant["candidate"] == pytest.approx(config["hidden_size"] ** -0.5)
    cause = (f"a constant that differs, not a kernel bug: {constant['where']} is {constant['candidate']!r} in the "
             f"candidate, {constant['reference']!r} in the reference")  # fmt: skip
    assert f"the candidate's aten.mul.Tensor ({cause}) gives rel_l2" in out and record["repro_cause"] == cause
    result.stdout.fnmatch_lines([f"  repro: {repro}/test_*.py ({cause})"])


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
        (lambda module, args: (_Silent(), args, {}, False), "module ran no aten op: nothing it returns was computed*"),
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


# -- values made inside the call: the model wrapper's positions (the `rotary` point) ------------------


@pytest.fixture
def long_golden(golden_dir) -> Path:
    """64 positions, with the reference's own bfloat16 error: a table rounded to bfloat16 fails the
    rotary point by itself there (its angles' error grows with the position)."""
    return golden_dir("qwen3_moe", seq_len=64, noise="bfloat16")


def test_a_wrapper_that_makes_its_positions_drills_clean(own, long_golden) -> None:
    """The port's `Positions` makes the position ids itself and drives its rotary with them: every op it
    runs is made inside the call (nothing it was given reaches its outputs). They are rows, matched to
    the reference's (which is given the golden's position ids), and all within their floor."""
    result, ops, record = own("rotary", "", golden=long_golden)
    assert result.ret == 0, result.stdout.str()[-2000:]
    assert record["culprit"] is None and record["made"] is None and record["accumulation"] is None, record
    assert {"_to_copy", "cos", "sin"} <= {r["name"] for r in record["rows"] if r["how"]}, record["rows"]
    assert [r["id"] for r in ops if r["status"] == "failed"] == []


POSITIONS_SAID = "the candidate's positions (arange), made inside the call, start at 1; the golden's position_ids at 0"


def test_positions_made_in_the_wrapper_that_start_at_1_are_named(own, long_golden, golden_dir) -> None:
    """Positions made inside the call that start at 1: the drill names the made value against the
    golden's position ids, with what the golden's in its place recovers, and drills at the op they
    change (the cast of the positions to float, the reference's `_to_copy`). Never said to be a
    compiled or scripted module: it ran eager ops, on values it made."""
    result, _, record = own("rotary", "wrapper_positions_from_one", golden=long_golden)
    assert record["culprit"] == "_to_copy" and record["recovery"] >= 0.9, record
    assert record["made"].startswith(POSITIONS_SAID), record["made"]
    result.stdout.fnmatch_lines(
        [f"  made inside the call: {POSITIONS_SAID} (giving the golden's in its place recovers 100% of the error)"]
    )
    result.stdout.fnmatch_lines(["drill rotary: * culprit _to_copy, substituting it recovers *"])
    # 16 positions: [1, 16] is too far from [0, 15] to be paired by value; the made value is named still
    result, _, record = own("rotary", "wrapper_positions_from_one", golden=golden_dir("qwen3_moe"))
    assert record["made"].startswith(POSITIONS_SAID), record
    result.stdout.fnmatch_lines(["drill rotary: * no culprit (*a value made inside the call differs*"])
    for said in (result.stdout.str(), *(v for v in record.values() if isinstance(v, str))):
        assert "compiled" not in said and "scripted" not in said


def test_a_table_rounded_to_bf16_that_fails_the_point_alone_is_said(own, long_golden) -> None:
    """The inverse-frequency table rounded to bfloat16 inside the call: the point fails its noise floor
    and no op leaves its own (a rounding of bfloat16 is within one). The drill says how many ops it
    compared, the largest ratios, and the table made in another dtype than the reference's buffer,
    whose values in its place recover the point; never "over 0 ops"."""
    result, _, record = own("rotary", "inv_freq_bf16", golden=long_golden)
    result.stdout.fnmatch_lines(["FAILED *parity::rotary - *"])  # the point fails its noise floor
    said = record["accumulation"]
    assert record["culprit"] is None and said is not None, record
    assert " over 0 ops" not in result.stdout.str() and " ops compared" in said and "largest ratios" in said, said
    table = "rotary._to_copy in bfloat16 (the reference's inv_freq: float32)"
    assert said.endswith(f"ran in another dtype than the reference's: {table}"), said
    made = record["made"]
    table = "the candidate's table rotary._to_copy, made inside the call in bfloat16, is the reference's inv_freq"
    assert made.startswith(f"{table} (float32) within "), made
    assert made.endswith("(giving the reference's in its place recovers 100% of the error)"), made
    result.stdout.fnmatch_lines([f"  made inside the call: {made}", f"  {said}"])


def test_ops_on_values_made_inside_the_call_are_captured() -> None:
    """A module whose outputs come from values it makes alone: its ops are captured as rows (made),
    not left as constants with nothing to judge; ops that mix made values with its inputs stay the
    first judged, the made ones before them followed."""

    class Made(torch.nn.Module):
        def forward(self, x):
            angles = torch.arange(x.shape[1]).float()[:, None] * torch.ones(4)
            return angles.cos(), x * torch.arange(x.shape[1]).float()[:, None].sin()

    graph, _ = capture_ops(Made(), [torch.ones(1, 3, 4)], {})
    judged = {n.kind for n in graph.compute()}
    assert {"cos", "mul"} <= judged and "sin" not in judged, judged  # the sin meets the input: followed
    assert all(n.made for n in graph.compute() if n.kind == "cos")


def test_a_failing_point_with_no_op_above_its_own_error_says_what_it_compared() -> None:
    """No op out of its floor and none above the reference's own error: the sentence says how many ops
    were compared and the largest ratios (below 1), never "accumulates over 0 ops"."""
    rows = [
        OpRow("cos", "cos", [4], "value", error=1e-3, noise=2e-3, ratio=0.5),
        OpRow("sin", "sin", [4], "value", error=3e-3, noise=4e-3, ratio=0.75),
        OpRow("extra", "mul", [4], None, verdict="extra"),
    ]
    said = _accumulation(types.SimpleNamespace(other_dtypes=lambda: []), rows)
    assert said == (
        "no single op leaves its dtype's floor, and none of the 2 ops compared is above the reference's own "
        "error: the largest ratios are sin 0.75x, cos 0.50x of their floor"
    ), said
    assert "over 0" not in _accumulation(types.SimpleNamespace(other_dtypes=lambda: []), rows[2:])


def test_the_rows_sentence_says_dropped_duplicated_and_misrouted_tokens() -> None:
    """An expert's tokens as the candidate ran them against the reference's: which were dropped, taken
    twice, or not the expert's own; and an op's name with its expert taken out (how groups are made)."""
    from pytest_moe_parity.drill.groups import rows_sentence, split

    assert rows_sentence("expert 0", "token", [3, 12, 5, 31, 7], [3, 5, 7]) == (
        "expert 0 ran on 3 of its 5 tokens: tokens 12, 31 were dropped"
    )
    assert rows_sentence("expert 2", "token", [1, 4, 9], [1, 4, 4, 9, 6]) == (
        "expert 2 ran on 3 of its 3 tokens: token 4 was taken more than once (duplicated); token 6 was not "
        "routed to expert 2 (misrouted to it)"
    )
    assert split("mlp.experts.expert[5].down_proj#2") == ("mlp.experts.down_proj#2", 5)
    assert split("act_fn.silu#4") is None
