"""The drill on decode attention over a static cache (`port_own`'s whole-cache layouts, NxDI's):
the new keys and values written into a cache sized to a bucket (`index_copy_`, or `scatter_` with an
index tensor; left padded, the live slots ending a context bucket), the scores over every slot of
it, the slots not live masked by the cache's positions. The reference joins the past and the new
keys (`torch.cat` in `DynamicCache.update`) and scores over the live length: the write is matched to
the join on its live slots, and the scores, the masked scores and the probabilities on theirs. Clean,
each layout drills clean; each decode bug is named at the op it changes (the write, the mask, the
rotation), substituting it (or, where the keys' write and the values' both introduced the error,
the cache write as one) recovers the component, and what the drill says of the culprit is true of the port."""

from __future__ import annotations

import re

import pytest
from drill_port import OwnPortBackend
from test_drill import run_repro
from test_drill_own_port import DECODE, own  # noqa: F401 (the fixture)

from pytest_moe_parity.drill.cache import CACHE_WRITE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

POINT = DECODE.format("attention")
LAYOUTS = [
    "static_whole",
    "static_scatter",
    "static_index_put",
    "static_left_padded",
    "static_scatter,static_left_padded",
]
WRITE, MASK, ROTATED = "update.cat", "eager_attention_forward.add", "apply_rotary_pos_emb.add"


def _geometry(record: dict, bugs: str) -> tuple[int, int, int]:
    """(the past's length, the cache's first live slot, its size) as the backend lays them out."""
    joined = next(r for r in record["rows"] if r["name"] == WRITE)["shape"]
    past = joined[2] - 1  # one new token
    start, size = OwnPortBackend.slots(past, 1, frozenset(bugs.split(",")))
    return past, start, size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_static_cache_drills_clean(layout, own) -> None:  # noqa: F811 (the fixture)
    """The keys' and values' writes are the reference's joins (on their live slots), every op is
    matched, none leaves its floor: no culprit, no structural difference, nothing failed."""
    result, ops, record = own(POINT, layout)
    assert result.ret == 0, result.stdout.str()[-2000:]
    assert record["culprit"] is None and not record["structure"] and record["unmatched"] is None, record
    assert [r["id"] for r in ops if r["status"] == "failed"] == []
    how = {r["name"]: r["how"] for r in record["rows"]}
    assert how[WRITE] == how[f"{WRITE}#2"] == CACHE_WRITE, how
    # the scores, the mask and the probabilities: matched on their live slots, not forgiven unmatched
    for name in ("eager_attention_forward.bmm", "eager_attention_forward.mul", MASK, "eager_attention_forward.softmax"):
        assert how[name] is not None, (name, how)


@pytest.mark.parametrize(
    ("bugs", "named"),
    [
        ("decode_write_one_early", WRITE),
        ("static_left_padded,decode_write_one_early", WRITE),
        ("static_whole,decode_cache_overwrites_last", WRITE),
        ("decode_k_before_rope", WRITE),
        ("static_scatter,decode_k_before_rope", WRITE),
        ("decode_past_not_joined", WRITE),
        ("static_index_put,decode_write_one_early", WRITE),
        ("decode_mask_hides_last", MASK),
        ("static_left_padded,decode_mask_hides_last", MASK),
        ("static_whole,decode_drops_last_cached", MASK),
        ("static_whole,decode_position_stale", ROTATED),
    ],
)
def test_each_decode_bug_over_a_static_cache_is_named_at_the_op_it_changes(bugs, named, own) -> None:  # noqa: F811
    result, _, record = own(POINT, bugs)
    rows = {r["name"]: r for r in record["rows"]}
    culprit = record["culprit"]
    assert culprit == named and rows[culprit]["verdict"] == "introduced", (culprit, record["structure"])
    recovered = [x for x in (record["recovery"], record["recovery_introduced"]) if x is not None]
    assert recovered and max(recovered) >= 0.9, record
    group = record["culprit_group"]
    if group:  # the keys' and the values' writes both introduced it: each alone leaves the other's error
        assert named == WRITE and group == "the cache write (keys and values)", group
        assert record["group_ops"] == [WRITE, f"{WRITE}#2"] and record["group_recovery"] >= 0.9, record
        result.stdout.fnmatch_lines([f"drill {POINT}: * culprit {group}, substituting them recovers *"])
    else:
        result.stdout.fnmatch_lines([f"drill {POINT}: * culprit {named}, substituting it recovers *"])
    past, start, size = _geometry(record, bugs)
    said = " ".join(record["evidence"])
    if named == WRITE:  # the slot it writes, where the reference's positions are, which differ
        early = "one_early" in bugs or "overwrites_last" in bugs
        aten = (
            "scatter_.src"
            if "scatter" in bugs
            else "index_put_.default"
            if "index_put" in bugs
            else "index_copy_.default"
        )
        assert f"({aten}, {size} slots)" in said, said
        assert f"writes slot {start + past - early};" in said, said
        assert f"positions 0-{past} ({WRITE}) are its slots {start}-{start + past} " in said, said
        wrong = {"early": f"positions {past - 1}-{past} differ", "rope": f"position {past} differs"}
        key = "early" if early else "rope" if "rope" in bugs else None
        if key:
            assert wrong[key] in said, said
        if "not_joined" in bugs:  # the past is nowhere in the buffer it writes
            assert "the cache held no past of the reference's before the write" in said, said
            assert re.search(rf"positions 0-{past - 1} differ", said), said
    if named == MASK:  # the live slot it masks
        hidden = past if "hides_last" in bugs else past - 1
        assert f"masks the reference's position {hidden} (the cache's slot {start + hidden})" in said, said


@pytest.mark.parametrize(("bugs", "cand_op"), [("decode_k_before_rope", "aten.index_copy_.default"),
                                               ("decode_mask_hides_last", "aten.where.self")])  # fmt: skip
def test_the_repro_of_a_static_cache_s_culprit_fails_alone(bugs, cand_op, own, tmp_path) -> None:  # noqa: F811
    """The culprit over a static cache (the write, the mask) as a repro: the port's op on the
    reference's values of its inputs, those in the cache's live slots (the rest the port's own), fails
    alone; the reference's op passes."""
    repro = tmp_path / "repro"
    _, _, record = own(POINT, bugs, "--parity-repro", str(repro))
    out, meta = run_repro(repro)
    assert f"{POINT}::{record['culprit']}: the candidate's {cand_op} gives rel_l2" in out
    assert meta["candidate"]["op"] == cand_op
