"""A hand-written plain-PyTorch port of Qwen3-MoE, as a team writes one for another runtime: its own
modules and names, experts fused in NxDI's layout (`gate_up [E, H, 2I]`, `down [E, I, H]`), weights
read from the Hugging Face checkpoint, and its own KV cache for decode steps (`generate`). `Bugs`
switches on the code-level port bugs the dump route must catch, each at the component that has it,
the decode-only ones at the first decode step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

POINTS = {
    "embedding": "embed",
    "rotary": "rotary",
    "layer_{layer}.input_norm": "layers.{layer}.input_norm",
    "layer_{layer}.attention": "layers.{layer}.attn",
    "layer_{layer}.post_attn_norm": "layers.{layer}.post_norm",
    "layer_{layer}.router": "layers.{layer}.moe.router",
    "layer_{layer}.experts": "layers.{layer}.moe.experts",
    "layer_{layer}.moe": "layers.{layer}.moe",
    "layer_{layer}.output": "layers.{layer}",
    "final_norm": "norm",
    "logits": "head",
}


@dataclass(frozen=True)
class Bugs:
    rope_interleaved: bool = False  # rotates (even, odd) pairs; the checkpoint's RoPE rotates halves
    gqa_repeat: bool = False  # kv heads tiled with repeat, not repeat_interleave
    no_renormalise: bool = False  # top-k weights left as softmax probabilities
    scale_by_hidden: bool = False  # scores scaled by hidden_size ** -0.5, not head_dim ** -0.5
    mask_one_ahead: bool = False  # each token also sees the next one
    zero_expert: tuple[int, int] | None = None  # (layer, expert) whose weights were lost in conversion
    gate_up_swapped: bool = False  # up's weights where gate's go, and gate's where up's go (conversion)
    down_not_transposed: bool = False  # the down projection loaded as stored ([H, I] read as [I, H]; square only)
    experts_reversed: bool = False  # expert e given the weights of expert E - 1 - e (conversion)
    # not a bug: the same function rounded otherwise, as a port on other kernels computes it (queries
    # scaled before the scores, experts summed in float32, norms' weights applied in float32)
    other_rounding: bool = False
    # not bugs either: the same values laid out otherwise, as ports on other runtimes do (NxDI fuses
    # q, k and v into one matmul; a port that shards heads across ranks computes each head's scores alone)
    fused_qkv: bool = False
    split_heads: bool = False
    # below a fixed limit, above the reference's own error:
    router_softmax_bf16: bool = False  # the router's softmax in bf16, not float32
    norm_eps_10x: bool = False  # every RMSNorm's eps ten times the checkpoint's
    # decode only (one new token on the cache):
    decode_position_stale: bool = False  # the new token is rotated at the last cached position, not its own
    decode_router_softmax_bf16: bool = False  # the decode graph's router softmax in bf16, not float32
    decode_drops_last_cached: bool = False  # the new token attends to every cached position but the last
    decode_cache_overwrites_last: bool = False  # the new token's keys and values overwrite the last cached ones
    # the new token's keys cached as they were before RoPE (the step itself attends with its rotated keys: its
    # output is right, the next step reads a wrong key)
    decode_cache_keys_unrotated: bool = False
    cache_bf16: bool = False  # keys and values kept in bf16 whatever the port computes in (a float32 port's bug)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fp32_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fp32_weight = fp32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight.float() * h).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = dim, theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.dim, 2).float() / self.dim)  # float32 always
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        h, self.heads, self.kv_heads, self.dim = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
        )
        if bugs.fused_qkv:
            self.qkv_proj = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.dim, bias=False)
        self.q_proj = nn.Linear(h, self.heads * self.dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.dim, h, bias=False)
        self.q_norm = RMSNorm(self.dim, cfg["rms_norm_eps"], bugs.other_rounding)
        self.k_norm = RMSNorm(self.dim, cfg["rms_norm_eps"], bugs.other_rounding)
        self.scale = (h if bugs.scale_by_hidden else self.dim) ** -0.5
        self.bugs = bugs

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`cache`: this layer's [keys, values] so far ([B, kv_heads, past, D], empty at first), extended
        in place with this call's."""
        b, t, _ = x.shape
        if self.bugs.fused_qkv:
            sizes = [self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim]
            q, k, v = self.qkv_proj(x).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(b, t, self.heads, self.dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.kv_heads, self.dim)).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        unrotated = k
        q = q * cos + _rotate(q, self.bugs.rope_interleaved) * sin
        k = k * cos + _rotate(k, self.bugs.rope_interleaved) * sin
        past = 0
        if cache is not None:
            past = cache[0].shape[2] if cache else 0
            if cache:
                if t == 1 and self.bugs.decode_cache_overwrites_last:  # written one position early
                    cache[0][:, :, -1:], cache[1][:, :, -1:] = k, v
                    past -= 1
                    k, v = cache[0], cache[1]
                else:
                    k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            if self.bugs.cache_bf16:  # what is kept is rounded; this call still uses its own keys and values
                cache[:] = [k.to(torch.bfloat16).to(q.dtype), v.to(torch.bfloat16).to(q.dtype)]
            elif past and t == 1 and self.bugs.decode_cache_keys_unrotated:
                cache[:] = [torch.cat([k[:, :, :-1], unrotated], dim=2), v]
            else:
                cache[:] = [k, v]
        groups = self.heads // self.kv_heads
        if self.bugs.gqa_repeat:
            k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.bugs.split_heads:
            scores = (
                torch.cat(
                    [torch.matmul(q[:, i : i + 1], k[:, i : i + 1].transpose(2, 3)) for i in range(self.heads)], dim=1
                )
                * self.scale
            )
        elif self.bugs.other_rounding:
            scores = torch.matmul(q * self.scale, k.transpose(2, 3))
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        ahead = 2 if self.bugs.mask_one_ahead else 1
        hidden = torch.triu(torch.ones(t, past + t, dtype=torch.bool), diagonal=past + ahead)
        if past and t == 1 and self.bugs.decode_drops_last_cached:
            hidden[:, past - 1] = True
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class Router(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg["num_experts"], cfg["hidden_size"]))
        self.k = cfg["num_experts_per_tok"]
        self.renormalise = cfg["norm_topk_prob"] and not bugs.no_renormalise
        self.bugs = bugs

    def forward(self, x: torch.Tensor, decode: bool = False):
        logits = F.linear(x, self.weight)
        bf16 = self.bugs.router_softmax_bf16 or (decode and self.bugs.decode_router_softmax_bf16)
        probs = F.softmax(logits, dim=-1, dtype=torch.bfloat16 if bf16 else torch.float32)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids


class Experts(nn.Module):
    """All experts of a layer fused, as NxDI lays them out: gate_up [E, H, 2I], down [E, I, H]."""

    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.gate_up = nn.Parameter(torch.zeros(e, h, 2 * i))
        self.down = nn.Parameter(torch.zeros(e, i, h))
        self.fp32_sum = bugs.other_rounding

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.float32 if self.fp32_sum else x.dtype)
        inter = self.down.shape[1]
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            gate_up = x[token] @ self.gate_up[expert]
            y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ self.down[expert]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.router = Router(cfg, bugs)
        self.experts = Experts(cfg, bugs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = self.router(flat, decode=x.shape[1] == 1)
        return self.experts(flat, ids, weights).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs):
        super().__init__()
        self.input_norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], bugs.other_rounding)
        self.attn = Attention(cfg, bugs)
        self.post_norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], bugs.other_rounding)
        self.moe = MoE(cfg, bugs)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, cache)
        return x + self.moe(self.post_norm(x))


class Qwen3MoePort(nn.Module):
    def __init__(self, cfg: dict, bugs: Bugs = Bugs()):
        super().__init__()
        self.bugs = bugs
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        self.rotary = Rotary(cfg["head_dim"], theta)
        self.layers = nn.ModuleList(Block(cfg, bugs) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor, cache: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """The logits of `ids` [B, T]; with `cache` (a list per layer, from `new_cache`), after the
        positions it holds, which it then holds too."""
        x = self.embed(ids)
        past = cache[0][0].shape[2] if cache and cache[0] else 0
        start = past - 1 if past and self.bugs.decode_position_stale else past
        positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
        cos, sin = self.rotary(x, positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache[i] if cache is not None else None)
        return self.head(self.norm(x))

    def new_cache(self) -> list[list[torch.Tensor]]:
        return [[] for _ in self.layers]

    def generate(self, ids: torch.Tensor, tokens: list[int], recorder=None) -> None:
        """The prefill of `ids`, then one decode step per token of `tokens` (teacher-forced: the tokens
        the reference chose), each on the cache the calls before it wrote; with a `recorder`
        (`pytest_moe_parity.dump.record`'s), each decode step's cache too, as the port writes it."""
        cache = self.new_cache()
        self(ids, cache)
        for token in tokens:
            self(torch.full((ids.shape[0], 1), token, dtype=ids.dtype), cache)
            for layer, (keys, values) in enumerate(cache if recorder is not None else ()):
                recorder.keep_cache(layer, keys, values)


def load_port(model_dir: Path, dtype: torch.dtype = torch.bfloat16, bugs: Bugs = Bugs()) -> Qwen3MoePort:
    """The port with the checkpoint's weights converted to its own names and fused layout."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_experts"] = cfg.get("num_experts", cfg.get("num_local_experts"))
    hf: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(str(shard)))
    if bugs.norm_eps_10x:
        cfg = {**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 10}
    port = Qwen3MoePort(cfg, bugs)
    state = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    state["head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    renames = {
        "input_norm.weight": "input_layernorm.weight",
        "post_norm.weight": "post_attention_layernorm.weight",
        "moe.router.weight": "mlp.gate.weight",
        **{
            f"attn.{p}.weight": f"self_attn.{p}.weight"
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        },
    }
    for i in range(cfg["num_hidden_layers"]):
        state.update({f"layers.{i}.{ours}": hf[f"model.layers.{i}.{theirs}"] for ours, theirs in renames.items()})
        experts = range(cfg["num_experts"])[:: -1 if bugs.experts_reversed else 1]
        expert = lambda e, p, i=i: hf[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"]  # noqa: E731
        halves = ("up_proj", "gate_proj") if bugs.gate_up_swapped else ("gate_proj", "up_proj")
        state[f"layers.{i}.moe.experts.gate_up"] = torch.stack(
            [torch.cat([expert(e, halves[0]).T, expert(e, halves[1]).T], dim=1) for e in experts]
        )
        down = (lambda w: w) if bugs.down_not_transposed else (lambda w: w.T)
        state[f"layers.{i}.moe.experts.down"] = torch.stack([down(expert(e, "down_proj")) for e in experts])
    if bugs.zero_expert is not None:
        layer, e = bugs.zero_expert
        for part in ("gate_up", "down"):
            state[f"layers.{layer}.moe.experts.{part}"][e] = 0
    if bugs.fused_qkv:
        for i in range(cfg["num_hidden_layers"]):
            parts = [state[f"layers.{i}.attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
            state[f"layers.{i}.attn.qkv_proj.weight"] = torch.cat(parts)
    port.load_state_dict({k: v.contiguous() for k, v in state.items()})
    return port.to(dtype).eval()
