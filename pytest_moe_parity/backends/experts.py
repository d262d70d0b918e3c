"""A static-shape experts implementation for compiled candidates. transformers' eager experts loop
over the experts that tokens were routed to (`nonzero`, a data-dependent shape): a traced graph
would freeze the routing of its example, and Neuron needs static shapes. Here every token goes
through every expert and the outputs are weighted by the dense routing matrix (zero for the experts
a token was not routed to), so the graph is the same for any routing. It costs num_experts / top_k
times the FLOPs of the sparse computation and E x T x (2I + H) activations, which a parity test of
one layer can afford; it agrees with eager to float32 rounding (~1e-7) on every table architecture.

It registers with transformers' `ExpertsInterface` under `DENSE`, so any experts class built with
`use_experts_implementation` (mixtral, qwen*_moe, deepseek_v3, minimax_m2, gpt_oss, olmoe, ...)
uses it when its config's `_experts_implementation` says so."""

from __future__ import annotations

import torch

DENSE = "moe_parity_dense"


def dense_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The same contract as transformers' experts forward: [T, H], [T, k] ids, [T, k] weights -> [T, H]."""
    num_experts = self.num_experts
    tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    routing = torch.zeros(tokens, num_experts, dtype=top_k_weights.dtype, device=hidden_states.device)
    routing = routing.scatter_add(1, top_k_index, top_k_weights)  # [T, E]: each token's weight per expert
    x = hidden_states.unsqueeze(0).expand(num_experts, tokens, hidden)
    # The experts' layout flags, with the defaults of transformers releases that predate one of them.
    gated = getattr(self, "has_gate", True)
    transposed = getattr(self, "is_transposed", False)
    bias = getattr(self, "has_bias", False)
    up = self.gate_up_proj if gated else self.up_proj
    proj = torch.bmm(x, up) if transposed else torch.bmm(x, up.transpose(1, 2))  # [E, T, 2I]
    if bias:
        proj = proj + (self.gate_up_proj_bias if gated else self.up_proj_bias).unsqueeze(1)
    proj = self._apply_gate(proj) if gated else self.act_fn(proj)
    out = torch.bmm(proj, self.down_proj) if transposed else torch.bmm(proj, self.down_proj.transpose(1, 2))
    if bias:
        out = out + self.down_proj_bias.unsqueeze(1)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    weight = routing.t().unsqueeze(-1)  # [E, T, 1]
    out = torch.where(weight != 0, out, torch.zeros_like(out))  # an expert a token skipped adds 0, never NaN
    return (out * weight).sum(0).to(hidden_states.dtype)


def register() -> str:
    """Make `DENSE` a valid `_experts_implementation` (idempotent); returns its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(DENSE, dense_experts_forward)
    return DENSE
