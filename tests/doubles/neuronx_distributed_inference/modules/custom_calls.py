import torch
from torch import nn


class CustomRMSNorm(nn.Module):
    """NxDI's RMSNorm (a custom call on device, modules/custom_calls.py): normalised and weighted in
    float32, the result cast back to the input's dtype."""

    def __init__(self, hidden_size=None, eps=1e-6, nki_enabled=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(dtype)
