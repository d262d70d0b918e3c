"""What vLLM ran for a point (`Backend.ran`): beside the module's class and dtypes (`backends.ran`), its
fused MoE's quant method, backend and experts kernel (`moe`), and its attention layers' backend and
implementation (`attention_backend`), read from the modules vLLM built."""

from __future__ import annotations

from typing import Any

from ..ran import Ran, weights_dtype


def _name(obj: Any) -> str:
    return type(obj).__name__


def moe_words(layer: Any) -> str:
    """A fused MoE layer's quant method, its backend where it says one, and the experts kernel it built
    (`UnquantizedFusedMoEMethod, backend CPU, experts CPUExperts`)."""
    method = layer.quant_method
    said = [_name(method)]
    backend = getattr(method, "unquantized_backend", None)
    if backend is not None:
        said.append(f"backend {getattr(backend, 'name', backend)}")
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", None), "fused_experts", None) or getattr(kernel, "fused_experts", None)
    if experts is not None:
        said.append(f"experts {_name(experts)}")
    return ", ".join(said)


def vllm_ran(module: Any) -> Ran:
    """What a vLLM module runs: its class and weights' dtypes, its fused MoE and its attention backend."""
    said: Ran = {"module": _name(module)}
    weights = weights_dtype(module)
    if weights:
        said["weights"] = weights
    for sub in module.modules():
        if "moe" not in said and hasattr(sub, "quant_method") and hasattr(sub, "w13_weight"):
            said["moe"] = moe_words(sub)
        backend = getattr(sub, "attn_backend", None)
        if "attention_backend" not in said and backend is not None and hasattr(backend, "get_name"):
            impl = getattr(sub, "impl", None)
            said["attention_backend"] = backend.get_name() + (f" ({_name(impl)})" if impl is not None else "")
    return said
