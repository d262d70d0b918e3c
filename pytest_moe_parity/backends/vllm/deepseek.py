"""`--hw vllm` on DeepSeek-V3 (vLLM's `DeepseekV3ForCausalLM`, in `deepseek_v2.py`): the calls that differ
from the other architectures'. The attention is vLLM's MLA (`DeepseekV2MLAAttention`: its fused q/kv
down-projection, norms, rotary, vLLM's MLA backend over a latent paged cache, o projection: `mla`); the
first `first_k_dense_replace` layers have a dense MLP (`DeepseekV2MLP`); the others vLLM's `DeepseekV2MoE`:
its gate (`GateLinear`, with `e_score_correction_bias`), the MoE runner's grouped top-k, its routed experts,
its shared experts (`DeepseekV2MLP`).

vLLM applies `routed_scaling_factor` to the routed experts' output (its runner's
`_maybe_apply_routed_scale_to_output`), where transformers multiplies the top-k weights by it: the router's
weights are shown times the runner's factor (what the golden's are), and weights given to vLLM's experts
(the golden's, or forced by --parity-routing) are divided by it before its experts take them, the output
times it after, as vLLM's runner does."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...errors import BackendError, PointUnavailable
from ...golden import GoldenRecord
from ...points import Point
from .. import CandidateOutput
from .mla import check_mla, mla_context, mla_layer

# What vLLM's DeepseekV2MoE reads from config.json to route as DeepSeek-V3 does (the hub's DeepSeek-V3
# config has both; transformers' DeepseekV3Config neither reads nor writes them): without them vLLM builds
# no score-correction bias and ranks experts by softmax.
ROUTING_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def check_config(config: dict[str, Any], model_dir: Any) -> None:
    """BackendError where vLLM would not route the checkpoint as DeepSeek-V3 does."""
    missing = {k: v for k, v in ROUTING_KEYS.items() if config.get(k) != v}
    if missing:
        keys = ", ".join(f'"{k}": "{v}"' for k, v in missing.items())
        raise BackendError(
            f"--hw vllm: vLLM's DeepseekV2MoE routes DeepSeek-V3 by its config's topk_method and scoring_func, "
            f"which {model_dir}/config.json lacks (transformers does not write them; DeepSeek's own config has "
            f"them): without them vLLM ranks experts by softmax with no score-correction bias; add {keys}"
        )


class DeepseekCalls:
    """The DeepSeek-V3 points of `--hw vllm`, on the backend's built model (`backend.model`)."""

    # vLLM's MLA keeps one latent row per token, the same on every TP rank (its down-projection is replicated)
    latent_cache = True

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        path = Path(backend.setup.model_dir) / "config.json"
        check_config(json.loads(path.read_text()) if path.is_file() else {}, backend.setup.model_dir)

    @property
    def _interleaved(self) -> bool:
        """The reference rotates interleaved pairs (transformers' `rope_interleave`, True by default)."""
        return bool(self.backend.golden.config.get("rope_interleave", True))

    def _layer(self, point: Point) -> Any:
        return self.backend.model.model.layers[point.layer]

    def _scale(self, block: Any) -> float:
        """The factor vLLM's MoE runner multiplies its routed experts' output by."""
        return float(block.experts.routed_scaling_factor)

    def _positions(self, positions: torch.Tensor, attn: Any) -> torch.Tensor:
        """The golden's positions as vLLM's model runner passes them: the first entries of a buffer of the
        scheduler's max_num_batched_tokens (zeros after them; at least heads x tokens long). vLLM's CPU rotary
        kernel reads past the tokens it is given when MLA hands it a 3-D query (it counts heads as tokens): in
        the engine, and here, those reads land in that buffer, not in whatever memory follows a small tensor."""
        flat = positions.reshape(-1)
        size = max(self.backend.config.scheduler_config.max_num_batched_tokens, attn.num_local_heads * flat.numel())
        buffer = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        buffer[: flat.numel()] = flat
        return buffer[: flat.numel()]

    def _fp16(self, point: Point) -> None:
        if self.backend.dtype == torch.float16:
            raise PointUnavailable(
                f"{point.id}: vLLM's DeepSeek runs float16 with its residual stream divided by routed_scaling_factor "
                "(its overflow guard in DeepseekV2DecoderLayer and the MoE runner): --hw vllm compares it in float32 "
                "or bfloat16"
            )

    def _rotary(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """The cos and sin of vLLM's rotary table at the golden's positions (`cos_sin_cache`: cos then sin over
        half the rotary dimensions; vLLM's DeepSeek rotates interleaved pairs, transformers' with
        `rope_interleave` too: the same frequencies, each repeated as transformers' table has them)."""
        rotary = self.backend.model.model.layers[0].self_attn.rotary_emb
        positions = golden.kwargs.get("position_ids")
        if positions is None and len(golden.args) > 1:
            positions = golden.args[1]
        if positions is None:
            raise PointUnavailable(f"{point.id}: --hw vllm reads vLLM's rotary table at the golden's positions")
        cos, sin = rotary.cos_sin_cache.index_select(0, positions.reshape(-1)).chunk(2, dim=-1)
        shape = (*positions.shape, -1)
        return (torch.cat([cos, cos], -1).reshape(shape), torch.cat([sin, sin], -1).reshape(shape)), None

    def _attention(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """vLLM's MLA attention module on the golden's hidden states and positions, over a latent paged cache
        and MLA metadata built for the call; a decode step's cache after it read back."""
        attn = self._layer(point).self_attn
        layer = mla_layer(attn)
        check_mla(point, layer, golden)
        hidden, positions = golden.kwargs["hidden_states"], golden.kwargs["position_ids"]
        with mla_context(self.backend.config, layer, golden, self.backend.device, self._interleaved) as state:
            out = attn(self._positions(positions, attn), hidden.reshape(-1, hidden.shape[-1]), None)
        return CandidateOutput((out.reshape(hidden.shape), None), cache=state.get("cache")), None

    def _mlp(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """A dense layer's MLP (vLLM's DeepseekV2MLP: merged gate/up projection, SiluAndMul, down projection)."""
        return _flat(self._layer(point).mlp, golden.args[0]), None

    def _shared_experts(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """The block's shared experts (vLLM's DeepseekV2MLP built with `reduce_results=False`: at TP > 1 each
        rank's output is a partial sum, which vLLM's MoE runner all-reduces with the routed experts' sum)."""
        block = self._layer(point).mlp
        return _reduced(block, _flat(block.shared_experts, golden.args[0])), None

    def _router(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """vLLM's gate logits, then its MoE runner's grouped top-k (with the score-correction bias); the
        weights times the runner's routed_scaling_factor, as transformers' router gives them."""
        block = self._layer(point).mlp
        x = golden.args[0]
        flat = x.reshape(-1, x.shape[-1])
        logits, _ = block.gate(flat)
        weights, ids = block.experts.router.select_experts(hidden_states=flat, router_logits=logits)
        return (logits, (weights * self._scale(block)).to(x.dtype), ids.long()), None

    def _experts(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """vLLM's routed experts (its fused MoE through the quant method) on the golden's routing: the golden's
        weights divided by routed_scaling_factor, the output times it, as vLLM's runner applies it."""
        x, ids, weights = golden.args[:3]
        block = self._layer(point).mlp
        routed = block.experts.routed_experts
        if routed.quant_method.is_monolithic:
            raise PointUnavailable(
                f"{point.id}: vLLM's {type(routed.quant_method).__name__} routes inside its kernel (monolithic): "
                "its experts cannot be given the golden's routing"
            )
        scale = self._scale(block)
        flat = x.reshape(-1, x.shape[-1])
        topk = weights.reshape(flat.shape[0], -1).float() / scale
        out = routed.forward_modular(flat, topk_weights=topk, topk_ids=ids.reshape(flat.shape[0], -1).int())
        return _reduced(block, out * scale).reshape(x.shape), None

    def _moe(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, Any]:
        """vLLM's DeepseekV2MoE whole (gate, grouped top-k, routed experts scaled, shared experts added); its
        runner's expert selection seen (and, with `force`, replaced)."""
        self._fp16(point)
        x = golden.args[0]
        block = self._layer(point).mlp
        with self._routing(block, force) as seen:
            out = _flat(block, x)
        return out, (seen[-1] if seen else None)

    def _output(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, Any]:
        """vLLM's decoder layer (norms fused with the residual adds, MLA attention, the MLP or the MoE block):
        its output is vLLM's (hidden, residual) summed, what the next layer's input norm adds."""
        self._fp16(point)
        layer = self._layer(point)
        mla = mla_layer(layer.self_attn)
        check_mla(point, mla, golden)
        hidden, positions = golden.args[0], golden.kwargs["position_ids"]
        routing = self._routing(layer.mlp, force) if hasattr(layer.mlp, "experts") else contextlib.nullcontext([])
        with mla_context(self.backend.config, mla, golden, self.backend.device, self._interleaved), routing as seen:
            flat = hidden.reshape(-1, hidden.shape[-1])
            out, residual = layer(self._positions(positions, layer.self_attn), flat, None)
        return (out + residual).reshape(hidden.shape), (seen[-1] if seen else None)

    @contextlib.contextmanager
    def _routing(self, block: Any, force: Any) -> Iterator[list]:
        """The MoE runner's expert selection seen as (logits, weights times routed_scaling_factor, ids), the
        golden's convention, and replaced by `force(it)` (its weights divided by the factor again)."""
        router = block.experts.router
        scale = self._scale(block)
        seen: list[tuple[torch.Tensor, ...]] = []
        select = router.select_experts

        def selecting(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = select(*args, **kwargs)
            routing = (kwargs["router_logits"], weights * scale, ids.long())
            if force is not None:
                routing = tuple(force(routing))
            seen.append(routing)
            return (routing[1] / scale).to(weights.dtype), routing[2].to(ids.dtype)

        router.select_experts = selecting
        try:
            yield seen
        finally:
            del router.select_experts


def _reduced(block: Any, out: torch.Tensor) -> torch.Tensor:
    """A rank's partial sum of the MoE block all-reduced as vLLM's runner reduces the block's output (its late
    all-reduce, `_maybe_reduce_final_output`: a no-op at TP 1)."""
    return block.experts._maybe_reduce_final_output(out, None, output_is_reduced=False)


def _flat(module: Any, x: torch.Tensor) -> torch.Tensor:
    """`module` on `x` as vLLM's layers take it (tokens flattened), in `x`'s shape."""
    return module(x.reshape(-1, x.shape[-1])).reshape(x.shape)
