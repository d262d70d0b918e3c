"""NxDI's attention helpers as its source has them (modules/attention/utils.py): the rotary
embedding from position ids, rotate-half RoPE, repeat_kv (repeat_interleave over kv heads) and
the token-generation softmax split into a prior (cached) and an active part."""

import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, factor=None):
        super().__init__()
        self.dim, self.base, self.factor = dim, base, factor
        self.max_position_embeddings = max_position_embeddings

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
        if self.factor is not None:
            inv_freq = inv_freq / self.factor
        expanded = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states, n_rep):
    batch, heads, length, dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    expanded = hidden_states[:, :, None].expand(batch, heads, n_rep, length, dim)
    return expanded.reshape(batch, heads * n_rep, length, dim)


def manual_softmax(prior_scores, active_scores):
    top = torch.maximum(prior_scores.max(dim=-1, keepdim=True)[0], active_scores)
    exp_prior, exp_active = torch.exp(prior_scores - top), torch.exp(active_scores - top)
    denominator = exp_prior.sum(dim=-1, keepdim=True) + exp_active.sum(dim=-1, keepdim=True)
    return exp_prior / denominator, exp_active / denominator
