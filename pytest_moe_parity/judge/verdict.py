"""Compare one point's candidate output with its golden record and decide pass or fail, with
the numbers and the one-line hint that make a failure a diagnosis. Knows nothing of pytest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..dtypes import dtype_name
from ..tree import first_tensor
from .metrics import (
    TensorMetrics,
    compare_routing,
    compare_tensors,
    json_safe,
    per_token_error,
    scatter_topk,
    tie_tolerance,
    worst_tokens,
)
from .tolerances import Tolerance

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
        "most tokens routed differently: router weight layout (rows = experts) or a missing score-correction bias"
    ),
    "router": "router: gate weight rows permuted or transposed, a lost score-correction bias, or the scoring function",
    "experts": "experts wrong with golden routing: gate/up order or expert order in the fused weights, or activation",
    "shared_experts": "shared expert: its weights, gate/up order, or a scaling factor",
    "moe": (
        "MoE block wrong while its router and experts pass: how it combines them (routing-weight "
        "normalisation or scaling factor, shared-expert gate, reshape)"
    ),
    "mlp": "dense MLP: gate/up/down order, weights or activation",
    "output": "decoder layer wrong while its parts pass: residual connections or the order of the norms",
    "logits": "lm_head: wrong or scaled weights, or tied vs untied embeddings",
}


@dataclass
class Check:
    name: str
    target: str
    value: float
    limit: float | None
    op: str
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "value": json_safe(self.value),
            "limit": json_safe(self.limit),
            "op": self.op,
            "passed": self.passed,
        }


@dataclass
class PointResult:
    id: str
    layer: int | None
    component: str
    passed: bool
    checks: list[Check] = field(default_factory=list)
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    routing: dict[str, Any] | None = None
    excluded_tokens: list[int] = field(default_factory=list)
    worst: list[tuple[int, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hint: str = ""
    tolerance: dict[str, Any] = field(default_factory=dict)
    tolerance_sources: list[str] = field(default_factory=list)
    candidate_dtype: str = ""
    golden_dtype: str = ""
    seconds: float = 0.0
    order: int = 0

    @property
    def status(self) -> str:
        return "passed" if self.passed else "failed"

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def main(self) -> TensorMetrics | None:
        return next(iter(self.metrics.values()), None)

    def to_row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "order": self.order,
            "layer": self.layer,
            "component": self.component,
            "status": self.status,
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
            "checks": [c.to_dict() for c in self.checks],
            "limits": {k: json_safe(v) for k, v in self.tolerance.items()},
            "tolerance_sources": self.tolerance_sources,
            "routing": self.routing,
            "excluded_tokens": self.excluded_tokens,
            "worst_tokens": [[t, json_safe(e)] for t, e in self.worst],
            "notes": self.notes,
            "hint": self.hint if not self.passed else "",
            "candidate_dtype": self.candidate_dtype,
            "golden_dtype": self.golden_dtype,
            "seconds": round(self.seconds, 6),
        }


def _leaves(obj: Any) -> list[torch.Tensor | None]:
    if isinstance(obj, torch.Tensor) or obj is None:
        return [obj]
    if isinstance(obj, tuple | list):
        out: list[torch.Tensor | None] = []
        for item in obj:
            out.extend(_leaves(item))
        return out
    return []


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., T, H] or [T, H] -> [B*T, H]: one row per token (batch-major, like the router's view)."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.reshape(-1, 1)
    return t.reshape(-1, t.shape[-1])


class Judge:
    """Applies one tolerance to one point."""

    def __init__(self, point: dict[str, Any], tol: Tolerance, candidate_dtype: torch.dtype, config: dict[str, Any]):
        self.point = point
        self.tol = tol
        self.dtype = candidate_dtype
        self.config = config
        self.result = PointResult(
            id=point["id"],
            layer=point["layer"],
            component=point["component"],
            passed=True,
            order=int(point.get("order", 0)),
            tolerance=tol.to_dict(),
            candidate_dtype=dtype_name(candidate_dtype),
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
        if keep_rows is not None and g.shape == c.shape:
            g, c = _token_rows(g)[keep_rows], _token_rows(c)[keep_rows]
        m = compare_tensors(g, c, atol=self.tol.atol, rtol=self.tol.rtol)
        r.metrics[target] = m
        if not m.shape_match:
            r.checks.append(Check("shape", target, float("nan"), None, "==", False))
            r.notes.append(
                f"{target}: shape mismatch: golden {tuple(golden.shape)} vs candidate {tuple(candidate.shape)}"
            )
            return m
        bad_nonfinite = (m.nan_candidate + m.inf_candidate) > (m.nan_golden + m.inf_golden)
        if bad_nonfinite:
            r.checks.append(Check("finite", target, float(m.nan_candidate + m.inf_candidate), 0.0, "<=", False))
            where = m.first_nonfinite
            token = where[-2] if where is not None and len(where) >= 2 else (where[0] if where else None)
            r.notes.append(
                f"{target}: candidate has {m.nan_candidate} NaN and {m.inf_candidate} Inf "
                f"(golden {m.nan_golden} / {m.inf_golden}); first at index {where}, token {token}"
            )
        r.checks.append(Check("cosine", target, m.cosine, self.tol.cosine, ">=", m.cosine >= self.tol.cosine))
        r.checks.append(Check("rel_l2", target, m.rel_l2, self.tol.rel_l2, "<=", m.rel_l2 <= self.tol.rel_l2))
        if self.tol.within is not None:
            r.checks.append(
                Check("within", target, m.within_tol, self.tol.within, ">=", m.within_tol >= self.tol.within)
            )
        if not r.worst and g.dim() >= 1 and g.numel() > 0:
            rows_g, rows_c = _token_rows(g), _token_rows(c)
            if rows_g.shape[0] > 1:
                per_token = per_token_error(rows_g, rows_c, token_dim=0)
                worst = worst_tokens(per_token, 5)
                if keep_rows is not None:
                    kept = torch.nonzero(keep_rows).flatten().tolist()
                    worst = [(kept[i], e) for i, e in worst]
                r.worst = worst
        return m

    # -- routing --------------------------------------------------------------------------------
    def selection(self, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Golden selection scores [T, E] and the per-token tie tolerance [T]."""
        kind = self.point.get("router_kind") or "softmax"
        logits = logits.reshape(-1, logits.shape[-1]).to(torch.float64)
        base_tol = tie_tolerance(logits, self.dtype, self.tol.tie_factor)
        if kind in ("sigmoid_bias", "grouped_sigmoid_bias"):
            scores = torch.sigmoid(logits)
            eps = torch.finfo(self.dtype).eps
            tol = 0.25 * base_tol
            if bias is not None:
                bias = bias.to(torch.float64)
                scores = scores + bias
                tol = tol + self.tol.tie_factor * eps * float(bias.abs().max())
            if kind == "grouped_sigmoid_bias":
                scores = self._group_penalty(scores)
            return scores, tol
        return logits, base_tol

    def _group_penalty(self, scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek picks expert groups first: an expert of an unpicked group is as far from being
        chosen as its own gap plus its group's gap, so subtract the group's deficit."""
        n_group = int(self.config.get("n_group") or 1)
        topk_group = int(self.config.get("topk_group") or n_group)
        T, E = scores.shape
        if n_group <= 1 or E % n_group:
            return scores
        grouped = scores.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        kth = group_scores.topk(topk_group, dim=-1).values[:, -1:]
        deficit = (kth - group_scores).clamp(min=0)
        return (grouped - deficit.unsqueeze(-1)).reshape(T, E)

    def routing(
        self,
        golden_router_out: Any,
        candidate_router_out: Any,
        bias: torch.Tensor | None,
        *,
        judge_flips: bool,
    ) -> list[int]:
        """Compare top-k sets; returns the tokens whose routing differs (flips and ties)."""
        g_logits, _, g_idx = golden_router_out[:3]
        c_idx = candidate_router_out[2].detach().to("cpu")
        scores, tol = self.selection(g_logits, bias)
        rm = compare_routing(scores, g_idx, c_idx, tolerance=tol)
        r = self.result
        r.routing = rm.to_dict()
        if judge_flips:
            share = rm.flip_share
            r.checks.append(
                Check("flip_share", "top_k", share, self.tol.max_flip_share, "<=", share <= self.tol.max_flip_share)
            )
        return rm.disagreeing_tokens

    # -- per component --------------------------------------------------------------------------
    def judge_router(self, golden_out: Any, cand_out: Any, bias: torch.Tensor | None) -> None:
        g_logits, g_w, g_idx = golden_out[:3]
        cand = _leaves(cand_out)
        if len(cand) < 3 or not all(isinstance(t, torch.Tensor) for t in cand[:3]):
            self.result.checks.append(Check("type", "router", float("nan"), None, "tuple", False))
            self.result.notes.append("router: candidate did not return (logits, top_k_weights, top_k_index)")
            return
        c_logits, c_w, c_idx = (t.detach().to("cpu") for t in cand[:3])
        self.compare("logits", g_logits, c_logits)
        disagree = self.routing(golden_out, cand, bias, judge_flips=True)
        num_experts = g_logits.shape[-1]
        keep = torch.ones(g_idx.reshape(-1, g_idx.shape[-1]).shape[0], dtype=torch.bool)
        keep[disagree] = False
        if keep.any():
            dense_g = scatter_topk(g_idx, g_w, num_experts)
            dense_c = scatter_topk(c_idx, c_w, num_experts)
            self.compare("weights", dense_g, dense_c, keep_rows=keep)
        self.result.excluded_tokens = disagree

    def judge_block(self, golden_out: Any, cand: Any, golden_router: Any | None, cand_router: Any | None, bias) -> None:
        """`moe` and `output`: the verdict over tokens whose routing did not flip."""
        g = first_tensor(golden_out)
        c = first_tensor(cand)
        keep = None
        if golden_router is not None and cand_router is not None:
            disagree = self.routing(golden_router, cand_router, bias, judge_flips=False)
            if disagree:
                rows = _token_rows(g).shape[0]
                keep = torch.ones(rows, dtype=torch.bool)
                keep[disagree] = False
                self.result.excluded_tokens = disagree
                self.result.notes.append(
                    f"{len(disagree)} token(s) whose routing flipped are excluded from the verdict: {disagree[:16]}"
                )
        elif golden_router is not None:
            self.result.notes.append("the backend does not expose the candidate's routing: all tokens compared")
        self.compare("out", g, c, keep_rows=keep)

    def judge_generic(self, golden_out: Any, cand_out: Any) -> None:
        gl = [t for t in _leaves(golden_out) if t is not None]
        cl = _leaves(cand_out)
        if isinstance(cand_out, torch.Tensor):
            cl = [cand_out]
        if len(cl) < len(gl):
            self.result.notes.append(f"candidate returned {len(cl)} tensor(s), golden has {len(gl)}")
        for i, g in enumerate(gl):
            target = "out" if len(gl) == 1 else f"out.{i}"
            self.compare(target, g, cl[i] if i < len(cl) else None)

    def finish(self) -> PointResult:
        r = self.result
        r.passed = all(c.passed for c in r.checks) and bool(r.checks)
        if not r.passed:
            r.hint = self._hint()
        return r

    def _hint(self) -> str:
        comp = self.point["component"]
        routing = self.result.routing or {}
        if comp == "router" and routing.get("set_agreement", 1.0) < 0.5:
            return HINTS["router_layout"]
        if comp == "attention" and self.point.get("layer") == 0:
            return HINTS["attention"] + "; at layer 0 check RoPE (theta, layout) first"
        return HINTS.get(comp, "")


def _router_triple(out: Any) -> bool:
    """(router_logits, top_k_weights, top_k_index), as every transformers MoE router returns."""
    return (
        isinstance(out, tuple | list)
        and len(out) >= 3
        and all(isinstance(t, torch.Tensor) for t in out[:3])
        and not out[2].is_floating_point()
    )


def judge_point(
    point: dict[str, Any],
    golden_out: Any,
    candidate: Any,
    tol: Tolerance,
    candidate_dtype: torch.dtype,
    *,
    config: dict[str, Any] | None = None,
    golden_router: Any | None = None,
    candidate_router: Any | None = None,
    score_bias: torch.Tensor | None = None,
) -> PointResult:
    judge = Judge(point, tol, candidate_dtype, config or {})
    comp = point["component"]
    if comp == "router" and _router_triple(golden_out):
        judge.judge_router(golden_out, candidate, score_bias)
    elif comp in ("moe", "output"):
        # routers of other shapes (e.g. logits only) give no top-k to exclude flipped tokens by
        golden_router = golden_router if _router_triple(golden_router) else None
        candidate_router = candidate_router if _router_triple(candidate_router) else None
        judge.judge_block(golden_out, candidate, golden_router, candidate_router, score_bias)
    else:
        judge.judge_generic(golden_out, candidate)
    return judge.finish()
