"""The precision settings NxDI's config exposes for its modules, as `--hw-option`s of `--hw nxdi` and
as the units of the precision search there (`replay.precision_nxdi`). Each is read by some of NxDI's
modules only; a setting that a point's module does not read is not one of its units.

- `router_dtype`: `neuron_config.router_config.dtype`, the dtype of NxD's `RouterTopK` (its
  `linear_router`, so the logits and the top-k over them) where the module is built by
  `modules/moe_v2.initialize_moe_module` without forcing it: Qwen3-MoE's `Qwen3MoeInferenceConfig` sets
  it to float32 when the config is made ("for accuracy"), which the option overrides after it, as a
  port's config would; GPT-OSS keeps the neuron config's. The router and MoE points only: in a decoder
  layer, `cast_type="as-declared"` (which the router's own dtype needs) leaves parts of NxDI's
  attention in float32 beside bfloat16 ones and the CPU build fails there. Not read by the older `modules/moe`
  (Mixtral, DBRX: their `RouterTopK` is built in float32 whatever the config says), nor by Llama 4's
  MoE layer (it sets float32 itself when built), nor by DeepSeek-V3's `GroupLimitedRouter` (built at
  the model's dtype here).
- `attention_dtype`: `neuron_config.attention_dtype`, what `NeuronAttentionBase` builds its
  projections in and casts its hidden states to (with `cast_type="as-declared"`, which NxDI requires
  where it differs from `torch_dtype`): the attention. Not the decoder layer that holds it: its
  attention then hands float32 to the MoE, whose experts NxDI builds at `torch_dtype`, and the CPU build
  fails there (`expected m1 and m2 to have the same dtype`), so it is not a unit there.
- `rpl_reduce_dtype`: `neuron_config.rpl_reduce_dtype`, the dtype a row-parallel linear's partial
  sums are all-reduced in (attention's `o_proj`, the shared experts'); only at `tp_degree` > 1: at
  TP 1 there is no reduction for it to change.

The norms (NxDI's RMSNorm on the CPU computes in float32 itself), the embedding, the routed experts
(`ExpertMLPsV2` at `torch_dtype`) and the lm_head have no setting of their own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...points import ATTENTION, OUTPUT, ROUTER
from .. import HwOption, one_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the factories (`module:Name` as the tables spell them) whose build reads neuron_config.router_config.dtype
ROUTER_DTYPE_READERS = (
    "neuronx_distributed_inference.modules.moe_v2:initialize_moe_module",
    "neuronx_distributed_inference.models.gpt_oss.modeling_gpt_oss:NeuronGptOssMoE",
)


@dataclass(frozen=True)
class Setting:
    """One precision setting: its `--hw-option`, the name NxDI gives it, the components that read it."""

    option: str
    said: str  # as NxDI's config spells it
    components: tuple[str, ...]
    help: str

    def applies(self, component: str, factory: str, tp: int) -> bool:
        if component not in self.components:
            return False
        if self.option == "router_dtype":
            return factory in ROUTER_DTYPE_READERS
        if self.option == "rpl_reduce_dtype":
            return tp > 1
        return True

    def current(self, config: Any) -> torch.dtype:
        """The dtype the module runs the setting's part in under `config`: a module's declared dtype holds
        with cast_type="as-declared" only, NxDI casting every module to torch_dtype with "config" (its
        default: `ModelWrapper.load_module`); an unset attention or reduce dtype is the model's."""
        nc = config.neuron_config
        if self.option == "rpl_reduce_dtype":
            return nc.rpl_reduce_dtype or nc.torch_dtype
        if getattr(nc, "cast_type", "config") != "as-declared":
            return nc.torch_dtype
        if self.option == "router_dtype":
            return nc.router_config.dtype
        return nc.attention_dtype or nc.torch_dtype


SETTINGS = (
    Setting("router_dtype", "router_config.dtype", (ROUTER, "moe"),
            "the MoE router's dtype (NxD's RouterTopK: its logits and their top-k), NxDI's "
            "neuron_config.router_config.dtype, set after the model's config (which may force it, as Qwen3-MoE's "
            "does); read by modules/moe_v2 (default: the config's)"),
    Setting("attention_dtype", "attention_dtype", (ATTENTION,),
            "the attention's dtype (NxDI's neuron_config.attention_dtype, with cast_type=as-declared; default: "
            "--dtype)"),
    Setting("rpl_reduce_dtype", "rpl_reduce_dtype", (ATTENTION, OUTPUT, "shared_experts"),
            "the dtype row-parallel linears all-reduce in at tp_degree > 1 (NxDI's neuron_config.rpl_reduce_dtype; "
            "default: the module's)"),
)  # fmt: skip
BY_OPTION = {s.option: s for s in SETTINGS}
CASTS = ("config", "as-declared")
OPTIONS = (
    *(HwOption(s.option, s.help, one_of(*DTYPES), None) for s in SETTINGS),
    HwOption("cast_type", "NxDI's neuron_config.cast_type: config casts every module to --dtype (NxDI's default), "
             "as-declared keeps each module's own dtype (the router's, the attention's); default: as-declared where "
             "router_dtype or attention_dtype is given, else config", one_of(*CASTS), None),
)  # fmt: skip


def plan_settings(values: dict[str, str | None]) -> dict[str, Any]:
    """The neuron config's keywords for the settings given (router_dtype is set after the config)."""
    plan: dict[str, Any] = {}
    if values.get("router_dtype") or values.get("attention_dtype"):
        plan["cast_type"] = "as-declared"  # a module's own dtype holds only so (NxDI requires it for attention_dtype)
    if values.get("cast_type"):
        plan["cast_type"] = values["cast_type"]
    if values.get("attention_dtype"):
        plan["attention_dtype"] = DTYPES[values["attention_dtype"]]
    if values.get("rpl_reduce_dtype"):
        plan["rpl_reduce_dtype"] = DTYPES[values["rpl_reduce_dtype"]]
    return plan


def after_config(config: Any, values: dict[str, str | None]) -> None:
    """What is set on the config once made: the router's dtype (which a model's config may force)."""
    if values.get("router_dtype"):
        config.neuron_config.router_config.dtype = DTYPES[values["router_dtype"]]


def applicable(component: str, factory: str, tp: int) -> list[Setting]:
    """The settings the module of `component` built by `factory` at TP `tp` reads."""
    return [s for s in SETTINGS if s.applies(component, factory, tp)]
