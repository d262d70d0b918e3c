"""Stateful ports, as third-party backends: the candidate checkpoint's transformers modules with a serving
engine's own attention (qwen3_moe's, on the golden's rotary tables) reading and writing a KV cache of slots
and a prefix cache, so that a request's output can depend on what earlier requests left there.

`ServingPort` is right: a request gets its slot reset, and the prefix cache is keyed by the prefix's
content (its rows at the layer's input, where a serving stack hashes the tokens). Its `run` is the prompt's
own clean run (a new engine), `run_state` the prompt served after other requests on the same engine:
- `reused`: another request (the prompt's rows reversed) in slot 0 first, then the prompt in slot 0;
- `prefix`: prefix caching on; a request with another prefix of the same length (the first `PREFIX` rows
  reversed) first, then one sharing the prompt's prefix with another suffix, then the prompt, which hits
  the entry of its prefix and reads its keys and values.

The two faulty ports differ from it in one line each, as the bugs do:
- `StaleSlotPort`: a slot given to a new request keeps the length of the last one, so the new request's
  keys and values are written after the stale ones and its queries read both (the first request right,
  every later one wrong);
- `PrefixKeyPort`: the prefix cache is keyed by the prefix's length alone, so the prompt hits the entry
  another request of another prefix wrote."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb, repeat_kv

from pytest_moe_parity.backends import CacheState, CandidateOutput
from pytest_moe_parity.backends.hf import TorchBackend

PREFIX = 8  # the rows a prefix-cache entry holds (a block of a paged cache)


@dataclass
class Engine:
    """One engine's caches: per layer and slot the keys and values held and their length; the prefix cache
    (key -> per layer the prefix's keys and values, and which request wrote them)."""

    keyed_by_length: bool = False
    keep_length: bool = False
    prefix_caching: bool = False
    slots: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    lengths: dict[tuple[int, int], int] = field(default_factory=dict)
    prefixes: dict[Any, dict[int, tuple[torch.Tensor, torch.Tensor, int]]] = field(default_factory=dict)
    request: int = 0
    slot: int = 0
    read: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    said: dict[int, str] = field(default_factory=dict)

    def begin(self, request: int, slot: int = 0) -> None:
        """A new request in `slot`: its length back to 0 (the stale-slot port keeps the last request's)."""
        self.request, self.slot = request, slot
        if not self.keep_length:
            for key in [k for k in self.lengths if k[1] == slot]:
                self.lengths[key] = 0

    def prefix_key(self, rows: torch.Tensor) -> Any:
        return rows.shape[-2] if self.keyed_by_length else hash(rows.detach().cpu().float().numpy().tobytes())

    def attend(self, layer: int, hidden: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """The keys and values the request's queries read at `layer`: what its slot holds, then its own new
        ones (written there); with prefix caching, its first PREFIX rows' from the prefix cache on a hit."""
        if self.prefix_caching and k.shape[-2] > PREFIX:
            key = self.prefix_key(hidden[:, :PREFIX])
            entry = self.prefixes.setdefault(key, {})
            if layer in entry:
                pk, pv, writer = entry[layer]
                k = torch.cat([pk, k[..., PREFIX:, :]], dim=-2)
                v = torch.cat([pv, v[..., PREFIX:, :]], dim=-2)
                hit = f"on a prefix-cache hit of rows 0-{PREFIX - 1} in slot {self.slot}"
                self.said[layer] = f"{hit}, written by request {writer}"
            else:
                entry[layer] = (k[..., :PREFIX, :].clone(), v[..., :PREFIX, :].clone(), self.request)
        start = self.lengths.get((layer, self.slot), 0)
        held = self.slots.get((layer, self.slot))
        keys = k if held is None or start == 0 else torch.cat([held[0][..., :start, :], k], dim=-2)
        values = v if held is None or start == 0 else torch.cat([held[1][..., :start, :], v], dim=-2)
        self.slots[layer, self.slot] = [keys, values]
        self.lengths[layer, self.slot] = keys.shape[-2]
        self.read[layer] = (keys, values)
        if start:
            rows = f"{start} row{'s' * (start != 1)}"
            self.said.setdefault(layer, f"after another request ({rows}) in slot {self.slot}")
        return keys, values


def slot_attention(port: ServingPort, attn: Any) -> Any:
    """qwen3_moe's attention as the port's engine runs it (the golden's rotary tables; its own causal mask over
    the rows it reads: those held before the request's all visible)."""

    def forward(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        keys, values = port.engine.attend(attn.layer_idx, hidden_states, k, v)
        new, total = q.shape[-2], keys.shape[-2]
        mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
        keys, values = repeat_kv(keys, attn.num_key_value_groups), repeat_kv(values, attn.num_key_value_groups)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    return forward


class ServingPort(TorchBackend):
    """A port whose attention serves requests from slots and a prefix cache (right)."""

    name = "serving-port"
    states = ("reused", "prefix")
    engine_options: ClassVar[dict[str, bool]] = {}

    def _install(self) -> None:
        for layer in self._model().model.model.layers:
            attn = layer.self_attn
            if getattr(attn, "_port", None) is not self:
                attn.forward, attn._port = slot_attention(self, attn), self

    def _serve(self, point, requests: list, prefix: bool = False) -> CandidateOutput:
        """The requests, one after another in slot 0 of a new engine; the last one's output, with the
        state its attention read in (`info["state"]`) and the keys and values it read (`cache`)."""
        self._install()
        self.engine = Engine(prefix_caching=prefix, **self.engine_options)
        for index, request in enumerate(requests):
            self.engine.begin(index)
            self.engine.read.clear()
            self.engine.said.clear()
            out = self._run(point, request)
        layer = point.layer
        if layer is not None and layer in self.engine.read:
            keys, values = self.engine.read[layer]
            out.cache = CacheState(layer, keys, values)
            if layer in self.engine.said:
                out.info["state"] = self.engine.said[layer]
        return out

    def run(self, point, golden):
        return self._serve(point, [golden])

    def run_state(self, point, golden, state):
        if state == "reused":
            return self._serve(point, [_other(golden, 0), golden])
        return self._serve(point, [_other(golden, 0, PREFIX), _other(golden, PREFIX), golden], prefix=True)


def _other(golden, start: int, end: int | None = None):
    """Another request of the prompt's length: its hidden rows start..end reversed (the rest the prompt's)."""
    hidden = golden.args[0] if golden.args else golden.kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return golden
    other = hidden.clone()
    end = hidden.shape[-2] if end is None else end
    other[:, start:end] = hidden[:, start:end].flip(1)
    if golden.args:
        return replace(golden, args=(other, *golden.args[1:]))
    return replace(golden, kwargs={**golden.kwargs, "hidden_states": other})


class StaleSlotPort(ServingPort):
    """A slot given to a new request keeps the last request's length: its stale keys and values are read."""

    name = "stale-slot-port"
    engine_options: ClassVar[dict[str, bool]] = {"keep_length": True}


class PrefixKeyPort(ServingPort):
    """The prefix cache is keyed by the prefix's length alone: another prefix's entry is hit."""

    name = "prefix-key-port"
    engine_options: ClassVar[dict[str, bool]] = {"keyed_by_length": True}
