"""vLLM's attention called outside its engine: the paged KV cache and the attention metadata its model
runner would build, built here from the golden's call: each row of the batch one request of its real
tokens (`requests`), on a decode step its past K and V written into the paged cache first by the attention
backend's own cache update."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import PointUnavailable
from ...golden import GoldenRecord
from ...model.calls import cache_states
from ...points import Point
from ...tree import CacheState
from .parallel import held_kv_heads
from .requests import Requests
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


@contextlib.contextmanager
def attention_context(config: Any, layer: Any, golden: GoldenRecord, device: torch.device) -> Iterator[dict]:
    """vLLM's forward context for `layer`'s call on the golden's tokens: each row of the batch one request
    of its real tokens only (`requests.Requests`), in a paged cache of its own, its real past written in
    first by the attention backend's own cache update, then the attention backend's own metadata builder
    over the requests (their new tokens take the next slots; the layer's own sliding window, where it has
    one: its past, the latest positions only, goes in at the slots of its own positions, the slots before
    them left empty, outside vLLM's window; at TP > 1 this rank's kv heads). Yields a dict that holds
    `requests` (for the call's flat token axis), and after the call `cache`: the layer's cache then in the
    golden's layout, as a CacheState (past and new K, V; this rank's kv heads; a sliding-window layer's
    latest positions)."""
    from vllm.forward_context import set_forward_context

    spec = layer.get_kv_cache_spec(config)
    past = past_of(golden)
    if past is not None:  # this rank's kv heads of the golden's (all of them at TP 1)
        heads = held_kv_heads(past.keys.shape[1])
        past = dataclasses.replace(past, keys=past.keys[:, heads], values=past.values[:, heads])
    with unseen():
        requests = Requests.of(golden, past, spec.block_size, offset=first_held(past))
        shape = (sum(requests.blocks), spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
        kv_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
    builder = layer.attn_backend.get_builder_cls()(spec, [layer.layer_name], config, device)  # sets layer.isa
    saved = layer.kv_cache
    layer.kv_cache = kv_cache
    with unseen():
        held = requests.past_slots().to(device)
    if past is not None and held.numel():  # the golden's past, written by the attention backend's own cache update
        with unseen():
            keys, values = (requests.flat_past(t).to(spec.dtype).to(device) for t in (past.keys, past.values))
        layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, held)
    with unseen():
        slots = requests.new_slots().to(device)
        starts, lengths = requests.query_start_loc(), requests.seq_lens()
        metadata = builder.build(0, _common(requests, starts, lengths, slots, device))
    state: dict[str, Any] = {"requests": requests}
    try:
        with set_forward_context({layer.layer_name: metadata}, config, slot_mapping={layer.layer_name: slots}):
            yield state
        if past is not None:
            with unseen():
                order = slot_order(layer, spec, device)
                first = requests.offset
                read = [
                    read_slots(kv_cache, requests.slots(r, first, requests.total(r)), order)
                    for r in range(requests.count)
                ]
                state["cache"] = as_golden(requests.cache_as_golden(read, past), past, requests.length)
    finally:
        layer.kv_cache = saved


def _common(requests: Requests, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, device: torch.device):
    """vLLM's CommonAttentionMetadata of the requests (what its model runner hands the metadata builder)."""
    return common_metadata(starts, lengths, requests.block_table(), slots, device)


def common_metadata(
    starts: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, device: Any, **more: Any
) -> Any:
    """vLLM's CommonAttentionMetadata of requests whose new tokens start at `starts` (int32, on the CPU, one
    more than the requests) and whose sequences are `lengths` long, in the blocks of `table` ([requests,
    blocks]), the new tokens at `slots`; `more`: the fields a backend's builder reads besides (MLA's)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=lengths.to(device),
        num_reqs=int(lengths.numel()),
        num_actual_tokens=int(starts[-1]),
        max_query_len=int((starts[1:] - starts[:-1]).max()),
        max_seq_len=int(lengths.max()),
        block_table_tensor=table.to(device),
        slot_mapping=slots,
        causal=True,
        **more,
    )


def unseen() -> contextlib.AbstractContextManager:
    """The backend's own bookkeeping (which tokens are real, the requests' slots and metadata, the cache read
    back) kept out of a drill's capture of the call: it is not vLLM's code under test."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


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


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, order: tuple[torch.Tensor, torch.Tensor]):
    """The keys and values at `slots` of a paged cache in vLLM's CPU attention's layout ([blocks, kv_heads,
    block_size, 2 x head_dim]: a block's keys, then its values, each in `order`), each [kv_heads, slots,
    head_dim]."""
    blocks, heads, size, _ = kv_cache.shape
    head = order[0].shape[1]
    halves = kv_cache.view(blocks, heads, 2 * size, head).chunk(2, dim=2)
    block, at = (slots // size).to(kv_cache.device), (slots % size).to(kv_cache.device)
    read = []
    for half, where in zip(halves, order, strict=True):
        flat = half.reshape(blocks, heads, size * head)[block]  # [slots, heads, size * head]
        index = where[at].unsqueeze(1).expand(-1, heads, -1)  # [slots, heads, head]
        read.append(flat.gather(2, index).transpose(0, 1))
    return read[0], read[1]


def read_cache(index: int, kv_cache: torch.Tensor, tokens: int, order: tuple[torch.Tensor, torch.Tensor]) -> CacheState:
    """The first `tokens` slots of a paged cache in vLLM's CPU attention's layout as layer `index`'s cache,
    [1, kv_heads, tokens, head_dim] keys and values."""
    slots = torch.arange(tokens, device=kv_cache.device)
    keys, values = read_slots(kv_cache, slots, order)
    return CacheState(index, keys[None], values[None])
