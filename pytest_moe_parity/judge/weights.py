"""Weights before activations: a candidate's weight tensor against the reference's, and what is
wrong with it in words (missing, transposed, gate/up halves swapped, experts or rows exchanged,
scaled, narrowed to another dtype, or just different)."""

from __future__ import annotations

import torch

from .distance import rel_l2

# Agreement of two float32 copies of one weight: bf16 storage rounds at 2^-8 relative.
REL_TOL = 2.0**-7


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64 (`distance.rel_l2`)."""
    return rel_l2(a.double(), b.double())


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and _rel(a, b) <= tol


def _matching(cand: torch.Tensor, ref: torch.Tensor, tol: float) -> list[int] | None:
    """For each slice i of `cand` along dim 0, the slice of `ref` it equals (None: some has none)."""
    found = []
    for i in range(cand.shape[0]):
        j = next((j for j in range(ref.shape[0]) if _close(cand[i], ref[j], tol)), None)
        if j is None:
            return None
        found.append(j)
    return found


def dtype_finding(name: str, ref_dtype: str | None, cand_dtype: str | None) -> str | None:
    """A tensor stored in another dtype than the reference's, in words (None: same, or unknown)."""
    if ref_dtype and cand_dtype and ref_dtype != cand_dtype:
        return f"{name}: stored as {cand_dtype}, the reference as {ref_dtype}"
    return None


def rounded(ref: torch.Tensor, cand: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the candidate's values are the reference's rounded to `dtype` (a conversion: a
    checkpoint stored in a narrower dtype than the reference's), exactly."""
    if cand.shape != ref.shape or not ref.is_floating_point():
        return False
    return bool(torch.equal(ref.detach().cpu().to(dtype).float(), cand.detach().cpu().float()))


def diagnose(
    name: str,
    ref: torch.Tensor,
    cand: torch.Tensor | None,
    *,
    ref_dtype: str | None = None,
    cand_dtype: str | None = None,
    tol: float = REL_TOL,
) -> list[str]:
    """What is wrong with the candidate's `name`, in words; [] when it holds the reference's values
    (within `tol`: storage rounding). Dtypes are the stored ones (e.g. "BF16"), when known: a tensor
    stored in another dtype is a finding only where its values are wrong too (a conversion is not)."""
    if cand is None:
        return [f"{name}: missing from the candidate"]
    ref, cand = ref.detach().float().cpu(), cand.detach().float().cpu()
    if cand.shape == ref.shape and _close(cand, ref, tol):
        return []
    narrowed = dtype_finding(name, ref_dtype, cand_dtype)
    findings = [narrowed] if narrowed else []
    findings.append(f"{name}: {_what(ref, cand, tol)}")
    return findings


def _what(ref: torch.Tensor, cand: torch.Tensor, tol: float) -> str:
    if cand.shape != ref.shape:
        flipped = cand.transpose(-1, -2) if cand.dim() >= 2 else None
        if flipped is not None and flipped.shape == ref.shape and _close(flipped, ref, tol):
            return f"transposed (the candidate holds {list(cand.shape)}, the reference {list(ref.shape)})"
        return f"shape {list(cand.shape)}, the reference's {list(ref.shape)}"
    if cand.dim() == 0:
        return f"{cand.item():.6g}, the reference's {ref.item():.6g}"
    if cand.numel() > 1 and bool((cand == cand.flatten()[0]).all()):  # one value everywhere: never loaded?
        return f"every value is {cand.flatten()[0].item():.6g} (left at its initialisation?)"
    dot = (cand.double() * ref.double()).sum().item()
    norm = (ref.double() ** 2).sum().item()
    if norm > 0:
        k = dot / norm
        if abs(k - 1) > tol and _rel(cand, ref * k) <= tol:
            return f"scaled by {k:.4g}"
    for dim in range(cand.dim()):  # gate and up halves exchanged (fused [.., 2I, ..] layouts)
        n = cand.shape[dim]
        if n % 2 == 0 and n >= 2:
            a, b = cand.split(n // 2, dim=dim)
            if _close(torch.cat([b, a], dim=dim), ref, tol):
                return f"its halves along dim {dim} are exchanged (gate and up swapped?)"
    if cand.dim() >= 2 and cand.shape[0] > 1:  # experts (3-D) or rows (2-D) exchanged
        order = _matching(cand, ref, tol)
        if order is not None:
            moved = [(i, j) for i, j in enumerate(order) if i != j]
            what = "expert" if cand.dim() >= 3 else "row"
            shown = ", ".join(f"{what} {i} holds reference {what} {j}" for i, j in moved[:3])
            return shown + (f" (and {len(moved) - 3} more)" if len(moved) > 3 else "")
    if cand.dim() >= 2:  # some slices wrong: which
        bad = [i for i in range(cand.shape[0]) if not _close(cand[i], ref[i], tol)]
        if 0 < len(bad) < cand.shape[0]:
            what = "expert" if cand.dim() >= 3 else "row"
            zero = [i for i in bad if cand[i].abs().max().item() == 0]
            listed = ", ".join(map(str, bad[:4])) + (" ..." if len(bad) > 4 else "")
            verb = f"{what}s {listed} differ" if len(bad) > 1 else f"{what} {listed} differs"
            return verb + (f" ({len(zero)} all zeros)" if zero else "")
    return f"differs: rel_l2 {_rel(cand, ref):.3g}, max_abs {(cand - ref).abs().max().item():.3g}"
