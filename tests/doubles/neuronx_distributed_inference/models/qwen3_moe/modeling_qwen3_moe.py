"""convert_qwen3_moe_hf_to_neuron_state_dict as documented (NEURON.md 3.1): keys without `model.`;
mlp.gate -> mlp.router.linear_router; per-expert gate_proj/up_proj [I, H] transposed and stacked
into mlp.expert_mlps.mlp_op.gate_up_proj.weight [E, H, 2I] (gate first); down_proj [H, I] ->
down_proj.weight [E, I, H]; q/k norms renamed; loops over config.num_hidden_layers."""

import torch

from ..config import InferenceConfig

EXPERT = "{}mlp.experts.{}.{}.weight"


class Qwen3MoeInferenceConfig(InferenceConfig):
    pass


def convert_qwen3_moe_hf_to_neuron_state_dict(neuron_state_dict, config):
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
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


class NeuronQwen3MoeForCausalLM:
    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        return convert_qwen3_moe_hf_to_neuron_state_dict(state_dict, config)
