"""NxDI's NeuronAttentionBase on the CPU, as its source computes it without kernels
(standard_causal_attention_forward; modules/attention/attention_base.py), with the documented
contract enforced: context encoding (a config with is_prefill_stage=True) takes a boolean causal
mask [B, 1, S, S] and int32 position ids [B, S]; token generation (is_prefill_stage=False) takes
the cache as (K, V) [B, kv_heads, past, head_dim] with a boolean mask over the past positions
[B, 1, 1, past], and computes the prior and the active part apart. It returns
NeuronAttentionBaseOutput (indexable as (hidden, (K, V), cos, sin)), K and V being this call's new
keys and values. q/k/v/o are plain Linears under the names the checkpoint holds (NxD's preshard
hooks map them to qkv_proj/o_proj), each rank computing its own heads (NxD's GQA sharding) and
all-reducing o_proj's output; `rank_util` is NxD's SPMDRank, which says the rank. At a decode
step each rank's cache holds that rank's kv heads."""

import math
from dataclasses import dataclass, fields

import torch
from neuronx_distributed.parallel_layers.layers import SPMDRank
from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region
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
        self.tp_degree = config.neuron_config.tp_degree
        self.rank_util = SPMDRank(self.tp_degree)
        if num_attention_heads % self.tp_degree:
            raise ValueError("the double does not pad attention heads to the TP degree")

    def _rank_weights(self):
        """This rank's columns of q/k/v and rows of o, as NxD's GQA shards them: q heads split evenly;
        kv heads kept if the TP degree divides them, else each repeated (repeat_interleave) up to the
        TP degree (REPLICATE_TO_TP_DEGREE) or to the attention heads (CONVERT_TO_MHA), then split."""
        rank, tp, kv, d = int(self.rank_util.get_rank()[0]), self.tp_degree, self.num_key_value_heads, self.head_dim
        per_rank = self.num_heads // tp
        q = self.q_proj.weight.view(self.num_heads, d, -1)[rank * per_rank : (rank + 1) * per_rank]
        o = self.o_proj.weight.view(-1, self.num_heads, d)[:, rank * per_rank : (rank + 1) * per_rank]
        grown = kv if kv % tp == 0 else tp if tp % kv == 0 else self.num_heads

        def shard(w):
            return w.view(kv, d, -1).repeat_interleave(grown // kv, dim=0).chunk(tp)[rank]

        k, v = shard(self.k_proj.weight), shard(self.v_proj.weight)
        return (q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1]),
                o.reshape(o.shape[0], -1), per_rank, k.shape[0])  # fmt: skip

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
        wq, wk, wv, wo, heads, kv_heads = self._rank_weights()
        groups = heads // kv_heads
        Q = self._heads(hidden_states @ wq.T, heads, self.q_layernorm)
        K = self._heads(hidden_states @ wk.T, kv_heads, self.k_layernorm)
        V = self._heads(hidden_states @ wv.T, kv_heads, None)
        cos, sin = self.rotary_emb(V, position_ids)
        Q, K = apply_rotary_pos_emb(Q, K, cos, sin)
        if past_key_value is None:  # context encoding
            _check(
                attention_mask.shape == (bsz, 1, q_len, q_len),
                f"a context mask is [B, 1, S, S], got {tuple(attention_mask.shape)}",
            )
            scores = Q @ repeat_kv(K, groups).transpose(2, 3) / self.softmax_scale
            scores = torch.where(attention_mask, scores, torch.finfo(scores.dtype).min)
            probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(Q.dtype)
            out = probs @ repeat_kv(V, groups)
        else:  # token generation: the prior (cached) part and the active part
            _check(isinstance(past_key_value, tuple) and len(past_key_value) == 2, "past_key_value is (K, V)")
            k_prior, v_prior = past_key_value
            past = k_prior.shape[2]
            _check(
                k_prior.shape == (bsz, kv_heads, past, self.head_dim),
                f"the K cache is this rank's BHSD [B, {kv_heads}, past, {self.head_dim}], got {tuple(k_prior.shape)}",
            )
            _check(
                attention_mask.shape == (bsz, 1, q_len, past),
                f"a token-generation mask covers the past: [B, 1, Q, {past}], got {tuple(attention_mask.shape)}",
            )
            prior = Q @ repeat_kv(k_prior, groups).transpose(2, 3) / self.softmax_scale
            prior = torch.where(attention_mask, prior, torch.finfo(prior.dtype).min).to(torch.float32)
            active = (Q @ repeat_kv(K, groups).transpose(2, 3) / self.softmax_scale).to(torch.float32)
            p_prior, p_active = manual_softmax(prior, active)
            out = p_prior.to(Q.dtype) @ repeat_kv(v_prior, groups)
            out = out + p_active.to(Q.dtype) @ repeat_kv(V, groups)
        out = out.transpose(1, 2).reshape(bsz, q_len, heads * self.head_dim) @ wo.T
        out = reduce_from_tensor_model_parallel_region(out)  # o_proj is row-parallel
        return NeuronAttentionBaseOutput(out.to(original), (K, V), cos, sin)
