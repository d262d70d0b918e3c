"""NxD's per-channel symmetric quantization of a float model as documented
(`quantize_pytorch_model_per_channel_symmetric`, then `convert_qint8_to_int8_state_dict`): every
nn.Linear's weight [out, in] stored as int8 (round(w / scale), the scale absmax / 127 per output
channel: PerChannelAbsMaxObserver, ch_axis 0) or float8_e4m3fn (w / scale cast, the scale absmax /
448, at least 1e-5: `quantize_fp8_per_channel`), beside `scale`, float32 [out, 1]; the modules
named in `modules_to_not_convert` (any module whose name contains one) kept as they are."""

import torch
from torch import nn

BOUNDS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class QuantizedLinear(nn.Module):
    """A quantized linear as its state dict holds it: `weight` (the format's values) and `scale`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x):
        raise NotImplementedError("the double quantizes for the state dict only")


def quantize_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    if dtype == torch.int8:
        scale = torch.clamp(absmax / BOUNDS[dtype], min=torch.finfo(torch.float32).eps)
        return torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8), scale
    scale = torch.clamp(absmax / BOUNDS[dtype], min=1e-5)
    return torch.clamp(w / scale, -448.0, 448.0).to(dtype), scale


def quantize_pytorch_model_per_channel_symmetric(
    float_model, inplace=False, dtype=torch.qint8, modules_to_not_convert=None
):
    dtype = torch.int8 if dtype in (torch.qint8, torch.int8) else dtype
    if dtype not in BOUNDS:
        raise ValueError(f"dtype: {dtype} is not supported to quantize model on CPU")
    keep = modules_to_not_convert or []
    linears = [(n, m) for n, m in float_model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        if any(k in name for k in keep):
            continue
        parent, _, attr = name.rpartition(".")
        owner = float_model.get_submodule(parent) if parent else float_model
        setattr(owner, attr, QuantizedLinear(*quantize_per_channel(module.weight, dtype)))
    return float_model


def convert_qint8_to_int8_state_dict(state_dict) -> None:
    """The double's quantized linears hold int8 already: nothing to convert."""
