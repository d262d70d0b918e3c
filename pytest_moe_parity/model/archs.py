"""Where each capture point lives in a transformers MoE model: one table keyed by `model_type`,
plus a structural finder for MoE models the table does not know."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..errors import ArchError
from ..points import EXPERTS, LAYER_COMPONENTS, MODEL_HEAD, MODEL_TAIL, Point

# How a router picks its experts, so that a top-k disagreement can be judged against the golden
# selection scores: softmax and top-k-then-softmax rank by the raw logits; sigmoid routers rank by
# sigmoid(logits) + a score-correction bias (DeepSeek-V3 additionally picks expert groups first).
ROUTER_KINDS = ("softmax", "topk_softmax", "sigmoid_bias", "grouped_sigmoid_bias")


@dataclass(frozen=True)
class ArchSpec:
    """Module paths of one architecture. Layer-relative paths are relative to a decoder layer."""

    embedding: str = "model.embed_tokens"
    rotary: str | None = "model.rotary_emb"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    logits: str = "lm_head"
    input_norm: str = "input_layernorm"
    attention: str = "self_attn"
    post_attn_norm: str = "post_attention_layernorm"
    moe: str = "mlp"
    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    shared_experts: str | None = None
    router_kind: str = "softmax"
    # Where a sigmoid router's score-correction bias lives, relative to the layer.
    score_bias: str | None = None

    def __post_init__(self) -> None:
        if self.router_kind not in ROUTER_KINDS:
            raise ValueError(f"router_kind {self.router_kind!r} is not one of {', '.join(ROUTER_KINDS)}")


ARCH_TABLE: dict[str, ArchSpec] = {
    "mixtral": ArchSpec(),
    "qwen3_moe": ArchSpec(),
    "olmoe": ArchSpec(),
    "qwen2_moe": ArchSpec(shared_experts="mlp.shared_expert"),
    "deepseek_v3": ArchSpec(
        shared_experts="mlp.shared_experts",
        router_kind="grouped_sigmoid_bias",
        score_bias="mlp.gate.e_score_correction_bias",
    ),
    "minimax_m2": ArchSpec(router_kind="sigmoid_bias", score_bias="mlp.e_score_correction_bias"),
    "gpt_oss": ArchSpec(router="mlp.router", router_kind="topk_softmax"),
}


@dataclass
class PointPlan:
    """The capture points of one model, in forward order, and how they were found."""

    model_type: str
    source: str  # "table" or "structural"
    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _get(model: nn.Module, path: str | None) -> nn.Module | None:
    if not path:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _has_experts(module: nn.Module) -> bool:
    return _find_experts(module) is not None


def _find_experts(block: nn.Module) -> tuple[str, nn.Module] | None:
    """The fused experts module (3-D parameters), a ModuleList of expert MLPs below `block`, or a child
    named `experts` whose weights hold every expert's in 2-D (DBRX's)."""
    for name, sub in block.named_modules():
        params = list(sub.parameters(recurse=False))
        if sum(p.dim() == 3 for p in params) >= 2:
            return name, sub
    for name, sub in block.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) >= 2 and "expert" in name.rsplit(".", 1)[-1]:
            return name, sub
    for name, sub in block.named_children():  # experts' weights stacked in 2-D (DBRX: [experts x ffn, hidden])
        if name.endswith("experts") and "shared" not in name and sum(p.dim() == 2 for p in sub.parameters()) >= 2:
            return name, sub
    return None


def _is_norm(module: nn.Module) -> bool:
    """A norm module: not a block that holds a token mixer between its norms (DBRX's NormAttentionNorm)."""
    name = type(module).__name__.lower()
    if "norm" not in name or isinstance(module, nn.ModuleList):
        return False
    return not any(_is_mixer(n, c) for n, c in module.named_children())


def plan_points(model: nn.Module, config=None) -> PointPlan:
    """Map `model` onto capture points, in forward order."""
    config = config if config is not None else model.config
    model_type = getattr(config, "model_type", "") or ""
    spec = ARCH_TABLE.get(model_type)
    if spec is not None:
        return _plan_from_spec(model, model_type, spec, "table")
    return _plan_from_spec(model, model_type, find_structure(model, config), "structural")


def layers_path(model: nn.Module, config=None) -> str:
    """Dotted path of the decoder layer list ("model.layers")."""
    config = config if config is not None else model.config
    spec = ARCH_TABLE.get(getattr(config, "model_type", "") or "")
    return spec.layers if spec is not None else find_structure(model, config).layers


def _plan_from_spec(model: nn.Module, model_type: str, spec: ArchSpec, source: str) -> PointPlan:
    plan = PointPlan(model_type=model_type, source=source)
    layers = _get(model, spec.layers)
    if not isinstance(layers, nn.ModuleList):
        raise ArchError(f"{model_type}: no decoder layer list at {spec.layers!r}")

    def add(component: str, layer: int | None, path: str | None, **extra: str | None) -> None:
        if path and _get(model, path) is not None:
            plan.points.append(Point(component, layer, module=path, order=len(plan.points), **extra))

    for component in MODEL_HEAD:
        add(component, None, getattr(spec, component))
    for i, layer in enumerate(layers):
        paths, extras = _layer_paths(model, layer, f"{spec.layers}.{i}", spec)
        for component in LAYER_COMPONENTS:  # the forward order
            add(component, i, paths.get(component), **extras.get(component, {}))
    for component in MODEL_TAIL:
        add(component, None, getattr(spec, component))
    if not any(p.component == EXPERTS for p in plan.points):
        key, declared = declared_experts(getattr(model, "config", None))
        plan.notes.append(
            f"{model_type}: its config says {key}={declared}, but no experts module was found (3-D expert "
            "weights or a list of expert modules): recording it as a dense model, its MoE blocks judged only "
            "within each layer's output"
            if declared > 1
            else f"{model_type}: no experts found; recording a dense model"
        )
    return plan


def declared_experts(config) -> tuple[str, int]:
    """Where a config gives a number of experts above one and that number (at its top level or in a
    sub-config, DBRX's `ffn_config.moe_num_experts`); ("", 0) where it gives none."""
    data = config if isinstance(config, dict) else config.to_dict() if hasattr(config, "to_dict") else {}
    sections = [("", data), *((f"{k}.", v) for k, v in data.items() if isinstance(v, dict))]
    for prefix, section in sections:
        for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
            value = section.get(key)
            if isinstance(value, int) and value > 1:
                return prefix + key, value
    return "", 0


def _layer_paths(
    model: nn.Module, layer: nn.Module, base: str, spec: ArchSpec
) -> tuple[dict[str, str | None], dict[str, dict[str, str | None]]]:
    """Module path of every component of one decoder layer (absent ones omitted), and the
    router details of the points that contain a router."""
    # hybrid models name their token mixer per layer (self_attn on some, mamba on others)
    mixer = next((n for n in spec.attention.split("|") if n and _get(layer, n) is not None), None)
    paths: dict[str, str | None] = {
        "input_norm": f"{base}.{spec.input_norm}",
        "attention": f"{base}.{mixer}" if mixer else None,
        "post_attn_norm": f"{base}.{spec.post_attn_norm}",
        "output": base,
    }
    extras: dict[str, dict[str, str | None]] = {}
    block = _get(layer, spec.moe)
    if block is None or not _has_experts(block):
        paths["mlp"] = f"{base}.{spec.moe}"
        return paths, extras
    bias = f"{base}.{spec.score_bias}" if spec.score_bias else None
    if bias is not None and not _has_tensor(model, bias):
        bias = None
    paths.update(
        router=f"{base}.{spec.router}",
        experts=f"{base}.{spec.experts}",
        shared_experts=f"{base}.{spec.shared_experts}" if spec.shared_experts else None,
        moe=f"{base}.{spec.moe}",
    )
    routing = {"router_kind": spec.router_kind, "score_bias": bias}
    extras.update(router=routing, moe=routing)
    return paths, extras


def _has_tensor(model: nn.Module, path: str) -> bool:
    owner, _, name = path.rpartition(".")
    mod = _get(model, owner)
    if mod is None:
        return False
    return name in dict(mod.named_parameters(recurse=False)) or name in dict(mod.named_buffers(recurse=False))


def _path_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for name, sub in model.named_modules():
        if sub is target:
            return name
    return None


def find_structure(model: nn.Module, config=None) -> ArchSpec:
    """Find the capture points of an MoE model by structure, for model types not in ARCH_TABLE."""
    config = config if config is not None else model.config
    layers_path, layers = _decoder_stack(model, config)
    base_path = layers_path.rpartition(".")[0]
    base = _get(model, base_path) if base_path else model

    embedding = _path_of(model, model.get_input_embeddings())
    logits = _path_of(model, model.get_output_embeddings())
    final_norm = rotary = None
    for name, child in base.named_children():
        cls = type(child).__name__.lower()
        if rotary is None and "rotary" in cls:
            rotary = f"{base_path}.{name}" if base_path else name
        elif final_norm is None and _is_norm(child):
            final_norm = f"{base_path}.{name}" if base_path else name

    # Layer-relative names, taken from the first MoE layer (dense layers share them).
    moe_layer = next((layer for layer in layers if _moe_child(layer) is not None), layers[0])
    attention, norms = _mixer_and_norms(layers, moe_layer)
    input_norm = "input_layernorm" if "input_layernorm" in norms else (norms[0] if norms else None)
    post_norm = (
        "post_attention_layernorm"
        if "post_attention_layernorm" in norms
        else next((n for n in norms if n != input_norm), None)
    )
    moe = _moe_child(moe_layer)
    router, experts, shared, kind, bias = _moe_parts(moe_layer, moe)
    return ArchSpec(
        embedding=embedding or "",
        rotary=rotary,
        layers=layers_path,
        final_norm=final_norm or "",
        logits=logits or "",
        input_norm=input_norm or "",
        attention=attention or "",
        post_attn_norm=post_norm or "",
        moe=moe or "mlp",
        router=router or "",
        experts=experts or "",
        shared_experts=shared,
        router_kind=kind,
        score_bias=bias,
    )


def _decoder_stack(model: nn.Module, config) -> tuple[str, nn.ModuleList]:
    """The decoder stack: the shortest path among module lists of the right length whose layers
    hold a token mixer (attention, or mamba/linear attention in hybrid models) or experts."""
    model_type = getattr(config, "model_type", "?")
    n_layers = getattr(config, "num_hidden_layers", None)
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and (n_layers is None or len(mod) == n_layers)
    ]
    candidates = [(n, m) for n, m in candidates if any(_attention_child(layer) or _moe_child(layer) for layer in m)]
    if not candidates:
        raise ArchError(f"{model_type}: cannot find the decoder layer list (a ModuleList of {n_layers} layers)")
    return min(candidates, key=lambda nm: nm[0].count("."))


def _mixer_and_norms(layers: nn.ModuleList, moe_layer: nn.Module) -> tuple[str, list[str]]:
    """The token mixer's layer-relative name (`a|b` where layers name theirs otherwise) and the norms'
    of `moe_layer`."""
    mixers = dict.fromkeys(name for layer in layers if (name := _attention_child(layer)) is not None)
    norms = [name for name, child in moe_layer.named_children() if _is_norm(child)]
    if not norms and len(mixers) == 1:  # the norms and the mixer inside one block (DBRX: norm_attn_norm)
        wrapper = next(iter(mixers))
        inner = moe_layer.get_submodule(wrapper)
        inner_mixer = _attention_child(inner)
        if inner_mixer is not None:
            mixers = {f"{wrapper}.{inner_mixer}": None}
            norms = [f"{wrapper}.{name}" for name, child in inner.named_children() if _is_norm(child)]
    return "|".join(mixers), norms


def _moe_parts(moe_layer: nn.Module, moe: str | None) -> tuple[str | None, str | None, str | None, str, str | None]:
    """The MoE block's router, experts and shared experts (layer-relative names), the router's kind
    and its score-correction bias: (None, None, None, "softmax", None) without a block."""
    router = experts = shared = None
    kind = "softmax"
    bias = None
    if moe is not None:
        block = moe_layer.get_submodule(moe)
        experts_name, _ = _find_experts(block)
        experts = f"{moe}.{experts_name}" if experts_name else moe
        router_name = _router_name(block, experts_name)
        router = f"{moe}.{router_name}" if router_name else None
        shared_name = next(
            (
                n
                for n, c in block.named_children()
                if "shared" in n and "gate" not in n and any(True for _ in c.parameters())
            ),
            None,
        )
        shared = f"{moe}.{shared_name}" if shared_name else None
        for owner in (router, moe):
            if owner is None:
                continue
            mod = moe_layer.get_submodule(owner)
            buffers = dict(mod.named_buffers(recurse=False))
            bias_name = next((n for n in buffers if "bias" in n), None)
            if bias_name:
                bias = f"{owner}.{bias_name}"
                kind = "sigmoid_bias"
                break
    return router, experts, shared, kind, bias


_MIXER_WORDS = ("attn", "attention", "mamba", "mixer", "conv")


def _is_mixer(name: str, child: nn.Module) -> bool:
    label = f"{name} {type(child).__name__}".lower()
    return any(word in label for word in _MIXER_WORDS) and not _has_experts(child)


def _attention_child(layer: nn.Module) -> str | None:
    """The token mixer of a decoder layer: attention, or mamba / linear attention in hybrids."""
    for name, child in layer.named_children():
        if _is_mixer(name, child):
            return name
    return None


def _moe_child(layer: nn.Module) -> str | None:
    for name, child in layer.named_children():
        if _is_mixer(name, child):
            continue
        if _has_experts(child):
            return name
    return None


def _router_name(block: nn.Module, experts_name: str | None) -> str | None:
    named = [(n, c) for n, c in block.named_children() if n != experts_name and "shared" not in n]
    for name, child in named:
        cls = type(child).__name__.lower()
        if "router" in cls or "gate" in cls or name in ("gate", "router"):
            return name
    return None
