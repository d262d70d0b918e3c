"""The older NxD MoE factory Mixtral uses: explicit sizes instead of the config's."""

from .moe_v2 import ExpertMLPsV2, MoE, RouterTopK


def initialize_moe_module(
    config, num_experts, top_k, hidden_size, intermediate_size, hidden_act, normalize_top_k_affinities=True
):
    if hidden_act != "silu":
        raise ValueError(f"the double implements silu experts, not {hidden_act}")
    router = RouterTopK(num_experts, top_k, hidden_size)
    experts = ExpertMLPsV2(
        num_experts, hidden_size, intermediate_size, config.neuron_config.torch_dtype, normalize_top_k_affinities
    )
    return MoE(router, experts)
