"""convert_qwen3_moe_hf_to_neuron_state_dict as documented (NEURON.md 3.1): keys without `model.`;
mlp.gate -> mlp.router.linear_router; per-expert gate_proj/up_proj [I, H] transposed and stacked
into mlp.expert_mlps.mlp_op.gate_up_proj.weight [E, H, 2I] (gate first); down_proj [H, I] ->
down_proj.weight [E, I, H]; q/k norms renamed; `rank_util.rank` and each attention's
`layers.{l}.self_attn.rank_util.rank` = arange(tp_degree) int32; loops over
config.num_hidden_layers. The attention and the decoder layer as the source builds them
(NeuronQwen3MoEAttention: per-head q/k RMSNorm before RoPE; the layer returns (h, kv, cos, sin, None))."""

import torch

from ...modules.attention.attention_base import NeuronAttentionBase
from ...modules.attention.utils import RotaryEmbedding
from ...modules.custom_calls import CustomRMSNorm
from ...modules.moe_v2 import initialize_moe_module
from ..application_base import NeuronApplicationBase
from ..config import InferenceConfig
from ..model_base import MoEDecoderLayer

EXPERT = "{}mlp.experts.{}.{}.weight"


class Qwen3MoeInferenceConfig(InferenceConfig):
    pass


def maybe_dequantize_layer(neuron_state_dict, config):
    """As the source's (release 2.29): each `*_scale_inv` (DeepSeek's FP8 block layout) times its e4m3
    weight, the scales repeated over `quantization_config["weight_block_size"]` blocks, multiplied in
    float32 and cast to the config's dtype; the scales dropped."""
    for key in [k for k in neuron_state_dict if k.endswith("_scale_inv")]:
        scales = neuron_state_dict.pop(key)
        name = key.replace("_scale_inv", "")
        b0, b1 = config.quantization_config["weight_block_size"]
        full = scales.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
        weight = neuron_state_dict[name].to(torch.float32) * full.to(torch.float32)
        neuron_state_dict[name] = weight.to(config.neuron_config.torch_dtype)


def convert_qwen3_moe_hf_to_neuron_state_dict(neuron_state_dict, config):
    maybe_dequantize_layer(neuron_state_dict, config)
    ranks = lambda: torch.arange(0, config.neuron_config.tp_degree, dtype=torch.int32)  # noqa: E731
    neuron_state_dict["rank_util.rank"] = ranks()
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
        neuron_state_dict[p + "self_attn.rank_util.rank"] = ranks()
        neuron_state_dict[p + "mlp.router.linear_router.weight"] = neuron_state_dict.pop(p + "mlp.gate.weight")
        experts = range(getattr(config, "num_experts", None) or config.num_local_experts)
        w = lambda e, name, p=p: neuron_state_dict.pop(EXPERT.format(p, e, name))  # noqa: E731
        gates, ups, downs = zip(
            *[(w(e, "gate_proj"), w(e, "up_proj"), w(e, "down_proj")) for e in experts], strict=True
        )
        neuron_state_dict[p + "mlp.expert_mlps.mlp_op.gate_up_proj.weight"] = torch.stack(
            [torch.cat([g.T, u.T], dim=1) for g, u in zip(gates, ups, strict=True)]
        )
        neuron_state_dict[p + "mlp.expert_mlps.mlp_op.down_proj.weight"] = torch.stack([d.T for d in downs])
        for a, b in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            neuron_state_dict[f"{p}self_attn.{b}.weight"] = neuron_state_dict.pop(f"{p}self_attn.{a}.weight")
    return neuron_state_dict


class NeuronQwen3MoeForCausalLM(NeuronApplicationBase):
    @staticmethod
    def load_hf_model(model_path, **kwargs):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        return convert_qwen3_moe_hf_to_neuron_state_dict(state_dict, config)


class NeuronQwen3MoEAttention(NeuronAttentionBase):
    def __init__(self, config):
        rotary_emb = RotaryEmbedding(
            config.head_dim, max_position_embeddings=config.max_position_embeddings, base=config.rope_theta
        )
        super().__init__(
            config=config,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary_emb=rotary_emb,
            rms_norm_eps=config.rms_norm_eps,
            use_qk_norm=False,
        )
        self.q_layernorm = CustomRMSNorm(self.head_dim, self.rms_norm_eps)
        self.k_layernorm = CustomRMSNorm(self.head_dim, self.rms_norm_eps)


class NeuronQwen3MoeDecoderLayer(MoEDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = NeuronQwen3MoEAttention(config=config)
        self.input_layernorm = CustomRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = CustomRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = initialize_moe_module(config=config)


def get_rmsnorm_cls():
    # NxDI: transformers' RMSNorm in CPU mode, its custom call otherwise; the double's custom call is plain math
    return CustomRMSNorm
