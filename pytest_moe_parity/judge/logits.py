"""Logits judged on what they decide: next-token (top-1) agreement with ties told from flips, top-k
overlap and the KL divergence per token."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..dtypes import json_safe
from .routing import RoutingMetrics, compare_routing, tie_tolerance, token_blocks
from .tensors import F64, INF, as_token_matrix, check_tensor
from .tokens import worst_tokens

__all__ = ["LogitsMetrics", "compare_logits"]


@dataclass
class LogitsMetrics:
    """How well candidate logits predict the same next tokens (see :func:`compare_logits`)."""

    num_tokens: int
    top1_agreement: float  # share of tokens whose argmax agrees
    top1: RoutingMetrics  # the argmax as a top-1 "routing": real flips and ties (golden gap within rounding)
    top_k: int  # the k of the overlap below
    top_k_overlap: float  # mean over tokens of |top-k(golden) & top-k(candidate)| / k
    kl_mean: float  # KL(p_golden || p_candidate) per token, in nats: mean and max
    kl_max: float
    kl_worst: list[tuple[int, float]]  # the tokens with the largest KL

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["top1"] = self.top1.to_dict()
        return json_safe(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogitsMetrics:
        """The metrics as a report holds them (`to_dict`)."""
        return cls(
            num_tokens=int(data.get("num_tokens", 0)),
            top1_agreement=float(data.get("top1_agreement", "nan")),
            top1=RoutingMetrics.from_dict(data.get("top1", {})),
            top_k=int(data.get("top_k", 0)),
            top_k_overlap=float(data.get("top_k_overlap", "nan")),
            kl_mean=float(data.get("kl_mean", "nan")),
            kl_max=float(data.get("kl_max", "nan")),
            kl_worst=[(int(t), float(v)) for t, v in data.get("kl_worst", [])],
        )


def compare_logits(
    golden: torch.Tensor,
    candidate: torch.Tensor,
    dtype: torch.dtype,
    *,
    tie_factor: float = 8.0,
    top_k: int = 5,
    tie_floor: torch.Tensor | None = None,
) -> LogitsMetrics:
    """Top-1 agreement (a disagreement is a tie when the golden's gap between its top-1 and the
    candidate's choice is within :func:`tie_tolerance` of ``dtype``, or within ``tie_floor``, a gap per
    token that a quantization's own error moves, where given), top-k overlap and the KL divergence
    of the candidate's next-token distribution from the golden's, per token. ``[..., V]``; leading dims
    are tokens. Computed in float64, in blocks of tokens."""
    g_all = as_token_matrix(check_tensor(golden, "golden"), "golden")
    c_all = as_token_matrix(check_tensor(candidate, "candidate"), "candidate")
    if g_all.shape != c_all.shape:
        raise ValueError(f"shape mismatch: golden {tuple(golden.shape)} vs candidate {tuple(candidate.shape)}")
    num_tokens, vocab = g_all.shape
    k = max(1, min(top_k, vocab))
    g_top1 = torch.empty(num_tokens, 1, dtype=torch.int64)
    c_top1 = torch.empty(num_tokens, 1, dtype=torch.int64)
    overlap = torch.zeros(num_tokens, dtype=F64)
    kl = torch.zeros(num_tokens, dtype=F64)
    for start, stop in token_blocks(num_tokens, vocab):
        g = g_all[start:stop].to(F64)
        c = c_all[start:stop].to(F64)
        g_best, c_best = g.topk(k, dim=1), c.topk(k, dim=1)
        g_top1[start:stop, 0] = _first_max(g, g_best).cpu()
        c_top1[start:stop, 0] = _first_max(c, c_best).cpu()
        shared = (g_best.indices[:, :, None] == c_best.indices[:, None, :]).any(dim=2).sum(dim=1)
        overlap[start:stop] = (shared.to(F64) / k).cpu()
        kl[start:stop] = _kl_rows(g, c, g_best.values[:, :1], c_best.values[:, :1]).cpu()
    kl = torch.where(torch.isnan(kl), INF, kl)
    scores = g_all  # the golden logits are the selection scores of the argmax
    tolerance = tie_tolerance(scores, dtype, tie_factor)
    if tie_floor is not None:
        tolerance = torch.maximum(tolerance, tie_floor.to(tolerance.device, F64).reshape(-1))
    top1 = compare_routing(scores, g_top1, c_top1, tolerance=tolerance)
    return LogitsMetrics(
        num_tokens=num_tokens,
        top1_agreement=float((g_top1 == c_top1).to(F64).mean()) if num_tokens else 1.0,
        top1=top1,
        top_k=k,
        top_k_overlap=float(overlap.mean()) if num_tokens else 1.0,
        kl_mean=float(kl.mean()) if num_tokens else 0.0,
        kl_max=float(kl.max()) if num_tokens else 0.0,
        kl_worst=worst_tokens(kl, 5),
    )


def _first_max(x: torch.Tensor, best: Any) -> torch.Tensor:
    """Each row's argmax (its first largest entry, as ``argmax``) from the row's ``topk``: the top
    index where the row's largest value is its own, ``argmax`` again only for the rows where it is not
    (a repeated largest value, a NaN)."""
    values, indices = best
    if values.shape[1] < 2:
        return x.argmax(dim=1)
    top = indices[:, 0].clone()
    again = (values[:, 1] == values[:, 0]) | torch.isnan(values[:, 0])
    if bool(again.any()):
        top[again] = x[again].argmax(dim=1)
    return top


def _kl_rows(g: torch.Tensor, c: torch.Tensor, g_max: torch.Tensor, c_max: torch.Tensor) -> torch.Tensor:
    """KL(softmax(g) || softmax(c)) of each row of float64 ``g``, ``c`` (``g_max``, ``c_max``: their
    rows' largest values, ``[T, 1]``). Finite rows: ``sum p_g (g - c) - (lse(g) - lse(c))`` with one
    exponential of each matrix (``p_g`` is ``exp(g - g_max)`` over its sum); a block holding a NaN or
    Inf (a masked vocabulary) takes log-softmax's way, where a token the golden rules out
    (``-inf``) adds nothing and one only the candidate rules out makes KL infinite."""
    if math.isfinite(float(g.sum()) + float(c.sum())):  # a non-finite entry makes its sum non-finite
        e = torch.sub(g, g_max).exp_()
        s_g = e.sum(dim=1)
        s_c = torch.sub(c, c_max).exp_().sum(dim=1)
        cross = torch.linalg.vecdot(e, g - c) / s_g
        return (cross - (g_max[:, 0] - c_max[:, 0]) - (s_g.log() - s_c.log())).clamp(min=0.0)
    log_pg, log_pc = torch.log_softmax(g, dim=1), torch.log_softmax(c, dim=1)
    terms = torch.where(log_pg == -INF, 0.0, log_pg.exp() * (log_pg - log_pc))
    return terms.sum(dim=1).clamp(min=0.0)  # rounding may give -1e-17
