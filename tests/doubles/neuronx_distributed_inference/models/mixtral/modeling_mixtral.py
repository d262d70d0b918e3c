"""convert_mixtral_to_neuron_state_dict as documented (NEURON.md 3.2): block_sparse_moe.gate ->
mlp.router.linear_router; experts.{e}.w1 (gate) and w3 (up) -> gate_up_proj [E, H, 2I]; w2 ->
down_proj [E, I, H]; `rank_util.rank` = arange(tp_degree) int32 (the source writes no
attention `rank_util`: the backend adds what a module needs). The attention (head_dim = hidden /
heads, no q/k norm) and the decoder layer as the source builds them."""

import torch

from ...modules.attention.attention_base import NeuronAttentionBase
from ...modules.attention.utils import RotaryEmbedding
from ...modules.custom_calls import CustomRMSNorm
from ...modules.moe import initialize_moe_module
from ..config import InferenceConfig
from ..model_base import MoEDecoderLayer


class MixtralInferenceConfig(InferenceConfig):
    pass


def convert_mixtral_to_neuron_state_dict(neuron_state_dict, config):
    neuron_state_dict["rank_util.rank"] = torch.arange(0, config.neuron_config.tp_degree, dtype=torch.int32)
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
        neuron_state_dict[p + "mlp.router.linear_router.weight"] = neuron_state_dict.pop(
            p + "block_sparse_moe.gate.weight"
        )
        w = lambda e, name, p=p: neuron_state_dict.pop(f"{p}block_sparse_moe.experts.{e}.{name}.weight")  # noqa: E731
        experts = range(config.num_local_experts)
        parts = [(w(e, "w1"), w(e, "w3"), w(e, "w2")) for e in experts]
        neuron_state_dict[p + "mlp.expert_mlps.mlp_op.gate_up_proj.weight"] = torch.stack(
            [torch.cat([g.T, u.T], dim=1) for g, u, _ in parts]
        )
        neuron_state_dict[p + "mlp.expert_mlps.mlp_op.down_proj.weight"] = torch.stack([d.T for _, _, d in parts])
    return neuron_state_dict


class NeuronMixtralForCausalLM:
    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        return convert_mixtral_to_neuron_state_dict(state_dict, config)


class NeuronMixtralAttention(NeuronAttentionBase):
    def __init__(self, config):
        head_dim = config.hidden_size // config.num_attention_heads
        rotary_emb = RotaryEmbedding(
            head_dim, max_position_embeddings=config.max_position_embeddings, base=config.rope_theta
        )
        super().__init__(
            config=config,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rotary_emb=rotary_emb,
        )


class NeuronMixtralDecoderLayer(MoEDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = NeuronMixtralAttention(config=config)
        self.mlp = initialize_moe_module(
            config=config,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
        )
        self.input_layernorm = CustomRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = CustomRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def get_rmsnorm_cls():
    # NxDI: transformers' RMSNorm in CPU mode, its custom call otherwise; the double's custom call is plain math
    return CustomRMSNorm
