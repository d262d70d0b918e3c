"""`--hw nxdi`: isolated replay on NxDI's own modules. Per point, the NxDI module of that component
is built through NxDI's test machinery (`neuronx_distributed_inference.utils.testing.build_module`)
at `--hw-option tp_degree=N`, with the weights of that layer only, converted by NxDI's own
conversion function; the golden inputs are adapted to the module's signature and its outputs
judged as the golden's (a router's full-softmax affinities become top-k weights in the verdict).
Decode steps (one token) trace their own graphs, as NxDI's token generation does.

What is NxDI's and what is ours: the table per architecture (`modules/<model_type>.json`:
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
heads, then split).

Where NxDI ships a model's modules but no application (DeepSeek-V3: models/deepseek's MLA attention
only), the table names NxD's modules for the rest (GroupLimitedRouter, ExpertMLPsV2, SharedExperts)
and lays the checkpoint out for them itself (`conversion`: renames, the experts stacked); the MLA is
called on its own cache form (one tensor, rotary K then latent KV, from transformers' latent cache).

The package: `tables` (the per-architecture tables), `weights` (one unit's checkpoint through NxDI's
conversion and back), `calls` (the module built per point, the golden's calls in NxDI's forms),
`evidence` (what the ranks say at TP > 1), `imports` (NxDI's imports and config), `backend` (the
backend), `cpu/` (the CPU build: NxDI's real modules, one process per rank)."""

from .backend import BUILDS, NxdiBackend
from .calls import NxdiPoint, attention_inputs, cache_of, experts_inputs, rank_kv_heads
from .imports import INSTALL, import_nxdi, nxdi_hf_config, upstream_warnings
from .tables import TABLES, Component, ModuleTable, load_module_table, resolve, tables
from .weights import back_to_reference, convert_unit, nxdi_cast, nxdi_cast_state, table_conversion, under, unit_state

__all__ = [
    "BUILDS",
    "INSTALL",
    "TABLES",
    "Component",
    "ModuleTable",
    "NxdiBackend",
    "NxdiPoint",
    "attention_inputs",
    "back_to_reference",
    "cache_of",
    "convert_unit",
    "experts_inputs",
    "import_nxdi",
    "load_module_table",
    "nxdi_cast",
    "nxdi_cast_state",
    "nxdi_hf_config",
    "rank_kv_heads",
    "resolve",
    "table_conversion",
    "tables",
    "under",
    "unit_state",
    "upstream_warnings",
]
