"""A second hand-written port of Qwen3-MoE, written otherwise than transformers *and* than
`port_qwen3`, as an NxDI modeling file computes it in plain PyTorch: each attention builds its own
positions, rotary tables and causal mask from how many positions its cache holds (nothing is passed
in but the hidden states), computes grouped-query scores without repeating K/V heads (the query heads
of a group stacked on the rows), keeps a static preallocated KV cache written at its cache positions
with `index_copy_`; the router takes its top-k over the logits and a softmax over the k it kept (the
renormalised top-k of the softmax, by another road); the experts dispatch sorted (every (token, slot)
pair sorted by expert, each expert a slice of one gather, the results weighted and scattered back at
once). Names are its own (`wq`, `wk`, `wv`, `wo`, `gate`, `w13`, `w2`). `Bugs` are the port bugs the
drill must name at the op they change, prefill and decode. `Positions` is the model wrapper's step
before the layers: it makes the position ids itself and drives the rotary tables with them (the
`rotary` point: values made inside the call, where the golden is given its position ids)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ZEROED_EXPERT = 3  # `expert_zeroed`: the expert the conversion leaves zero (the test input routes to it)
CAPACITY_FACTOR = 1.5  # `capacity_truncated`: each expert's capacity, times an even share of the pairs

BUGS = {
    # prefill (attention)
    "rope_theta_hardcoded": "the rotary base Qwen3's published 1e6, not the checkpoint's rope_theta",
    "rope_exponent_halved": "inverse frequencies theta ** (-2i / (D / 2)), not theta ** (-2i / D)",
    "rope_interleaved": "rotates (even, odd) pairs; the checkpoint rotates halves",
    "kv_head_modulo": "query head h reads K/V head h % kv_heads, not h // group",
    "scale_by_hidden": "scores scaled by hidden_size ** -0.5, not head_dim ** -0.5",
    "mask_one_ahead": "each token also sees the next one",
    "k_norm_skipped": "the keys' RMSNorm left out",
    # prefill (router, experts)
    "router_softmax_all": "the softmax over every expert's logit after the top-k: weights not renormalised",
    "gate_up_swapped": "up's weights where gate's go (conversion)",
    "experts_reversed": "expert e given expert E - 1 - e's weights (conversion)",
    "weights_ignored": "expert outputs summed unweighted",
    "silu_as_gelu": "the experts' activation gelu, not silu",
    "expert_zeroed": f"expert {ZEROED_EXPERT}'s weights zeroed (conversion)",
    "capacity_truncated": f"a capacity dispatch: each expert keeps its first ceil(T * k / E * {CAPACITY_FACTOR}) "
    "(token, slot) pairs in token order, the rest dropped (GShard's, NxDI's capacity factor)",
    # decode only
    "decode_position_stale": "the new token rotated at the last cached position, not its own",
    "decode_cache_overwrites_last": "the new keys and values written over the last cached ones",
    "decode_drops_last_cached": "the new token attends to every cached position but the last",
    "decode_cache_keys_unrotated": "the new keys cached before RoPE (the step attends with its rotated keys)",
    # decode, over the whole static cache (each implies `static_whole`)
    "decode_write_one_early": "the new keys and values written one slot early, over the last cached ones",
    "decode_k_before_rope": "the new keys written into the cache before their rotation",
    "decode_past_not_joined": "the new keys and values written into a fresh buffer: the past is never read",
    "decode_mask_hides_last": "the mask hides the last live slot (the new token's own)",
    # not a bug: NxDI's static cache, scores over all of its slots, those not live masked
    "static_whole": "(layout) scores over the whole static cache (a bucket), slots not live masked by position",
    "static_scatter": "(layout) the whole cache written with scatter_ and an index tensor, not index_copy_",
    "static_index_put": "(layout) the whole cache written by indexing (cache[:, :, slots] = new: index_put_)",
    "static_left_padded": "(layout) the whole cache left padded: the live slots end a context bucket, as NxDI pads",
    # the rotary point (its tables driven by the model wrapper, which makes the position ids)
    "wrapper_positions_from_one": "the wrapper's position ids start at 1, not 0",
    "inv_freq_bf16": "the inverse-frequency table rounded to bfloat16 (a rounding that fails the point alone)",
    # not a bug: another dispatch, each expert's tokens taken with a boolean mask, in token order
    "dispatch_masked": "(layout) each expert's rows taken with x[mask], not from one sorted gather",
    # not a bug: the sorted rows made by a one-hot matmul (GShard's dispatch), not by a gather: no
    # index says which token a row holds
    "dispatch_onehot": "(layout) the sorted rows made by a one-hot matmul, not a gather",
}


@dataclass(frozen=True)
class Bugs:
    names: frozenset[str] = frozenset()

    def __getattr__(self, name: str) -> bool:
        if name not in BUGS:
            raise AttributeError(name)
        return name in self.names

    @classmethod
    def parse(cls, text: str) -> Bugs:
        names = frozenset(n for n in text.split(",") if n)
        unknown = sorted(names - set(BUGS))
        if unknown:
            raise ValueError(f"no such port bug: {', '.join(unknown)}")
        return cls(names)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


WHOLE = (  # the whole-cache layouts, and the decode bugs that imply one
    "static_whole", "static_scatter", "static_index_put", "static_left_padded",
    "decode_write_one_early", "decode_k_before_rope", "decode_past_not_joined", "decode_mask_hides_last",
)  # fmt: skip


class StaticCache:
    """One layer's keys and values, preallocated [B, kv_heads, max_len, D], `length` positions held
    from slot `start` on (left padding: the slots before it are padding)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, start: int = 0):
        self.keys, self.values, self.length, self.start = keys, values, length, start

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, max_len: int, dtype: torch.dtype) -> StaticCache:
        zeros = torch.zeros(batch, heads, max_len, dim, dtype=dtype)
        return cls(zeros, zeros.clone(), 0)

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, max_len: int, start: int = 0) -> StaticCache:
        """A cache of `max_len` positions holding `keys`/`values` [B, kv, past, D] (a golden's) from
        slot `start` on."""
        cache = cls.empty(keys.shape[0], keys.shape[1], keys.shape[3], max_len, keys.dtype)
        cache.keys[:, :, start : start + keys.shape[2]] = keys
        cache.values[:, :, start : start + keys.shape[2]] = values
        cache.length, cache.start = keys.shape[2], start
        return cache


class Attention(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        hidden, self.heads, self.kv_heads, self.dim = (
            cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
        )  # fmt: skip
        self.wq = nn.Linear(hidden, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(hidden, self.kv_heads * self.dim, bias=False)
        self.wv = nn.Linear(hidden, self.kv_heads * self.dim, bias=False)
        self.wo = nn.Linear(self.heads * self.dim, hidden, bias=False)
        self.q_norm_weight = nn.Parameter(torch.ones(self.dim))
        self.k_norm_weight = nn.Parameter(torch.ones(self.dim))
        self.eps = cfg["rms_norm_eps"]
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        self.theta = 1e6 if bugs.rope_theta_hardcoded else theta
        self.scale = (hidden if bugs.scale_by_hidden else self.dim) ** -0.5
        self.bugs = bugs

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.dim // 2 if self.bugs.rope_exponent_halved else self.dim
        inv_freq = torch.pow(self.theta, -torch.arange(0, self.dim, 2, dtype=torch.float32) / span)
        angles = torch.outer(positions.float(), inv_freq)  # [T, D/2]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.bugs.rope_interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, x: torch.Tensor, cache: StaticCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        past = cache.length if cache is not None else 0
        start = past
        if t == 1 and past and self.bugs.decode_position_stale:
            start -= 1
        positions = torch.arange(start, start + t)
        cos, sin = self.rotary(positions, x.dtype)
        q = rms(self.wq(x).view(b, t, self.heads, self.dim), self.q_norm_weight, self.eps)
        k = self.wk(x).view(b, t, self.kv_heads, self.dim)
        if not self.bugs.k_norm_skipped:
            k = rms(k, self.k_norm_weight, self.eps)
        v = self.wv(x).view(b, t, self.kv_heads, self.dim)
        q = self.rotate(q.transpose(1, 2), cos, sin)  # [B, heads, T, D]
        unrotated = k.transpose(1, 2)
        k = self.rotate(unrotated, cos, sin)
        v = v.transpose(1, 2)
        if cache is not None and any(n in self.bugs.names for n in WHOLE):
            return self.wo(self.over_whole_cache(q, unrotated if self.bugs.decode_k_before_rope else k, v, cache))
        if cache is not None:  # written at their cache positions, then the positions held read back
            at = torch.arange(past, past + t)
            if t == 1 and past and self.bugs.decode_cache_overwrites_last:
                at = at - 1
            unrotated_write = t == 1 and past and self.bugs.decode_cache_keys_unrotated
            cache.keys.index_copy_(2, at, unrotated if unrotated_write else k)
            cache.values.index_copy_(2, at, v)
            cache.length = int(at[-1]) + 1
            own = k
            k, v = cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]
            if unrotated_write:  # the step itself attends with the keys it rotated
                k = torch.cat([k[:, :, :-1], own], dim=2)
        group = self.heads // self.kv_heads
        if self.bugs.kv_head_modulo:  # heads regrouped as if head h belonged to group h % kv_heads
            q = q.view(b, group, self.kv_heads, t, self.dim).transpose(1, 2)
        q = q.reshape(b, self.kv_heads, group * t, self.dim)  # a group's query heads stacked on the rows
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # [B, kv, group * T, S]
        keys = k.shape[2]
        rows = torch.arange(keys - t, keys).repeat(group)  # each row's own position
        ahead = 1 if self.bugs.mask_one_ahead else 0
        allowed = torch.arange(keys)[None, :] <= rows[:, None] + ahead
        if t == 1 and keys > 1 and self.bugs.decode_drops_last_cached:
            allowed[:, keys - 2] = False
        scores = torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=scores.dtype))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v).view(b, self.kv_heads, group, t, self.dim)
        if self.bugs.kv_head_modulo:
            out = out.transpose(1, 2)
        out = out.reshape(b, self.heads, t, self.dim).transpose(1, 2).reshape(b, t, -1)
        return self.wo(out)

    def over_whole_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """NxDI's decode: K/V written into the static cache at their slots (`index_copy_`, `scatter_`
        with an index tensor, or `index_put_`), the scores over every slot of the cache, the slots not live
        (padding, not yet written) masked by the cache's positions."""
        b, _, t, _ = q.shape
        live, size = cache.start + cache.length, cache.keys.shape[2]
        own = torch.arange(live, live + t)  # the new tokens' slots
        at = own - 1 if t == 1 and (self.bugs.decode_write_one_early or self.bugs.decode_cache_overwrites_last) else own
        keys, values = cache.keys, cache.values
        if self.bugs.decode_past_not_joined:
            keys, values = torch.zeros_like(keys), torch.zeros_like(values)
        for into, new in ((keys, k), (values, v)):
            if self.bugs.static_scatter:
                into.scatter_(2, at.view(1, 1, t, 1).expand_as(new), new)
            elif self.bugs.static_index_put:
                into[:, :, at] = new
            else:
                into.index_copy_(2, at, new)
        cache.length += t
        group = self.heads // self.kv_heads
        q = q.reshape(b, self.kv_heads, group * t, self.dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale  # [B, kv, group * T, slots]
        slots, rows = torch.arange(size), own.repeat(group)
        allowed = (slots[None, :] >= cache.start) & (slots[None, :] <= rows[:, None])
        if t == 1 and (self.bugs.decode_drops_last_cached or self.bugs.decode_mask_hides_last):
            allowed = allowed & (slots != live - (1 if self.bugs.decode_drops_last_cached else 0))
        scores = torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=scores.dtype))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, values).view(b, self.kv_heads, group, t, self.dim)
        return out.reshape(b, self.heads, t, self.dim).transpose(1, 2).reshape(b, t, -1)


class Rotary(nn.Module):
    """The model's rotary tables from the position ids it is given, in transformers' layout (cos and
    sin [B, T, D], each half the same angles); its inverse frequencies made in the call."""

    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.dim = cfg["head_dim"]
        self.theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        self.bugs = bugs

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.pow(self.theta, -torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        if self.bugs.inv_freq_bf16:  # the table kept in the model's dtype
            inv_freq = inv_freq.to(torch.bfloat16)
        angles = positions[..., None].float() * inv_freq.float()  # [B, T, D/2]
        both = torch.cat([angles, angles], dim=-1)
        return both.cos().to(dtype), both.sin().to(dtype)


class Positions(nn.Module):
    """The model wrapper's step before the layers, as an NxDI model wrapper takes it: the position
    ids made here (from how many positions the cache holds), not given, and the rotary tables of them."""

    def __init__(self, rotary: Rotary, bugs: Bugs):
        super().__init__()
        self.rotary, self.bugs = rotary, bugs

    def forward(self, x: torch.Tensor, past: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = x.shape[:2]
        start = past + (1 if self.bugs.wrapper_positions_from_one else 0)
        positions = torch.arange(start, start + t).expand(b, t)
        return self.rotary(positions, x.dtype)


class Router(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(cfg["num_experts"], cfg["hidden_size"]))
        self.k = cfg["num_experts_per_tok"]
        self.bugs = bugs

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = x @ self.gate.T
        top, ids = logits.float().topk(self.k, dim=-1)
        # softmax over the kept logits: the renormalised top-k of the softmax, by another road
        all_experts = self.bugs.router_softmax_all
        weights = logits.float().softmax(-1).gather(-1, ids) if all_experts else top.softmax(-1)
        return logits, weights.to(x.dtype), ids


class Experts(nn.Module):
    """Experts fused as NxDI lays them out (`w13` [E, H, 2I], `w2` [E, I, H]), dispatched sorted."""

    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.w13 = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.w2 = nn.Parameter(torch.zeros(e, i, h))
        self.bugs = bugs

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.bugs.dispatch_masked:
            return self.masked(x, ids, weights)
        k, inter = ids.shape[1], self.w2.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # every (token, slot) pair, by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        if self.bugs.capacity_truncated:
            order, counts = capacity_dispatch(flat, self.w13.shape[0])
        token = order // k
        rows = F.one_hot(token, x.shape[0]).to(x.dtype) @ x if self.bugs.dispatch_onehot else x[token]
        act = F.gelu if self.bugs.silu_as_gelu else F.silu
        outs, start = [], 0
        for expert, n in enumerate(counts):
            if n:
                h = rows[start : start + n] @ self.w13[expert]
                outs.append((act(h[:, :inter]) * h[:, inter:]) @ self.w2[expert])
                start += n
        y = torch.cat(outs)
        if not self.bugs.weights_ignored:
            y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)

    def masked(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        inter, out = self.w2.shape[1], torch.zeros_like(x)
        act = F.gelu if self.bugs.silu_as_gelu else F.silu
        for expert in range(self.w13.shape[0]):
            chosen = ids == expert  # [T, k]
            mask = chosen.any(-1)
            if not bool(mask.any()):
                continue
            h = x[mask] @ self.w13[expert]
            y = (act(h[:, :inter]) * h[:, inter:]) @ self.w2[expert]
            if not self.bugs.weights_ignored:
                y = y * (weights * chosen).sum(-1)[mask, None]
            out = out.index_add(0, mask.nonzero().squeeze(1), y)
        return out


class MoE(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.router, self.experts = Router(cfg, bugs), Experts(cfg, bugs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = self.router(flat)
        return self.experts(flat, ids, weights).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(cfg["hidden_size"]))
        self.mlp_norm = nn.Parameter(torch.ones(cfg["hidden_size"]))
        self.eps = cfg["rms_norm_eps"]
        self.attn, self.moe = Attention(cfg, bugs), MoE(cfg, bugs)

    def forward(self, x: torch.Tensor, cache: StaticCache | None = None) -> torch.Tensor:
        x = x + self.attn(rms(x, self.attn_norm, self.eps), cache)
        return x + self.moe(rms(x, self.mlp_norm, self.eps))


class OwnPort(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs = Bugs()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Block(cfg, bugs) for _ in range(cfg["num_hidden_layers"]))
        self.positions = Positions(Rotary(cfg, bugs), bugs)
        self.norm = nn.Parameter(torch.ones(cfg["hidden_size"]))
        self.head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def new_cache(self, batch: int, max_len: int) -> list[StaticCache]:
        dtype = self.head.weight.dtype
        kv, dim = self.cfg["num_key_value_heads"], self.cfg["head_dim"]
        return [StaticCache.empty(batch, kv, dim, max_len, dtype) for _ in self.layers]

    def forward(self, ids: torch.Tensor, cache: list[StaticCache] | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache[i] if cache is not None else None)
        return self.head(rms(x, self.norm, self.cfg["rms_norm_eps"]))


def capacity_dispatch(flat: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """`capacity_truncated`: every (token, slot) pair (`flat`: each pair's expert) sorted by expert, of
    which each expert keeps its first `capacity` (in token order), an even share of the pairs times
    CAPACITY_FACTOR, the rest dropped (GShard's, NxDI's capacity dispatch): (the kept pairs, each
    expert's count)."""
    capacity = math.ceil(flat.numel() / experts * CAPACITY_FACTOR)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    starts = torch.tensor([0, *counts[:-1]]).cumsum(0)
    rank = torch.arange(order.numel()) - starts[flat[order]]  # each pair's place among its expert's
    return order[rank < capacity], [min(n, capacity) for n in counts]


def load_port(model_dir: Path, dtype: torch.dtype = torch.bfloat16, bugs: Bugs = Bugs()) -> OwnPort:
    """The port with the checkpoint's weights converted to its own names and fused layout."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_experts"] = cfg.get("num_experts", cfg.get("num_local_experts"))
    hf: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(str(shard)))
    port = OwnPort(cfg, bugs)
    state = {"embed.weight": hf["model.embed_tokens.weight"], "norm": hf["model.norm.weight"]}
    state["head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        state[ours + "attn_norm"] = hf[theirs + "input_layernorm.weight"]
        state[ours + "mlp_norm"] = hf[theirs + "post_attention_layernorm.weight"]
        for p, q in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            state[f"{ours}attn.{p}.weight"] = hf[f"{theirs}self_attn.{q}.weight"]
        state[ours + "attn.q_norm_weight"] = hf[theirs + "self_attn.q_norm.weight"]
        state[ours + "attn.k_norm_weight"] = hf[theirs + "self_attn.k_norm.weight"]
        state[ours + "moe.router.gate"] = hf[theirs + "mlp.gate.weight"]
        experts = range(cfg["num_experts"])[:: -1 if bugs.experts_reversed else 1]
        halves = ("up_proj", "gate_proj") if bugs.gate_up_swapped else ("gate_proj", "up_proj")
        expert = lambda e, p, theirs=theirs: hf[f"{theirs}mlp.experts.{e}.{p}.weight"]  # noqa: E731
        state[ours + "moe.experts.w13"] = torch.stack(
            [torch.cat([expert(e, halves[0]).T, expert(e, halves[1]).T], dim=1) for e in experts]
        )
        state[ours + "moe.experts.w2"] = torch.stack([expert(e, "down_proj").T for e in experts])
        if bugs.expert_zeroed:
            for name in ("w13", "w2"):
                state[f"{ours}moe.experts.{name}"][ZEROED_EXPERT] = 0
    port.load_state_dict({k: v.contiguous() for k, v in state.items()})
    return port.to(dtype).eval()
