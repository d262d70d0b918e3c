"""NxDI's NeuronAttentionBase on the CPU, as its source computes it without kernels
(standard_causal_attention_forward; modules/attention/attention_base.py), with the documented
contract enforced: context encoding (a config with is_prefill_stage=True) takes a boolean causal
mask [B, 1, S, S] and int32 position ids [B, S]; token generation (is_prefill_stage=False) takes
the cache as (K, V) [B, kv_heads, past, head_dim] with a boolean mask over the past positions
[B, 1, 1, past], and computes the prior and the active part apart. It returns
NeuronAttentionBaseOutput (indexable as (hidden, (K, V), cos, sin)), K and V being this call's new
keys and values. q/k/v/o are plain Linears under the names the checkpoint holds (NxD's preshard
hooks map them to qkv_proj/o_proj); `rank_util.rank` is NxD's SPMDRank."""

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from .utils import apply_rotary_pos_emb, manual_softmax, repeat_kv


@dataclass(frozen=True)
class NeuronAttentionBaseOutput:
    hidden_states: torch.Tensor
    present_key_value: tuple
    cos_cache: torch.Tensor | None = None
    sin_cache: torch.Tensor | None = None

    def __iter__(self):
        return iter([self.hidden_states, self.present_key_value, self.cos_cache, self.sin_cache])

    def __getitem__(self, i):
        return getattr(self, fields(self)[i].name)


class SPMDRank(nn.Module):
    def __init__(self, world_size):
        super().__init__()
        self.rank = nn.Parameter(torch.arange(world_size, dtype=torch.int32), requires_grad=False)


def _check(condition, message):
    if not condition:
        raise TypeError(f"NeuronAttentionBase: {message}")


class NeuronAttentionBase(nn.Module):
    def __init__(
        self,
        config,
        hidden_size,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rotary_emb,
        rms_norm_eps=None,
        use_qk_norm=False,
    ):
        super().__init__()
        dtype = config.neuron_config.torch_dtype
        self.torch_dtype = dtype
        self.is_prefill_stage = getattr(config.neuron_config, "is_prefill_stage", True)
        self.num_heads, self.num_key_value_heads, self.head_dim = num_attention_heads, num_key_value_heads, head_dim
        self.num_key_value_groups = num_attention_heads // num_key_value_heads
        self.rotary_emb = rotary_emb
        self.rms_norm_eps = rms_norm_eps
        self.softmax_scale = math.sqrt(head_dim)
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(num_attention_heads * head_dim, hidden_size, bias=False, dtype=dtype)
        self.q_layernorm = self.k_layernorm = None
        self.rank_util = SPMDRank(config.neuron_config.tp_degree)

    def _heads(self, x, heads, norm):
        bsz, q_len, _ = x.shape
        x = x.view(bsz, q_len, heads, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, **kwargs):
        original = hidden_states.dtype
        hidden_states = hidden_states.to(self.torch_dtype)
        bsz, q_len, _ = hidden_states.shape
        _check(position_ids is not None and position_ids.shape == (bsz, q_len), "position_ids [B, S] are required")
        _check(attention_mask is not None and attention_mask.dtype == torch.bool, "the mask is a boolean tensor")
        _check(
            self.is_prefill_stage == (past_key_value is None),
            "context encoding is built with is_prefill_stage=True, token generation with False (as NxDI's models are)",
        )
        Q = self._heads(self.q_proj(hidden_states), self.num_heads, self.q_layernorm)
        K = self._heads(self.k_proj(hidden_states), self.num_key_value_heads, self.k_layernorm)
        V = self._heads(self.v_proj(hidden_states), self.num_key_value_heads, None)
        cos, sin = self.rotary_emb(V, position_ids)
        Q, K = apply_rotary_pos_emb(Q, K, cos, sin)
        if past_key_value is None:  # context encoding
            _check(
                attention_mask.shape == (bsz, 1, q_len, q_len),
                f"a context mask is [B, 1, S, S], got {tuple(attention_mask.shape)}",
            )
            scores = Q @ repeat_kv(K, self.num_key_value_groups).transpose(2, 3) / self.softmax_scale
            scores = torch.where(attention_mask, scores, torch.finfo(scores.dtype).min)
            probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(Q.dtype)
            out = probs @ repeat_kv(V, self.num_key_value_groups)
        else:  # token generation: the prior (cached) part and the active part
            _check(isinstance(past_key_value, tuple) and len(past_key_value) == 2, "past_key_value is (K, V)")
            k_prior, v_prior = past_key_value
            past = k_prior.shape[2]
            _check(
                k_prior.shape == (bsz, self.num_key_value_heads, past, self.head_dim),
                f"the K cache is BHSD, got {tuple(k_prior.shape)}",
            )
            _check(
                attention_mask.shape == (bsz, 1, q_len, past),
                f"a token-generation mask covers the past: [B, 1, Q, {past}], got {tuple(attention_mask.shape)}",
            )
            prior = Q @ repeat_kv(k_prior, self.num_key_value_groups).transpose(2, 3) / self.softmax_scale
            prior = torch.where(attention_mask, prior, torch.finfo(prior.dtype).min).to(torch.float32)
            active = (Q @ repeat_kv(K, self.num_key_value_groups).transpose(2, 3) / self.softmax_scale).to(
                torch.float32
            )
            p_prior, p_active = manual_softmax(prior, active)
            out = p_prior.to(Q.dtype) @ repeat_kv(v_prior, self.num_key_value_groups)
            out = out + p_active.to(Q.dtype) @ repeat_kv(V, self.num_key_value_groups)
        out = self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim))
        return NeuronAttentionBaseOutput(out.to(original), (K, V), cos, sin)
