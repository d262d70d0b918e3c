"""Compare one point's candidate output with its golden record and decide pass or fail, with
the numbers and the one-line hint that make a failure a diagnosis. Knows nothing of pytest."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import dtype_name, json_safe
from ..points import ATTENTION, EXPERTS, LOGITS, ROUTER, Point
from ..tree import first_tensor, leaves
from .logits import compare_logits
from .result import BatchRow, Check, Custom, PointResult
from .routing import (
    SelectionRule,
    candidate_routing,
    router_triple,
    routing_view,
    scatter_topk,
    topk_agreement,
    topk_of_affinities,
    worst_experts,
)
from .tensors import TensorMetrics, compare_tensors, worst_elements
from .tokens import RowSums, row_sums, worst_tokens
from .tolerances import (
    LOGITS_LIMITS,
    NOISE_LIMIT,
    NOISE_TOKENS,
    ROUTING_LIMITS,
    TENSOR_LIMITS,
    TOKEN_LIMIT,
    TOKEN_NOISE_SLACK,
    Tolerance,
    ToleranceKey,
    noise_floor,
)

REL_L2_LIMIT = next(k for k in TENSOR_LIMITS if k.figure == "rel_l2")

HINTS = {
    "embedding": "embedding rows permuted or a different vocabulary mapping (or the wrong checkpoint)",
    "rotary": "RoPE: theta, scaling (rope_parameters) or the cos/sin layout differ",
    "input_norm": "norm: eps, a lost or ignored weight, or the (1 + w) vs w convention",
    "post_attn_norm": "norm: eps, a lost or ignored weight, or the (1 + w) vs w convention",
    "final_norm": "final norm: eps, a lost or ignored weight, or the (1 + w) vs w convention",
    "attention": (
        "attention: q/k/v/o weight layout (head order, GQA grouping), q/k norms, RoPE layout "
        "(interleaved vs half-split), softmax scale or mask"
    ),
    "router_layout": (
        "most tokens routed differently and the logits differ: the router's weight layout (rows = experts, "
        "transposed) or another layer's gate"
    ),
    # a router whose failure leaves some of its outputs right: only the causes those leave open
    "router_logits": (
        "router logits differ: the gate's weight (rows permuted or transposed, another layer's) or its dtype"
    ),
    "router_selection": (
        "the chosen experts differ while the router's logits agree: the selection rule (a lost score-correction "
        "bias, group-limited routing: n_group/topk_group, softmax vs sigmoid before top-k)"
    ),
    "router_weights": (
        "the routing weights differ while the logits and the chosen experts agree: their normalisation (top-k "
        "renormalisation: norm_topk_prob, a routed scaling factor, softmax over all experts vs over the top k)"
    ),
    "cache_write": (
        "the KV cache this decode step left, while its own output is right: where it wrote (a position early or "
        "late, the worst positions above) or what (keys cached before RoPE or their norm, values for keys); the "
        "next step reads it"
    ),
    "experts": "experts wrong with golden routing: gate/up order or expert order in the fused weights, or activation",
    "shared_experts": "shared expert: its weights, gate/up order, or a scaling factor",
    "moe": (
        "MoE block wrong while its router and experts pass: how it combines them (routing-weight "
        "normalisation or scaling factor, shared-expert gate, reshape)"
    ),
    "mlp": "dense MLP: gate/up/down order, weights or activation",
    "output": "decoder layer wrong while its parts pass: residual connections or the order of the norms",
    "logits": "lm_head: wrong or scaled weights, or tied vs untied embeddings",
    "shape": (
        "the candidate's output has another shape than the golden's (the shapes above): what the port returns "
        "(e.g. some tokens only) or its layout, not its numbers"
    ),
}
WORST_ELEMENTS = 5
WORST_EXPERTS = 5
PER_EXPERT = frozenset({EXPERTS, "moe"})  # points whose error is broken down per expert
# A token is measured against at least this share of the median token's norm: a token whose golden
# row is nearly zero (sin at position 0, a padding row) would otherwise turn rounding into a failure.
TOKEN_FLOOR = 0.5
# Under a quantization floor, a next-token flip is a tie where the golden's gap is within this many
# standard deviations of what the reference's own quantization error moves it (`_quant_ties`).
QUANT_TIE_SIGMAS = 3.0


def _tensor_leaves(obj: Any) -> list[torch.Tensor | None]:
    """The tensors of an output structure in order; None where the structure has None (an omitted
    output such as attention weights) so that positions line up between golden and candidate."""
    return [x for x in leaves(obj) if x is None or isinstance(x, torch.Tensor)]


def _record_rows(record: torch.Tensor | None, keep: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The reference's own squared error per token (`Case.noise_tokens`) at the `rows` tokens `keep`
    keeps, in float64; None where there is none, its count differs, or a kept token has none (NaN)."""
    if record is None:
        return None
    d2 = (record if keep is None else record[keep]).to(torch.float64)
    return None if d2.numel() != rows or bool(torch.isnan(d2).any()) else d2


def _kept_rows(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The token rows of `t` that `keep` keeps (`_token_rows`), or `t` itself where it keeps them all."""
    return t if keep is None or bool(keep.all()) else _token_rows(t)[keep]


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., T, H] or [T, H] -> [B*T, H]: one row per token (batch-major, like the router's view)."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.reshape(-1, 1)
    return t.reshape(-1, t.shape[-1])


def _rows_kept(rows: int, tokens: int, left_out: list[int], *, dense: bool = False) -> torch.Tensor | None:
    """Which of a tensor's `rows` stay when the tokens `left_out` (of `tokens`) go: a row per token;
    with `dense`, also experts run on every token, a row per expert and token, expert-major
    (`[E*T, H]`, Llama 4's `hidden.repeat(E, 1)`), where a token goes under every expert. None where
    the rows are neither (nothing is left out)."""
    if tokens <= 0 or rows % tokens or (rows != tokens and not dense):
        return None
    keep = torch.ones(rows, dtype=torch.bool)
    keep.view(rows // tokens, tokens)[:, torch.as_tensor(list(left_out), dtype=torch.long)] = False
    return keep


class Judge:
    """Applies one tolerance to one point (see `Case`). The router whose routing a routed block is
    judged by is the case's `router`, the point itself for a router."""

    def __init__(self, case: Case):
        point, tol = case.point, case.tol
        self.point = point
        self.tol = tol
        # fixed: the dtype's limits apply (isolated runs, chained runs without noise figures);
        # noise: the reference's own error per compared tensor, for the noise ratio
        self.fixed = case.fixed
        self.noise = case.noise
        # the reference's own squared error per token and tensor (NaN: a token it left out): its figures
        # are then taken over the very tokens the candidate is judged on
        self.noise_tokens = case.noise_tokens or {}
        self.floor = case.floor  # a quantization floor (its scheme), or None: the candidate dtype's own rounding
        self._fixed_targets: set[str] = set()  # tensors judged by the dtype's limits: no token both runs kept
        self._unreachable: dict[str, set[str]] = {}  # the dtype's limits the reference's own run fails, by tensor
        self._kept: dict[str, torch.Tensor] = {}  # per tensor with a row per token: the rows judged
        # chained runs: (tokens left out everywhere, the number of tokens), see _keep
        self.exclude = case.exclude if case.exclude and case.exclude[0] else None
        # the batch's padding: left out as a chained run's flips are (only real tokens are judged)
        self.padding = case.padding if case.padding and case.padding[0] else None
        self.flipped = list(self.exclude[0]) if self.exclude is not None else []
        if self.padding is not None:
            self.exclude = (sorted(set(self.flipped) | set(self.padding[0])), self.padding[1])
        self.sequences = case.sequences
        self.dtype = case.dtype
        router = case.router if case.router is not None else (point if point.component == ROUTER else None)
        self.rule = SelectionRule.of(router, case.dtype, tol.tie_factor, case.config)
        # per compared target: its token rows' sums and which tokens they are (see _token_check)
        self.row_sums: dict[str, tuple[RowSums, torch.Tensor | None]] = {}
        # per tensor with several token rows: its worst tokens and every token's error (see _token_check)
        self._token_figures: dict[str, tuple[list[tuple[int, float]], list[float | None]]] = {}
        self.result = PointResult(
            id=point.id,
            layer=point.layer,
            component=point.component,
            passed=True,
            order=point.order,
            step=point.step,
            tolerance=tol.to_dict(),
            candidate_dtype=dtype_name(case.dtype),
        )

    # -- generic tensor comparison --------------------------------------------------------------
    def compare(self, target: str, golden: torch.Tensor, candidate: Any, *, keep_rows: torch.Tensor | None = None):
        r = self.result
        if not isinstance(candidate, torch.Tensor):
            r.checks.append(Check("type", target, float("nan"), None, "tensor", False))
            r.notes.append(f"{target}: candidate returned {type(candidate).__name__}, expected a tensor")
            return None
        r.golden_dtype = r.golden_dtype or dtype_name(golden.dtype)
        g, c = golden, candidate.detach().to("cpu")
        if g.is_complex() or c.is_complex():  # e.g. rotary freqs_cis: compare real and imaginary parts
            g = torch.view_as_real(g) if g.is_complex() else g
            c = torch.view_as_real(c) if c.is_complex() else c
        keep_rows = self._keep(target, g, keep_rows) if g.shape == c.shape else keep_rows
        if keep_rows is not None:
            self._kept[target] = keep_rows
        self._without_figures(target)
        if g.shape == c.shape:  # (a copy of the rows kept: none where every row is, as for vocabulary-wide logits)
            g, c = _kept_rows(g, keep_rows), _kept_rows(c, keep_rows)
        m = compare_tensors(g, c, atol=self.tol.atol, rtol=self.tol.rtol)
        r.metrics[target] = m
        if not m.shape_match:
            r.checks.append(Check("shape", target, float("nan"), None, "==", False))
            r.notes.append(
                f"{target}: shape mismatch: golden {tuple(golden.shape)} vs candidate {tuple(candidate.shape)}"
            )
            return m
        failed = False
        if (m.nan_candidate + m.inf_candidate) > (m.nan_golden + m.inf_golden):
            failed = True
            r.checks.append(Check("finite", target, float(m.nan_candidate + m.inf_candidate), 0.0, "<=", False))
            where = m.first_nonfinite
            token = where[-2] if where is not None and len(where) >= 2 else (where[0] if where else None)
            r.notes.append(
                f"{target}: candidate has {m.nan_candidate} NaN and {m.inf_candidate} Inf "
                f"(golden {m.nan_golden} / {m.inf_golden}); first at index {where}, token {token}"
            )
        beyond = self._beyond_the_reference(target)
        for key in TENSOR_LIMITS if (self.fixed or target in self._fixed_targets) and "tensor" not in beyond else ():
            limit = self.tol.limit(key)
            if limit is None:
                continue
            value = getattr(m, key.figure)
            passed = key.passes(value, limit)
            failed = failed or not passed
            r.checks.append(Check(key.check_name, target, value, limit, key.op, passed, key.name))
        kept = torch.nonzero(keep_rows).flatten().tolist() if keep_rows is not None else None
        failed = self._token_check(target, g, c, m, keep_rows) or failed
        if failed and g.numel():
            rows = worst_elements(g, c, WORST_ELEMENTS)
            if kept is not None:  # indices of the kept rows -> token positions
                rows = [((kept[i[0]], *i[1:]), gv, cv, dv) for i, gv, cv, dv in rows]
            r.worst_elements[target] = rows
        return m

    def _without_figures(self, target: str) -> None:
        """Under the noise verdict, a tensor the golden holds no figure of the reference's own run for
        (a decode step's KV cache in a golden recorded before its chained runs kept it, any other target
        they did not judge) is judged by the dtype's limits, as an isolated run judges it: every tensor a
        point holds gets a check."""
        if self.fixed or target in self._fixed_targets or target in (self.noise or {}):
            return
        if target in self.noise_tokens:  # its every token left out by the reference's run: `_keep` decided
            return
        self._fixed_targets.add(target)
        self.result.notes.append(
            f"{target}: the golden holds no figure of the reference's own run for it: judged by the dtype's limits "
            "(record its noise floor again for a noise ratio)"
        )

    def _beyond_the_reference(self, target: str) -> set[str]:
        """The dtype's limits (`tensor`: rel_l2 and those it implies; `token`) that the reference's own
        run in the candidate's dtype fails at this tensor, in a verdict by the dtype's limits that has it
        (isolated, with a noise floor): no candidate in that dtype could meet them (a selection flipped
        by rounding, as DeepSeek-V3.2's sparse attention picks its keys), so the tensor is judged against
        that run alone, by its noise ratio, and the note says why."""
        ref = self.noise.get(target) if self.fixed and self.noise else None
        beyond: set[str] = set()
        for scope, figure, key in (("tensor", "rel_l2", REL_L2_LIMIT), ("token", "max_token_rel_l2", TOKEN_LIMIT)):
            limit, value = self.tol.limit(key), (ref or {}).get(figure)
            # under a quantization floor, wherever the ratio the noise verdict allows reaches past the limit
            reach = 1.0 if not self.floor else self.tol.noise_factor * (TOKEN_NOISE_SLACK if scope == "token" else 1.0)
            if limit is not None and value is not None and not key.passes(value * reach, limit):
                beyond.add(scope)
                run = f"{dtype_name(self.dtype)} run" if not self.floor else f"run under {self.floor}"
                within = (
                    f"{figure} {value:.4g} > {limit:g}"
                    if reach == 1.0
                    else f"{figure} {value:.4g} x {reach:g} > {limit:g}"
                )
                self.result.notes.append(
                    f"{target}: the reference's own {run} is beyond the dtype's limit here "
                    f"({within}): judged against that run alone (its noise ratio)"
                )
        self._unreachable[target] = beyond
        return beyond

    def _keep(self, target: str, g: torch.Tensor, keep_rows: torch.Tensor | None) -> torch.Tensor | None:
        """`keep_rows` without the tokens a chained run leaves out, for a tensor with a row per token,
        and without those the reference's own run left out (its per-token record has no figure for
        them): both are judged on the same tokens. Where none would be left, the reference has no
        figure over the candidate's tokens, and this tensor is judged by the dtype's limits."""
        rows = _token_rows(g).shape[0] if g.dim() >= 1 else 0
        keep = keep_rows
        left = None
        if self.exclude is not None and g.dim() >= 1:
            left = _rows_kept(rows, self.exclude[1], self.exclude[0], dense=self.point.component == EXPERTS)
        if left is not None:
            keep = left if keep is None else keep & left
        reference = self.noise_tokens.get(target)
        if reference is None or self.fixed:
            return keep
        if reference.numel() != rows:
            self.noise_tokens.pop(target)  # not a row per token: the whole-tensor figures stand
            return keep
        both = ~torch.isnan(reference) if keep is None else keep & ~torch.isnan(reference)
        if both.any() or (keep is not None and not keep.any()):
            return both if not bool(both.all()) else keep
        self._fixed_targets.add(target)
        self.result.notes.append(
            f"{target}: no token that both this run and the reference's own run routed like the golden so far: "
            "judged by the dtype's limits"
        )
        return keep

    def _token_check(
        self, target: str, g: torch.Tensor, c: torch.Tensor, m: TensorMetrics, keep_rows: torch.Tensor | None
    ) -> bool:
        """The worst token's own error against `token_rel_l2` (a whole-tensor figure dilutes damage to
        a few tokens); True when it fails. Tokens are the rows of the tensor's last dimension; their
        sums are kept for the per-expert breakdown."""
        if g.dim() < 2 or g.numel() == 0 or c.shape != g.shape:
            return False
        sums = row_sums(_token_rows(g), _token_rows(c), token_dim=0)
        self.row_sums[target] = (sums, keep_rows)
        if _token_rows(g).shape[0] < 2:  # one token (a decode step): its error is the tensor's
            return False
        errors = sums.errors(TOKEN_FLOOR)
        worst = worst_tokens(errors, 5)
        if keep_rows is not None:  # rows of the kept tokens -> token positions
            kept = torch.nonzero(keep_rows).flatten().tolist()
            worst = [(kept[i], e) for i, e in worst]
        m.max_token_rel_l2, m.worst_token = worst[0][1], worst[0][0]
        values: list[float | None] = [json_safe(e) for e in errors.tolist()]
        if keep_rows is not None:
            spread: list[float | None] = [None] * keep_rows.numel()
            for row, e in zip(torch.nonzero(keep_rows).flatten().tolist(), values, strict=True):
                spread[row] = e
            values = spread
        self._token_figures[target] = (worst, values)
        key = TOKEN_LIMIT
        limit = self.tol.limit(key)
        reachable = "token" not in self._unreachable.get(target, ())
        judged_by_limits = (self.fixed or target in self._fixed_targets) and reachable
        if limit is None or not judged_by_limits:
            return False
        passed = key.passes(m.max_token_rel_l2, limit)
        self.result.checks.append(Check(key.check_name, target, m.max_token_rel_l2, limit, key.op, passed, key.name))
        return not passed

    # -- routing --------------------------------------------------------------------------------
    def compare_topk(
        self,
        golden_router_out: Any,
        candidate_router_out: Any,
        bias: torch.Tensor | None,
        *,
        judge_flips: bool,
    ) -> list[int]:
        """Compare top-k sets; returns the tokens whose routing differs (flips and ties). In a chained
        verdict, the tokens already left out (routed unlike the golden before this layer, so following
        other experts since) are not judged again here: their flips are where they first happened."""
        rm = topk_agreement(self.rule, golden_router_out, candidate_router_out, bias, self.exclude)
        r = self.result
        r.routing = rm
        if judge_flips and rm.weight_words():
            r.notes.append(rm.weight_words())
        if judge_flips:
            for key in ROUTING_LIMITS:
                value, limit = getattr(rm, key.figure), self._flip_limit(key, "top_k", rm.num_tokens)
                passed = key.passes(value, limit)
                r.checks.append(Check(key.check_name, "top_k", value, limit, key.op, passed, key.name))
        return rm.disagreeing_tokens

    # -- per component --------------------------------------------------------------------------
    def routing_of(self, cand_out: Any, golden_out: Any, bias: torch.Tensor | None) -> tuple | None:
        """The candidate router's (logits, top-k weights or None, top-k ids): as it returned them, or,
        from its logits alone (what a capture of one tensor per module holds), the ids that the
        golden's selection rule picks from them (the weights unknown)."""
        return candidate_routing(self.rule, cand_out, golden_out, bias)

    def judge_router(self, golden_out: Any, cand_out: Any, bias: torch.Tensor | None) -> None:
        g_logits, g_w, g_idx = golden_out[:3]
        derived = not router_triple(cand_out) and self.routing_of(cand_out, golden_out, bias)
        if derived:  # logits only: the logits and the top-k sets they select; no weights to compare
            self.compare("logits", g_logits, derived[0].detach().to("cpu"))
            self.result.excluded_tokens = self.compare_topk(golden_out, derived, bias, judge_flips=True)
            self.result.notes.append(
                "router: the candidate gave its logits only: judged on them and on the top-k experts they "
                "select by the golden's rule; the top-k weights are not compared"
            )
            return
        cand = [t for t in _tensor_leaves(cand_out) if t is not None]
        if len(cand) < 3 or not all(isinstance(t, torch.Tensor) for t in cand[:3]):
            self.result.checks.append(Check("type", "router", float("nan"), None, "tuple", False))
            self.result.notes.append("router: candidate did not return (logits, top_k_weights, top_k_index)")
            return
        c_logits, c_w, c_idx = (t.detach().to("cpu") for t in cand[:3])
        num_experts = g_logits.shape[-1]
        if c_w.shape[-1] == num_experts and c_idx.shape[-1] < num_experts:
            c_w = self._topk_of_affinities(c_w, c_idx, g_w)
        self.compare("logits", g_logits, c_logits)
        disagree = self.compare_topk(golden_out, cand, bias, judge_flips=True)
        keep = torch.ones(g_idx.reshape(-1, g_idx.shape[-1]).shape[0], dtype=torch.bool)
        keep[disagree] = False
        if keep.any():
            dense_g = scatter_topk(g_idx, g_w, num_experts)
            dense_c = scatter_topk(c_idx, c_w, num_experts)
            self.compare("weights", dense_g, dense_c, keep_rows=keep)
        self.result.excluded_tokens = disagree

    def _topk_of_affinities(self, affinities: torch.Tensor, index: torch.Tensor, golden_w: torch.Tensor):
        picked, renormalised = topk_of_affinities(affinities, index, golden_w)
        self.result.notes.append(
            "router: the candidate's weights are every expert's affinity [T, E]: its top-k ids' affinities are "
            + ("judged renormalised, as the golden's top-k weights are" if renormalised else "judged as they are")
        )
        return picked

    def judge_routed_block(
        self, golden_out: Any, cand: Any, golden_router: Any | None, cand_router: Any | None, bias
    ) -> None:
        """Points that follow a router (`moe`, `output`, `experts`): the verdict over the tokens whose
        routing did not flip, when the candidate's own routing is known; for `experts` and `moe`, the
        error of each expert over the tokens routed to it."""
        g = first_tensor(golden_out)
        c = first_tensor(cand)
        keep = None
        if golden_router is not None and cand_router is not None:
            disagree = self.compare_topk(golden_router, cand_router, bias, judge_flips=False)
            if disagree:
                tokens = _token_rows(golden_router[2]).shape[0]
                dense = self.point.component == EXPERTS
                keep = _rows_kept(_token_rows(g).shape[0], tokens, disagree, dense=dense)
                self.result.excluded_tokens = disagree
                self.result.notes.append(
                    f"{len(disagree)} token(s) whose routing flipped are excluded from the verdict: {disagree[:16]}"
                )
        elif golden_router is not None and self.point.component != EXPERTS:
            # (the experts of an isolated replay take the golden routing as input: nothing to exclude)
            self.result.notes.append("the backend does not expose the candidate's routing: all tokens compared")
        self.compare("out", g, c, keep_rows=keep)
        if golden_router is not None and self.point.component in PER_EXPERT:
            self._expert_breakdown("out", golden_router)

    def _expert_breakdown(self, target: str, golden_router: Any) -> None:
        """The experts that carry most of the error (`routing.worst_experts`): one broken expert of many,
        used by a few tokens, is named even where its damage is diluted in the whole tensor."""
        if target not in self.row_sums:
            return
        sums, keep_rows = self.row_sums[target]
        self.result.worst_experts = worst_experts(sums, keep_rows, golden_router, WORST_EXPERTS)

    def judge_logits(self, golden_out: Any, cand_out: Any) -> None:
        """The logits point: the tensor checks, then next-token agreement: top-1 (a real flip fails,
        a flip within the golden's rounding is a tie), top-k overlap and KL divergence per token."""
        g = first_tensor(golden_out)
        c = first_tensor(cand_out)
        m = self.compare("out", g, c)
        if m is None or not m.shape_match or not isinstance(c, torch.Tensor) or g.dim() < 1:
            return
        keep = self._kept.get("out")  # the tokens the tensor checks judged
        g, c = _token_rows(_kept_rows(g, keep)), _token_rows(_kept_rows(c.detach().to("cpu"), keep))
        lm = compare_logits(g, c, self.dtype, tie_factor=self.tol.tie_factor, tie_floor=self._quant_ties(keep, g))
        self.result.logits = lm
        for key in LOGITS_LIMITS:
            value, limit = getattr(lm.top1, key.figure), self._flip_limit(key, "top1", lm.top1.num_tokens)
            passed = key.passes(value, limit)
            self.result.checks.append(Check(key.check_name, "top1", value, limit, key.op, passed, key.name))

    def _quant_ties(self, keep: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor | None:
        """Under a quantization floor, the next-token gap per token that the reference's own error under
        the scheme moves: `QUANT_TIE_SIGMAS` standard deviations of the difference of two of its logits'
        errors (sqrt(2) times their RMS over the vocabulary at that token). A flip within it is a tie, as
        one within the dtype's rounding is: the quantized reference itself flips such tokens."""
        d2 = _record_rows(self.noise_tokens.get("out"), keep, g.shape[0]) if self.floor and not self.fixed else None
        if d2 is None:
            return None
        return QUANT_TIE_SIGMAS * math.sqrt(2.0) * torch.sqrt(d2 / max(g.shape[-1], 1))

    def judge_generic(self, golden_out: Any, cand_out: Any) -> None:
        gl = [t for t in _tensor_leaves(golden_out) if t is not None]
        cl = _tensor_leaves(cand_out)
        if len(cl) < len(gl):
            self.result.notes.append(f"candidate returned {len(cl)} tensor(s), golden has {len(gl)}")
        for i, g in enumerate(gl):
            target = "out" if len(gl) == 1 else f"out.{i}"
            self.compare(target, g, cl[i] if i < len(cl) else None)

    def judge_cache_write(self, golden: tuple[torch.Tensor, torch.Tensor], candidate: Any) -> None:
        """A decode step's attention: the layer's KV cache after the call (what was there and what it
        wrote), keys and values, one row per cache position, so a write at the wrong position or of
        wrong values fails at its position (`cache.keys`, `cache.values`)."""
        for name, g in zip(("keys", "values"), golden, strict=True):
            c = getattr(candidate, name, None) if candidate is not None else None
            self.compare(f"cache.{name}", _positions(g), _positions(c) if isinstance(c, torch.Tensor) else None)

    def _flip_limit(self, key: ToleranceKey, target: str, tokens: int = 0) -> float:
        """The share of real flips (routing top-k, next-token top-1) allowed: the tolerance, or in a
        chained run judged against the noise floor, at least `noise_factor` times the share of real
        flips the reference's own chained run had (inherited drift flips near-ties wider than a
        dtype's rounding). Under a quantization floor, whose chained runs drift far wider than a
        dtype's rounding, a share over `tokens` tokens resolves one token: the reference's counts as
        at least one token's (its 0 of 16 and a candidate's 1 of 14 differ by one near-tie)."""
        limit = self.tol.limit(key)
        if self.fixed or not self.noise:
            return limit
        reference = self.noise.get(target, {}).get("flip_share", 0.0)
        if self.floor and tokens:
            reference = max(reference, 1.0 / tokens)
        return max(limit, self.tol.noise_factor * reference)

    def _noise_checks(self) -> None:
        """Each compared tensor's error over the reference's own error in the candidate's dtype at
        this point (relative L2, and the worst token's): the noise ratio, and its verdict."""
        if not self.noise:
            return
        # an error under an eighth of the dtype's epsilon is below one rounding of the output (routing
        # weights that mostly round exactly): a ratio of two such errors says nothing
        floor = noise_floor(self.dtype)
        targets: dict[str, dict[str, float]] = {}
        widened: dict[str, tuple[int, float]] = {}
        for target, m in self.result.metrics.items():
            ref = self._reference(target)
            if ref is None or not m.shape_match or target in self._fixed_targets:
                continue
            figures = {"rel_l2_ratio": m.rel_l2 / max(ref["rel_l2"], floor)}
            if m.max_token_rel_l2 is not None and ref.get("max_token_rel_l2") is not None:
                figures["token_ratio"] = m.max_token_rel_l2 / max(ref["max_token_rel_l2"], floor)
            weighted = [figures["rel_l2_ratio"], figures.get("token_ratio", 0.0) / TOKEN_NOISE_SLACK]
            ratio = max(weighted) if all(math.isfinite(x) for x in weighted) else math.inf
            targets[target] = {"ratio": ratio, **figures, **{f"reference_{k}": v for k, v in ref.items()}}
            limit = self.tol.limit(NOISE_LIMIT)
            judged = self._tokens_judged(target)
            if limit is not None and judged is not None and judged < NOISE_TOKENS:
                limit *= math.sqrt(NOISE_TOKENS / max(judged, 1))  # few tokens: a noisier ratio
                widened[target] = (judged, limit)
            if limit is not None:
                passed = NOISE_LIMIT.passes(ratio, limit)
                self.result.checks.append(
                    Check(NOISE_LIMIT.check_name, target, ratio, limit, NOISE_LIMIT.op, passed, NOISE_LIMIT.name)
                )
        if widened:
            target, (n, limit) = next(iter(widened.items()))
            self.result.notes.append(
                f"{target}: {n} token(s) judged: the noise limit widens to {limit:.3g} (a ratio over fewer than "
                f"{NOISE_TOKENS} tokens is a noisier estimate)"
            )
        if targets:
            self.result.noise = {"ratio": max(t["ratio"] for t in targets.values()), "targets": targets}
            if self.floor:
                self.result.noise["floor"] = self.floor
            subset = [t for t in targets.values() if t.get("reference_tokens", 0) < t.get("reference_of_tokens", 0)]
            if subset:
                n, of = subset[0]["reference_tokens"], subset[0]["reference_of_tokens"]
                self.result.notes.append(
                    f"noise ratio over the {n} of {of} tokens that this run and the reference's own run both "
                    "routed like the golden so far (their errors compared on the same tokens)"
                )

    def _tokens_judged(self, target: str) -> int | None:
        """How many tokens a tensor's verdict judged (None: it has no row per token)."""
        if target not in self.row_sums:
            return None
        return int(self.row_sums[target][0].d2.numel())

    def _reference(self, target: str) -> dict[str, float] | None:
        """The reference's own figures for a tensor: over the tokens this verdict judges where its
        per-token record gives them (and then how many tokens that is), else as recorded."""
        ref = self.noise.get(target)
        record = self.noise_tokens.get(target)
        if ref is None or record is None or target not in self.row_sums:
            return ref
        sums, keep = self.row_sums[target]
        d2 = _record_rows(record, keep, sums.g2.numel())
        if d2 is None:
            return ref
        g2 = sums.g2
        rel = float(torch.sqrt(d2.sum() / g2.sum())) if float(g2.sum()) > 0 else 0.0
        token = float(RowSums(d2, g2, torch.zeros_like(d2, dtype=torch.bool)).errors(TOKEN_FLOOR).max())
        figures = {**ref, "rel_l2": rel, "max_token_rel_l2": token, "tokens": int(d2.numel())}
        return {**figures, "of_tokens": int(record.numel())}

    def finish(self) -> PointResult:
        self._noise_checks()
        for target, keep in self._kept.items():  # every token left out: no figure of any token
            if not keep.any():
                self.result.token_d2[target] = torch.full((keep.numel(),), math.nan, dtype=torch.float32)
        for target, (sums, keep) in self.row_sums.items():  # each token's squared error, NaN where left out
            if keep is None:
                self.result.token_d2[target] = sums.d2.to(torch.float32)
            else:
                full = torch.full((keep.numel(),), math.nan, dtype=torch.float32)
                full[keep] = sums.d2.to(torch.float32)
                self.result.token_d2[target] = full
        r = self.result
        if self.flipped:
            tokens = self.flipped
            r.excluded_tokens = sorted(set(r.excluded_tokens) | set(tokens))
            r.notes.append(
                f"{len(tokens)} token(s) left out: the candidate routed them unlike the golden at an earlier "
                f"layer, so they follow other experts from there on: {tokens[:16]}"
            )
        if self.padding is not None:
            r.notes.append(f"{len(self.padding[0])} padding token(s) of the batch are not judged: real tokens only")
        if self.sequences > 1:
            r.rows = self._row_figures()
        nothing_left = not r.checks and bool(self._kept) and not any(bool(k.any()) for k in self._kept.values())
        if nothing_left:  # every token routed unlike the golden before here: the flip was judged where it was
            r.notes.append(
                "no token left to judge: every token was routed unlike the golden at this layer or before (judged "
                "at its router, near-ties allowed)"
            )
        r.passed = all(c.passed for c in r.checks) and (bool(r.checks) or nothing_left)
        self._show(r)
        if not r.passed:
            r.hint = self._hint()
        return r

    def _show(self, r: PointResult) -> None:
        """The tensor that stands for the point: the first whose check failed (a router's weights
        when only they are off), else its output (the logits), else the first compared; its worst
        tokens and per-token errors are the point's."""
        failing = [c.target for c in r.checks if not c.passed and c.target in r.metrics]
        r.shown = next(iter(failing), None) or next((t for t in ("out", "logits") if t in r.metrics), None)
        if r.shown is None:
            r.shown = next(iter(r.metrics), None)
        figures = self._token_figures.get(r.shown or "") or next(iter(self._token_figures.values()), None)
        if figures is not None:
            r.worst, r.token_errors = figures

    def _row_figures(self) -> list[BatchRow]:
        """Each row of the batch: its real tokens judged, its relative L2 error and worst token's over
        them (the main tensor: the output, else the first with a row per token), and whether it fails
        the dtype's limits for them (the rows a failure names)."""
        target = "out" if "out" in self.row_sums else next(iter(self.row_sums), None)
        if target is None:
            return []
        sums, keep = self.row_sums[target]
        tokens = keep.numel() if keep is not None else sums.d2.numel()
        if tokens % self.sequences:
            return []
        length = tokens // self.sequences
        index = torch.nonzero(keep).flatten() if keep is not None else torch.arange(tokens)
        rows = (index // length).unsqueeze(-1)
        errors, counts = sums.group_errors(rows, self.sequences)
        token_errors = sums.errors(TOKEN_FLOOR)
        worst = torch.zeros(self.sequences, dtype=token_errors.dtype).scatter_reduce(
            0, rows.flatten(), token_errors, reduce="amax", include_self=True
        )
        limit_rel, limit_token = self.tol.limit(REL_L2_LIMIT), self.tol.limit(TOKEN_LIMIT)
        figures = []
        for row in range(self.sequences):
            n, rel, top = int(counts[row]), float(errors[row]), float(worst[row])
            failed = n > 0 and (
                (limit_rel is not None and not REL_L2_LIMIT.passes(rel, limit_rel))
                or (limit_token is not None and length > 1 and not TOKEN_LIMIT.passes(top, limit_token))
            )
            figures.append(BatchRow(row, n, rel if n else None, top if n else None, bool(failed)))
        return figures

    def _hint(self) -> str:
        """The causes the failure's own figures leave open: a router whose logits and choices agree
        is not blamed for its gate."""
        comp = self.point.component
        routing = self.result.routing
        if any(c.name == "shape" and not c.passed for c in self.result.checks):
            return HINTS["shape"]
        if comp == ROUTER:
            failed = {c.target for c in self.result.checks if not c.passed}
            if "logits" in failed or not failed & {"logits", "top_k", "weights"}:
                most = routing is not None and routing.set_agreement < 0.5  # most tokens routed otherwise
                return HINTS["router_layout" if most else "router_logits"]
            if "top_k" in failed:  # the logits agree: not the gate
                return HINTS["router_selection"]
            return HINTS["router_weights"]
        failed = {c.target for c in self.result.checks if not c.passed}
        if comp == ATTENTION and failed and all(t.startswith("cache.") for t in failed):
            return HINTS["cache_write"]
        if comp == ATTENTION and self.point.layer == 0:
            return HINTS["attention"] + "; at layer 0 check RoPE (theta, layout) first"
        return HINTS.get(comp, "")


def _positions(t: torch.Tensor) -> torch.Tensor:
    """[batch, heads, positions, head_dim] -> [batch, positions, heads * head_dim]."""
    return t.transpose(1, 2).flatten(2) if t.dim() == 4 else t


@dataclass
class Case:
    """What one verdict is given: the point, the golden's and the candidate's outputs, the tolerance and
    the candidate's dtype, then what some points need.

    Attributes:
        config: the model's config (DeepSeek's expert groups for the router's selection rule).
        router: the router point whose routing a routed block (`Point.follows_router`) is judged by;
            ``golden_router`` / ``candidate_router``: that router's outputs.
        score_bias: the golden router's selection bias (sigmoid routers).
        fixed: the dtype's limits apply; ``noise``: the reference's own error per tensor
            (``noise_factor`` bounds the ratio); ``noise_tokens``: its squared error per token.
        exclude: (tokens, number of tokens): tokens left out of every tensor with a row per token
            (a chained run's earlier routing flips).
        padding: (tokens, number of tokens): the batch's padding tokens, left out the same way (only
            real tokens are judged).
        sequences: rows of the batch: with more than one, each row's own figures are kept and the
            rows that fail are named.
        cache_write: (the golden's keys and values after a decode step, the candidate's CacheState or
            None), compared too.
        floor: the scheme of a quantization floor (``noise`` is the reference's own error under it): where
            the ratio ``noise_factor`` allows reaches past the dtype's limit, the ratio alone judges.
    """

    point: Point | Custom
    golden: Any
    candidate: Any
    tol: Tolerance
    dtype: torch.dtype
    config: dict[str, Any] = field(default_factory=dict)
    router: Point | None = None
    golden_router: Any | None = None
    candidate_router: Any | None = None
    score_bias: torch.Tensor | None = None
    fixed: bool = True
    noise: dict[str, dict[str, float]] | None = None
    exclude: tuple[list[int], int] | None = None
    cache_write: tuple[tuple[torch.Tensor, torch.Tensor], Any] | None = None
    noise_tokens: dict[str, torch.Tensor] | None = None
    padding: tuple[list[int], int] | None = None
    sequences: int = 1
    floor: str | None = None


def judge_point(case: Case) -> PointResult:
    """The verdict of one point. Routers are judged on logits, weights by expert id and top-k sets;
    points that follow a router (`Point.follows_router`) over the tokens whose routing agrees, given
    the golden and candidate outputs of their `router`; the logits on next-token agreement too;
    every other point tensor by tensor; then the cache write of a decode step, where given."""
    point = case.point
    judge = Judge(case)
    golden_out, candidate, bias = case.golden, case.candidate, case.score_bias
    if point.component == ROUTER:  # a router's output in another form (Llama 4's): read as the triple
        golden_out, candidate = routing_view(golden_out), routing_view(candidate)
    if point.component == ROUTER and router_triple(golden_out):
        judge.judge_router(golden_out, candidate, bias)
    elif isinstance(point, Point) and point.follows_router:
        # routers of other shapes (e.g. logits only) give no top-k to exclude flipped tokens by
        golden_router = routing_view(case.golden_router)
        golden_router = golden_router if router_triple(golden_router) else None
        candidate_router = None
        if golden_router is not None and case.candidate_router is not None:
            candidate_router = judge.routing_of(routing_view(case.candidate_router), golden_router, bias)
        judge.judge_routed_block(golden_out, candidate, golden_router, candidate_router, bias)
    elif point.component == LOGITS and isinstance(first_tensor(golden_out), torch.Tensor):
        judge.judge_logits(golden_out, candidate)
    else:
        judge.judge_generic(golden_out, candidate)
    if case.cache_write is not None:
        judge.judge_cache_write(*case.cache_write)
    return judge.finish()
