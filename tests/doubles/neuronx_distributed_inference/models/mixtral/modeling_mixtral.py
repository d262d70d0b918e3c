"""convert_mixtral_to_neuron_state_dict as documented (NEURON.md 3.2): block_sparse_moe.gate ->
mlp.router.linear_router; experts.{e}.w1 (gate) and w3 (up) -> gate_up_proj [E, H, 2I]; w2 ->
down_proj [E, I, H]."""

import torch

from ..config import InferenceConfig


class MixtralInferenceConfig(InferenceConfig):
    pass


def convert_mixtral_to_neuron_state_dict(neuron_state_dict, config):
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
