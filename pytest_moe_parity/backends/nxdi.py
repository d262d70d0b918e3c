"""`--hw nxdi`: isolated replay on NxDI's own modules. Per point, the NxDI module of that component
is built through NxDI's test machinery (`neuronx_distributed_inference.utils.testing.build_module`)
at `--hw-option tp_degree=N`, with the weights of that layer only, converted by NxDI's own
conversion function; the golden inputs are adapted to the module's signature and its outputs
judged as the golden's (a router's full-softmax affinities become top-k weights in the verdict).
Decode steps (one token) trace their own graphs, as NxDI's token generation does.

What is NxDI's and what is ours: the table per architecture (`nxdi_modules/<model_type>.json`:
data, so a team adds its model without touching this file) names NxDI's config, application and
MoE factory; this module renames one layer's checkpoint keys to layer 0, runs the application's
`convert_hf_to_neuron_state_dict` on them with a one-layer config, keeps the MoE's keys, writes them
to a safetensors checkpoint and calls

    build_module(module_cls, example_inputs=[inputs], module_init_kwargs=..., tp_degree=N,
                 compiler_workdir=..., checkpoint_path=..., checkpoint_loader_fn=load_file)

So far the MoE side is built (`router`, `experts`, `moe`); the other points say why they are not,
and an NxDI tensor capture (`--hw dump`) covers them."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BackendError, PointUnavailable
from ..golden import GoldenRecord
from ..points import Point
from . import Backend, BackendSetup, CandidateOutput, HwOption, positive_int
from .lazy_model import weight_map

INSTALL = (
    'pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "pytest-moe-parity[nxdi]" '
    "(neuronx-distributed-inference with torch-neuronx, Neuron SDK 2.28 or later, on a trn1/trn2/inf2 instance)"
)
TABLES = Path(__file__).with_name("nxdi_modules")


@dataclass
class ModuleTable:
    """How an architecture's points map onto NxDI (one JSON file per `model_type`)."""

    model_type: str
    config: str  # "module:Class" of the InferenceConfig
    neuron_config: str
    application: str  # the NeuronXxxForCausalLM whose convert_hf_to_neuron_state_dict converts weights
    moe_factory: str
    moe_factory_args: dict[str, str]  # factory keyword -> config attribute
    layer_module: str  # the MoE's path in NxDI's model, e.g. "layers.{layer}.mlp"
    components: dict[str, str]  # point component -> attribute of the MoE called ("": the MoE itself)
    unavailable: dict[str, str] = field(default_factory=dict)


def tables() -> list[str]:
    return sorted(p.stem for p in TABLES.glob("*.json"))


def load_module_table(model_type: str) -> ModuleTable | None:
    path = TABLES / f"{model_type}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    data.pop("source", None)
    return ModuleTable(**data)


def resolve(spec: str) -> Any:
    """ "package.module:Name" -> the object (imported on use: NxDI only where it is installed)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# -- weights ------------------------------------------------------------------------------------
def layer_state(model_dir: Path, layer: int, weights: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """One decoder layer's checkpoint tensors, renamed to layer 0 without the base-model prefix
    (`model.layers.17.mlp.gate.weight` -> `layers.0.mlp.gate.weight`), as NxDI's get_state_dict
    hands them to its conversion: only this layer's tensors are read."""
    from safetensors import safe_open

    weights = weights if weights is not None else weight_map(model_dir)
    marker = f"layers.{layer}."
    keys = [k for k in weights if marker in k and k.split(marker, 1)[0] in ("", "model.")]
    state: dict[str, torch.Tensor] = {}
    for file in sorted({weights[k] for k in keys}):
        with safe_open(str(model_dir / file), framework="pt") as fh:
            for key in (k for k in keys if weights[k] == file):
                state["layers.0." + key.split(marker, 1)[1]] = fh.get_tensor(key)
    return state


def convert_layer(state: dict[str, torch.Tensor], convert: Any, config: Any, prefix: str) -> dict[str, torch.Tensor]:
    """NxDI's conversion of one layer (renamed to layer 0, with a one-layer config), keeping the
    keys under `prefix` (e.g. `layers.0.mlp.`) relative to it."""
    one = copy.copy(config)
    one.num_hidden_layers = 1
    converted = convert(dict(state), one)
    kept = {k[len(prefix) :]: v for k, v in converted.items() if k.startswith(prefix)}
    if not kept:
        raise BackendError(f"NxDI's conversion gave no tensor under {prefix!r}; is the table's layer_module right?")
    return kept


# -- the module built per point -----------------------------------------------------------------
class MoEPoint(nn.Module):
    """NxDI's MoE of one layer, called as one point needs it: the router, the experts on given
    routing, or the whole block. Built by build_module from keyword arguments."""

    def __init__(self, factory: str, factory_args: dict[str, str], config: Any, call: str):
        super().__init__()
        kwargs = {k: getattr(config, v) for k, v in factory_args.items()}
        self.moe = resolve(factory)(config=config, **kwargs)
        self.call = call

    def forward(self, hidden: torch.Tensor, *routing: torch.Tensor) -> Any:
        if self.call == "router":
            return self.moe.router(hidden)  # (logits [T, E], affinities [T, E], top-k ids [T, k])
        if self.call == "expert_mlps":
            affinities, index = routing
            return self.moe.expert_mlps(hidden, affinities, index, hidden.shape[0])
        out = self.moe(hidden)
        return out[0] if isinstance(out, tuple | list) else out


def experts_inputs(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int):
    """The golden experts call (hidden [T, H], top-k ids, top-k weights) in NxD's form: (hidden,
    affinities [T, E] with each token's top-k weights at their expert ids, ids [T, k])."""
    ids = top_k_index.reshape(-1, top_k_index.shape[-1]).long()
    weights = top_k_weights.reshape(ids.shape).to(hidden.dtype)
    affinities = torch.zeros(ids.shape[0], experts, dtype=hidden.dtype).scatter(1, ids, weights)
    return hidden.reshape(ids.shape[0], -1), affinities, ids


class NxdiBackend(Backend):
    """`--hw nxdi [--hw-option tp_degree=N]`: NxDI's modules of the golden's architecture."""

    name = "nxdi"
    captures_routing = True  # the MoE block's routing: its router, built for the same layer and input
    options = (
        HwOption("tp_degree", "tensor-parallel degree of each built module (default: 1)", positive_int, 1),
        HwOption("workdir", "where converted checkpoints and compiler artifacts go (default: a temporary directory)"),
        HwOption("compiler_args", "neuronx-cc arguments (default: NxDI's own)"),
    )

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        if importlib.util.find_spec("neuronx_distributed_inference") is None:
            raise BackendError(f"--hw nxdi needs neuronx-distributed-inference, which is not installed: {INSTALL}")
        table = load_module_table(self.golden.model_type)
        if table is None:
            raise BackendError(
                f"--hw nxdi has no NxDI module table for {self.golden.model_type} (tables: {', '.join(tables())}); "
                f"add one to {TABLES}, or compare an NxDI tensor capture with --hw dump"
            )
        if setup.model_dir is None:
            raise BackendError("--hw nxdi needs the Hugging Face checkpoint NxDI converts: pass --model DIR")
        self.table = table
        self.weights = weight_map(setup.model_dir)
        self.config: Any = None
        self._built: dict[tuple, Any] = {}
        self._workdir: Path | None = None

    def start(self) -> None:
        import tempfile

        from transformers import AutoConfig

        load_pretrained_config = resolve("neuronx_distributed_inference.utils.hf_adapter:load_pretrained_config")
        hf_config = AutoConfig.from_pretrained(self.setup.model_dir)
        neuron_config = resolve(self.table.neuron_config)(
            tp_degree=self.hw_options["tp_degree"], torch_dtype=self.dtype
        )
        self.config = resolve(self.table.config)(neuron_config, load_config=load_pretrained_config(hf_config=hf_config))
        if self.hw_options["workdir"]:
            self._workdir = Path(self.hw_options["workdir"]).expanduser()
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="moe-parity-nxdi-")
            self._workdir = Path(self._tmp.name)

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        call = self.table.components.get(point.component)
        if call is None or point.layer is None:
            why = self.table.unavailable.get(point.component, "NxDI has no module for it in the table")
            raise PointUnavailable(f"{point.id}: not built by --hw nxdi: {why}")
        if self.config is None:
            self.start()
        inputs = self._inputs(point, golden, call)
        with torch.no_grad():
            output = self._module(point, call, inputs)(*inputs)
            # the block's own routing (same weights, same input: what its router chose inside)
            routing = tuple(self._module(point, "router", inputs)(*inputs)) if point.routed_block else None
        return CandidateOutput(output, routing, info={"nxdi_module": self.table.layer_module.format(layer=point.layer)})

    def _inputs(self, point: Point, golden: GoldenRecord, call: str) -> tuple[torch.Tensor, ...]:
        hidden = golden.args[0] if golden.args else next(iter(golden.kwargs.values()))
        if call == "expert_mlps":
            index, weights = golden.args[1:3] if len(golden.args) >= 3 else list(golden.kwargs.values())[1:3]
            return experts_inputs(
                hidden,
                index,
                weights,
                int(self.golden.config.get("num_experts") or self.golden.config["num_local_experts"]),
            )
        return (hidden,)

    def _module(self, point: Point, call: str, inputs: tuple[torch.Tensor, ...]) -> Any:
        key = (point.layer, call, tuple(tuple(t.shape) for t in inputs))
        if key not in self._built:
            from safetensors.torch import load_file, save_file

            build_module = resolve("neuronx_distributed_inference.utils.testing:build_module")
            application = resolve(self.table.application)
            prefix = self.table.layer_module.format(layer=0) + "."
            converted = convert_layer(
                layer_state(self.setup.model_dir, point.layer, self.weights),
                application.convert_hf_to_neuron_state_dict,
                self.config,
                prefix,
            )
            assert self._workdir is not None
            where = self._workdir / f"layer_{point.layer}.{call or 'moe'}.{'x'.join(map(str, inputs[0].shape))}"
            where.mkdir(parents=True, exist_ok=True)
            checkpoint = where / "checkpoint.safetensors"
            save_file({f"moe.{k}": v.contiguous() for k, v in converted.items()}, str(checkpoint))
            kwargs = {
                "factory": self.table.moe_factory,
                "factory_args": self.table.moe_factory_args,
                "config": self.config,
                "call": call,
            }
            if any(k[0] != point.layer for k in self._built):  # one layer's modules at a time
                self._built.clear()
            self._built[key] = build_module(
                MoEPoint,
                example_inputs=[tuple(inputs)],
                module_init_kwargs=kwargs,
                tp_degree=self.hw_options["tp_degree"],
                compiler_args=self.hw_options["compiler_args"],
                compiler_workdir=str(where / "compiler"),
                checkpoint_path=str(checkpoint),
                checkpoint_loader_fn=load_file,
            )
        return self._built[key]

    def close(self) -> None:
        self._built.clear()
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()
