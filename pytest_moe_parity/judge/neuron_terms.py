"""The vLLM Neuron plugin's own acceptance terms, computed as its accuracy module computes them, so that
a Neuron port's reviewer sees the figures their review asks for beside this tool's verdict.

Three runs: the baseline (the HF reference in float32: the golden), the expected (the HF reference in
the candidate's dtype, bfloat16: the plugin's "BF16 CPU" run) and the actual (the Neuron run). Each
error is against the baseline; the terms compare the target's error with the dtype's own.

Source: `vllm_neuron/accuracy/` of the vLLM Neuron plugin. The stored snapshot of vllm-project/vllm-neuron
(a5ef7c8, 2025-11-17) predates the module; it was read in the public fork jinhuang12/vllm-neuron:

- `tensor_compare.py` (the text `testing.py` imports): `compare_tensors_three_way` (L-inf and L2 errors
  relative to the baseline's max and norm; their target/dtype ratios; `_compute_bc`, a Bhattacharyya
  coefficient of the two absolute-error histograms over 100 shared bins), passed when both ratios are
  under `DynamicThresholdConfig`'s 1.5; `compare_captures_three_way` compares each token apart.
- `testing.py` (commit 16045ea5d04a14e57d4178205a9485c0e89720dc): `assert_close_three_way` over several
  inputs: the worst L-inf and L2 ratios, and the BC and sigma-ratio (RMS of the target's errors over the
  dtype's) of all inputs' errors pooled; passed when `(bc >= 0.99 or sigma_ratio <= 1.0) and worst L-inf
  ratio < 5.0 and worst L2 ratio < 3.0`.
- `logit_validation.py` (commit 10c6804db2035ce7de5a19474a00b78223d9ebb4): `_compute_three_way_metrics` per
  generated token (infinite logits masked, the baseline's max and norm clamped to 1e-10) with its own
  `_compute_bc` (no equal-range guard), and `_compute_aggregate_metrics`: per generated token the BC of the
  errors pooled across prompts (`agg_bc` PASS when every one is >= 0.99), the sigma-ratio of all errors
  pooled, `agg_linf/l2_{1.2,1.5}x` (per token, the worst target error across prompts under that multiple of
  the worst dtype error); `multi_prompt_logit_validation` passes on `sigma_ratio <= 1.0 or agg_bc PASS`, or on
  every prompt's two-way tolerance-map check (not computed here)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

DYNAMIC_MULTIPLIER = 1.5  # tensor_compare.DynamicThresholdConfig.linf_multiplier, l2_multiplier
BC_THRESHOLD = 0.99  # testing.assert_close_three_way(bc_threshold=0.99); DEFAULT_AGGREGATE_CONFIG["agg_bc_threshold"]
MAX_LINF_RATIO = 5.0  # testing.assert_close_three_way(max_linf_ratio=5.0)
MAX_L2_RATIO = 3.0  # testing.assert_close_three_way(max_l2_ratio=3.0)
SIGMA_THRESHOLD = 1.0  # DEFAULT_AGGREGATE_CONFIG["agg_sigma_ratio_threshold"]; assert_close_three_way's sigma <= 1.0
AGG_MULTIPLIERS = (1.2, 1.5)  # DEFAULT_AGGREGATE_CONFIG["agg_linf_multipliers"], ["agg_l2_multipliers"]
BINS = 100


def bc(errors1: np.ndarray, errors2: np.ndarray, *, guard: bool = True) -> float:
    """`_compute_bc`: the Bhattacharyya coefficient of two error histograms over `BINS` shared bins from the
    smaller minimum to the larger maximum. `guard`: tensor_compare's (1.0 where every error is the same
    value); logit_validation's has none (numpy then bins everything into its last bin)."""
    if len(errors1) == 0 or len(errors2) == 0:
        return 0.0
    lo, hi = min(errors1.min(), errors2.min()), max(errors1.max(), errors2.max())
    if guard and lo == hi:
        return 1.0
    bins = np.linspace(lo, hi, BINS + 1)
    h1, _ = np.histogram(errors1, bins=bins)
    h2, _ = np.histogram(errors2, bins=bins)
    p1, p2 = h1 / (h1.sum() + 1e-10), h2 / (h2.sum() + 1e-10)
    return float(np.clip(np.sum(np.sqrt(p1 * p2)), 0.0, 1.0))


def _ratio(tgt: float, base: float) -> float:
    return tgt / base if base > 0 else (0.0 if tgt == 0 else math.inf)


def three_way(baseline: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> dict[str, Any]:
    """`compare_tensors_three_way` on one input (shapes equal): errors relative to the baseline's max (L-inf)
    and norm (L2), their target/dtype ratios, the raw absolute errors, and its 1.5x verdict."""
    b, e, a = baseline.float(), expected.float(), actual.float()
    base_diff, tgt_diff = e - b, a - b
    bmax, bnorm = b.abs().max().item(), torch.norm(b).item()
    base_linf = base_diff.abs().max().item() / bmax if bmax > 0 else 0
    tgt_linf = tgt_diff.abs().max().item() / bmax if bmax > 0 else 0
    base_l2 = torch.norm(base_diff).item() / bnorm if bnorm > 0 else 0
    tgt_l2 = torch.norm(tgt_diff).item() / bnorm if bnorm > 0 else 0
    linf_ratio, l2_ratio = _ratio(tgt_linf, base_linf), _ratio(tgt_l2, base_l2)
    return {
        "linf_ratio": linf_ratio,
        "l2_ratio": l2_ratio,
        "passed": linf_ratio < DYNAMIC_MULTIPLIER and l2_ratio < DYNAMIC_MULTIPLIER,
        "base_errors": base_diff.abs().flatten().numpy(),
        "tgt_errors": tgt_diff.abs().flatten().numpy(),
    }


def module_terms(baseline: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> dict[str, Any]:
    """A point's terms over its tokens (each `[*rest]` vector an input, as `compare_captures_three_way`
    slices them): `assert_close_three_way`'s aggregate (sigma-ratio, BC, worst ratios, its verdict) and the
    number of tokens `compare_tensors_three_way` passes at 1.5x. Tensors `[tokens, *rest]`."""
    worst_linf = worst_l2 = 0.0
    base, tgt, within = [], [], 0
    for i in range(baseline.shape[0]):
        r = three_way(baseline[i], expected[i], actual[i])
        worst_linf, worst_l2 = max(worst_linf, r["linf_ratio"]), max(worst_l2, r["l2_ratio"])
        base.append(r["base_errors"])
        tgt.append(r["tgt_errors"])
        within += r["passed"]
    cat_base, cat_tgt = np.concatenate(base), np.concatenate(tgt)
    agg_bc = bc(cat_base, cat_tgt)
    base_rms, tgt_rms = float(np.sqrt(np.mean(cat_base**2))), float(np.sqrt(np.mean(cat_tgt**2)))
    sigma = tgt_rms / base_rms if base_rms > 0 else math.inf
    passed = (agg_bc >= BC_THRESHOLD or sigma <= SIGMA_THRESHOLD) and worst_linf < MAX_LINF_RATIO
    passed = passed and worst_l2 < MAX_L2_RATIO
    return {
        "sigma_ratio": sigma,
        "bc": agg_bc,
        "worst_linf_ratio": worst_linf,
        "worst_l2_ratio": worst_l2,
        "passed": passed,
        "inputs": baseline.shape[0],
        "tokens_within": within,
    }


def logit_token(baseline: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> dict[str, Any]:
    """`_compute_three_way_metrics` on one generated token's logits `[vocab]`."""
    fp32, base, tgt = baseline.float(), expected.float(), actual.float()
    mask = ~(torch.isinf(fp32) | torch.isinf(base) | torch.isinf(tgt))
    if not bool(mask.any()):
        return {"base_linf": math.inf, "tgt_linf": math.inf, "base_l2": math.inf, "tgt_l2": math.inf,
                "base_errors": np.zeros(0, np.float32), "tgt_errors": np.zeros(0, np.float32)}  # fmt: skip
    fp32_v, base_d, tgt_d = fp32[mask], base[mask] - fp32[mask], tgt[mask] - fp32[mask]
    fmax, fnorm = fp32_v.abs().max().clamp(min=1e-10), torch.norm(fp32_v).clamp(min=1e-10)
    return {
        "base_linf": (base_d.abs().max() / fmax).item(),
        "tgt_linf": (tgt_d.abs().max() / fmax).item(),
        "base_l2": (torch.norm(base_d) / fnorm).item(),
        "tgt_l2": (torch.norm(tgt_d) / fnorm).item(),
        "base_errors": base_d.abs().numpy(),
        "tgt_errors": tgt_d.abs().numpy(),
    }


def logit_terms(baseline: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> dict[str, Any]:
    """One generated token's logits across the prompts (`[prompts, vocab]`): its pooled BC (the per-token BC of
    `_compute_aggregate_metrics`), the worst errors across prompts, and the sums the run's sigma-ratio pools."""
    tokens = [logit_token(baseline[i], expected[i], actual[i]) for i in range(baseline.shape[0])]
    base = np.concatenate([t["base_errors"] for t in tokens]).astype(np.float64)
    tgt = np.concatenate([t["tgt_errors"] for t in tokens]).astype(np.float64)
    return {
        "bc": bc(base, tgt, guard=False) if len(base) and len(tgt) else 0.0,
        **{f"max_{k}": max(t[k] for t in tokens) for k in ("base_linf", "tgt_linf", "base_l2", "tgt_l2")},
        "base_sq": float(np.sum(base**2)),
        "tgt_sq": float(np.sum(tgt**2)),
        "n": len(base),
    }


def logit_validation(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """`_compute_aggregate_metrics`' cross-prompt terms over the generated tokens' `logit_terms`, and
    `multi_prompt_logit_validation`'s three-way pass (`sigma_ratio <= 1.0 or agg_bc`)."""
    n = sum(t["n"] for t in tokens)
    base_rms = math.sqrt(sum(t["base_sq"] for t in tokens) / n) if n else 0.0
    sigma = math.sqrt(sum(t["tgt_sq"] for t in tokens) / n) / base_rms if base_rms > 0 else math.inf
    per_token_bc = [t["bc"] for t in tokens]
    out: dict[str, Any] = {
        "tokens": len(tokens),
        "agg_sigma_ratio": sigma,
        "per_token_bc": per_token_bc,
        "agg_bc": "PASS" if tokens and all(b >= BC_THRESHOLD for b in per_token_bc) else "FAIL",
    }
    for kind in ("linf", "l2"):
        for mult in AGG_MULTIPLIERS:
            ok = all(t[f"max_tgt_{kind}"] < mult * t[f"max_base_{kind}"] for t in tokens)
            out[f"agg_{kind}_{mult}x"] = "PASS" if ok else "FAIL"
    out["passed"] = sigma <= SIGMA_THRESHOLD or out["agg_bc"] == "PASS"
    return out
