"""The hand-written port of `port_qwen3` as a backend that gives its own modules (`--hw port`): what
an entry-point backend for another runtime looks like to the drill. Its bugs and layouts come from
`--hw-option bugs=rope_interleaved,fused_qkv,...` (the names of `port_qwen3.Bugs`)."""

from __future__ import annotations

import dataclasses

import port_own
import torch
from port_qwen3 import Bugs, load_port

from pytest_moe_parity.backends import Backend, BackendError, CandidateOutput, HwOption, PointUnavailable

# point component -> (the port's module under layers.N, how the golden call becomes its arguments)
_MODULES = {
    "attention": (
        "attn",
        lambda args, kwargs: [kwargs["hidden_states"], *kwargs["position_embeddings"]],
    ),
    "router": ("moe.router", lambda args, kwargs: [args[0]]),
    "experts": ("moe.experts", lambda args, kwargs: list(args[:3])),
}


def _bugs(text: str) -> Bugs:
    names = [n for n in text.split(",") if n]
    known = {f.name for f in dataclasses.fields(Bugs)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"no such port bug or layout: {', '.join(unknown)}")
    return Bugs(**dict.fromkeys(names, True))


class _ModuleBackend(Backend):
    """A port's module per point (`_call`: the module and its arguments for the golden call), run
    as it is and given to the drill as the port's own code."""

    def _call(self, point, golden) -> tuple[torch.nn.Module, list]:
        raise NotImplementedError

    def run(self, point, golden) -> CandidateOutput:
        module, args = self._call(point, golden)
        with torch.no_grad():
            return CandidateOutput(module(*args))

    def drill_call(self, point, golden):
        module, args = self._call(point, golden)
        return module, args, {}, False


class PortBackend(_ModuleBackend):
    name = "port"
    options = (HwOption("bugs", "port bugs and layouts, comma-separated", _bugs, Bugs()),)
    native_dtype = torch.bfloat16

    def start(self) -> None:
        if self.setup.model_dir is None:
            raise BackendError("--hw port needs the checkpoint: pass --model DIR")
        self.port = load_port(self.setup.model_dir, self.dtype, self.hw_options["bugs"])

    def _call(self, point, golden) -> tuple[torch.nn.Module, list]:
        if point.component not in _MODULES or point.layer is None:
            raise PointUnavailable(f"the port has no {point.component} module to compare")
        if not hasattr(self, "port"):
            self.start()
        path, arguments = _MODULES[point.component]
        module = self.port.layers[point.layer].get_submodule(path)
        return module, arguments(golden.args, golden.kwargs)


class OwnPortBackend(_ModuleBackend):
    """`port_own`'s port (`--hw ownport`): its attention takes the hidden states alone (positions,
    rotary tables and mask made inside, from what its static cache holds); a decode step's cache is
    the golden's, copied into the port's own preallocated one. The `rotary` point is the model
    wrapper's `Positions`: given the hidden states alone, it makes the position ids it drives the
    rotary tables with."""

    name = "ownport"
    options = (HwOption("bugs", "port bugs, comma-separated (port_own.BUGS)", port_own.Bugs.parse, port_own.Bugs()),)
    native_dtype = torch.bfloat16
    SLACK = 4  # the static cache's positions beyond what a call needs, as a port's max length leaves

    @classmethod
    def slots(cls, past: int, new: int, bugs: frozenset[str]) -> tuple[int, int]:
        """Where the golden's past goes in the port's cache, and the cache's size: `past + new + SLACK`
        positions; over the whole cache (`port_own.WHOLE`), a bucket (the next power of two), left
        padded where asked (the past ends a context bucket of its own, as NxDI pads a prompt)."""
        if not bugs & set(port_own.WHOLE):
            return 0, past + new + cls.SLACK
        start = (1 << past.bit_length()) - past if "static_left_padded" in bugs else 0  # never none
        return start, 1 << (start + past + new + cls.SLACK - 1).bit_length()

    def start(self) -> None:
        if self.setup.model_dir is None:
            raise BackendError("--hw ownport needs the checkpoint: pass --model DIR")
        self.port = port_own.load_port(self.setup.model_dir, self.dtype, self.hw_options["bugs"])

    def _call(self, point, golden) -> tuple[torch.nn.Module, list]:
        if not hasattr(self, "port"):
            self.start()
        if point.id == "rotary":  # the wrapper makes the positions: given the hidden states alone
            return self.port.positions, [golden.args[0]]
        if point.layer is None or point.component not in ("attention", "router", "experts", "moe"):
            raise PointUnavailable(f"the port has no {point.component} module to compare")
        layer = self.port.layers[point.layer]
        if point.component == "attention":
            hidden = golden.kwargs["hidden_states"]
            state = golden.kwargs.get("cache")
            if state is None:
                return layer.attn, [hidden]
            past, bugs = state.keys.shape[2], self.hw_options["bugs"]
            start, size = self.slots(past, hidden.shape[1], bugs.names)
            keys, values = state.keys.to(self.dtype), state.values.to(self.dtype)
            return layer.attn, [hidden, port_own.StaticCache.holding(keys, values, size, start)]
        if point.component == "experts":
            return layer.moe.experts, list(golden.args[:3])
        return (layer.moe.router if point.component == "router" else layer.moe), [golden.args[0]]
