"""What NxDI ran for a point (`Backend.ran`), from the factory its module is built by and the neuron config
it is built with (the context-encoding or token-generation one): its dtype, its MoE path (dropless or a
capacity factor, the blockwise matmul's block size, the router's activation and dtype, where the affinities
are applied) and its attention kernels (the `*_kernel_enabled` flags that are on)."""

from __future__ import annotations

from typing import Any

from ...points import ATTENTION, EXPERTS, OUTPUT
from ..ran import Ran

MOE_COMPONENTS = (EXPERTS, "moe", OUTPUT)
ATTENTION_COMPONENTS = (ATTENTION, OUTPUT)


def _dtype(value: Any) -> str:
    return str(value).removeprefix("torch.")


def moe_words(nc: Any) -> str:
    """NxD's MoE path as its neuron config sets it."""
    capacity = getattr(nc, "capacity_factor", None)
    said = ["dropless" if capacity is None else f"capacity factor {capacity:g}"]
    block = getattr(getattr(nc, "blockwise_matmul_config", None), "block_size", None)
    if block:
        said.append(f"blockwise block_size {block}")
    if getattr(nc, "early_expert_affinity_modulation", False):
        said.append("affinities applied early")
    if getattr(nc, "fused_shared_experts", False):
        said.append("shared experts fused")
    return ", ".join(said)


def router_words(nc: Any) -> str | None:
    router = getattr(nc, "router_config", None)
    if router is None:
        return None
    # a module's declared dtype holds with cast_type="as-declared" only: NxDI casts every module to torch_dtype else
    declared = getattr(nc, "cast_type", "config") == "as-declared"
    dtype = getattr(router, "dtype", "?") if declared else nc.torch_dtype
    return f"{getattr(router, 'act_fn', '?')} in {_dtype(dtype)}"


def attention_words(nc: Any) -> str:
    """The attention kernels the neuron config turns on, or NxDI's own attention."""
    flags = sorted(k for k, v in vars(nc).items() if ("kernel_enabled" in k or k == "fused_qkv") and v is True)
    return "kernels: " + ", ".join(flags) if flags else "NxDI's native attention (no kernel)"


def nxdi_ran(factory: str, component: str, config: Any, submodule: str = "") -> Ran:
    """What NxDI builds for a component from `factory` (`module:Name`; the point calls its `submodule`, where
    one is named) under `config` (its inference config)."""
    nc = config.neuron_config
    module = factory.rpartition(":")[2].removesuffix("()") + (f" .{submodule}" if submodule else "")
    said: Ran = {"module": module, "weights": _dtype(nc.torch_dtype)}
    if getattr(nc, "attention_dtype", None) is not None and component in ATTENTION_COMPONENTS:
        said["compute"] = _dtype(nc.attention_dtype)
    if getattr(nc, "is_prefill_stage", None) is not None:
        said["stage"] = "context encoding" if nc.is_prefill_stage else "token generation"
    if component in MOE_COMPONENTS:
        said["moe"] = moe_words(nc)
    if component in MOE_COMPONENTS or component == "router":
        router = router_words(nc)
        if router:
            said["router"] = router
    if component in ATTENTION_COMPONENTS:
        said["attention"] = attention_words(nc)
    return said
