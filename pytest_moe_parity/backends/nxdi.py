"""`--hw nxdi`: isolated replay on NxDI's own modules. Per point, the NxDI module of that component
is built through NxDI's test machinery (`neuronx_distributed_inference.utils.testing.build_module`)
at `--hw-option tp_degree=N`, with the weights of that layer only, converted by NxDI's own
conversion function; the golden inputs are adapted to the module's signature and its outputs
judged as the golden's (a router's full-softmax affinities become top-k weights in the verdict).
Decode steps (one token) trace their own graphs, as NxDI's token generation does.

What is NxDI's and what is ours: the table per architecture (`nxdi_modules/<model_type>.json`:
data, so a team adds its model without touching this file) names NxDI's config, application and
MoE factory; this module renames one layer's checkpoint keys to layer 0, runs the application's
`convert_hf_to_neuron_state_dict` on them with a one-layer config (the model-level keys with a
zero-layer one), keeps the point's module's keys, writes them to a safetensors checkpoint and calls

    build_module(module_cls, example_inputs=[inputs], module_init_kwargs=..., tp_degree=N,
                 compiler_workdir=..., checkpoint_path=..., checkpoint_loader_fn=load_file)

Built: the embedding, the norms, the attention, the MoE's router, experts and block, whole decoder
layers, the final norm and the lm_head (`logits`, gathered). The attention and the decoder layer are
called as NxDI's own module tests call them (`test_qwen3_moe_layers.py`): context encoding with a
boolean causal mask [B, 1, S, S] and int32 position ids; token generation with the cache as
(K, V) [B, kv_heads, past, head_dim] and a boolean mask over the past positions [B, 1, 1, past].
The cache is an input of the traced graph, which build_module gives every rank alike, while NxDI's
token generation holds each rank's own kv heads: at tp_degree > 1 the built module picks its rank's
heads of the golden cache itself (NxD's SPMDRank and an index_select, the rank-in-graph pattern NxDI
uses), by NxD's GQA sharding (kv heads kept, or repeated up to the TP degree or to the attention
heads, then split)."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import compat
from ..compat import legacy_rope, load_config
from ..dump.nxdi_capture import read_table, table_names
from ..errors import BackendError, PointUnavailable
from ..golden import GoldenRecord
from ..judge.distance import rel_l2_flat
from ..model.calls import cache_states
from ..model.checkpoint import weight_map
from ..points import Point, layer_group
from ..tree import CacheState, first_tensor, leaves
from . import Backend, BackendSetup, CandidateOutput, HwOption, on_off, one_of, positive_int

INSTALL = (
    'pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "pytest-moe-parity[nxdi]" '
    "(neuronx-distributed-inference with torch-neuronx, Neuron SDK 2.28 or later, on a trn1/trn2/inf2 instance)"
)
TABLES = Path(__file__).with_name("nxdi_modules")


@dataclass
class Component:
    """How one point's NxDI module is built: its path in NxDI's model (`{layer}` for decoder
    layers), the factory called with config attributes (`args`: keyword -> attribute), fixed
    keywords (`literals`; "$dtype": the candidate's dtype), the config itself (`config`), the
    attribute of the built module that the point calls ("": the module), the inputs' form, NxD's
    SPMDRank tensors the module holds (`rank_buffers`: arange(tp_degree), added where the conversion
    did not write them) and the submodule whose output is the module's routing (`routing`)."""

    module: str
    factory: str
    args: dict[str, str] = field(default_factory=dict)
    literals: dict[str, Any] = field(default_factory=dict)
    config: bool = False
    call: str = ""
    inputs: str = "hidden"  # hidden | tokens | experts | attention
    rank_buffers: list[str] = field(default_factory=list)
    routing: str = ""


@dataclass
class ModuleTable:
    """How an architecture's points map onto NxDI (one JSON file per `model_type`)."""

    model_type: str
    config: str  # "module:Class" of the InferenceConfig
    neuron_config: str
    application: str  # the NeuronXxxForCausalLM whose convert_hf_to_neuron_state_dict converts weights
    components: dict[str, Component]
    unavailable: dict[str, str] = field(default_factory=dict)
    # The inverse of the application's conversion, for weight items: {"prefix", "top_level", "rules"}.
    weights: dict[str, Any] | None = None


def tables() -> list[str]:
    return table_names(TABLES)


def load_module_table(model_type: str) -> ModuleTable | None:
    data = read_table(TABLES, model_type)
    if data is None:
        return None
    data["components"] = {k: Component(**v) for k, v in data["components"].items()}
    return ModuleTable(**data)


def resolve(spec: str) -> Any:
    """ "package.module:Name" -> the object (imported on use: NxDI only where it is installed);
    "package.module:name()" -> what that function returns (NxDI's `get_rmsnorm_cls()`: the class
    NxDI itself picks, its custom call on a device, transformers' RMSNorm in CPU mode)."""
    module, _, name = spec.partition(":")
    if name.endswith("()"):
        return getattr(importlib.import_module(module), name[:-2])()
    return getattr(importlib.import_module(module), name)


# -- weights ------------------------------------------------------------------------------------
def unit_state(model_dir: Path, layer: int | None, weights: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """One decoder layer's checkpoint tensors, renamed to layer 0, or (layer None) the model-level
    ones, without the base-model prefix (`model.layers.17.mlp.gate.weight` ->
    `layers.0.mlp.gate.weight`, `model.norm.weight` -> `norm.weight`), as NxDI's get_state_dict
    hands them to its conversion: only these tensors are read."""
    from safetensors import safe_open

    weights = weights if weights is not None else weight_map(model_dir)
    renamed: dict[str, str] = {}
    for key in weights:
        bare = key.removeprefix("model.")
        if layer is not None and bare.startswith(f"layers.{layer}."):
            renamed[key] = "layers.0." + bare[len(f"layers.{layer}.") :]
        elif layer is None and not bare.startswith("layers."):
            renamed[key] = bare
    state: dict[str, torch.Tensor] = {}
    for file in sorted({weights[k] for k in renamed}):
        with safe_open(str(model_dir / file), framework="pt") as fh:
            for key in (k for k in renamed if weights[k] == file):
                state[renamed[key]] = fh.get_tensor(key)
    return state


def convert_unit(state: dict[str, torch.Tensor], convert: Any, config: Any, layers: int) -> dict[str, torch.Tensor]:
    """NxDI's conversion of one unit's tensors with a config of `layers` decoder layers (1 for a
    layer renamed to layer 0, 0 for the model-level tensors); the caller's config is untouched."""
    one = copy.copy(config)
    one.num_hidden_layers = layers
    return convert(dict(state), one)


def back_to_reference(
    converted: dict[str, torch.Tensor], inverse: dict[str, Any], layer: int | None
) -> dict[str, torch.Tensor]:
    """A unit's converted tensors (its layer renamed to 0) under the reference's names and layout,
    by the table's inverse rules: `neuron` -> `hf` (with `{layer}`), an optional `transpose` of two
    dims; any other name is the reference's under `prefix` (except the `top_level` ones)."""
    rules = {r["neuron"].format(layer=0): r for r in inverse.get("rules", [])}
    prefix, top = inverse.get("prefix", ""), tuple(inverse.get("top_level", ()))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in converted.items():
        rule = rules.get(name)
        if rule is None:
            bare = name if layer is None else name.replace("layers.0.", f"layers.{layer}.", 1)
            out[bare if bare.startswith(top) else prefix + bare] = tensor
            continue
        if "transpose" in rule:
            tensor = tensor.transpose(*rule["transpose"])
        out[rule["hf"].format(layer=layer)] = tensor
    return out


def under(converted: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The converted tensors under `prefix` (e.g. `layers.0.mlp.`), relative to it."""
    kept = {k[len(prefix) :]: v for k, v in converted.items() if k.startswith(prefix)}
    if not kept:
        raise BackendError(f"NxDI's conversion gave no tensor under {prefix!r}; is the table's module path right?")
    return kept


# -- the module built per point -----------------------------------------------------------------
class NxdiPoint(nn.Module):
    """The NxDI module of one point, called as the point needs it (the MoE's router, its experts on
    given routing, the whole module; an attention or a decoder layer on (hidden, mask, position ids
    [, past K, past V]), giving (hidden, K, V) and, with `routing`, that submodule's outputs after
    them, caught by a forward hook as NxD's tensor capture does). Built by build_module from
    keyword arguments."""

    def __init__(
        self,
        factory: str,
        kwargs: dict[str, Any],
        call: str,
        form: str = "hidden",
        routing: str = "",
        kv_heads: list[list[int]] | None = None,
        seq_len: int = 0,
    ):
        super().__init__()
        self.inner = resolve(factory)(**kwargs)
        config = kwargs.get("config")
        if config is not None and getattr(config.neuron_config, "cast_type", "config") == "config":
            nxdi_cast(self.inner, config.neuron_config.torch_dtype)
        self.call = call
        self.form = form
        self.seq_len = seq_len
        self._caught: list[Any] = []
        if routing:
            self.inner.get_submodule(routing).register_forward_hook(lambda _m, _i, out: self._caught.append(out))
        # token generation at TP > 1: each rank takes its kv heads of the cache
        self.register_buffer("kv_heads", None if kv_heads is None else torch.tensor(kv_heads, dtype=torch.int32))
        if kv_heads is not None:
            self.rank_util = resolve("neuronx_distributed.parallel_layers.layers:SPMDRank")(len(kv_heads))

    def forward(self, first: torch.Tensor, *rest: torch.Tensor) -> Any:
        if self.form == "attention":
            mask, positions, *past = rest
            if past and self.kv_heads is not None:
                mine = self.kv_heads.index_select(0, self.rank_util.get_rank()).flatten()
                past = [t.index_select(1, mine) for t in past]
            self._caught.clear()
            out = self.inner(
                hidden_states=first,
                attention_mask=mask,
                position_ids=positions,
                past_key_value=tuple(past) if past else None,
            )
            caught = tuple(self._caught[0]) if self._caught else ()
            return (out[0], out[1][0], out[1][1], *caught)
        if self.call == "expert_mlps":
            affinities, index = rest
            out = self.inner.expert_mlps(first, affinities, index, self.seq_len)
            return reduce_experts(self.inner, out)
        if self.call:
            return getattr(self.inner, self.call)(first, *rest)  # a router: (logits, affinities [T, E], ids)
        out = self.inner(first, *rest)
        return out[0] if isinstance(out, tuple | list) else out


class _RankCapture:
    """`drill_call`'s module on the CPU build: captured on its ranks (`capture_ops` gives each
    rank's graph: the drill joins them), its outputs read as the point reads them (`read_as`)."""

    def __init__(self, module: Any, read_as: Any = None):
        self.module, self.read_as = module, read_as

    def capture_ops(self, capture: Any, args: list, kwargs: dict, router: bool | None = None) -> list:
        with upstream_warnings():
            return self.module.capture_ops(capture, args, kwargs, router=router)


def _router_as_reference(logits: torch.Tensor, affinities: torch.Tensor, index: torch.Tensor, golden_w: torch.Tensor):
    """NxDI's router's (logits, affinities [T, E], ids) as the reference's (logits, top-k weights,
    ids): the top-k ids' affinities, renormalised where the golden's are (`judge.routing`)."""
    from ..judge.routing import topk_of_affinities

    return logits, topk_of_affinities(affinities, index, golden_w)[0], index


def nxdi_cast(module: nn.Module, dtype: torch.dtype) -> None:
    """NxDI's model-wide cast (`ModelWrapper`'s `load_module` with `cast_type="config"`, which
    `build_module` leaves out): every floating tensor but fp8 to the config's dtype."""
    if dtype != torch.float32:
        keep = (torch.float8_e4m3fn, torch.float8_e5m2)
        module._apply(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype not in keep else t)


def nxdi_cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """NxDI's cast of a checkpoint with `cast_type="config"` (`get_state_dict`'s `_cast_helper`):
    floating tensors but fp8 and `*scale` to the config's dtype."""
    if dtype == torch.float32:
        return state
    cast = {k for k, v in state.items() if v.is_floating_point() and v.dtype != torch.float8_e4m3fn}
    return {k: v.to(dtype) if k in cast and not k.endswith("scale") else v for k, v in state.items()}


def reduce_experts(moe: Any, partial: torch.Tensor) -> torch.Tensor:
    """The all-reduce NxD's MoE module applies to its experts' output (`ExpertMLPsV2` leaves each
    rank with its partial sum: the "delayed all-reduce" of `modules/moe/model.py`), over the expert-
    parallel world where experts are sharded by EP, else the tensor-parallel group."""
    from neuronx_distributed.parallel_layers import mappings, parallel_state

    group = parallel_state.get_world_group() if getattr(moe, "ep_enabled", False) else moe.tensor_parallel_group
    return mappings.reduce_from_tensor_model_parallel_region(partial, process_group=group)


def _merge(info: dict[str, Any], more: dict[str, Any]) -> None:
    """Adds a finding to a point's info: notes appended, the first hint kept."""
    info.setdefault("notes", []).extend(more.get("notes", []))
    if more.get("hint") and not info.get("hint"):
        info["hint"] = more["hint"]
    info.update({k: v for k, v in more.items() if k not in ("notes", "hint")})
    if not info["notes"]:
        del info["notes"]


def attention_inputs(golden: GoldenRecord) -> tuple[torch.Tensor, ...]:
    """The golden call of an attention or a decoder layer (hidden states, transformers' additive
    mask [B, 1, Q, past + Q], position ids, the KV cache at a decode step) in NxDI's form: (hidden,
    a boolean mask, int32 position ids) for context encoding, (hidden, the mask over the past
    positions [B, 1, Q, past], position ids, past K, past V) for token generation. Without a
    recorded mask or positions: causal, and positions counted on from the cache's length."""
    hidden = golden.kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        hidden = next(a for a in golden.args if isinstance(a, torch.Tensor))
    bsz, q_len = hidden.shape[:2]
    cache = cache_of(golden)
    past = int(cache.keys.shape[2]) if cache is not None else 0
    mask = golden.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        keep = mask if mask.dtype == torch.bool else mask == 0
        keep = keep[:, :1, :, : past + q_len].expand(bsz, 1, q_len, past + q_len)
    else:
        keep = torch.ones(q_len, past + q_len, dtype=torch.bool).tril(past).expand(bsz, 1, q_len, past + q_len)
    positions = golden.kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        positions = torch.arange(past, past + q_len).expand(bsz, q_len)
    positions = positions.to(torch.int32).expand(bsz, q_len).contiguous()
    if cache is None:
        return hidden, keep.contiguous(), positions
    return hidden, keep[..., :past].contiguous(), positions, cache.keys, cache.values


def cache_of(golden: GoldenRecord) -> CacheState | None:
    """The KV cache a decode step's call carries (None: a prefill call)."""
    found = cache_states(golden.kwargs) + cache_states(golden.args)
    return found[0] if found else None


def rank_kv_heads(tp_degree: int, heads: int, kv_heads: int) -> list[list[int]] | None:
    """Which of the model's kv heads each rank holds, as NxD's GQA shards them
    (`gqa.get_shardable_head_counts`, `replicate_kv`): kept where the TP degree divides them, else each
    repeated (repeat_interleave) up to the TP degree (REPLICATE_TO_TP_DEGREE, when it is a multiple)
    or to the attention heads (CONVERT_TO_MHA), then split evenly. None where NxDI pads the attention
    heads (their count not a multiple of the TP degree)."""
    if heads % tp_degree:
        return None
    if heads == kv_heads or kv_heads % tp_degree == 0:
        grown = kv_heads
    else:
        grown = tp_degree if tp_degree % kv_heads == 0 else heads
    repeats, each = grown // kv_heads, grown // tp_degree
    return [[j // repeats for j in range(r * each, (r + 1) * each)] for r in range(tp_degree)]


def experts_inputs(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int):
    """The golden experts call (hidden [T, H], top-k ids, top-k weights) in NxD's form: (hidden,
    affinities [T, E] with each token's top-k weights at their expert ids, ids [T, k])."""
    ids = top_k_index.reshape(-1, top_k_index.shape[-1]).long()
    weights = top_k_weights.reshape(ids.shape).to(hidden.dtype)
    affinities = torch.zeros(ids.shape[0], experts, dtype=hidden.dtype).scatter(1, ids, weights)
    return hidden.reshape(ids.shape[0], -1), affinities, ids


BUILDS = ("neuron", "cpu")


build_choice = one_of(*BUILDS)


def import_nxdi() -> None:
    """Imports NxDI (the stand-ins for the Neuron-only packages already in place where wanted),
    turning the failures a user meets into one sentence each."""
    try:
        importlib.import_module("neuronx_distributed_inference.utils.testing")
    except ImportError as exc:
        if compat.MAJOR >= 5:
            raise BackendError(
                f"--hw nxdi: NxDI and NxD do not import under transformers {compat.VERSION} ({exc}); "
                "run it in the Neuron SDK's Python stack (torch 2.9, torch-xla 2.9, transformers 4.57), where NxDI "
                "pins transformers==4.57.*"
            ) from None
        raise BackendError(f"--hw nxdi: NxDI cannot be imported here ({exc}): {INSTALL}") from None


@contextlib.contextmanager
def upstream_warnings():
    """NxD's and NxDI's own deprecation notices (every NeuronConfig warns about `get_platform_lnc`)
    are about their code, not the port under test: kept out of a run that errors on warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def nxdi_hf_config(model_dir: Path) -> Any:
    """The checkpoint's transformers config as NxDI reads it: the rotary settings under the names
    NxDI's configs require (`rope_theta`, `rope_scaling`, None for the default rotary), whichever
    transformers wrote config.json (`compat.load_config` reads one written by transformers 5 on a
    4.57 host)."""
    hf_config = load_config(model_dir)
    rope = legacy_rope(hf_config.to_dict())
    for name, value in rope.items():
        setattr(hf_config, name, value)
    if not hasattr(hf_config, "rope_scaling"):
        hf_config.rope_scaling = None
    return hf_config


class NxdiBackend(Backend):
    """`--hw nxdi [--hw-option tp_degree=N] [--hw-option build=cpu]`: NxDI's modules of the
    golden's architecture, traced and compiled for a Neuron device (`build=neuron`), or run on the
    CPU as NxDI's own CPU inference runs them (`build=cpu`: one process per rank, gloo)."""

    name = "nxdi"
    options = (
        HwOption("tp_degree", "tensor-parallel degree of each built module (default: 1)", positive_int, 1),
        HwOption(
            "build",
            "neuron: traced and compiled by NxDI's build_module on a Neuron host (the default); cpu: NxDI's "
            "real modules on this machine's CPU, one process per rank, as NxDI's CPU inference runs them",
            build_choice,
            "neuron",
        ),
        HwOption(
            "tp_diff",
            "with build=cpu and tp_degree > 1: also run each point at TP 1 and name where the two part (on/off)",
            on_off,
            False,
        ),
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
        self.cpu = self.hw_options["build"] == "cpu"
        if self.cpu:
            from .nxdi_cpu import standins

            standins.install()
            self._cpu_mode = os.environ.get("NXD_CPU_MODE")
            os.environ["NXD_CPU_MODE"] = "1"  # NxDI's modules take their CPU branches (plain-math RMSNorm)
        with upstream_warnings():
            import_nxdi()
        self._check_tp(table)
        self.tp = self.hw_options["tp_degree"]
        if self.hw_options["tp_diff"] and not (self.cpu and self.tp > 1):
            raise BackendError(
                "--hw-option tp_diff=on compares TP 1 with TP N on the CPU: it needs build=cpu and tp_degree above 1"
            )
        self.table = table
        self.weights = weight_map(setup.model_dir)
        self.config: Any = None
        self._configs: dict[int, Any] = {}
        self._last: tuple[Any, ...] = (None,)  # the last point run at TP > 1 on the CPU: id, spec, inputs, output
        self._built: dict[tuple, Any] = {}
        self._converted: dict[tuple[int | None, int], dict[str, torch.Tensor]] = {}  # one unit's, per TP degree
        self._workdir: Path | None = None

    def _check_tp(self, table: ModuleTable) -> None:
        """A TP degree NxD cannot shard the golden's model by is a usage error, not a run of errors."""
        tp = self.hw_options["tp_degree"]
        config = self.golden.config
        experts = config.get("num_experts") or config.get("num_local_experts")
        sizes = {"the vocabulary": config.get("vocab_size"), "the hidden size": config.get("hidden_size")}
        if experts:
            sizes["each expert's intermediate size"] = config.get("moe_intermediate_size") or config.get(
                "intermediate_size"
            )
        bad = [f"{what} ({size})" for what, size in sizes.items() if size and size % tp]
        if bad:
            raise BackendError(
                f"--hw-option tp_degree={tp}: NxD shards {' and '.join(bad)} by the TP degree, which does not divide "
                f"{'it' if len(bad) == 1 else 'them'}; use a TP degree that does (e.g. 1 or 2)"
            )

    def start(self) -> None:
        if self.config is not None:  # started already (weight items run before the first point)
            return
        import tempfile

        self.config = self._config(self.tp)
        if self.hw_options["workdir"]:
            self._workdir = Path(self.hw_options["workdir"]).expanduser()
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="moe-parity-nxdi-")
            self._workdir = Path(self._tmp.name)

    def _config(self, tp: int) -> Any:
        """NxDI's inference config of the golden's model at TP `tp` (made once per degree)."""
        if tp not in self._configs:
            with upstream_warnings():
                hf_adapter = resolve("neuronx_distributed_inference.utils.hf_adapter:load_pretrained_config")
                neuron_config = resolve(self.table.neuron_config)(tp_degree=tp, torch_dtype=self.dtype)
                self._configs[tp] = resolve(self.table.config)(
                    neuron_config, load_config=hf_adapter(hf_config=nxdi_hf_config(self.setup.model_dir))
                )
        return self._configs[tp]

    def _spec_inputs(self, point: Point, golden: GoldenRecord) -> tuple[Component, tuple[torch.Tensor, ...]]:
        """The table's entry of the point's component and its inputs in the module's form."""
        spec = self.table.components.get(point.component)
        if spec is None:
            why = self.table.unavailable.get(point.component, "the table names no NxDI module for it")
            raise PointUnavailable(f"{point.id}: not built by --hw nxdi: {why}")
        if self.config is None:
            self.start()
        return spec, self._inputs(point, spec, golden)

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        spec, inputs = self._spec_inputs(point, golden)
        cache = None
        info: dict[str, Any] = {"nxdi_module": spec.module.format(layer=point.layer)}
        with torch.no_grad(), upstream_warnings():
            module = self._module(point, point.component, spec, inputs)
            output = module(*inputs)
            if self.cpu and self.tp > 1:
                _merge(info, self._parallel_evidence(point, spec, inputs, module))
            routing = None
            if spec.inputs == "attention":
                output, keys, values, *caught = output
                routing = tuple(caught) or None
                past = cache_of(golden)
                if past is not None and self.hw_options["tp_degree"] == 1:  # at TP > 1 K, V are rank 0's heads
                    # token generation: the cache after the call is the past and this step's K, V
                    cache = CacheState(
                        past.layer, torch.cat([inputs[3], keys], dim=2), torch.cat([inputs[4], values], dim=2)
                    )
            elif point.routed_block and "router" in self.table.components:  # what the block's router chose
                router = self.table.components["router"]
                routing = tuple(self._module(point, "router", router, inputs)(*inputs))
        return CandidateOutput(output, routing, info=info, cache=cache)

    def drill_call(self, point: Point, golden: GoldenRecord) -> tuple[Any, list, dict, bool]:
        """`--parity-drill` on the CPU build: NxDI's module of the point, captured op by op on its
        ranks (at TP > 1, their graphs joined into one: `drill.ranks`)."""
        if not self.cpu:
            raise NotImplementedError(
                "--hw nxdi drills its CPU build (--hw-option build=cpu): on a Neuron device NxDI runs the module as "
                "one traced graph, with no ops to capture one by one; drill the same NxDI code with build=cpu"
            )
        spec, inputs = self._spec_inputs(point, golden)
        with upstream_warnings():
            module = self._module(point, point.component, spec, inputs)
        read_as = None
        if point.component == "router":  # its affinities read as top-k weights, as the point's verdict reads them
            golden_w = [t for t in leaves(self.golden.load(point).output) if isinstance(t, torch.Tensor)][1]
            read_as = functools.partial(_router_as_reference, golden_w=golden_w)
        return _RankCapture(module, read_as), list(inputs), {}, False

    def _parallel_evidence(self, point: Point, spec: Component, inputs: tuple[torch.Tensor, ...], module: Any):
        """What the ranks' own outputs say at TP > 1 (the CPU build holds every rank's): whether they
        agree, as NxD's replicated outputs must, and where they do not, whether their sum is the golden
        output (a missing all-reduce). With `tp_diff`, the TP 1 differential of every point too. Notes
        for the row, and the hint of the point if it fails."""
        firsts = [first_tensor(o) for o in module.rank_outputs]
        self._last = (point.id, spec, inputs, firsts[0])
        out: dict[str, Any] = {}
        differ = [r for r in range(1, self.tp) if not torch.equal(firsts[r], firsts[0])]
        if not differ and not self.hw_options["tp_diff"]:
            return out
        expected = first_tensor(self.golden.load(point).output)  # what the backend is handed has no output
        if differ:
            summed = rel_l2_flat(sum(f.double() for f in firsts), expected) < 0.1 * rel_l2_flat(firsts[0], expected)
            ranks = ", ".join(map(str, differ))
            out["notes"] = [f"tensor parallelism: rank(s) {ranks} of {self.tp} output other values than rank 0"]
            out["hint"] = (
                f"tensor parallelism (tp_degree={self.tp}): the ranks hold partial sums whose total is the "
                "expected output: a missing all-reduce"
                if summed
                else f"tensor parallelism (tp_degree={self.tp}): the ranks' outputs differ where NxD replicates "
                "them: a missing collective, or ranks computing on other shards than NxD's sharding gives them"
            )
        if self.hw_options["tp_diff"]:
            _merge(out, self._tp_differential(point, expected))
        return out

    def explain(self, point: Point, golden: GoldenRecord) -> dict[str, Any]:
        """A failed point at TP > 1 on the CPU: the TP 1 differential (unless every point had it)."""
        if not (self.cpu and self.tp > 1) or self.hw_options["tp_diff"] or self._last[0] != point.id:
            return {}
        with torch.no_grad(), upstream_warnings():
            return self._tp_differential(point, first_tensor(golden.output))

    def _tp_differential(self, point: Point, expected: torch.Tensor) -> dict[str, Any]:
        """The same point built at TP 1: where it matches the golden and TP N does not, the
        divergence comes from the parallelism."""
        _, spec, inputs, at_tp = self._last
        single = first_tensor(self._module(point, point.component, spec, inputs, tp=1)(*inputs))
        err_n, err_1 = rel_l2_flat(at_tp, expected), rel_l2_flat(single, expected)
        out: dict[str, Any] = {
            "notes": [f"TP differential: rel_l2 to the golden {err_n:.3g} at TP {self.tp}, {err_1:.3g} at TP 1"]
        }
        if err_n > 4 * err_1 + 1e-6:
            out["tp_parted"] = True
            out["notes"].append(f"TP 1 and TP {self.tp} of the candidate part here")
            out["hint"] = (
                f"tensor parallelism (tp_degree={self.tp}): TP 1 of the same candidate matches the golden where TP "
                f"{self.tp} does not: a sharding bug (a rank loading another rank's shard, the wrong half of a split) "
                "or a missing collective"
            )
        return out

    def _inputs(self, point: Point, spec: Component, golden: GoldenRecord) -> tuple[torch.Tensor, ...]:
        if spec.inputs == "attention":
            cache = cache_of(golden)
            if cache is not None and cache.window is not None:
                raise PointUnavailable(
                    f"{point.id}: not built by --hw nxdi: a sliding-window layer's cache (NxDI's windowed "
                    "attention keeps its own rolling layout); compare it with --hw dump on an NxDI capture"
                )
            if cache is not None and self._rank_kv_heads() is None:
                raise PointUnavailable(
                    f"{point.id}: not built by --hw nxdi at tp_degree={self.hw_options['tp_degree']}: NxDI pads "
                    f"{self.config.num_attention_heads} attention heads to a multiple of it, and which rank holds "
                    "which kv heads of the cache is then not known here; use a TP degree that divides the heads, "
                    "or compare an NxDI capture"
                )
            return attention_inputs(golden)
        values = [*golden.args, *golden.kwargs.values()]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if spec.inputs == "experts":
            hidden, index, weights = tensors[:3]
            experts = self.golden.config.get("num_experts") or self.golden.config["num_local_experts"]
            return experts_inputs(hidden, index, weights, int(experts))
        return (tensors[0],)  # the hidden states, or a token-id tensor for the embedding

    def _unit(self, layer: int | None, tp: int | None = None) -> dict[str, torch.Tensor]:
        """NxDI's conversion of this unit (its layer renamed to 0) at TP `tp` (the conversion writes
        rank tensors), converted once and kept while its points run."""
        key = (layer, tp or self.tp)
        if key not in self._converted:
            if any(k[0] != layer for k in self._converted):  # one unit at a time
                self._converted.clear()
            application = resolve(self.table.application)
            state = unit_state(self.setup.model_dir, layer, self.weights)
            self._converted[key] = convert_unit(
                state, application.convert_hf_to_neuron_state_dict, self._config(key[1]), int(layer is not None)
            )
        return self._converted[key]

    def _weights(self, layer: int | None, module: str, tp: int) -> dict[str, torch.Tensor]:
        """NxDI's converted tensors of `module` (a path in NxDI's model) for this unit."""
        return under(self._unit(layer, tp), module.format(layer=0) + ".")

    def held_weights(self, layer: int | None) -> dict[str, torch.Tensor] | None:
        """What NxDI's conversion made of the candidate checkpoint's unit, mapped back by the
        table's inverse rules (None: the table has none, and the checkpoint itself is compared)."""
        if self.table.weights is None:
            return None
        if self.config is None:
            self.start()
        return back_to_reference(self._unit(layer), self.table.weights, layer)

    def _rank_kv_heads(self, tp: int | None = None) -> list[list[int]] | None:
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        return rank_kv_heads(tp or self.tp, heads, kv_heads)

    def _kwargs(self, spec: Component, prefill: bool, tp: int) -> dict[str, Any]:
        """The factory's keywords; the config as NxDI gives its context-encoding model
        (`is_prefill_stage=True`) or its token-generation model (False), whose code paths differ."""
        base = self._config(tp)
        kwargs = {k: getattr(base, v) for k, v in spec.args.items()}
        kwargs.update({k: self.dtype if v == "$dtype" else v for k, v in spec.literals.items()})
        if spec.config:
            config = copy.copy(base)
            config.neuron_config = copy.copy(base.neuron_config)
            config.neuron_config.is_prefill_stage = prefill
            kwargs["config"] = config
        return kwargs

    def _module(
        self, point: Point, name: str, spec: Component, inputs: tuple[torch.Tensor, ...], tp: int | None = None
    ) -> Any:
        tp = tp or self.tp
        key = (point.layer, name, tuple((tuple(t.shape), t.dtype) for t in inputs), tp)
        if key not in self._built:
            from safetensors.torch import load_file, save_file

            if self.cpu:
                from .nxdi_cpu.ranks import build_module
            else:
                build_module = resolve("neuronx_distributed_inference.utils.testing:build_module")
            converted = nxdi_cast_state(self._weights(point.layer, spec.module, tp), self.dtype_of(tp))
            for name in spec.rank_buffers:  # NxD's SPMDRank: some conversions write it, some leave it to the loader
                converted.setdefault(name, torch.arange(tp, dtype=torch.int32))
            assert self._workdir is not None
            unit = "model" if point.layer is None else layer_group(point.layer)
            token_generation = spec.inputs == "attention" and len(inputs) == 5  # (hidden, mask, positions, K, V)
            shape = "x".join(map(str, inputs[0].shape)) + (f".past{inputs[3].shape[2]}" if token_generation else "")
            where = self._workdir / f"{unit}.{name}.{shape}.tp{tp}"
            where.mkdir(parents=True, exist_ok=True)
            checkpoint = where / "checkpoint.safetensors"
            state = {f"inner.{k}": v.contiguous() for k, v in converted.items()}
            kv_heads = self._rank_kv_heads(tp) if token_generation and tp > 1 else None
            if kv_heads is not None:  # the wrapper's own: its SPMDRank and which kv heads each rank holds
                state["rank_util.rank"] = torch.arange(tp, dtype=torch.int32)
                state["kv_heads"] = torch.tensor(kv_heads, dtype=torch.int32)
            save_file(state, str(checkpoint))
            if any(k[0] != point.layer for k in self._built):  # one unit's modules at a time
                self._release()
            self._built[key] = build_module(
                NxdiPoint,
                example_inputs=[tuple(inputs)],
                module_init_kwargs={
                    "factory": spec.factory,
                    "kwargs": self._kwargs(spec, prefill=point.step is None, tp=tp),
                    "call": spec.call,
                    "form": spec.inputs,
                    "routing": spec.routing,
                    "kv_heads": kv_heads,
                    "seq_len": 1 if point.step is not None else self.golden_seq_len(),
                },
                tp_degree=tp,
                compiler_args=self.hw_options["compiler_args"],
                compiler_workdir=str(where / "compiler"),
                checkpoint_path=str(checkpoint),
                checkpoint_loader_fn=load_file,
            )
        return self._built[key]

    def dtype_of(self, tp: int) -> torch.dtype:
        return self._config(tp).neuron_config.torch_dtype

    def golden_seq_len(self) -> int:
        """The prefill's tokens per sequence (NxD's experts pick the context-encoding path by it)."""
        ids = self.golden.manifest.get("inputs", {}).get("input_ids") or [[]]
        return len(ids[0])

    def _release(self) -> None:
        """Drops the built modules (on the CPU build, from their ranks too)."""
        for module in self._built.values():
            if hasattr(module, "release"):
                module.release()
        self._built.clear()

    def close(self) -> None:
        self._release()
        self._converted.clear()
        if getattr(self, "cpu", False):
            from .nxdi_cpu.ranks import close_pools

            close_pools()
            if self._cpu_mode is None:
                os.environ.pop("NXD_CPU_MODE", None)
            else:
                os.environ["NXD_CPU_MODE"] = self._cpu_mode
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()
