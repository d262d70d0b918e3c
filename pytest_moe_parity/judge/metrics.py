"""The judge's metrics, one import away: tensors (`tensors`: cosine, rel_l2, max_abs, ... at memory
speed), tokens (`tokens`: each token's own error), routing (`routing`: top-k sets, ties and flips) and
logits (`logits`: next-token agreement). Each lives in its own module; this one gathers their public
names (the metrics' public API: `from pytest_moe_parity.judge.metrics import compare_tensors`)."""

from __future__ import annotations

from .logits import LogitsMetrics, compare_logits
from .routing import RoutingFlip, RoutingMetrics, compare_routing, scatter_topk, tie_tolerance
from .tensors import TensorMetrics, compare_tensors, worst_elements
from .tokens import RowSums, per_token_error, row_sums, worst_tokens

__all__ = [
    "LogitsMetrics",
    "RoutingFlip",
    "RoutingMetrics",
    "RowSums",
    "TensorMetrics",
    "compare_logits",
    "compare_routing",
    "compare_tensors",
    "per_token_error",
    "row_sums",
    "scatter_topk",
    "tie_tolerance",
    "worst_elements",
    "worst_tokens",
]
