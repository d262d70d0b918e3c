"""What NxDI's MoE decoder layers share (each model's own class in NxDI: NeuronQwen3MoeDecoderLayer,
NeuronMixtralDecoderLayer): input norm, attention, residual, post-attention norm, MoE, residual;
returning (hidden, (K, V), cos, sin, None)."""

from torch import nn


class MoEDecoderLayer(nn.Module):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, **kwargs):
        residual = hidden_states
        hidden_states, present_key_value, cos_cache, sin_cache = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))[0]
        return (hidden_states, present_key_value, cos_cache, sin_cache, None)
