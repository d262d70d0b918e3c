"""Per-token errors: the sums of squares of each row (token) of the difference and of the golden,
the relative error of each token, of a group of tokens (an expert's), and the worst tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tensors import F64, INF, check_tensor

__all__ = ["RowSums", "per_token_error", "row_sums", "worst_tokens"]


@dataclass
class RowSums:
    """Per-row sums of squares of the difference (``d2``) and of the finite golden (``g2``), float64
    ``[T]``, with ``bad`` marking rows where the candidate has a NaN or an unmatched Inf. Relative
    errors of any set of rows (one token, the tokens of one expert) follow from them."""

    d2: torch.Tensor
    g2: torch.Tensor
    bad: torch.Tensor

    def errors(self, floor_share: float = 0.0) -> torch.Tensor:
        """``||c_t - g_t|| / max(||g_t||, floor)`` per row, ``floor = floor_share * median_t ||g_t||``
        (so a row whose golden is almost zero, like sin at position 0, is measured against the
        typical row instead of its own near-zero norm). 0 where equal, inf where the golden row is 0
        and the candidate's is not, or where the candidate is not finite."""
        g2 = self.g2
        if floor_share > 0.0 and g2.numel():
            g2 = g2.clamp(min=float(floor_share**2 * g2.median()))
        err = torch.sqrt(self.d2) / torch.sqrt(g2)
        err = torch.where(self.d2 == 0.0, 0.0, torch.where(g2 == 0.0, INF, err))
        return torch.where(self.bad | torch.isnan(err), INF, err)

    def group_errors(self, groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Relative L2 error over the rows of each group, and the number of rows per group.

        ``groups [T, k]`` lists, per row, the groups it belongs to (e.g. the experts a token was routed
        to; -1 for none). Returns float64 ``[G]`` errors (nan for an empty group, inf where a member
        row is not finite) and int64 ``[G]`` counts."""
        groups = groups.reshape(self.d2.shape[0], -1).to(torch.int64)
        valid = (groups >= 0) & (groups < num_groups)
        member = groups.clamp(min=0)
        weights = valid.to(F64)
        d2 = torch.zeros(num_groups, dtype=F64).index_add_(0, member.flatten(), (self.d2[:, None] * weights).flatten())
        g2 = torch.zeros(num_groups, dtype=F64).index_add_(0, member.flatten(), (self.g2[:, None] * weights).flatten())
        count = torch.zeros(num_groups, dtype=torch.int64).index_add_(0, member.flatten(), valid.flatten().long())
        bad = torch.zeros(num_groups, dtype=torch.int64).index_add_(
            0, member.flatten(), (valid & self.bad[:, None]).flatten().long()
        )
        err = torch.sqrt(d2) / torch.sqrt(g2)
        err = torch.where(d2 == 0.0, 0.0, torch.where(g2 == 0.0, INF, err))
        err = torch.where(bad > 0, INF, err)
        return torch.where(count == 0, math.nan, err), count


def row_sums(golden: torch.Tensor, candidate: torch.Tensor, token_dim: int = -2) -> RowSums:
    """The :class:`RowSums` of every slice ``t`` along ``token_dim`` (other dimensions flattened).

    Non-finite values never yield nan: equal Infs count as equal, ``g2`` is taken over the finite golden
    values, and a NaN or unmatched Inf marks the row ``bad``. Processed in blocks of rows, so no float64
    copy of the whole tensor is made."""
    golden = check_tensor(golden, "golden")
    candidate = check_tensor(candidate, "candidate")
    if golden.shape != candidate.shape:
        raise ValueError(f"shape mismatch: golden {tuple(golden.shape)} vs candidate {tuple(candidate.shape)}")
    if golden.ndim == 0:
        raise ValueError("per-token errors need at least one dimension")
    if not -golden.ndim <= token_dim < golden.ndim:
        raise ValueError(f"token_dim {token_dim} out of range for a {golden.ndim}-d tensor")
    g_all = golden.movedim(token_dim, 0)
    c_all = candidate.movedim(token_dim, 0)
    num_tokens = g_all.shape[0]
    inner = math.prod(g_all.shape[1:])
    d2_all = torch.zeros(num_tokens, dtype=F64)
    g2_all = torch.zeros(num_tokens, dtype=F64)
    bad_all = torch.zeros(num_tokens, dtype=torch.bool)
    if num_tokens == 0 or inner == 0:
        return RowSums(d2_all, g2_all, bad_all)
    rows = max(1, (1 << 20) // inner)  # a few block-sized float64 temporaries, ~8 MB each
    for start in range(0, num_tokens, rows):
        stop = min(start + rows, num_tokens)
        g = g_all[start:stop].reshape(stop - start, inner).to(F64)
        c = c_all[start:stop].reshape(stop - start, inner).to(F64)
        diff = c - g
        d2 = (diff * diff).sum(dim=1)
        g2 = (g * g).sum(dim=1)
        if not math.isfinite(float(d2.sum()) + float(g2.sum())):  # a NaN or Inf in the block, or a sum overflowed
            diff = torch.where(g == c, 0.0, diff)  # equal Infs -> 0; NaN / unmatched Inf -> nan or inf
            bad_all[start:stop] = (~torch.isfinite(diff)).any(dim=1).cpu()
            d2 = torch.where(torch.isfinite(diff), diff, 0.0).square_().sum(dim=1)
            g2 = torch.where(torch.isfinite(g), g, 0.0).square_().sum(dim=1)
        d2_all[start:stop] = d2.cpu()
        g2_all[start:stop] = g2.cpu()
    return RowSums(d2_all, g2_all, bad_all)


def per_token_error(
    golden: torch.Tensor, candidate: torch.Tensor, token_dim: int = -2, *, floor_share: float = 0.0
) -> torch.Tensor:
    """Relative L2 error ``||c_t - g_t|| / ||g_t||`` of every slice ``t`` along ``token_dim``.

    All other dimensions are flattened. Returns float64 ``[T]``. A slice with ``||g_t|| = 0`` gives 0.0 if
    it is equal to the golden, else inf; a NaN or unmatched Inf makes the error inf. With
    ``floor_share``, the denominator is at least that share of the median row norm (see
    :meth:`RowSums.errors`).
    """
    return row_sums(golden, candidate, token_dim).errors(floor_share)


def worst_tokens(per_token: torch.Tensor, n: int = 5) -> list[tuple[int, float]]:
    """The ``n`` largest entries of a 1-D error vector as ``(position, error)``, largest first.

    Ties keep ascending position order; a NaN entry ranks as the worst.
    """
    per_token = check_tensor(per_token, "per_token")
    if per_token.ndim != 1:
        raise ValueError(f"per_token must be 1-D, got shape {tuple(per_token.shape)}")
    if n <= 0 or per_token.numel() == 0:
        return []
    values = per_token.to(F64).cpu()
    key = torch.where(torch.isnan(values), INF, values)
    order = torch.sort(key, descending=True, stable=True).indices[:n].tolist()
    picked = values[order].tolist()
    return list(zip(order, picked, strict=True))
