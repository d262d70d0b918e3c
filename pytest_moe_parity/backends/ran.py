"""What a point's candidate ran (`Backend.ran`, `CandidateOutput.ran`): a flat dict of words, kept in
the point's report row (`ran`), shown beside its verdict, and compared run to run by `moe-parity diff`.

The keys are one vocabulary across backends (a backend gives those it can say):

- `module`: the class of the module that ran the point;
- `weights`: the dtypes of its parameters (`bfloat16`; mixed: `bfloat16+float32`, the most held first),
  and `compute`: the dtype of the floating inputs it was called with;
- `attention`, `experts`: the attention and experts implementations (transformers' `_attn_implementation`
  and `_experts_implementation`; the blocks of query rows where attention ran in blocks);
- `quant`: a quantization emulated or dequantized; `linear`: quantized-linear classes in the module;
- `graph`, `compiler`, `graph_breaks`, `break`, `recompiles`, `fallback`, `cache`: a compiled candidate's;
- the serving stacks' own (vLLM's `moe`, `attention_backend`; NxDI's `stage`, `moe`, `router`), in their backends;
- a dump's: the tensor the point was read from (`dumped`) and its dtype (`output`).

`cache` (a compile cache hit, a reused graph) says where a graph came from, not what it computes: `moe-parity
diff` does not compare it (`PROVENANCE`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..tree import leaves
from .experts import DENSE

Ran = dict[str, str]
PROVENANCE = ("cache",)  # keys that say where a thing came from, not what ran (not diffed)


def dtype_words(dtypes: Iterable[torch.dtype], sizes: Iterable[int] | None = None) -> str:
    """Dtypes as one word (`bfloat16`), or joined by `+`, the most held (`sizes`: elements) or most
    frequent first."""
    dtypes = list(dtypes)
    counts: Counter[str] = Counter()
    for dtype, n in zip(dtypes, sizes if sizes is not None else [1] * len(dtypes), strict=True):
        counts[str(dtype).removeprefix("torch.")] += n
    return "+".join(name for name, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def weights_dtype(module: nn.Module) -> str | None:
    """The dtypes of `module`'s parameters (floating ones), by elements held; None where it has none."""
    params = [p for p in module.parameters() if p.is_floating_point()]
    if not params:
        return None
    return dtype_words((p.dtype for p in params), (p.numel() for p in params))


def compute_dtype(call: Any) -> str | None:
    """The dtypes of the floating tensors in `call` (a call's args and kwargs, or an output), most frequent
    first."""
    found = [t.dtype for t in leaves(call) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return dtype_words(found) if found else None


def experts_modules(module: nn.Module) -> list[nn.Module]:
    """Experts built with transformers' `use_experts_implementation` inside `module` (itself included):
    they dispatch on their config's `_experts_implementation`."""
    return [m for m in module.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """Attention modules inside `module` (itself included), by their class name."""
    return [m for m in module.modules() if type(m).__name__.endswith("Attention")]


def quantized_linears(module: nn.Module) -> list[str]:
    """The classes of linear layers inside `module` that are not torch's own (a quantized checkpoint's
    FP8Linear, bitsandbytes' Linear8bitLt, ...)."""
    names = {type(m).__name__ for m in module.modules() if "Linear" in type(m).__name__ and type(m) is not nn.Linear}
    return sorted(names)


def module_ran(module: nn.Module, config: Any, compute: str | None = None, attention: str | None = None) -> Ran:
    """What a transformers module runs: its class, weights' and inputs' dtypes, and the attention and
    experts implementations its config selects where it holds attention or experts (`compute`: the
    dtypes of its call's inputs, `compute_dtype`; `attention`: the attention's own words, where the
    caller ran it otherwise than its config says)."""
    said: Ran = {"module": type(module).__name__}
    weights = weights_dtype(module)
    if weights:
        said["weights"] = weights
    if compute:
        said["compute"] = compute
    if attention_modules(module):
        said["attention"] = attention or str(getattr(config, "_attn_implementation", None) or "eager")
    experts = experts_modules(module)
    if experts:
        own = getattr(experts[0], "config", config)
        name = str(getattr(own, "_experts_implementation", None) or "eager")
        said["experts"] = "dense" if name == DENSE else name
    linears = quantized_linears(module)
    if linears:
        said["linear"] = ", ".join(linears)
    return said


def merged(*parts: Ran | None) -> Ran | None:
    """Several sayings of one call, later ones winning; None where none says anything."""
    out: Ran = {}
    for part in parts:
        if part:
            out.update({str(k): str(v) for k, v in part.items()})
    return out or None
