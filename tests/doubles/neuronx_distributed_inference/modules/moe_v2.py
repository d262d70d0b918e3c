"""NxD's MoE as its source computes it (`modules/moe/routing.py`, `expert_mlps_v2.py`, `model.py`):
RouterTopK (the input cast to the router weight's dtype, float64 softmax over every expert, the full
affinities returned with the top-k ids), ExpertMLPsV2 (gate_up [E, H, 2I], down [E, I, H], top-k
affinities renormalised; at TP > 1 each rank holds its share of the intermediate size and returns
its partial sum) and the MoE module, which all-reduces the experts' partial sums (NxD's "delayed
all-reduce")."""

import torch
import torch.nn.functional as F
from neuronx_distributed.parallel_layers import mappings
from torch import nn


class RouterTopK(nn.Module):
    def __init__(self, num_experts, top_k, hidden_size):
        super().__init__()
        self.top_k = top_k
        self.linear_router = nn.Linear(hidden_size, num_experts, bias=False, dtype=torch.float32)

    def forward(self, hidden_states):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = self.linear_router(flat.to(self.linear_router.weight.dtype))
        affinities = torch.softmax(logits.to(torch.float64), dim=-1)
        index = torch.topk(affinities, self.top_k, dim=-1).indices
        return logits.to(hidden_states.dtype), affinities.to(hidden_states.dtype), index.long()


class MLPOp(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, dtype):
        super().__init__()
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = nn.Parameter(
            torch.zeros(num_experts, hidden_size, 2 * intermediate_size, dtype=dtype)
        )
        self.down_proj = nn.Module()
        self.down_proj.weight = nn.Parameter(torch.zeros(num_experts, intermediate_size, hidden_size, dtype=dtype))


class ExpertMLPsV2(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, dtype, normalize_top_k_affinities=True):
        super().__init__()
        self.mlp_op = MLPOp(num_experts, hidden_size, intermediate_size, dtype)
        self.normalize = normalize_top_k_affinities

    def forward(self, hidden_states, expert_affinities, expert_index, seq_len):
        weights = expert_affinities.gather(1, expert_index).to(torch.float32)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        gate_up, down = self.mlp_op.gate_up_proj.weight, self.mlp_op.down_proj.weight
        rank, size = mappings.rank_and_size()  # this rank's share of the intermediate size
        full = down.shape[1]
        inter = full // size
        share = torch.arange(rank * inter, (rank + 1) * inter)
        mine = torch.cat([share, full + share])  # its gate and its up columns
        gate_up, down = gate_up[:, :, mine], down[:, rank * inter : (rank + 1) * inter]
        out = torch.zeros_like(hidden_states)
        for expert in expert_index.unique().tolist():
            token, slot = torch.where(expert_index == expert)
            h = hidden_states[token] @ gate_up[expert]
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ down[expert]
            out.index_add_(0, token, (y * weights[token, slot, None].to(y.dtype)).to(out.dtype))
        return out


class MoE(nn.Module):
    ep_enabled = False
    tensor_parallel_group = None

    def __init__(self, router, expert_mlps):
        super().__init__()
        self.router = router
        self.expert_mlps = expert_mlps

    def forward(self, hidden_states, padding_mask=None):
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, affinities, index = self.router(flat)
        out = self.expert_mlps(flat, affinities, index, shape[-2])
        return (mappings.reduce_from_tensor_model_parallel_region(out).reshape(shape),)


def initialize_moe_module(config, rmsnorm=None, init_tkg_module=False):
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dtype = config.neuron_config.torch_dtype
    router = RouterTopK(experts, config.num_experts_per_tok, config.hidden_size)
    return MoE(router, ExpertMLPsV2(experts, config.hidden_size, inter, dtype))
