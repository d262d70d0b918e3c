"""The table per architecture (`modules/<model_type>.json`: data, so a team adds its model without
touching the code) that names NxDI's config, application and MoE factory, and how each point's
module is built."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...files import read_table, table_names

TABLES = Path(__file__).with_name("modules")


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
    # the submodule whose output the call replaces by its last two inputs (a MoE's router, its affinities
    # and top-k ids given: --parity-routing); "": none
    forced: str = ""
    # tensors NxD's module reads as plain attributes that the model owning it sets (GroupLimitedRouter's
    # `e_score_correction_bias`): registered as buffers, name -> the config attribute of their length, so
    # the checkpoint fills them
    buffers: dict[str, str] = field(default_factory=dict)
    # a router whose affinities [T, E] the model weighs after it (DeepSeek-V3: the top k renormalised,
    # then scaled): {"normalize": config attribute (bool), "scale": config attribute (float)}; {}: none
    topk_weights: dict[str, str] = field(default_factory=dict)
    # attributes of this component's config copy, each the value of another (NxDI's initialize_moe_module
    # reads `num_local_experts`, `intermediate_size`), and literal settings of its neuron_config copy
    config_set: dict[str, str] = field(default_factory=dict)
    neuron_set: dict[str, Any] = field(default_factory=dict)
    # why NxDI's module runs on the CPU build at TP 1 only ("": it runs at any degree)
    cpu_tp1_only: str = ""
    # how many of the call's outputs the point judges (0: all): DBRX's router point records transformers'
    # router logits alone, so NxD's router's (logits, affinities, ids) is judged by its logits
    outputs: int = 0
    # fixed keywords of an attention-form call (GPT-OSS's decoder layer pops cos_cache, sin_cache; "$rope":
    # whether the point's layer applies the rotary embedding, from the config's `no_rope_layers`: Llama 4's
    # polar-compatible rope)
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    # a method of the module called before each call: the per-forward state NxDI's model resets (GPT-OSS's
    # decoder layers share a rotary cache, cleared at the end of each decode forward); "": none
    before_call: str = ""
    # the part of the built module the point is (Llama 4's MoE: `moe` of NxDI's NeuronMoEDecoderLayer; its
    # attention: `self_attn` of the decoder layer, built at the point's layer for its NoPE/rotary choice)
    submodule: str = ""
    # the point gives its tokens' output [T, H] and its router's top-k scores scattered over the experts
    # [T, E] (transformers' Llama4TextMoe returns both)
    scores: bool = False


@dataclass
class ModuleTable:
    """How an architecture's points map onto NxDI (one JSON file per `model_type`)."""

    model_type: str
    config: str  # "module:Class" of the InferenceConfig
    neuron_config: str
    application: str  # the NeuronXxxForCausalLM whose convert_hf_to_neuron_state_dict converts weights ("": none)
    components: dict[str, Component]
    unavailable: dict[str, str] = field(default_factory=dict)
    # The inverse of the application's conversion, for weight items: {"prefix", "top_level", "rules"}.
    weights: dict[str, Any] | None = None
    # Why NxDI's MoE of this architecture does not split its experts under moe_ep_degree ("": it does).
    no_expert_parallelism: str = ""
    # Where NxDI ships no application (no convert_hf_to_neuron_state_dict): the table's own layout of the
    # checkpoint for NxD's modules (`weights.table_conversion`: renames and the experts stacked).
    conversion: dict[str, Any] | None = None
    # Config attributes NxDI's modules read that the checkpoint's config leaves out (None or absent).
    config_defaults: dict[str, Any] = field(default_factory=dict)
    # How the checkpoint is laid out for the conversion, where not as Llama's (`model.layers.N.`, the
    # conversion looping over `num_hidden_layers`): {"prefix", "layers", "layer_count", "model_level"}
    # (`weights.unit_state`).
    checkpoint: dict[str, Any] = field(default_factory=dict)
    # "module:function" giving each decoder layer's config from the model's, as NxDI's model builds its
    # layers (GPT-OSS's get_updated_configs: the sliding window kept on sliding layers alone); "": one config
    layer_configs: str = ""
    # NxDI's token generation takes a sliding-window layer's cache as the window - 1 positions it keeps
    # (a rolling buffer: their order is immaterial to the attention), so the golden's kept window is fed
    window_cache: bool = False
    # the checkpoint layout the application's conversion reads, where it reads one alone: {"quant_method",
    # "why"} (GPT-OSS's reads the hub's MXFP4 experts); a checkpoint in another is a usage error
    checkpoint_quant: dict[str, str] = field(default_factory=dict)


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


def attribute(config: Any, path: str) -> Any:
    """`path` read from NxDI's config: an attribute, or dotted through nested configs and dicts
    (`ffn_config.ffn_act_fn.name`: DBRX's nested configs are namespaces, its activation a dict)."""
    value = config
    for part in path.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value
