"""transformers' conversion of a checkpoint's per-expert tensors, with one copy where it makes two.

transformers 5 loads a checkpoint in the hub's per-expert layout (`experts.0.gate_proj.weight`, ...)
into the fused experts of its modules through the conversion mapping of the architecture
(`conversion_mapping.get_model_conversion_mapping`): for gate and up, `MergeModulelist(dim=0)` stacks
each projection's experts, then `Concatenate(dim=1)` joins the two stacks. Both are copies of the
layer's largest tensors (for Qwen3-30B-A3B, 805 MB of a 1.25 GB bf16 layer: a stack, then a cat, each
about as long as a read of the layer). `fused` hands the loader the same mapping with that pair of
operations replaced by one that copies each expert's tensor straight into its place in the joined
tensor: the same tensor, bit for bit, with one copy. Every other entry, and every other operation,
is transformers' own.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch


def fused(mapping: list[Any]) -> list[Any]:
    """`mapping` with each converter whose operations are exactly MergeModulelist(dim=0) then
    Concatenate(dim) doing both in one copy (`stack_concat`); the other entries as they are."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    out = []
    for entry in mapping:
        ops = getattr(entry, "operations", None) if isinstance(entry, WeightConverter) else None
        if (
            ops is not None
            and len(ops) == 2
            and type(ops[0]) is MergeModulelist
            and ops[0].dim == 0
            and type(ops[1]) is Concatenate
        ):
            entry = copy.deepcopy(entry)
            entry.operations = [_stack_concat_op()(ops[1].dim)]
        out.append(entry)
    return out


def model_names(mapping: list[Any], known: set[str]) -> Any:
    """A function giving the model's name of a checkpoint key under `mapping`'s renamings and
    converters (transformers' `rename_source_key`: a hub checkpoint's `model.word_embeddings.weight`
    is the model's `model.embed_tokens.weight`); where this transformers has no such function, the
    key as it is. As transformers' loading does, a key that is one of the model's names (`known`)
    and would be renamed to none of them stays as it is: DeepSeek-V4's renaming of `.norm.` to `.kv_norm.`
    (its attention's) would otherwise take the final `model.norm.weight` away."""
    try:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return lambda key: key
    renamings = [e for e in mapping if isinstance(e, WeightRenaming)]
    converters = [e for e in mapping if isinstance(e, WeightConverter)]

    def name(key: str) -> str:
        renamed = rename_source_key(key, renamings, converters)[0]
        return key if renamed not in known and key in known else renamed

    return name


def stack_concat(groups: list[list[torch.Tensor] | torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat([torch.stack(g) if a list else g for g in groups], dim)`, written once into its
    result: each tensor is copied into its place (and freed from its list as it goes)."""
    stacked = _stacked_shapes(groups, dim)
    if stacked is None:  # whatever torch makes of it, errors included
        return torch.cat([torch.stack(g) if isinstance(g, list) else g for g in groups], dim=dim)
    axis = dim % len(stacked[0])
    first = groups[0][0] if isinstance(groups[0], list) else groups[0]
    shape = list(stacked[0])
    shape[axis] = sum(s[axis] for s in stacked)
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    offset = 0
    for group, size in zip(groups, stacked, strict=True):
        part = out.narrow(axis, offset, size[axis])
        offset += size[axis]
        if isinstance(group, torch.Tensor):
            part.copy_(group)
            continue
        for j in range(len(group)):
            part.select(0, j).copy_(group[j])
            group[j] = None  # type: ignore[call-overload]  # the expert's own copy (a cast one) goes now
    return out


def _stacked_shapes(groups: list[list[torch.Tensor] | torch.Tensor], dim: int) -> list[tuple[int, ...]] | None:
    """Each group's shape once stacked, where stacking and joining `groups` is plain copying (non-empty
    lists of one shape each, the stacks alike but along `dim`, one dtype and one device); else None."""
    if not groups or any(isinstance(g, list) and not g for g in groups):
        return None
    tensors = [t for g in groups for t in (g if isinstance(g, list) else [g])]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors):
        return None
    if any(isinstance(g, list) and any(t.shape != g[0].shape for t in g) for g in groups):
        return None
    stacked = [(len(g), *g[0].shape) if isinstance(g, list) else tuple(g.shape) for g in groups]
    ndim = len(stacked[0])
    if not -ndim <= dim < ndim or any(len(s) != ndim for s in stacked):
        return None
    axis = dim % ndim
    rest = [s[:axis] + s[axis + 1 :] for s in stacked]
    return stacked if all(r == rest[0] for r in rest) else None


@functools.cache
def _stack_concat_op() -> type:
    """The operation class (transformers' `ConversionOps`, imported where transformers is)."""
    from transformers.core_model_loading import ConversionOps

    class StackConcat(ConversionOps):
        """MergeModulelist(dim=0) then Concatenate(dim), as one copy (see the module)."""

        def __init__(self, dim: int):
            self.dim = dim

        @torch.no_grad()
        def convert(
            self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
        ) -> dict[str, torch.Tensor]:
            if len(target_patterns) > 1:
                raise ValueError("Undefined Operation encountered!")  # Concatenate's own words
            groups = [input_dict.pop(p) for p in source_patterns if p in input_dict]
            return {target_patterns[0]: stack_concat(groups, self.dim)}

    return StackConcat
