"""What the ranks of the CPU build say about a point at TP > 1: whether they agree, as NxD's
replicated outputs must, whether their sum is the expected output, and the TP 1 differential."""

from __future__ import annotations

from typing import Any

import torch

from ...judge.distance import rel_l2_flat


def merge(info: dict[str, Any], more: dict[str, Any]) -> None:
    """Adds a finding to a point's info: notes appended, the first hint kept."""
    info.setdefault("notes", []).extend(more.get("notes", []))
    if more.get("hint") and not info.get("hint"):
        info["hint"] = more["hint"]
    info.update({k: v for k, v in more.items() if k not in ("notes", "hint")})
    if not info["notes"]:
        del info["notes"]


def ranks_differing(firsts: list[torch.Tensor]) -> list[int]:
    """The ranks whose output is not rank 0's (NxD, and vLLM, replicate a module's output on every rank)."""
    return [r for r in range(1, len(firsts)) if not torch.equal(firsts[r], firsts[0])]


def rank_evidence(
    firsts: list[torch.Tensor], differ: list[int], expected: torch.Tensor, stack: str = "NxD"
) -> dict[str, Any]:
    """Ranks that output other values than rank 0: a note, and the hint of the point if it fails
    (their sum the expected output: a missing all-reduce). `stack`: whose sharding it is."""
    tp = len(firsts)
    summed = rel_l2_flat(sum(f.double() for f in firsts), expected) < 0.1 * rel_l2_flat(firsts[0], expected)
    ranks = ", ".join(map(str, differ))
    return {
        "notes": [f"tensor parallelism: rank(s) {ranks} of {tp} output other values than rank 0"],
        "hint": (
            f"tensor parallelism (tp_degree={tp}): the ranks hold partial sums whose total is the expected output: "
            "a missing all-reduce"
            if summed
            else f"tensor parallelism (tp_degree={tp}): the ranks' outputs differ where {stack} replicates them: a "
            f"missing collective, or ranks computing on other shards than {stack}'s sharding gives them"
        ),
    }


def tp_differential(at_tp: torch.Tensor, single: torch.Tensor, expected: torch.Tensor, tp: int) -> dict[str, Any]:
    """The same point at TP `tp` and at TP 1 against the golden: where TP 1 matches and TP `tp` does
    not, the divergence comes from the parallelism."""
    err_n, err_1 = rel_l2_flat(at_tp, expected), rel_l2_flat(single, expected)
    note = f"TP differential: rel_l2 to the golden {err_n:.3g} at TP {tp}, {err_1:.3g} at TP 1"
    out: dict[str, Any] = {"notes": [note]}
    if err_n > 4 * err_1 + 1e-6:
        out["tp_parted"] = True
        out["notes"].append(f"TP 1 and TP {tp} of the candidate part here")
        out["hint"] = (
            f"tensor parallelism (tp_degree={tp}): TP 1 of the same candidate matches the golden where TP {tp} does "
            "not: a sharding bug (a rank loading another rank's shard, the wrong half of a split) or a missing "
            "collective"
        )
    return out
