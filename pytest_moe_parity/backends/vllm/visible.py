"""vLLM's attention kernels made visible to the drill. vLLM's CPU build registers its paged-cache update and
its attention kernels (`torch.ops._C.cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`) as
CompositeImplicitAutograd: they run in C++ before torch's Python dispatch, so a capture sees nothing of
them. For a drilled call, the attention backend's own `do_kv_cache_update` and `forward` of each layer
are called through two ops of this package (`moe_parity_vllm::do_kv_cache_update`,
`moe_parity_vllm::attention_forward`) whose kernels call vLLM's methods as they are at that moment (a
change made to vLLM's class is what runs): each is then one op of the capture, its inputs and the cache
it writes explicit tensors, which the drill can run again after the call."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

NAMESPACE = "moe_parity_vllm"


def _state() -> dict[str, dict[str, Any]]:
    """Per attention layer name, what its kernels need after the call (the layer, the metadata of its last
    drilled call). Kept on torch's op namespace, which outlives this module: the ops are registered once per
    process, and pytester's in-process sessions import this package again."""
    namespace = getattr(torch.ops, NAMESPACE)
    if not hasattr(namespace, "_layers"):
        namespace._layers = {"layer": {}, "metadata": {}}
    return namespace._layers


def _register() -> None:
    """The two ops, once per process."""
    namespace = getattr(torch.ops, NAMESPACE)
    if getattr(namespace, "_registered", False):
        return

    @torch.library.custom_op(f"{NAMESPACE}::do_kv_cache_update", mutates_args=("kv_cache",))
    def do_kv_cache_update(
        key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layer: str
    ) -> None:
        attn = _state()["layer"][layer]
        type(attn.impl).do_kv_cache_update(attn.impl, attn, key, value, kv_cache, slot_mapping)

    @torch.library.custom_op(f"{NAMESPACE}::attention_forward", mutates_args=("output",))
    def attention_forward(
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        layer: str,
    ) -> None:
        state = _state()
        attn = state["layer"][layer]
        type(attn.impl).forward(attn.impl, attn, query, key, value, kv_cache, state["metadata"][layer], output=output)

    namespace._registered = (do_kv_cache_update, attention_forward)  # kept alive with the namespace


def _update(name: str, layer: Any, key, value, kv_cache, slot_mapping) -> None:
    getattr(torch.ops, NAMESPACE).do_kv_cache_update(key, value, kv_cache, slot_mapping, name)


def _forward(name: str, layer: Any, query, key, value, kv_cache, attn_metadata, output=None, **quant: Any):
    if any(v is not None for v in quant.values()):  # fused output quantization: vLLM's own path
        return type(layer.impl).forward(layer.impl, layer, query, key, value, kv_cache, attn_metadata, output, **quant)
    _state()["metadata"][name] = attn_metadata
    getattr(torch.ops, NAMESPACE).attention_forward(query, key, value, kv_cache, output, name)
    return output


@contextlib.contextmanager
def visible_attention(module: torch.nn.Module) -> Iterator[None]:
    """For the call: vLLM's attention layers under `module` call their cache update and attention in Python
    (`use_direct_call`, as vLLM does where its platform has no opaque attention op) and through this
    module's two ops, each one op of the drill's capture."""
    from vllm.model_executor.layers.attention import Attention

    _register()
    layers = [m for m in module.modules() if isinstance(m, Attention)]
    saved = [m.use_direct_call for m in layers]
    for m in layers:
        _state()["layer"][m.layer_name] = m
        m.use_direct_call = True
        m.impl.do_kv_cache_update = functools.partial(_update, m.layer_name)
        m.impl.forward = functools.partial(_forward, m.layer_name)
    try:
        yield
    finally:
        for m, was in zip(layers, saved, strict=True):
            m.use_direct_call = was
            del m.impl.do_kv_cache_update, m.impl.forward
