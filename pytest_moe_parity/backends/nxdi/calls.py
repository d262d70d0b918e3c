"""The module built per point and the golden's calls in NxDI's forms: the attention's (boolean mask,
int32 positions, the cache as K, V), the experts' (affinities over every expert), the router's outputs
read as the reference's."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ...golden import GoldenRecord
from ...model.calls import cache_states
from ...tree import CacheState
from .imports import upstream_warnings
from .tables import resolve
from .weights import nxdi_cast


class NxdiPoint(nn.Module):
    """The NxDI module of one point, called as the point needs it (the MoE's router, its experts on
    given routing, the whole module; an attention or a decoder layer on (hidden, mask, position ids
    [, past K, past V]), giving (hidden, K, V) and, with `routing`, that submodule's outputs after
    them, caught by a forward hook as NxD's tensor capture does). Built by build_module from
    keyword arguments."""

    def __init__(
        self,
        factory: str,
        kwargs: dict[str, Any],
        call: str,
        form: str = "hidden",
        routing: str = "",
        kv_heads: list[list[int]] | None = None,
        seq_len: int = 0,
        forced: str = "",
        submodule: str = "",
        buffers: dict[str, int] | None = None,
        topk_weights: dict[str, Any] | None = None,
        call_kwargs: dict[str, Any] | None = None,
        before_call: str = "",
    ):
        super().__init__()
        self.inner = resolve(factory)(**kwargs)
        for name, size in (buffers or {}).items():  # read as attributes, set by the model that owns the module
            owner, _, attr = name.rpartition(".")
            self.inner.get_submodule(owner).register_buffer(attr, torch.zeros(size))
        if submodule:
            self.inner = self.inner.get_submodule(submodule)
        self.topk_weights = topk_weights or {}
        config = kwargs.get("config")
        if config is not None and getattr(config.neuron_config, "cast_type", "config") == "config":
            nxdi_cast(self.inner, config.neuron_config.torch_dtype)
        # a dotted call names a submodule's attribute (GPT-OSS's `moe.router` inside its MoE wrapper)
        self.call = call
        self._owner, _, self._method = call.rpartition(".")
        self.call_kwargs = dict(call_kwargs or {})
        self.before_call = before_call
        self.form = form
        self.seq_len = seq_len
        self._caught: list[Any] = []
        if routing:
            self.inner.get_submodule(routing).register_forward_hook(lambda _m, _i, out: self._caught.append(out))
        self._forced: tuple[torch.Tensor, ...] | None = None  # (affinities [T, E], top-k ids) the router gives
        if forced:
            self.inner.get_submodule(forced).register_forward_hook(self._force)
        # token generation at TP > 1: each rank takes its kv heads of the cache
        self.register_buffer("kv_heads", None if kv_heads is None else torch.tensor(kv_heads, dtype=torch.int32))
        if kv_heads is not None:
            self.rank_util = resolve("neuronx_distributed.parallel_layers.layers:SPMDRank")(len(kv_heads))

    def _force(self, module: nn.Module, args: Any, out: Any) -> Any:
        if self._forced is None:
            return out
        affinities, index = self._forced
        return (out[0], affinities.to(out[1].dtype), index.to(out[2].dtype), *out[3:])

    @property
    def owner(self) -> nn.Module:
        """The module whose attribute the call names (the built module itself for an undotted call)."""
        return self.inner.get_submodule(self._owner) if self._owner else self.inner

    def forward(self, first: torch.Tensor, *rest: torch.Tensor) -> Any:
        if self.before_call:  # an attribute path (GPT-OSS's rotary cache manager is no nn.Module)
            functools.reduce(getattr, self.before_call.split("."), self.inner)()
        if self.form == "mla":  # DeepSeek's MLA: its cache one tensor, (rotary K, latent KV), given and written
            mask, positions, *past = rest
            out = self.inner(
                hidden_states=first,
                attention_mask=mask,
                position_ids=positions,
                past_key_value=past[0] if past else None,
            )
            return (out[0], out[1][0], out[1][1])
        if self.form == "partial":  # NxD's SharedExperts: its row-parallel down projection left unreduced
            mlp = self.inner.get_submodule(self.call)
            out = mlp(first, self.seq_len)
            if mlp.sequence_parallel_enabled and self.seq_len > 1:  # its weights replicated: each rank the whole
                return out
            return reduce_partial(mlp.tensor_parallel_group, out)
        if self.form == "router":
            return self._read_topk(*(getattr(self.owner, self._method) if self.call else self.inner)(first)[:3])
        if self.form == "forced":  # the whole module, its router's affinities and top-k ids given
            self._forced = (rest[0], rest[1])
            try:
                out = self.inner(first)
            finally:
                self._forced = None
            return out[0] if isinstance(out, tuple | list) else out
        if self.form == "attention":
            mask, positions, *past = rest
            if past and self.kv_heads is not None:
                mine = self.kv_heads.index_select(0, self.rank_util.get_rank()).flatten()
                past = [t.index_select(1, mine) for t in past]
            self._caught.clear()
            out = self.inner(
                hidden_states=first,
                attention_mask=mask,
                position_ids=positions,
                past_key_value=tuple(past) if past else None,
                **self.call_kwargs,
            )
            caught = tuple(self._caught[0]) if self._caught else ()
            return (out[0], out[1][0], out[1][1], *caught)
        if self._method == "expert_mlps":
            affinities, index = rest
            moe = self.owner
            return reduce_experts(moe, moe.expert_mlps(first, affinities, index, self.seq_len))
        if self.call:
            return getattr(self.owner, self._method)(first, *rest)  # a router: (logits, affinities [T, E], ids)
        out = self.inner(first, *rest)
        return out[0] if isinstance(out, tuple | list) else out

    def _read_topk(self, logits: torch.Tensor, affinities: torch.Tensor, index: torch.Tensor) -> tuple:
        """The router's (logits, affinities [T, E], ids); with `topk_weights`, its top-k ids' affinities
        weighed as the model weighs them after the router (renormalised, scaled): (logits, [T, k], ids)."""
        if not self.topk_weights:
            return logits, affinities, index
        picked = affinities.gather(-1, index.long())
        if self.topk_weights["normalize"]:
            picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
        return logits, picked * self.topk_weights["scale"], index


class RankCapture:
    """`drill_call`'s module on the CPU build: captured on its ranks (`capture_ops` gives each
    rank's graph: the drill joins them), its outputs read as the point reads them (`read_as`)."""

    def __init__(self, module: Any, read_as: Any = None):
        self.module, self.read_as = module, read_as

    def capture_ops(self, capture: Any, args: list, kwargs: dict, router: bool | None = None) -> list:
        with upstream_warnings():
            return self.module.capture_ops(capture, args, kwargs, router=router)


def router_as_reference(logits: torch.Tensor, affinities: torch.Tensor, index: torch.Tensor, golden_w: torch.Tensor):
    """NxDI's router's (logits, affinities [T, E], ids) as the reference's (logits, top-k weights,
    ids): the top-k ids' affinities, renormalised where the golden's are (`judge.routing`)."""
    from ...judge.routing import topk_of_affinities

    return logits, topk_of_affinities(affinities, index, golden_w)[0], index


def reduce_experts(moe: Any, partial: torch.Tensor) -> torch.Tensor:
    """The all-reduce NxD's MoE module applies to its experts' output (`ExpertMLPsV2` leaves each
    rank with its partial sum: the "delayed all-reduce" of `modules/moe/model.py`), over the expert-
    parallel world where experts are sharded by EP, else the tensor-parallel group."""
    from neuronx_distributed.parallel_layers import mappings, parallel_state

    group = parallel_state.get_world_group() if getattr(moe, "ep_enabled", False) else moe.tensor_parallel_group
    return mappings.reduce_from_tensor_model_parallel_region(partial, process_group=group)


def reduce_partial(group: Any, partial: torch.Tensor) -> torch.Tensor:
    """The all-reduce over `group` that NxD's MoE applies to its shared experts' partial sums (the
    MoE's delayed all-reduce; at token generation with sequence parallelism, each rank's slice of the
    replicated weights, `SharedExperts._forward_token_gen_replicated_weights`)."""
    from neuronx_distributed.parallel_layers import mappings

    return mappings.reduce_from_tensor_model_parallel_region(partial, process_group=group)


def interleaved(rotary: torch.Tensor) -> torch.Tensor:
    """transformers' DeepSeek rotary K (`rope_interleave`: each pair's rotated halves laid out as [evens,
    odds]) in NxDI's layout (the pairs interleaved, as NxDI's `rotate_fn` rotates them)."""
    half = rotary.shape[-1] // 2
    return torch.stack((rotary[..., :half], rotary[..., half:]), dim=-1).flatten(-2)


def deinterleaved(rotary: torch.Tensor) -> torch.Tensor:
    """NxDI's rotary K back in transformers' layout (the inverse of `interleaved`)."""
    return torch.cat((rotary[..., 0::2], rotary[..., 1::2]), dim=-1)


def mla_inputs(golden: GoldenRecord) -> tuple[torch.Tensor, ...]:
    """The golden call of DeepSeek's MLA attention in NxDI's form: as `attention_inputs`, the cache (the
    latent KV [B, 1, S, kv_lora_rank] and the rotary K [B, 1, S, rope dim], as transformers caches them)
    as NxDI's one past tensor [B, S, rope dim + kv_lora_rank] (rotary K first, in NxDI's layout)."""
    inputs = attention_inputs(golden)
    if len(inputs) == 3:
        return inputs
    hidden, mask, positions, latent, rotary = inputs
    return hidden, mask, positions, torch.cat([interleaved(rotary[:, 0]), latent[:, 0]], dim=-1)


def attention_inputs(golden: GoldenRecord) -> tuple[torch.Tensor, ...]:
    """The golden call of an attention or a decoder layer (hidden states, transformers' additive
    mask [B, 1, Q, past + Q], position ids, the KV cache at a decode step) in NxDI's form: (hidden,
    a boolean mask, int32 position ids) for context encoding, (hidden, the mask over the past
    positions [B, 1, Q, past], position ids, past K, past V) for token generation. Without a
    recorded mask or positions: causal, and positions counted on from the cache's length."""
    hidden = golden.kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        hidden = next(a for a in golden.args if isinstance(a, torch.Tensor))
    bsz, q_len = hidden.shape[:2]
    cache = cache_of(golden)
    past = int(cache.keys.shape[2]) if cache is not None else 0
    mask = golden.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        keep = mask if mask.dtype == torch.bool else mask == 0
        keep = keep[:, :1, :, : past + q_len].expand(bsz, 1, q_len, past + q_len)
    else:
        keep = torch.ones(q_len, past + q_len, dtype=torch.bool).tril(past).expand(bsz, 1, q_len, past + q_len)
    positions = golden.kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(past, past + q_len).expand(bsz, q_len)
    positions = positions.to(torch.int32).expand(bsz, q_len).contiguous()
    if cache is None:
        return hidden, keep.contiguous(), positions
    return hidden, keep[..., :past].contiguous(), positions, cache.keys, cache.values


def chunk_size(config: Any, layer: int | None) -> int:
    """The attention chunk of a layer the golden's config makes chunked (Llama 4's `layer_types`
    "chunked_attention"); 0 for any other layer."""
    data = config if isinstance(config, dict) else config.to_dict() if hasattr(config, "to_dict") else {}
    types = data.get("layer_types") or []
    if layer is None or layer >= len(types) or types[layer] != "chunked_attention":
        return 0
    return int(data.get("attention_chunk_size") or 0)


def chunked_attention_inputs(golden: GoldenRecord, chunk: int) -> tuple[torch.Tensor, ...]:
    """A decode step of a chunked attention layer in NxDI's form (`NeuronAttentionBase.chunked_attention_
    forward` at token generation): its KV cache of `chunk` slots, position p in slot p % chunk, holding
    the current chunk's past positions (taken from the golden's cache, whose last chunk - 1 positions
    transformers keeps), the other slots zeros; the mask over the slots before p % chunk, as NxDI's
    `_create_chunked_attn_mask_tkg` makes it; the position ids those the golden's cache has seen."""
    hidden = attention_inputs(golden)[0]
    cache = cache_of(golden)
    assert cache is not None and cache.seen is not None
    bsz, q_len = hidden.shape[:2]
    position = int(cache.seen)
    here = position % chunk  # the current chunk's positions before this one
    keys, values = (torch.zeros(*t.shape[:2], chunk, t.shape[3], dtype=t.dtype) for t in (cache.keys, cache.values))
    if here:
        keys[:, :, :here] = cache.keys[:, :, -here:]
        values[:, :, :here] = cache.values[:, :, -here:]
    mask = (torch.arange(chunk) < here).expand(bsz, 1, q_len, chunk).contiguous()
    positions = torch.full((bsz, q_len), position, dtype=torch.int32)
    return hidden, mask, positions, keys, values


def cache_of(golden: GoldenRecord) -> CacheState | None:
    """The KV cache a decode step's call carries (None: a prefill call)."""
    found = cache_states(golden.kwargs) + cache_states(golden.args)
    return found[0] if found else None


def cache_after(
    past: CacheState, keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor
) -> CacheState:
    """A token-generation step's cache after the call: the past and this step's K, V; for a sliding-
    window layer the window - 1 latest positions (what NxDI's rolling buffer holds, in position order)."""
    keys, values = (
        torch.cat([keys, new_keys.to(keys.dtype)], dim=2),
        torch.cat([values, new_values.to(values.dtype)], dim=2),
    )
    if past.window is None:
        return CacheState(past.layer, keys, values)
    kept = past.window - 1
    seen = None if past.seen is None else past.seen + new_keys.shape[2]
    return CacheState(past.layer, keys[:, :, -kept:], values[:, :, -kept:], past.window, seen)


def rank_kv_heads(tp_degree: int, heads: int, kv_heads: int) -> list[list[int]] | None:
    """Which of the model's kv heads each rank holds, as NxD's GQA shards them
    (`gqa.get_shardable_head_counts`, `replicate_kv`): kept where the TP degree divides them, else each
    repeated (repeat_interleave) up to the TP degree (REPLICATE_TO_TP_DEGREE, when it is a multiple)
    or to the attention heads (CONVERT_TO_MHA), then split evenly. None where NxDI pads the attention
    heads (their count not a multiple of the TP degree)."""
    if heads % tp_degree:
        return None
    if heads == kv_heads or kv_heads % tp_degree == 0:
        grown = kv_heads
    else:
        grown = tp_degree if tp_degree % kv_heads == 0 else heads
    repeats, each = grown // kv_heads, grown // tp_degree
    return [[j // repeats for j in range(r * each, (r + 1) * each)] for r in range(tp_degree)]


def experts_inputs(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int):
    """The golden experts call (hidden [T, H], top-k ids, top-k weights) in NxD's form: (hidden,
    affinities [T, E] with each token's top-k weights at their expert ids, ids [T, k])."""
    ids = top_k_index.reshape(-1, top_k_index.shape[-1]).long()
    weights = top_k_weights.reshape(ids.shape).to(hidden.dtype)
    affinities = torch.zeros(ids.shape[0], experts, dtype=hidden.dtype).scatter(1, ids, weights)
    return hidden.reshape(ids.shape[0], -1), affinities, ids
