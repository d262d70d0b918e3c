"""vLLM's multi-head latent attention (DeepSeek's MLA) called outside its engine: the latent paged cache
and the MLA metadata its model runner would build, built here for one sequence from the golden's call.

vLLM's MLA layer (`MLAAttention`) keeps one latent row per token in its paged cache,
`[blocks, block_size, kv_lora_rank + qk_rope_head_dim]`: the normed compressed KV (`kv_c_normed`) and the
roped shared key (`k_pe`). The golden of transformers' DeepSeek-V3 keeps the same two tensors as its cache
(`cache.keys`: the normed latent `[1, 1, T, kv_lora_rank]`, `cache.values`: the roped key `[1, 1, T,
rope_dim]`), so a decode step's past goes in as the golden has it and the cache after the call is read back
as the golden's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import PointUnavailable
from ...golden import GoldenRecord
from ...points import Point
from ...tree import CacheState
from .attention import common_metadata, past_of


def mla_layer(attn: Any) -> Any:
    """vLLM's `MLAAttention` of a DeepSeek attention module (`DeepseekV2MLAAttention.mla_attn.mla_attn`)."""
    return attn.mla_attn.mla_attn


def check_mla(point: Point, layer: Any, golden: GoldenRecord) -> None:
    """PointUnavailable, saying why, where vLLM's MLA backend cannot take this call."""
    sizes = layer.attn_backend.get_supported_head_sizes()
    if layer.head_size not in sizes:
        raise PointUnavailable(
            f"{point.id}: not run by --hw vllm: vLLM's {layer.attn_backend.get_name()} attention takes a latent "
            f"cache row (kv_lora_rank + qk_rope_head_dim) of {', '.join(map(str, sizes))} and this model's is "
            f"{layer.kv_lora_rank} + {layer.qk_rope_head_dim} = {layer.head_size}"
        )
    positions = golden.kwargs.get("position_ids")
    if positions is None or positions.shape[0] != 1:
        raise PointUnavailable(f"{point.id}: --hw vllm builds vLLM's attention metadata for one sequence, not a batch")


def _check_layout(layer: Any, spec: Any, device: torch.device) -> None:
    """vLLM's MLA cache update writes a token's latent then its roped key, one row per slot (the CPU_MLA
    backend's layout, which `read_latent` reads): checked by writing known rows into a scratch block
    through the backend's own update, so that a backend with another layout is not misread."""
    rank, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
    size = spec.block_size
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(size, rank + rope, generator=gen).to(spec.dtype).to(device)
    probe = torch.zeros(1, size, spec.head_size, dtype=spec.dtype, device=device)
    slots = torch.arange(size, dtype=torch.int64, device=device)
    layer.impl.do_kv_cache_update(
        rows[:, :rank], rows[:, None, rank:], probe, slots, layer.kv_cache_dtype, layer._k_scale
    )
    if not torch.equal(probe.view(size, -1)[:, : rank + rope], rows):
        raise PointUnavailable(
            f"vLLM's {layer.attn_backend.get_name()} keeps its latent cache in a layout --hw vllm does not read "
            "(it reads one row per token: the latent, then the roped key)"
        )


@contextlib.contextmanager
def mla_context(
    config: Any, layer: Any, golden: GoldenRecord, device: torch.device, interleaved: bool
) -> Iterator[dict]:
    """vLLM's forward context for the MLA layer `layer`'s call on the golden's tokens: a latent paged cache of
    its own (on a decode step the golden's past written in first by the backend's own cache update, at slots
    0..past-1), the MLA metadata of one request whose new tokens take the next slots (vLLM's builder sends a
    one-token step down its decode path: the absorbed MQA over the latent cache). Yields a dict that holds,
    after the call, `cache`: the layer's cache then, as a CacheState (latent, roped key). `interleaved`: the
    reference rotates interleaved pairs (transformers' `rope_interleave`) and keeps the roped key with the
    pairs' first elements, then their second (`apply_rotary_pos_emb_interleave`); vLLM keeps the pairs in
    place: the golden's roped keys are put in vLLM's order as they go in, and read back in the golden's."""
    from vllm.forward_context import set_forward_context

    spec = layer.get_kv_cache_spec(config)
    past = past_of(golden)
    held = 0 if past is None else past.keys.shape[2]
    new = golden.kwargs["position_ids"].shape[-1]
    total = held + new
    blocks = -(-total // spec.block_size)
    kv_cache = torch.zeros(blocks, spec.block_size, spec.head_size, dtype=spec.dtype, device=device)
    builder = layer.attn_backend.get_builder_cls()(spec, [layer.layer_name], config, device)
    saved = layer.kv_cache
    layer.kv_cache = kv_cache
    try:
        if past is not None:
            _check_layout(layer, spec, device)
            latent = past.keys[0, 0].to(spec.dtype)  # [tokens, kv_lora_rank]
            roped = past.values[0, 0, :, None].to(spec.dtype)  # [tokens, 1, rope_dim]
            roped = pairs_in_place(roped) if interleaved else roped
            slots = torch.arange(held, dtype=torch.int64, device=device)
            layer.impl.do_kv_cache_update(latent, roped, kv_cache, slots, layer.kv_cache_dtype, layer._k_scale)
        slots = torch.arange(held, total, dtype=torch.int64, device=device)
        metadata = builder.build(0, _one_request(new, total, blocks, slots, device))
        state: dict[str, Any] = {}
        with set_forward_context({layer.layer_name: metadata}, config, slot_mapping={layer.layer_name: slots}):
            yield state
        if past is not None:
            state["cache"] = read_latent(past.layer, kv_cache, total, layer.kv_lora_rank, interleaved)
    finally:
        layer.kv_cache = saved


def _one_request(new: int, total: int, blocks: int, slots: torch.Tensor, device: torch.device) -> Any:
    """vLLM's CommonAttentionMetadata of one request of `total` tokens whose last `new` are computed now."""
    starts, lengths = torch.tensor([0, new], dtype=torch.int32), torch.tensor([total], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    prefilling = torch.tensor([new == total], device=device)
    more = {"seq_lens_cpu_upper_bound": lengths, "is_prefilling": prefilling}
    return common_metadata(starts, lengths, table, slots, device, **more)


def read_latent(index: int, kv_cache: torch.Tensor, tokens: int, rank: int, interleaved: bool) -> CacheState:
    """The first `tokens` slots of vLLM's latent cache as the golden keeps them: keys the normed latent
    `[1, 1, tokens, kv_lora_rank]`, values the roped key `[1, 1, tokens, rope_dim]` (its pairs split into
    firsts then seconds where `interleaved`)."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])[:tokens]
    roped = rows[:, rank:]
    if interleaved:
        roped = torch.cat([roped[:, 0::2], roped[:, 1::2]], dim=-1)
    return CacheState(index, rows[None, None, :, :rank], roped[None, None])


def pairs_in_place(roped: torch.Tensor) -> torch.Tensor:
    """A roped key kept as the pairs' firsts then their seconds, put back as pairs (x0, x1), (x2, x3), ..."""
    first, second = roped.chunk(2, dim=-1)
    return torch.stack([first, second], dim=-1).flatten(-2)
