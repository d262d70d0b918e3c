"""`--parity-drill` on `--hw vllm`: vLLM's module for a point, called as the backend calls it (under vLLM's
config and forward context, over the paged cache and metadata built for the call), captured op by op. Its
ops are vLLM's own (its CPU kernels `torch.ops._C.*`: RMSNorm, rotary, the packed GEMMs, the fused MoE,
the paged cache update and attention: `visible`), matched to the reference's by value."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...golden import GoldenRecord
from ...points import Point
from .. import CandidateOutput
from .attention import past_of
from .requests import Requests
from .visible import visible_attention


class VllmCall(nn.Module):
    """The backend's call of one point as a module: vLLM's module for the point (`target`) with its
    submodules as this module's own, under their vLLM names (`qkv_proj`, `experts.routed_experts`), so the
    drill's rows say where in vLLM each op ran. Called with the golden call's args and kwargs (the
    drill's inputs), it returns what the backend's run of the point returns."""

    def __init__(self, backend: Any, point: Point, target: nn.Module):
        super().__init__()
        for name, child in target.named_children():
            self.add_module(name, child)
        self.__dict__["backend"], self.__dict__["point"], self.__dict__["target"] = backend, point, target

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        record = GoldenRecord(self.point, list(args), dict(kwargs), None)
        call = getattr(self.backend, f"_{self.point.component}")
        with self.backend._context(), visible_attention(self.target):
            output, _ = call(self.point, record, None)
        return output.output if isinstance(output, CandidateOutput) else output


def drill_call(backend: Any, point: Point, golden: GoldenRecord) -> tuple[nn.Module, list, dict, bool]:
    """`Backend.drill_call` for `--hw vllm`: vLLM's module of the point (a port's own code: matched to the
    reference's ops by value), on the golden call's inputs."""
    if getattr(backend, f"_{point.component}", None) is None:
        raise NotImplementedError(f"{point.id}: --hw vllm has no call for a {point.component} point to drill")
    if point.component in ("attention", "output") and not Requests.of(golden, past_of(golden), 1).whole:
        raise NotImplementedError(
            f"{point.id}: --hw vllm runs a padded batch's attention on its real tokens only and the reference on "
            "every token: their ops cannot be paired one by one; drill a golden recorded without padding"
        )
    if point.component == "rotary":  # vLLM's rotary embedding is its attention's own
        target = backend.model.model.layers[0].self_attn.rotary_emb
    else:
        target = backend.module(backend.golden.entry(point)["module"])
    return VllmCall(backend, point, target), list(golden.args), dict(golden.kwargs), False
