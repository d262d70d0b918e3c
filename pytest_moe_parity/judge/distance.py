"""The relative errors every room compares with, one family (as torch's numeric suite keeps
`compute_normalized_l2_error` and its siblings together): `rel_l2` (a candidate against a
reference, over the entries that are not masks, integers by the share that differ), the norms it
divides by, and `rel_l2_flat` (two outputs of one size in any shape). On the CPU, large values
are compared a chunk at a time through scratch buffers (no temporary the size of the values)."""

from __future__ import annotations

import math
import threading

import torch

# |x| at least this is a mask (finfo(dtype).min, -inf), whatever the dtype: not a magnitude to compare
MASKED = 1e30


def rel_l2(candidate: torch.Tensor, reference: torch.Tensor, norm: float | None = None) -> float:
    """||candidate - reference|| / ||reference|| over the reference's entries that are not masks
    (masks: entries of magnitude 1e30 and more, a dtype's lowest or an infinity, which must be masks
    of the same sign on both sides, else the error is infinite; a NaN where the other side has none
    is an infinite error); for integer and boolean outputs, the share of entries that differ.
    `norm`: ||reference|| over its entries that are not masks (`unmasked_norm`), where the caller
    has it (a reference op's, computed once)."""
    r = reference.detach()
    c = candidate.detach().to(r.device)
    if not (r.is_floating_point() or r.is_complex()):
        return float((c != r).double().mean()) if c.numel() else 0.0
    if r.is_complex() or c.is_complex():  # DeepSeek-V2's rotary: (real, imaginary) pairs
        c, r = torch.view_as_real(c.to(torch.complex64)), torch.view_as_real(r.to(torch.complex64))
    r = r if r.dtype in (torch.float32, torch.float64) else r.float()
    # both clamped to +-MASKED: masks (the dtype's lowest, infinities: masked scores) where and of the
    # sign the reference's are differ by 0 there; a mask on one side only, or of another sign, by
    # MASKED or more, and a NaN by one: the exact tests below tell those
    num = _diff_norm(c, r)
    if math.isfinite(num) and num < MASKED:  # the common case: one pass, and the reference's norm
        given = norm is not None and math.isfinite(norm) and norm < MASKED
        denom = norm if given else float(torch.linalg.vector_norm(r))
        if not (math.isfinite(denom) and denom < MASKED):
            denom = unmasked_norm(r)
        return _ratio(num, denom)
    masked = r.abs() >= MASKED
    if bool(masked.any()):  # compared as masks, not as magnitudes
        c = c.to(r.dtype)
        if not torch.equal(masked, c.abs() >= MASKED) or bool(((r < 0) != (c < 0)).logical_and_(masked).any()):
            return float("inf")
        num = float(torch.linalg.vector_norm(torch.where(masked, 0.0, c - r)))
        denom = float(torch.linalg.vector_norm(torch.where(masked, 0.0, r)))
        if math.isfinite(num) and math.isfinite(denom):
            return _ratio(num, denom)
        c, r = torch.where(masked, 0.0, c), torch.where(masked, 0.0, r)  # what is left: NaNs, infinities
    same = (c == r) | (c.isnan() & r.isnan())
    if bool((~same & ~(c.isfinite() & r.isfinite())).any()):
        return float("inf")
    num = float(torch.linalg.vector_norm(torch.where(same, 0.0, c - r).double()))
    denom = float(torch.linalg.vector_norm(torch.where(r.isfinite(), r, 0.0).double()))
    return _ratio(num, denom)


def _ratio(num: float, denom: float) -> float:
    """num / denom, where no difference is 0 and a difference from zero infinite."""
    if not num:
        return 0.0
    return num / denom if denom else float("inf")


CHUNK = 1 << 18  # entries `_diff_norm` takes at a time on the CPU
_scratch = threading.local()  # per thread: its scratch buffers, per dtype


def _buffers(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two CPU buffers of CHUNK entries of `dtype`, made once per thread (1 MiB each in float32)."""
    kept = getattr(_scratch, "buffers", None)
    if kept is None:
        kept = _scratch.buffers = {}
    if dtype not in kept:
        kept[dtype] = (torch.empty(CHUNK, dtype=dtype), torch.empty(CHUNK, dtype=dtype))
    return kept[dtype]


def _diff_norm(c: torch.Tensor, r: torch.Tensor) -> float:
    """||clamp(c) - clamp(r)|| in r's dtype, each clamped to +-MASKED (c and r of one shape). On the
    CPU, CHUNK entries at a time through a scratch buffer: no temporary the size of the values (a
    fresh one of megabytes costs more in page faults than the sum, and host memory at a real
    model's shapes)."""
    n = r.numel()
    if r.device.type != "cpu" or n <= CHUNK or not (c.is_contiguous() and r.is_contiguous()):
        num = float(torch.linalg.vector_norm(c.to(r.dtype, copy=True).sub_(r)))
        if math.isfinite(num) and num < MASKED:  # no masks, or masks alike to the bit: fewer ops than clamping
            return num
        diff = c.to(r.dtype, copy=True).clamp_(-MASKED, MASKED).sub_(r.clamp(-MASKED, MASKED))
        return float(torch.linalg.vector_norm(diff))
    flat_c, flat_r = c.reshape(-1), r.reshape(-1)
    buffer, other = _buffers(r.dtype)
    total = 0.0
    for start in range(0, n, CHUNK):
        size = min(CHUNK, n - start)
        part = buffer[:size].copy_(flat_c[start : start + size]).clamp_(-MASKED, MASKED)
        part.sub_(other[:size].copy_(flat_r[start : start + size]).clamp_(-MASKED, MASKED))
        total += float(torch.linalg.vector_norm(part)) ** 2
    return math.sqrt(total)


def unmasked_norm(t: torch.Tensor) -> float:
    """||t|| in float32 over its entries that are not masks (of magnitude MASKED and more)."""
    norm = float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32))
    return norm if math.isfinite(norm) and norm < MASKED else mask_figures(t)[0]


def mask_figures(t: torch.Tensor) -> tuple[float, int, int]:
    """(||t|| in float32 over its entries that are not masks, its masks below 0, above 0); on the
    CPU CHUNK entries at a time, as `_diff_norm`."""
    x = t.detach()
    if x.device.type != "cpu" or x.numel() <= CHUNK or not x.is_contiguous():
        x = x.float()
        low, high = x <= -MASKED, x >= MASKED
        counts = int(torch.count_nonzero(low)), int(torch.count_nonzero(high))
        return float(torch.linalg.vector_norm(x.masked_fill(low.logical_or_(high), 0.0))), *counts
    flat, buffer = x.reshape(-1), _buffers(torch.float32)[0]
    total, lows, highs = 0.0, 0, 0
    for start in range(0, x.numel(), CHUNK):
        part = buffer[: min(CHUNK, x.numel() - start)].copy_(flat[start : start + CHUNK])
        low, high = part <= -MASKED, part >= MASKED
        lows, highs = lows + int(torch.count_nonzero(low)), highs + int(torch.count_nonzero(high))
        total += float(torch.linalg.vector_norm(part.masked_fill_(low.logical_or_(high), 0.0))) ** 2
    return math.sqrt(total), lows, highs


def rel_l2_flat(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """`rel_l2` of two values of one size over their flattened entries (inf where the sizes differ):
    a module's output against another run's, whatever shape each gives it."""
    if candidate.numel() != reference.numel():
        return float("inf")
    return rel_l2(candidate.detach().reshape(reference.shape), reference)
