"""`--parity-routing ids|ids+weights`: which level of a MoE block's routing carries its error. After
each MoE block, an item `layer_N.moe::routing` replays the block on the golden's inputs at each level:

- `own`: its own router, as in a real run; every token judged but the near ties (a flip within the
  dtype's rounding of the golden's scores is forgiven, as the router point forgives it);
- `ids`: the golden's expert ids (in the golden's slot order), with the candidate's own weights for
  them: where it chose the same experts, the weights it gave them; where not, its own scores at the
  golden's experts by the reference's rule (`routing.weights_for`);
- `ids+weights`: the golden's ids and weights, the router's whole output.

The item fails where its own routing leaves the block's limits and a forced level brings it back
within them: the routing alone changes the block, and the first level that recovers it names what is
wrong (`ids`: the experts it selects; `ids+weights`: the weights it gives them). Where no level
recovers the block, the routing is not the cause (the experts or the shared experts are, and the
block's own item says so): the item passes and says it. Where its own routing keeps the block within
its limits, real flips included, they carry little weight: accumulation, not a bug."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import BackendFailure, PointUnavailable, SetupError
from ..golden import GoldenStore
from ..judge.result import PointResult
from ..judge.routing import (
    RoutingMetrics,
    SelectionRule,
    candidate_routing,
    router_triple,
    routing_view,
    scatter_topk,
    scattered_routing,
    topk_agreement,
    weights_for,
)
from ..points import Point
from ..report.rows import RoutingRow, Row, unjudged_row
from ..report.text import fmt
from .checks import Checker, CheckerSetup, Option, RunAgain, result_figures
from .runner import ParityRunner

KIND = "routing"
LEVELS = ("ids", "ids+weights")  # the levels --parity-routing names, each forcing more of the routing
BLOCK = "moe"  # the points whose routing is forced: the MoE blocks

WHAT = {  # what a level that recovers the block says is wrong
    "ids": "the experts it selects: with the golden's expert ids (and its own weights for them) the block matches",
    "ids+weights": (
        "the weights it gives the experts: with the golden's expert ids alone the block still differs, with the "
        "golden's ids and weights it matches"
    ),
}
HINTS = {
    "ids": (
        "the router selects other experts than the reference: its selection scores (a score-correction bias, the "
        "expert groups, the top-k rule); see {router}"
    ),
    "ids+weights": (
        "the router weighs the experts otherwise: the normalisation of the top-k weights, a scaling factor, the "
        "weights' pairing with the expert ids (slot order); see {router}"
    ),
}


@dataclass(frozen=True)
class RoutingEntry(RunAgain):
    """The routing item of a MoE block (`layer_N.moe::routing`): right after it (after its drill items)."""

    kind = KIND


def forced(level: str, rule: SelectionRule, golden: tuple, scale: float) -> Any:
    """The replacement of the candidate router's output at `level` (a function of that output): the
    golden's ids, each with the candidate's own weight (`ids`), or the golden's ids and weights
    (`ids+weights`); cast to the candidate's dtypes and device, in its output's shapes."""
    _, g_weights, g_ids = golden[:3]

    def force(out: Any) -> Any:
        view = routing_view(out)
        if not router_triple(view):
            raise ValueError(f"the candidate's router returned {type(out).__name__}, not (logits, weights, ids)")
        logits, weights, ids = view[:3]
        if level == "ids+weights":
            new_weights = g_weights
        else:
            new_weights = own_weights(rule, (logits, weights, ids), g_ids, g_weights, scale)
        shape_w = weights.shape if weights.shape[-1] == ids.shape[-1] else ids.shape
        new_w = new_weights.reshape(shape_w).to(dtype=weights.dtype, device=weights.device)
        new_ids = g_ids.reshape(ids.shape).to(dtype=ids.dtype, device=ids.device)
        return scattered_routing((logits, new_w, new_ids, *view[3:]), out)

    return force


def own_weights(rule: SelectionRule, own: tuple, g_ids: torch.Tensor, g_weights: torch.Tensor, scale: float):
    """The candidate's weights [T, k] for the golden's experts: where its own top-k is the golden's
    set, the weight it gave each (by expert id); elsewhere its own scores at the golden's experts, by
    the reference's rule."""
    logits, weights, ids = (t.detach().to("cpu") for t in own[:3])
    experts = logits.shape[-1]
    golden_ids = g_ids.reshape(-1, g_ids.shape[-1]).long()
    k = golden_ids.shape[-1]
    flat_ids = ids.reshape(-1, ids.shape[-1]).long()
    if weights.shape[-1] == experts and flat_ids.shape[-1] < experts:  # every expert's affinity [T, E]
        dense = weights.reshape(-1, experts).to(torch.float64)
    else:
        dense = scatter_topk(flat_ids, weights.reshape(flat_ids.shape).to(torch.float64), experts)
    same = torch.zeros(golden_ids.shape[0], experts, dtype=torch.bool).scatter_(1, golden_ids, True)
    chose = torch.zeros_like(same).scatter_(1, flat_ids, True)
    agree = (same == chose).all(dim=-1, keepdim=True)
    mine = dense.gather(1, golden_ids)
    rule_weights = weights_for(rule, logits, golden_ids, g_weights, scale)
    return torch.where(agree.expand(-1, k), mine, rule_weights)


def ties_only(candidate: tuple, golden: tuple, routing: RoutingMetrics) -> tuple:
    """The candidate's routing as the block's verdict should see it to forgive near ties only: the
    real flips' tokens given the golden's ids (so only the ties are left out of the verdict; the real
    flips' tokens are judged on the candidate's output, which followed its own routing)."""
    ids = candidate[2].detach().to("cpu").clone()
    flat, g_ids = ids.reshape(-1, ids.shape[-1]), golden[2].reshape(-1, golden[2].shape[-1])
    for flip in routing.flips:
        flat[flip.token] = g_ids[flip.token].to(flat.dtype)
    return (candidate[0], candidate[1], flat.reshape(ids.shape), *candidate[3:])


class RoutingItems(Checker):
    """The routing items of a run (`--parity-routing LEVEL`: the levels up to LEVEL)."""

    kind = KIND
    family = "differential"
    marker = "moe-parity items of a MoE block's forced routing (--parity-routing)"
    options = (
        Option("--parity-routing", "parity_routing", {"choices": ("ids", "ids+weights")},
               "after each MoE block, an item (POINT::routing) that replays it with the golden's expert ids (ids), "
               "then also its weights (ids+weights): it fails where the routing alone changes the block and names the "
               "level that recovers it (--hw cpu or cuda)"),
    )  # fmt: skip

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: str | None) -> RoutingItems | None:
        return routing_items(setup.golden, setup.runner, value, setup.hw, cls.flag(setup))

    def __init__(self, golden: GoldenStore, runner: ParityRunner, level: str):
        self.golden, self.runner = golden, runner
        self.levels = LEVELS[: LEVELS.index(level) + 1]

    def after(self, point: Point, selected: bool) -> Iterator[RoutingEntry]:
        if selected and point.component == BLOCK and self.golden.router_of(point) is not None:
            yield RoutingEntry(point, self.place(point))

    def unjudged_row(self, entry: RoutingEntry, status: str, message: str) -> Row:
        return unjudged_row(self._row(entry, "passed", []), status, message)

    def _row(self, entry: RoutingEntry, status: str, results: list[tuple[str, PointResult]], **more: Any) -> RoutingRow:
        point = entry.point
        levels, metrics = [], {}
        for level, result in results:
            if result.main is not None:
                metrics[level] = result.main
            levels.append({"level": level, **result_figures(result), "tokens_left_out": len(result.excluded_tokens)})
        return RoutingRow(
            id=entry.id, order=entry.order, layer=point.layer, step=point.step, component=point.component,
            status=status, levels=levels, metrics=metrics, **more,
        )  # fmt: skip

    def check(self, entry: RoutingEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        point, runner = entry.point, self.runner
        router = self.golden.router_of(point)
        assert router is not None
        record = self.golden.load(point, row_masks=runner.backend.row_masks)
        router_record = runner.router_record(router)
        golden = routing_view(router_record.output)
        if not router_triple(golden):
            raise PointUnavailable(f"{router.id}: the golden's router gives no top-k (logits, weights, ids) to force")
        bias = router_record.extras.get("score_bias")
        tol, _ = runner.tolerance(point)
        rule = SelectionRule.of(router, runner.dtype, tol.tie_factor, self.golden.config)
        own = runner.call(point, record)
        mine = candidate_routing(rule, own.routing, golden, bias) if own.routing is not None else None
        if mine is None or mine[1] is None:
            raise BackendFailure(entry.id, ValueError("the backend shows no (logits, weights, ids) of its router"))
        agreement = topk_agreement(rule, golden, mine, bias)
        forgiving = replace(own, routing=ties_only(mine, golden, agreement))
        results = [("own", runner.judge_output(point, record, forgiving, "isolated", None))]
        scale = float(self.golden.config.get("routed_scaling_factor") or 1.0)
        for level in self.levels:
            out = runner.call(point, record, forced(level, rule, golden, scale))
            results.append((level, runner.judge_output(point, record, out, "isolated", None)))
        return self._verdict(entry, router, results, agreement)

    def _verdict(
        self, entry: RoutingEntry, router: Point, results: list[tuple[str, PointResult]], agreement: RoutingMetrics
    ) -> tuple[Row, str | None]:
        own = results[0][1]
        recovered = next((level for level, r in results[1:] if r.passed), None) if not own.passed else None
        said = _routing_words(agreement)
        if own.passed:
            notes = [f"its own routing keeps the block within its limits ({said})"]
            if agreement.flips:
                notes.append("the real flips carry too little weight to move the block: accumulation, not a bug")
        elif recovered is None and "ids+weights" in self.levels:
            notes = [
                "not the routing: with the golden's expert ids and weights the block still diverges; the experts or "
                f"the shared experts are wrong (see {entry.point.id})"
            ]
        elif recovered is None:
            notes = [
                "not the expert selection: with the golden's expert ids the block still diverges; the weights were "
                "not forced (--parity-routing ids+weights forces them too)"
            ]
        else:
            notes = [f"the routing alone changes the block: {WHAT[recovered]}", said]
        status = "failed" if recovered is not None else "passed"
        hint = HINTS[recovered].format(router=router.id) if recovered is not None else ""
        row = self._row(entry, status, results, recovered=recovered, routing=agreement, notes=notes, hint=hint)
        if recovered is None:
            return row, None
        return row, "\n".join([f"{entry.id}: {notes[0]}", *_level_table(row), f"  {said}", f"  hint: {hint}"])


def _routing_words(agreement: RoutingMetrics) -> str:
    """Its own routing against the golden's, in words."""
    n = agreement.num_tokens
    words = [f"{len(agreement.flips)} of {n} token(s) routed to other experts"]
    if agreement.flips and agreement.flipped_weight is not None:
        words[0] += (
            f", carrying {agreement.flipped_weight:.1%} of the golden's routing weight "
            f"(at most {agreement.max_flipped_weight or 0.0:.1%} of one token's)"
        )
    if agreement.ties:
        words.append(f"{len(agreement.ties)} near tie(s) forgiven")
    return "; ".join(words)


def _level_table(row: RoutingRow) -> list[str]:
    """Each level's figures, a line each, its verdict last (FAIL marked as the point tables are)."""
    lines = [f"  {'level':<12} {'rel_l2':>10} {'cosine':>10} {'worst token':>12}  verdict"]
    for level in row.levels:
        verdict = "FAIL" if level["status"] == "failed" else "pass"
        lines.append(
            f"  {level['level']:<12} {fmt(level['rel_l2']):>10} {fmt(level['cosine'], 6):>10} "
            f"{fmt(level['max_token_rel_l2']):>12}  {verdict}"
        )
    return lines


def routing_items(
    golden: GoldenStore, runner: ParityRunner, level: str | None, hw: str, flag: str
) -> RoutingItems | None:
    """The run's routing items (`--parity-routing LEVEL`), or None where not asked; SetupError where the
    golden or the backend cannot have them."""
    if level is None:
        return None
    if level not in LEVELS:
        raise SetupError(f"{flag} {level!r}: expected one of {', '.join(LEVELS)}")
    if not runner.backend.forces_routing:
        raise SetupError(
            f"{flag} {level}: the {hw} backend cannot replace a router's output inside its block; force the routing "
            "with --hw cpu, cuda or nxdi (build=cpu), or judge an engine's own routing with `moe-parity routes GOLDEN "
            "TRACE`"
        )
    if golden.captured_tokens is not None:
        raise SetupError(
            f"{flag} {level}: this golden keeps some tokens' outputs only (--capture-tokens); forcing the routing "
            "needs every token's: record the golden without --capture-tokens"
        )
    if not any(p.component == BLOCK and golden.router_of(p) is not None for p in golden.points):
        raise SetupError(f"{flag} {level}: the golden has no MoE block with a router (no {BLOCK} point follows one)")
    return RoutingItems(golden, runner, level)
