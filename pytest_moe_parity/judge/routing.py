"""Top-k expert routing compared: the experts each token was sent to by the golden and by the
candidate, flips told from ties within the dtype's rounding of the golden's scores."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..dtypes import json_safe
from ..tree import leaves
from .tensors import F64, INF, as_index_matrix, as_token_matrix, check_tensor
from .tokens import RowSums

__all__ = [
    "RoutingFlip",
    "RoutingMetrics",
    "SelectionRule",
    "candidate_routing",
    "compare_routing",
    "router_triple",
    "routing_view",
    "scatter_topk",
    "scattered_routing",
    "score_dtype",
    "tie_tolerance",
    "topk_agreement",
    "topk_of_affinities",
    "weights_for",
    "with_experts_call",
    "worst_experts",
]


@dataclass
class RoutingFlip:
    """A token whose candidate top-k expert set differs from the golden one."""

    token: int
    golden_experts: list[int]
    candidate_experts: list[int]
    gap: float
    is_tie: bool

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingFlip:
        """A flip as a report holds it (`RoutingMetrics.to_dict`)."""
        return cls(
            int(data["token"]), [int(e) for e in data.get("golden_experts", [])],
            [int(e) for e in data.get("candidate_experts", [])], float(data.get("gap", "nan")),
            bool(data.get("is_tie", False)),
        )  # fmt: skip


@dataclass
class RoutingMetrics:
    """Top-k routing agreement between golden and candidate (see :func:`compare_routing`)."""

    num_tokens: int
    top_k: int
    num_experts: int
    set_agreement: float
    flips: list[RoutingFlip]
    ties: list[RoutingFlip]
    tie_tolerance: float
    # the golden's routing weight on the experts real flips lost: its share of all the golden's routing
    # weight, and the most of one token's own (None: the golden's weights were not given). Flips that
    # carry little weight move the output little: accumulation, where heavy ones are a bug.
    flipped_weight: float | None = None
    max_flipped_weight: float | None = None

    @property
    def flipped_tokens(self) -> list[int]:
        """Tokens with a real flip (not explained by a near-tie of golden scores)."""
        return [flip.token for flip in self.flips]

    @property
    def disagreeing_tokens(self) -> list[int]:
        """All tokens whose top-k sets differ (real flips and ties), ascending."""
        return sorted(flip.token for flip in [*self.flips, *self.ties])

    @property
    def flip_share(self) -> float:
        """Share of tokens with a real flip."""
        return len(self.flips) / self.num_tokens if self.num_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict including the derived properties."""
        data = asdict(self)
        data["flip_share"] = self.flip_share
        data["flipped_tokens"] = self.flipped_tokens
        data["disagreeing_tokens"] = self.disagreeing_tokens
        return json_safe(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingMetrics:
        """The metrics as a report holds them (`to_dict`; the derived figures are derived again)."""
        return cls(
            num_tokens=int(data.get("num_tokens", 0)),
            top_k=int(data.get("top_k", 0)),
            num_experts=int(data.get("num_experts", 0)),
            set_agreement=float(data.get("set_agreement", "nan")),
            flips=[RoutingFlip.from_dict(f) for f in data.get("flips", [])],
            ties=[RoutingFlip.from_dict(f) for f in data.get("ties", [])],
            tie_tolerance=float(data.get("tie_tolerance", "nan")),
            flipped_weight=_optional(data.get("flipped_weight")),
            max_flipped_weight=_optional(data.get("max_flipped_weight")),
        )

    def weigh(self, golden_ids: torch.Tensor, golden_weights: torch.Tensor) -> None:
        """Fill `flipped_weight` and `max_flipped_weight` from the golden's top-k ids and weights."""
        ids = golden_ids.reshape(-1, golden_ids.shape[-1])
        if golden_weights.numel() != ids.numel() or ids.shape[0] != self.num_tokens:
            return
        weights = golden_weights.reshape(ids.shape).to(F64).abs()
        total = float(weights.sum())
        lost = []
        for flip in self.flips:
            gone = set(flip.golden_experts) - set(flip.candidate_experts)
            row, own = ids[flip.token].tolist(), weights[flip.token]
            carried = sum(float(own[i]) for i, e in enumerate(row) if e in gone)
            lost.append((carried, float(own.sum())))
        self.flipped_weight = sum(c for c, _ in lost) / total if total > 0 else 0.0
        self.max_flipped_weight = max((c / t for c, t in lost if t > 0), default=0.0)

    def weight_words(self) -> str:
        """The weight real flips carry, in words ("" where there is none to say)."""
        if not self.flips or self.flipped_weight is None:
            return ""
        return (
            f"the {len(self.flips)} real flip(s) carry {self.flipped_weight:.1%} of the golden's routing weight "
            f"(at most {self.max_flipped_weight or 0.0:.1%} of one token's)"
        )


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def tie_tolerance(scores: torch.Tensor, dtype: torch.dtype, factor: float = 8.0) -> torch.Tensor:
    """Per-token absolute tolerance ``[T]`` for calling a routing disagreement a tie.

    ``factor * eps(dtype) * rms_e(scores[t, e]) + factor * eps(dtype) * 1e-6``, computed in float64 with
    ``eps = torch.finfo(dtype).eps`` (``dtype`` is the precision the candidate computes its router scores
    in). The RMS is taken over the token's finite scores only, so masked (``-inf``) experts do not inflate
    it. Leading dims of ``scores [..., E]`` are flattened to T. Raises ValueError for non-float dtypes.
    """
    scores = check_tensor(scores, "scores")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"tie_tolerance needs a floating-point dtype, got {dtype!r}")
    if not factor >= 0.0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    eps = torch.finfo(dtype).eps
    s = as_token_matrix(scores, "scores")
    # In blocks of tokens: the scores of a vocabulary-wide `[T, V]` (a model's logits, judged as a
    # top-1 routing) would otherwise be copied whole in float64 (8x the float32 logits' size, with
    # the masks), far beyond what recording or replaying them holds.
    sq_sum = torch.empty(s.shape[0], dtype=F64, device=s.device)
    count = torch.empty(s.shape[0], dtype=F64, device=s.device)
    for start, stop in token_blocks(*s.shape):
        block = s[start:stop].to(F64)
        if math.isfinite(float(block.sum())):  # every score finite: no masks to build
            sq_sum[start:stop] = torch.linalg.vecdot(block, block)
            count[start:stop] = block.shape[1]
            continue
        finite = torch.isfinite(block)
        sq_sum[start:stop] = torch.where(finite, block, 0.0).square_().sum(dim=1)
        count[start:stop] = finite.sum(dim=1)
    rms = torch.sqrt(sq_sum / count.clamp(min=1))
    return factor * eps * rms + factor * eps * 1e-6


def token_blocks(tokens: int, width: int, elements: int = 1 << 20) -> Iterator[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of a ``[tokens, width]`` matrix, about `elements` entries each: the
    float64 working copies of a vocabulary-wide matrix stay a few MB whatever its number of tokens."""
    rows = max(1, elements // max(width, 1))
    for start in range(0, tokens, rows):
        yield start, min(start + rows, tokens)


def compare_routing(
    golden_scores: torch.Tensor,
    golden_topk: torch.Tensor,
    candidate_topk: torch.Tensor,
    *,
    tolerance: torch.Tensor | float,
) -> RoutingMetrics:
    """Compare golden and candidate top-k expert *sets* per token (order within top-k is ignored).

    ``golden_scores [..., E]`` are the golden selection scores (what top-k was taken over);
    ``golden_topk`` / ``candidate_topk [..., k]`` integer expert ids; leading dims are flattened to T.
    For a token whose sets differ, ``gap = min(golden_scores[t, G \\ C]) - max(golden_scores[t, C \\ G])``
    is the golden margin by which the candidate's choice lost; the disagreement is a tie when
    ``gap <= tolerance[t]`` (``tolerance`` a scalar or a per-token tensor, e.g. :func:`tie_tolerance`),
    otherwise a real flip. A gap that is NaN (NaN scores) is a real flip; a gap <= 0 (golden top-k not
    the best by ``golden_scores``) is a tie.
    """
    scores = check_tensor(golden_scores, "golden_scores")
    s = as_token_matrix(scores, "golden_scores")  # read in float64 only at the rows that disagree
    num_tokens, num_experts = s.shape
    g_ids = as_index_matrix(golden_topk, "golden_topk", num_experts)
    c_ids = as_index_matrix(candidate_topk, "candidate_topk", num_experts)
    if g_ids.shape[0] != num_tokens:
        raise ValueError(f"golden_topk has {g_ids.shape[0]} tokens, golden_scores has {num_tokens}")
    if c_ids.shape != g_ids.shape:
        raise ValueError(f"candidate_topk shape {tuple(c_ids.shape)} != golden_topk {tuple(g_ids.shape)}")
    top_k = g_ids.shape[1]

    if isinstance(tolerance, torch.Tensor):
        tol = tolerance.detach().to(device=s.device, dtype=F64).reshape(-1)
        if tol.numel() == 1:
            tol = tol.expand(num_tokens)
        elif tol.numel() != num_tokens:
            raise ValueError(f"tolerance has {tol.numel()} entries, expected 1 or {num_tokens}")
        max_tol = float(tol.max()) if num_tokens else 0.0
    else:
        tol = torch.full((num_tokens,), float(tolerance), dtype=F64, device=s.device)
        max_tol = float(tolerance)

    g_ids, c_ids = g_ids.to(s.device), c_ids.to(s.device)
    # the expert sets, compared sorted ([T, k]: no [T, E] mask, which for logits is vocabulary-wide)
    g_sorted_all, c_sorted_all = g_ids.sort(dim=1).values, c_ids.sort(dim=1).values
    disagree = (_distinct(g_sorted_all) != _distinct(c_sorted_all)).any(dim=1).nonzero().flatten()
    flips: list[RoutingFlip] = []
    ties: list[RoutingFlip] = []
    if disagree.numel():
        gaps = torch.empty(len(disagree), dtype=F64, device=s.device)
        for start, stop in token_blocks(len(disagree), num_experts):  # a broken port: every token disagrees
            rows = disagree[start:stop]
            shape = (len(rows), num_experts)
            g_sel = torch.zeros(shape, dtype=torch.bool, device=s.device).scatter_(1, g_ids[rows], True)
            c_sel = torch.zeros(shape, dtype=torch.bool, device=s.device).scatter_(1, c_ids[rows], True)
            s_sel = s[rows].to(F64)
            lost = torch.where(g_sel & ~c_sel, s_sel, INF).amin(dim=1)
            gained = torch.where(c_sel & ~g_sel, s_sel, -INF).amax(dim=1)
            gaps[start:stop] = lost - gained
        is_tie = gaps <= tol[disagree]
        g_sorted = g_sorted_all[disagree].tolist()
        c_sorted = c_sorted_all[disagree].tolist()
        for row, token in enumerate(disagree.tolist()):
            tie = bool(is_tie[row])
            flip = RoutingFlip(token, g_sorted[row], c_sorted[row], float(gaps[row]), tie)
            (ties if tie else flips).append(flip)
    set_agreement = 1.0 - disagree.numel() / num_tokens if num_tokens else 1.0
    return RoutingMetrics(
        num_tokens=num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        set_agreement=set_agreement,
        flips=flips,
        ties=ties,
        tie_tolerance=max_tol,
    )


def _distinct(ids: torch.Tensor) -> torch.Tensor:
    """Sorted ids ``[T, k]`` with each repeat of an id made -1 (and sorted again): the set they name,
    position by position, so two rows name the same set exactly when they are equal."""
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return torch.where(repeat, -1, ids).sort(dim=1).values


def scatter_topk(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dense ``[T, E]`` matrix with each top-k weight placed at its expert id (0 elsewhere).

    Lets routing weights be compared aligned by expert id instead of by top-k position. Leading dims are
    flattened to T; duplicate ids are summed, so rows sum to the weights' row sums. Floating weights keep
    their dtype, others become float32.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    ids = as_index_matrix(top_k_index, "top_k_index", num_experts)
    weights = as_token_matrix(check_tensor(top_k_weights, "top_k_weights"), "top_k_weights")
    if weights.shape != ids.shape:
        raise ValueError(f"top_k_weights shape {tuple(weights.shape)} != top_k_index {tuple(ids.shape)}")
    dtype = weights.dtype if weights.is_floating_point() else torch.float32
    dense = torch.zeros(ids.shape[0], num_experts, dtype=dtype, device=weights.device)
    return dense.scatter_add_(1, ids.to(weights.device), weights.to(dtype))


# --------------------------------------------------------------------------------------------------------
# how routers select: the rules a verdict reads the golden's scores by
# --------------------------------------------------------------------------------------------------------


def router_triple(out: Any) -> bool:
    """(router_logits, top_k_weights, top_k_index), as every transformers MoE router returns."""
    return (
        isinstance(out, tuple | list)
        and len(out) >= 3
        and all(isinstance(t, torch.Tensor) for t in out[:3])
        and not out[2].is_floating_point()
    )


def with_experts_call(out: Any, experts_call: Any) -> Any:
    """A router that gives its logits alone (DBRX's: its block softmaxes them, takes the top k and
    renormalises), read with the top-k weights and ids its layer's experts were called with (their call's
    tensors: hidden, top-k ids, top-k weights): the triple the verdicts read. Any other output as it is."""
    if not isinstance(out, torch.Tensor) or experts_call is None:
        return out
    tensors = [t for t in leaves(experts_call) if isinstance(t, torch.Tensor)]
    if len(tensors) < 3 or tensors[1].is_floating_point() or not tensors[2].is_floating_point():
        return out
    return (out, tensors[2], tensors[1])


def routing_view(out: Any) -> Any:
    """A router's output as (logits, top-k weights, top-k ids) where it gives them in another form:
    Llama 4's `(scores, logits)`, its top-k's sigmoid scattered into [T, E] and zero elsewhere, is the
    logits' top-k (k: the most nonzero scores a token has) with the scores there. Any other output as
    it is (a triple already, or no routing that can be read)."""
    if router_triple(out) or not isinstance(out, tuple | list) or len(out) != 2:
        return out
    scores, logits = out
    if not (
        isinstance(scores, torch.Tensor)
        and isinstance(logits, torch.Tensor)
        and scores.is_floating_point()
        and logits.is_floating_point()
        and scores.shape == logits.shape
        and scores.dim() >= 1
        and scores.numel() > 0
    ):
        return out
    experts = scores.shape[-1]
    flat = scores.detach().reshape(-1, experts)
    k = int((flat != 0).sum(-1).max())
    if not 0 < k < experts or bool((flat < 0).any()):
        return out
    ids = logits.detach().topk(k, dim=-1).indices
    return (logits, scores.gather(-1, ids), ids)


def scattered_routing(view: tuple, out: Any) -> Any:
    """A routing in `routing_view`'s form (logits, top-k weights, ids) given back in the form of the
    router output `out` it was read from (one `routing_view` reads): a triple as a triple, Llama 4's
    pair as its scores scattered into [T, E] (zero elsewhere) and the logits."""
    if router_triple(out):
        return view
    scores, _ = out
    logits, weights, ids = view[:3]
    dense = torch.zeros_like(scores).scatter_(-1, ids.to(scores.device).long(), weights.to(scores))
    return (dense, logits)


@dataclass(frozen=True)
class SelectionRule:
    """How a router picks its top-k experts from its logits, and the tie tolerance of its scores in the
    candidate's dtype: ``softmax`` (Mixtral, Qwen3-MoE, ...: the logits' order), ``sigmoid_bias`` (the
    sigmoid plus a selection bias: MiniMax-M2, GLM-4.5) and ``grouped_sigmoid_bias`` (DeepSeek-V3: the
    same, expert groups picked first)."""

    kind: str
    dtype: torch.dtype
    tie_factor: float
    n_group: int = 1
    topk_group: int = 1

    @classmethod
    def of(cls, router: Any, dtype: torch.dtype, tie_factor: float, config: dict[str, Any]) -> SelectionRule:
        """The rule of `router` (a Point with a `router_kind`, or None: softmax); `config` gives
        DeepSeek's expert groups."""
        kind = (getattr(router, "router_kind", None) if router is not None else None) or "softmax"
        n_group = int(config.get("n_group") or 1)
        return cls(kind, dtype, tie_factor, n_group, int(config.get("topk_group") or n_group))

    def scores(
        self, logits: torch.Tensor, bias: torch.Tensor | None, rounded_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Golden selection scores [T, E] and the per-token tie tolerance [T]. `rounded_to`: the dtype
        the candidate's sigmoid router gave its scores in (`score_dtype`); where it is coarser than
        float32 (a sigmoid run in the module's bf16, as LFM2-MoE's), two scores closer than one unit
        in the last place of that dtype may swap by its rounding alone, and are a tie."""
        logits = logits.reshape(-1, logits.shape[-1]).to(torch.float64)
        base_tol = tie_tolerance(logits, self.dtype, self.tie_factor)
        if self.kind not in ("sigmoid_bias", "grouped_sigmoid_bias"):
            return logits, base_tol
        scores = torch.sigmoid(logits)
        tol = 0.25 * base_tol
        coarse = rounded_to is not None and torch.finfo(rounded_to).eps > torch.finfo(torch.float32).eps
        if coarse:
            tol = tol + ulp(scores.amax(dim=-1), rounded_to)
        if bias is not None:
            bias = bias.to(torch.float64)
            scores = scores + bias
            tol = tol + self.tie_factor * torch.finfo(self.dtype).eps * float(bias.abs().max())
            if coarse:  # the bias added in that dtype too
                tol = tol + ulp(scores.abs().amax(dim=-1), rounded_to)
        if self.kind == "grouped_sigmoid_bias":
            scores = self._group_penalty(scores)
        return scores, tol

    def pick(self, logits: torch.Tensor, k: int, bias: torch.Tensor | None) -> torch.Tensor:
        """The top-k expert ids [T, k] this rule selects from `logits`."""
        scores, _ = self.scores(logits, bias)
        return scores.topk(k, dim=-1).indices

    def _group_penalty(self, scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek picks expert groups first: an expert of an unpicked group is as far from being
        chosen as its own gap plus its group's gap, so subtract the group's deficit."""
        T, E = scores.shape
        if self.n_group <= 1 or E % self.n_group:
            return scores
        grouped = scores.view(T, self.n_group, E // self.n_group)
        group_scores = grouped.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)
        kth = group_scores.topk(self.topk_group, dim=-1).values[:, -1:]
        deficit = (kth - group_scores).clamp(min=0)
        return (grouped - deficit.unsqueeze(-1)).reshape(T, E)


def score_dtype(router_out: Any) -> torch.dtype | None:
    """The dtype a router's scores were rounded to, read from its (logits, top-k weights, ids): the
    weights' dtype, as they are gathered from the scores (float32 for MiniMax-M2 and DeepSeek-V3,
    whose sigmoid runs in float32 whatever their logits' dtype; bf16 for LFM2-MoE's in a bf16 model).
    None where the weights are unknown (ids this package picked from captured logits, in float64)."""
    weights = router_out[1]
    if isinstance(weights, torch.Tensor) and weights.dtype.is_floating_point:
        return weights.dtype
    return None


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at the magnitude of each of `values` (float64; the
    smallest normal's where a value is zero or below it)."""
    info = torch.finfo(dtype)
    magnitude = values.to(F64).abs().clamp(min=info.tiny)
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1
    return torch.ldexp(torch.full_like(magnitude, info.eps / 2), exponent)


def topk_of_affinities(
    affinities: torch.Tensor, index: torch.Tensor, golden_w: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """A router that returns every expert's affinity [T, E] with its top-k ids (NxDI's RouterTopK: the
    full softmax; the experts renormalise the top k): the top-k weights, renormalised when the golden's
    top-k weights are (rows summing to 1); and whether they were."""
    picked = affinities.reshape(-1, affinities.shape[-1]).gather(1, index.reshape(-1, index.shape[-1]).long())
    sums = golden_w.reshape(-1, golden_w.shape[-1]).to(torch.float64).sum(-1)
    renormalised = bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-2))
    if renormalised:
        picked = picked / picked.sum(-1, keepdim=True)
    return picked, renormalised


def topk_agreement(
    rule: SelectionRule,
    golden_router_out: Any,
    candidate_router_out: Any,
    bias: torch.Tensor | None,
    exclude: tuple[list[int], int] | None = None,
) -> RoutingMetrics:
    """The candidate router's top-k sets against the golden's, read by the golden's selection rule. In
    a chained verdict, `exclude` (tokens, number of tokens) leaves out the tokens already routed unlike
    the golden before this layer (following other experts since): their flips are where they first
    happened. Flips and ties keep the tokens' own positions."""
    g_logits, g_w, g_idx = golden_router_out[:3]
    c_idx = candidate_router_out[2].detach().to("cpu")
    scores, tol = rule.scores(g_logits, bias, score_dtype(candidate_router_out))
    rows = scores.shape[0]
    if exclude is None or rows != exclude[1] or g_idx.numel() != c_idx.numel():
        rm = compare_routing(scores, g_idx, c_idx, tolerance=tol)
        rm.weigh(g_idx, g_w)
        return rm
    keep = torch.ones(rows, dtype=torch.bool)
    keep[exclude[0]] = False
    positions = keep.nonzero().flatten().tolist()
    g_idx, c_idx = g_idx.reshape(rows, -1)[keep], c_idx.reshape(rows, -1)[keep]
    scores, tol = scores[keep], (tol[keep] if isinstance(tol, torch.Tensor) and tol.dim() else tol)
    rm = compare_routing(scores, g_idx, c_idx, tolerance=tol)
    rm.weigh(g_idx, g_w.reshape(rows, -1)[keep] if g_w.numel() == rows * g_idx.shape[-1] else g_w)
    rm.flips = [replace(f, token=positions[f.token]) for f in rm.flips]
    rm.ties = [replace(f, token=positions[f.token]) for f in rm.ties]
    return rm


def candidate_routing(rule: SelectionRule, cand_out: Any, golden_out: Any, bias: torch.Tensor | None) -> tuple | None:
    """The candidate router's (logits, top-k weights or None, top-k ids): as it returned them, or, from
    its logits alone (what a capture of one tensor per module holds), the ids that the golden's
    selection rule picks from them (the weights unknown). None when neither can be read."""
    cand_out = routing_view(cand_out)
    if router_triple(cand_out):
        return tuple(cand_out)
    kept = [x for x in leaves(cand_out) if x is None or isinstance(x, torch.Tensor)]
    g_logits, _, g_idx = golden_out[:3]
    if len(kept) != 1 or kept[0] is None or kept[0].shape[-1] != g_logits.shape[-1]:
        return None
    logits = kept[0]
    ids = rule.pick(logits.detach().to("cpu"), g_idx.shape[-1], bias).reshape(g_idx.shape)
    return logits, None, ids


def weights_for(
    rule: SelectionRule, logits: torch.Tensor, ids: torch.Tensor, golden_weights: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """The top-k weights [T, k] the reference's rule gives the experts `ids` [T, k] from `logits`
    [T, E]: each expert's affinity (the softmax of the logits; their sigmoid for sigmoid routers),
    renormalised to the golden's row sum where the golden's top-k weights sum to one constant per token
    (normalised weights, times a scaling factor), else times `scale` (the config's scaling factor)."""
    flat = logits.reshape(-1, logits.shape[-1]).to(F64)
    sigmoid = rule.kind in ("sigmoid_bias", "grouped_sigmoid_bias")
    affinity = torch.sigmoid(flat) if sigmoid else torch.softmax(flat, dim=-1)
    picked = affinity.gather(1, ids.reshape(flat.shape[0], -1).long().to(flat.device))
    sums = golden_weights.reshape(picked.shape).to(F64).sum(-1)
    constant = float(sums.mean()) if sums.numel() else 1.0
    if sums.numel() and bool(torch.allclose(sums, torch.full_like(sums, constant), rtol=1e-2, atol=1e-3)):
        return picked / picked.sum(-1, keepdim=True).clamp(min=1e-20) * constant
    return picked * scale


def worst_experts(
    sums: RowSums, keep_rows: torch.Tensor | None, golden_router: Any, n: int
) -> list[tuple[int, int, float, float]]:
    """The `n` experts that carry most of the error, as (expert, tokens, rel_l2 over its golden-routed
    tokens, its own share of the error): one broken expert of many, used by a few tokens, is named where
    its damage is diluted in the whole tensor, and a healthy expert that shares its tokens with a broken
    one is not blamed for them (`expert_shares`). Experts with no share of it are left out. Empty where
    the rows are not the router's tokens (an unusual layout)."""
    g_logits, g_weights, g_idx = golden_router[:3]
    idx = g_idx.reshape(-1, g_idx.shape[-1])
    if idx.shape[0] != (keep_rows.shape[0] if keep_rows is not None else sums.d2.shape[0]):
        return []
    weights = g_weights.reshape(idx.shape) if g_weights.numel() == idx.numel() else torch.ones(idx.shape)
    if keep_rows is not None:
        idx, weights = idx[keep_rows], weights[keep_rows]
    experts = g_logits.shape[-1]
    errors, counts = sums.group_errors(idx, experts)
    used = torch.nonzero(counts > 0).flatten()
    if not used.numel():
        return []
    shares = expert_shares(torch.sqrt(sums.d2), idx, weights, experts)
    rel = torch.where(torch.isnan(errors), -1.0, errors)
    order = sorted(used.tolist(), key=lambda e: (-float(shares[e]), -float(rel[e])))
    named = [e for e in order if float(shares[e]) >= SHARE_SHOWN] or order
    return [(e, int(counts[e]), float(errors[e]), float(shares[e])) for e in named[:n]]


# An expert is named among the worst where it carries at least this share of the block's error.
SHARE_SHOWN = 0.02


def expert_shares(token_error: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: int) -> torch.Tensor:
    """Each expert's own share of the error (summing to 1 where there is any): each token's error
    (`token_error`, the norm of its difference) read as the routing-weighted sum of its experts' own
    errors per unit weight, solved for those over every token at once, none negative. A healthy expert
    that shares tokens with a broken one explains none of their error, since its other tokens have none."""
    design = torch.zeros(idx.shape[0], experts, dtype=torch.float64)
    design.scatter_add_(1, idx.long(), weights.to(torch.float64).abs())
    y = torch.nan_to_num(token_error.to(torch.float64), nan=0.0, posinf=0.0)
    per_unit = _non_negative_least_squares(design, y)
    carried = per_unit * design.sum(dim=0)
    total = float(carried.sum())
    return carried / total if total > 0 else carried


def _non_negative_least_squares(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """min ||a x - y|| with x >= 0: least squares over the columns still free, the negative ones
    fixed at 0, until none is negative (at most one pass per column)."""
    free = a.abs().sum(dim=0) > 0
    x = torch.zeros(a.shape[1], dtype=a.dtype)
    for _ in range(a.shape[1]):
        if not free.any():
            break
        columns = torch.nonzero(free).flatten()
        solution = torch.linalg.lstsq(a[:, columns], y.unsqueeze(-1), driver="gelsd").solution.squeeze(-1)
        negative = solution < 0
        if not negative.any():
            x[columns] = solution
            break
        free[columns[negative]] = False
    return x
