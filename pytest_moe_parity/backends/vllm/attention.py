"""vLLM's attention called outside its engine: the paged KV cache and the attention metadata its model
runner would build, built here for one sequence from the golden's call (its positions, and on a decode
step its past K and V written into the paged cache first by the attention backend's own cache update)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import PointUnavailable
from ...golden import GoldenRecord
from ...model.calls import cache_states
from ...points import Point
from ...tree import CacheState
from .parallel import held_kv_heads
from .window import as_golden, first_held


def past_of(golden: GoldenRecord) -> CacheState | None:
    """The KV cache a decode step's call carries (None: a prefill call)."""
    found = cache_states(golden.kwargs) + cache_states(golden.args)
    return found[0] if found else None


def check(point: Point, layer: Any, golden: GoldenRecord) -> None:
    """PointUnavailable, saying why, where vLLM's attention cannot take this call."""
    sizes = layer.attn_backend.get_supported_head_sizes()
    head = layer.impl.head_size
    if head not in sizes:
        raise PointUnavailable(
            f"{point.id}: not run by --hw vllm: vLLM's {layer.attn_backend.get_name()} attention takes head sizes "
            f"{', '.join(map(str, sizes))} and this model's head_dim is {head}"
        )
    past = past_of(golden)
    if past is not None and past.window is not None and past.seen is None:
        raise PointUnavailable(f"{point.id}: the golden's sliding-window cache does not say how many positions it saw")
    positions = golden.kwargs.get("position_ids")
    if positions is None or positions.shape[0] != 1:
        raise PointUnavailable(f"{point.id}: --hw vllm builds vLLM's attention metadata for one sequence, not a batch")


@contextlib.contextmanager
def attention_context(config: Any, layer: Any, golden: GoldenRecord, device: torch.device) -> Iterator[dict]:
    """vLLM's forward context for `layer`'s call on the golden's tokens: a paged cache of its own (the
    golden's past written in first, at the slots of its positions: a sliding-window layer's cache holds
    only its latest positions, the slots before them are left empty, outside vLLM's window), the metadata
    of one request whose new tokens take the next slots (vLLM's builder over this layer alone: the layer's
    own sliding window, where it has one). Yields a dict that holds, after the call, `cache`: the layer's
    cache then, as a CacheState (what the golden's cache holds: a sliding-window layer's latest positions)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    spec = layer.get_kv_cache_spec(config)
    past = past_of(golden)
    held = 0 if past is None else past.keys.shape[2]
    first = first_held(past)
    new = golden.kwargs["position_ids"].shape[-1]
    total = first + held + new
    blocks = -(-total // spec.block_size)
    dtype = spec.dtype
    kv_cache = torch.zeros(blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=dtype, device=device)
    builder = layer.attn_backend.get_builder_cls()(spec, [layer.layer_name], config, device)  # sets layer.isa
    saved = layer.kv_cache
    layer.kv_cache = kv_cache
    if past is not None:  # the golden's past, written by the backend's own cache update ([tokens, heads, dim])
        heads = held_kv_heads(past.keys.shape[1])  # this rank's kv heads of the golden's (all at TP 1)
        keys, values = (t[0][heads].transpose(0, 1).contiguous().to(dtype) for t in (past.keys, past.values))
        slots = torch.arange(first, first + held, dtype=torch.int64, device=device)
        layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    int32 = {"dtype": torch.int32, "device": device}
    starts, lengths = torch.tensor([0, new], **int32), torch.tensor([total], **int32)
    slots = torch.arange(first + held, total, dtype=torch.int64, device=device)
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.cpu(),
        seq_lens=lengths,
        num_reqs=1,
        num_actual_tokens=new,
        max_query_len=new,
        max_seq_len=total,
        block_table_tensor=torch.arange(blocks, **int32)[None],
        slot_mapping=slots,
        causal=True,
    )
    metadata = builder.build(0, common)
    state: dict[str, Any] = {}
    try:
        with set_forward_context({layer.layer_name: metadata}, config, slot_mapping={layer.layer_name: slots}):
            yield state
        if past is not None:
            cache = read_cache(past.layer, kv_cache, total, slot_order(layer, spec, device))
            state["cache"] = as_golden(cache, past, new)
    finally:
        layer.kv_cache = saved


def slot_order(layer: Any, spec: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's attention backend puts each (token, dim) of a block's keys and of its values (its CPU
    kernels keep a block's keys transposed, in an order that may depend on the CPU's instruction set): found
    by writing codes through the backend's own cache update into a scratch block, tokens then dims (codes up
    to 256, exact in bfloat16 too). Each: [block_size, head_dim] offsets into one head's half of a block."""
    size, head = spec.block_size, spec.head_size
    probe = torch.zeros(1, spec.num_kv_heads, size, 2 * head, dtype=spec.dtype, device=device)
    slots = torch.arange(size, dtype=torch.int64, device=device)
    codes = []
    for axis in (0, 2):  # token codes, then dim codes
        shape = [size, spec.num_kv_heads, head]
        code = torch.arange(1, shape[axis] + 1, device=device).view([-1 if a == axis else 1 for a in range(3)])
        code = code.expand(shape).to(spec.dtype).contiguous()
        probe.zero_()
        layer.impl.do_kv_cache_update(layer, code, -code, probe, slots)
        halves = probe.view(1, spec.num_kv_heads, 2 * size, head).chunk(2, dim=2)
        codes.append([h[0, 0].reshape(-1).abs().long() - 1 for h in halves])
    orders = []
    for tokens, dims in zip(*codes, strict=True):
        order = torch.empty(size, head, dtype=torch.long, device=device)
        order[tokens, dims] = torch.arange(size * head, device=device)
        orders.append(order)
    return orders[0], orders[1]


def read_cache(index: int, kv_cache: torch.Tensor, tokens: int, order: tuple[torch.Tensor, torch.Tensor]) -> CacheState:
    """The first `tokens` slots of a paged cache in vLLM's CPU attention's layout ([blocks, kv_heads,
    block_size, 2 x head_dim]: a block's keys, then its values, each in `order`), as [1, kv_heads, tokens,
    head_dim] keys and values."""
    blocks, heads, size, _ = kv_cache.shape
    head = order[0].shape[1]
    halves = kv_cache.view(blocks, heads, 2 * size, head).chunk(2, dim=2)
    flat = []
    for half, where in zip(halves, order, strict=True):
        read = half.reshape(blocks, heads, size * head)[..., where.reshape(-1)].view(blocks, heads, size, head)
        flat.append(read.transpose(0, 1).reshape(heads, blocks * size, head)[None, :, :tokens])
    return CacheState(index, flat[0], flat[1])
