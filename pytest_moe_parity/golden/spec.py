"""The recorded call format: a nested call structure (args, kwargs, output) as plain JSON with
tensors referenced by key, written by `Flattener` and rebuilt by `build`. Parameters and buffers
passed as arguments are recorded by name (`ParamRef`) and, on replay, taken from the model under
test: only activations are golden."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..dtypes import dtype_name
from ..errors import RecordError
from ..tree import CacheState, RowMask, map_structure

# A spec is plain JSON describing a nested call structure; tensors are referenced by key.
Spec = dict[str, Any]


@dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of the model that a module received as an argument."""

    name: str


def _scalar_spec(value: Any) -> Spec:
    if isinstance(value, float) and not math.isfinite(value):
        return {"t": "float", "value": repr(value)}
    return {"t": "value", "value": value}


def causal_mask(
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    padding: list[list[int]] | None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The causal attention mask `[B | 1, 1, Q, K]` transformers' eager attention takes: query `i` (at key
    position `K - Q + i`) sees the keys up to its own that are real tokens (`padding`: the batch's
    attention mask `[B, K]`, 1 for a real token); allowed entries 0 and the others the dtype's minimum
    (or True / False for a boolean mask). `rows=(start, stop)`: those query rows only."""
    b, h, q, k = shape
    start, stop = rows if rows is not None else (0, q)
    allowed = (torch.arange(k)[None, :] <= torch.arange(start, stop)[:, None] + (k - q))[None, None]
    if padding is not None:
        allowed = allowed & torch.tensor(padding, dtype=torch.bool)[:, None, None, :k]
    allowed = allowed.expand(b, h, stop - start, k)
    if dtype == torch.bool:
        return allowed.contiguous()
    masked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, torch.zeros((), dtype=dtype), masked).contiguous()


@dataclass(frozen=True)
class CausalRows:
    """A golden's causal mask (a `causal_mask` spec) made a block of query rows at a time (a `RowMask`):
    a replay that runs attention in blocks never holds it whole (`T x T` floats: 1 GiB at 16k tokens).
    `cast` gives it in a candidate's dtype and device, as `_cast_input` casts a mask made whole."""

    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    padding: list[list[int]] | None = None
    device: torch.device | str = "cpu"

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return causal_mask(self.shape, self.dtype, self.padding, (start, stop)).to(self.device)

    def materialize(self) -> torch.Tensor:
        return causal_mask(self.shape, self.dtype, self.padding).to(self.device)

    def cast(self, dtype: torch.dtype, device: torch.device | str) -> CausalRows:
        """In `dtype` (a float mask's masked entries at that dtype's minimum) on `device`."""
        keep = dtype if self.dtype.is_floating_point else self.dtype  # a boolean mask stays boolean
        return CausalRows(self.shape, keep, self.padding, device)


MASK_BLOCK_BYTES = 16 * 2**20  # a mask too large for this is compared with the causal one a block of rows at a time


def mask_shaped(t: torch.Tensor | RowMask) -> bool:
    """Whether `t` has the shape and dtype of an attention mask `[B, 1, Q, K]` (Q <= K) worth a spec."""
    shape = tuple(t.shape)
    if len(shape) != 4 or shape[1] != 1 or shape[2] > shape[3] or math.prod(shape) < 64:
        return False
    return not isinstance(t, torch.Tensor) or (
        (t.dtype == torch.bool or t.is_floating_point()) and t.device.type != "meta"
    )


def causal_mask_spec(t: torch.Tensor | RowMask, padding: list[list[int]] | None) -> Spec | None:
    """A spec that rebuilds `t` where it is exactly the causal mask of its shape over the batch's
    padding (`causal_mask`): a `[1, 1, T, T]` float32 mask is T^2 * 4 bytes per layer (1 GiB at 16k
    tokens), its spec a line; None for any other tensor. A `RowMask` is compared a block of rows at
    a time, without being made whole."""
    if not mask_shaped(t):
        return None
    shape = tuple(t.shape)
    rows = len(padding) if padding is not None else 1
    if padding is not None and (shape[0] != rows or len(padding[0]) < shape[3]):
        padding = None  # another batch than the recorded one's: compared without it
    q = shape[2]
    step = max(1, MASK_BLOCK_BYTES // max(1, shape[0] * shape[3] * 4))
    for start in range(0, q, step):
        stop = min(q, start + step)
        got = t.rows(start, stop) if isinstance(t, RowMask) else t[:, :, start:stop]
        if got is None or not torch.equal(got.detach().cpu(), causal_mask(shape, t.dtype, padding, (start, stop))):
            return None
    return {"t": "causal_mask", "shape": list(shape), "dtype": dtype_name(t.dtype), "padded": padding is not None}


def parse_token_spec(text: str, tokens: int) -> list[int]:
    """`0-63,last-64` -> the positions it names among `tokens` (sorted, each once): `A-B` (inclusive),
    `N`, `last-K` (the last K); ValueError naming the part that is not one of them or out of range."""
    positions: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        low, dash, high = part.partition("-")
        try:
            if low == "last":
                first, last = tokens - int(high), tokens - 1
            else:
                first = int(low)
                last = int(high) if dash else first
        except ValueError:
            raise ValueError(f"{part!r} is not a position, a range A-B or last-K") from None
        if first < 0 or last < first or last >= tokens:
            raise ValueError(f"{part!r} is not within the {tokens} tokens (positions 0-{tokens - 1})")
        positions.update(range(first, last + 1))
    if not positions:
        raise ValueError(f"{text!r} names no position; e.g. 0-63,last-64")
    return sorted(positions)


def select_tokens(t: Any, batch: int, seq: int, positions: list[int]) -> Any:
    """A tensor with a token dimension (`[batch, seq, ...]`, or flattened `[batch * seq, ...]`) at the
    token `positions` only; anything else as it is."""
    if not isinstance(t, torch.Tensor) or seq <= 1:
        return t
    index = torch.tensor(positions, dtype=torch.long, device=t.device)
    if t.dim() >= 2 and t.shape[0] == batch and t.shape[1] == seq:
        return t.index_select(1, index)
    if t.dim() >= 1 and t.shape[0] == batch * seq:
        per = t.reshape(batch, seq, *t.shape[1:]).index_select(1, index)
        return per.reshape(batch * len(positions), *t.shape[1:])
    return t


class Flattener:
    """Turns a nested call structure into a spec, copying tensors to CPU under stable keys.
    `source(tensor)` may name the earlier point output a tensor is (see `record.capture`): the spec
    keeps it under "from", for chained replay. `param_name(tensor)` names a tensor that is one of the
    model's parameters or buffers (recorded by name, not by value), else None. `compact(tensor)` may
    give a spec that rebuilds it without storing it (a causal mask: `causal_mask_spec`)."""

    def __init__(
        self,
        param_name: Callable[[torch.Tensor], str | None],
        keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
        source: Callable[[torch.Tensor], Spec | None] | None = None,
        compact: Callable[[torch.Tensor], Spec | None] | None = None,
    ):
        self.param_name = param_name
        self.source = source
        self.compact = compact
        self.tensors: dict[str, torch.Tensor] = {}
        # (id, version) of a tensor already stored -> key; the original is kept alive so that its
        # id cannot be reused by another tensor while this flattener lives.
        self._seen: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
        self.keep = keep or (lambda t: t.detach().to("cpu", copy=True).contiguous())

    def flatten(self, obj: Any, key: str) -> Spec:
        if isinstance(obj, torch.Tensor):
            name = self.param_name(obj)
            if name is not None:
                return {"t": "param", "name": name}
            compact = self.compact(obj) if self.compact is not None else None
            if compact is not None:
                return compact
            seen = self._seen.get((id(obj), obj._version))
            if seen is not None:
                spec = {"t": "tensor", "key": seen[0]}
            else:
                self.tensors[key] = self.keep(obj)
                self._seen[(id(obj), obj._version)] = (key, obj)
                spec = {"t": "tensor", "key": key}
            origin = self.source(obj) if self.source is not None else None
            if origin is not None:
                spec["from"] = origin
            return spec
        if obj is None:
            return {"t": "none"}
        if isinstance(obj, RowMask):  # kept as the spec that makes it, else made whole and stored
            compact = self.compact(obj) if self.compact is not None else None
            return compact if compact is not None else self.flatten(obj.materialize(), key)
        if isinstance(obj, CacheState):
            return {
                "t": "cache",
                "layer": obj.layer,
                "keys": self.flatten(obj.keys, f"{key}.keys"),
                "values": self.flatten(obj.values, f"{key}.values"),
                "window": obj.window,
                "seen": obj.seen,
            }
        if isinstance(obj, bool | int | float | str):
            return _scalar_spec(obj)
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "value": dtype_name(obj)}
        if isinstance(obj, tuple | list):
            kind = "tuple" if isinstance(obj, tuple) else "list"
            return {"t": kind, "items": [self.flatten(v, f"{key}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            if not all(isinstance(k, str) for k in obj):
                raise RecordError(f"{key}: dict with non-string keys cannot be recorded")
            return {"t": "dict", "items": {k: self.flatten(v, f"{key}.{k}") for k, v in obj.items()}}
        raise RecordError(
            f"{key}: cannot record an argument of type {type(obj).__name__} "
            "(a cache object is recorded as its layer's tensors, see model.calls.cache_state)"
        )


def spec_tensor_keys(spec: Spec) -> Iterator[str]:
    """The keys of every tensor a spec references."""
    kind = spec["t"]
    if kind == "tensor":
        yield spec["key"]
    elif kind == "cache":
        yield from spec_tensor_keys(spec["keys"])
        yield from spec_tensor_keys(spec["values"])
    elif kind in ("tuple", "list", "dict"):
        items = spec["items"].values() if kind == "dict" else spec["items"]
        for item in items:
            yield from spec_tensor_keys(item)


def build(
    spec: Spec,
    tensors: dict[str, torch.Tensor],
    chained: Callable[[Spec], torch.Tensor | None] | None = None,
    padding: list[list[int]] | None = None,
    row_masks: bool = False,
) -> Any:
    """Rebuild a recorded structure; parameters come back as ParamRef placeholders. With `chained`,
    a tensor recorded as an earlier point's output ("from") is `chained(origin)` where that gives
    a tensor (the candidate's own output, in chain mode), the golden's otherwise. A causal mask is
    made again over `padding` (the golden's batch attention mask): whole, or with `row_masks` as a
    `CausalRows` that makes it a block of query rows at a time."""
    kind = spec["t"]
    if kind == "causal_mask":
        rows = CausalRows(tuple(spec["shape"]), getattr(torch, spec["dtype"]), padding if spec.get("padded") else None)
        return rows if row_masks else rows.materialize()
    if kind == "tensor":
        golden = tensors[spec["key"]]
        if chained is not None and "from" in spec:
            own = chained(spec["from"])
            if own is not None and own.numel() == golden.numel():
                return own.reshape(golden.shape)  # the origin may be the same values in another view
        return golden
    if kind == "param":
        return ParamRef(spec["name"])
    if kind == "none":
        return None
    if kind == "value":
        return spec["value"]
    if kind == "float":
        return float(spec["value"])
    if kind == "dtype":
        return getattr(torch, spec["value"])
    if kind == "omitted":
        return None
    if kind == "cache":
        keys, values = build(spec["keys"], tensors), build(spec["values"], tensors)
        return CacheState(spec["layer"], keys, values, window=spec.get("window"), seen=spec.get("seen"))
    if kind in ("tuple", "list"):
        items = [build(s, tensors, chained, padding, row_masks) for s in spec["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: build(s, tensors, chained, padding, row_masks) for k, s in spec["items"].items()}
    raise ValueError(f"unknown spec kind {kind!r}")


def spec_origins(spec: Spec) -> Iterator[Spec]:
    """The "from" entries of a spec's tensors (see `Flattener`)."""
    kind = spec["t"]
    if kind == "tensor" and "from" in spec:
        yield spec["from"]
    elif kind in ("tuple", "list", "dict"):
        items = spec["items"].values() if kind == "dict" else spec["items"]
        for item in items:
            yield from spec_origins(item)


def resolve_params(obj: Any, model: nn.Module | Callable[[str], torch.Tensor]) -> Any:
    """Replace ParamRef placeholders by the candidate's own parameter or buffer of that name:
    looked up in `model` (a module, by dotted path from its root) or by calling `model(name)`."""
    lookup = model if not isinstance(model, nn.Module) else (lambda name: named_tensor(model, name))
    return map_structure(obj, lambda leaf: lookup(leaf.name) if isinstance(leaf, ParamRef) else leaf)


def named_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer called `name` (dotted path from the model root)."""
    owner, _, attr = name.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    if attr in mod._parameters:
        return mod._parameters[attr]
    return mod.get_buffer(attr)


def describe_origin(origin: Spec) -> str:
    """`layer_2.attention.out[0]`, or `embedding.out[0] + layer_0.attention.out[0]`."""
    if "sum" in origin:
        return " + ".join(describe_origin(o) for o in origin["sum"])
    return f"{origin['point']}.out[{origin['leaf']}]"


def describe(spec: Spec, tensors: dict[str, dict[str, Any]], path: str) -> list[tuple[str, str]]:
    """(path, description) for every leaf of a recorded structure, e.g.
    ("kwargs.position_embeddings.0", "tensor (1, 16, 16) float32"); `tensors` maps a tensor key
    to its manifest entry (shape and dtype)."""
    kind = spec["t"]
    if kind == "tensor":
        meta = tensors.get(spec["key"], {})
        origin = f" = {describe_origin(spec['from'])}" if "from" in spec else ""
        return [(path, f"tensor {tuple(meta.get('shape', ()))} {meta.get('dtype', '?')}{origin}")]
    if kind == "param":
        return [(path, f"parameter {spec['name']} (the candidate's own)")]
    if kind in ("tuple", "list"):
        if not spec["items"]:
            return [(path, f"empty {kind}")]
        return [row for i, item in enumerate(spec["items"]) for row in describe(item, tensors, f"{path}.{i}")]
    if kind == "dict":
        return [row for k, item in spec["items"].items() for row in describe(item, tensors, f"{path}.{k}")]
    if kind == "omitted":
        return [(path, "omitted (not recorded, not compared)")]
    if kind == "causal_mask":
        over = " over the batch's padding" if spec.get("padded") else ""
        return [(path, f"causal mask {tuple(spec['shape'])} {spec['dtype']}{over} (made again, not stored)")]
    if kind == "cache":
        meta = tensors.get(spec["keys"].get("key", ""), {})
        window = f", window {spec['window']}, {spec['seen']} positions seen" if spec.get("window") else ""
        return [(path, f"KV cache of layer {spec['layer']}: keys and values {tuple(meta.get('shape', ()))}{window}")]
    if kind == "none":
        return [(path, "None")]
    return [(path, f"{kind} {spec.get('value')!r}")]
