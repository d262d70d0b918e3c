"""ParallelEmbedding and ColumnParallelLinear with their documented keyword arguments; one rank
holds the whole weight (gather_output=True gives what every rank sees)."""

import torch
import torch.nn.functional as F
from torch import nn


class ParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings,
        embedding_dim,
        padding_idx=None,
        dtype=torch.float32,
        shard_across_embedding=False,
        **kwargs,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_embeddings, embedding_dim, dtype=dtype))
        self.padding_idx = padding_idx

    def forward(self, input_ids):
        if input_ids.is_floating_point():
            raise TypeError("ParallelEmbedding takes token ids")
        return F.embedding(input_ids, self.weight, self.padding_idx)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, **kwargs):
        super().__init__()
        if not gather_output:
            raise ValueError("the double holds one rank: gather_output=False would be a vocabulary shard")
        self.weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class SPMDRank(nn.Module):
    """NxD's rank inside a traced SPMD graph: a parameter of one element, sharded along dim 0 from
    the checkpoint's arange(world_size), so rank r holds [r]."""

    def __init__(self, world_size, tensor_model_parallel_size=None):
        super().__init__()
        self.world_size = world_size
        self.rank = nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)
        self.rank.partition_dim = 0  # NxD's set_tensor_model_parallel_attributes(is_parallel=True, dim=0)

    def get_rank(self):
        return self.rank
