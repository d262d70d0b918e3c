"""Port bugs, injected into a copy of a tiny checkpoint in the hub's own layout, the way a broken
conversion script or loader would produce them."""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pytest_moe_parity.golden import GoldenStore

Tensors = dict[str, torch.Tensor]


def edit_checkpoint(src: Path, dst: Path, edit: Callable[[Tensors], None]) -> Path:
    """Copy `src` to `dst`, then apply `edit` to the union of its tensors and write them back
    into the same shards."""
    shutil.copytree(src, dst)
    shards = sorted(dst.glob("*.safetensors"))
    by_file: dict[Path, Tensors] = {}
    everything: Tensors = {}
    for f in shards:
        with safe_open(str(f), "pt") as fh:
            by_file[f] = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
        everything.update(by_file[f])
    edit(everything)
    for f, tensors in by_file.items():
        save_file({k: everything[k].contiguous() for k in tensors}, str(f), metadata={"format": "pt"})
    return dst


def edit_config(dst: Path, edit: Callable[[dict], None]) -> None:
    path = dst / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2))


def _expert_keys(t: Tensors, layer: int, expert: int) -> dict[str, str]:
    """gate/up/down keys of one expert, whatever the hub naming (gate_proj/up_proj/down_proj or w1/w3/w2)."""
    prefix = next(k for k in t if f".layers.{layer}." in k and f".experts.{expert}." in k).split(f".experts.{expert}.")[
        0
    ]
    base = f"{prefix}.experts.{expert}."
    if base + "w1.weight" in t:
        return {"gate": base + "w1.weight", "up": base + "w3.weight", "down": base + "w2.weight"}
    return {"gate": base + "gate_proj.weight", "up": base + "up_proj.weight", "down": base + "down_proj.weight"}


def swap_gate_up(layer: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        if any(f"layers.{layer}.mlp.experts.gate_up_proj" in k for k in t):  # gpt_oss: fused, interleaved
            key = f"model.layers.{layer}.mlp.experts.gate_up_proj"
            w = t[key]
            t[key] = torch.stack([w[..., 1::2], w[..., 0::2]], dim=-1).reshape(w.shape)
            return
        e = 0
        while any(f".layers.{layer}." in k and f".experts.{e}." in k for k in t):
            keys = _expert_keys(t, layer, e)
            t[keys["gate"]], t[keys["up"]] = t[keys["up"]], t[keys["gate"]]
            e += 1

    return edit


def swap_experts(layer: int, a: int, b: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        ka, kb = _expert_keys(t, layer, a), _expert_keys(t, layer, b)
        for part in ("gate", "up", "down"):
            t[ka[part]], t[kb[part]] = t[kb[part]], t[ka[part]]

    return edit


def zero_expert(layer: int, expert: int) -> Callable[[Tensors], None]:
    """One expert whose down projection the port never loaded (zeros)."""

    def edit(t: Tensors) -> None:
        key = _expert_keys(t, layer, expert)["down"]
        t[key] = torch.zeros_like(t[key])

    return edit


def _one(t: Tensors, *fragments: str) -> str:
    found = [k for k in t if all(f in k for f in fragments)]
    assert len(found) == 1, (fragments, found)
    return found[0]


def permute_router_rows(layer: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        key = _one(t, f"layers.{layer}.", "router.weight") if any("router.weight" in k for k in t) else None
        key = key or _one(t, f"layers.{layer}.", ".gate.weight")
        w = t[key]
        t[key] = w.roll(1, dims=0)
        bias = key.replace(".weight", ".bias")
        if bias in t:
            t[bias] = t[bias].roll(1, dims=0)

    return edit


def drop_score_bias(layer: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        key = _one(t, f"layers.{layer}.", "e_score_correction_bias")
        t[key] = torch.zeros_like(t[key])

    return edit


def lose_weight(key: str) -> Callable[[Tensors], None]:
    """A norm whose weight the port never loaded: left at its init (ones)."""

    def edit(t: Tensors) -> None:
        t[key] = torch.ones_like(t[key])

    return edit


def permute_o_proj_heads(layer: int, num_heads: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        key = _one(t, f"layers.{layer}.", "o_proj.weight")
        w = t[key]
        hidden, inner = w.shape
        heads = w.reshape(hidden, num_heads, inner // num_heads)
        t[key] = heads.roll(1, dims=1).reshape(hidden, inner)

    return edit


def scale(key_fragment: str, layer: int | None, factor: float) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        frags = (f"layers.{layer}.", key_fragment) if layer is not None else (key_fragment,)
        key = _one(t, *frags)
        t[key] = t[key] * factor

    return edit


def narrow(key_fragment: str, layer: int, dtype: torch.dtype = torch.bfloat16) -> Callable[[Tensors], None]:
    """One weight stored in a narrower dtype (its values rounded to it)."""

    def edit(t: Tensors) -> None:
        key = _one(t, f"layers.{layer}.", key_fragment)
        t[key] = t[key].to(dtype)

    return edit


def scale_rows(key_fragment: str, rows: list[int], factor: float) -> Callable[[Tensors], None]:
    """Some rows of one weight scaled, e.g. a few vocabulary rows of lm_head."""

    def edit(t: Tensors) -> None:
        key = _one(t, key_fragment)
        w = t[key].clone()
        w[rows] *= factor
        t[key] = w

    return edit


def swap_embedding_rows(a: int, b: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        key = _one(t, "embed_tokens.weight")
        w = t[key].clone()
        w[[a, b]] = w[[b, a]]
        t[key] = w

    return edit


def poison(key_fragment: str, layer: int) -> Callable[[Tensors], None]:
    """One NaN in a weight: what an uninitialised buffer or a bad cast leaves behind."""

    def edit(t: Tensors) -> None:
        key = _one(t, f"layers.{layer}.", key_fragment)
        w = t[key].clone()
        w.view(-1)[0] = float("nan")
        t[key] = w

    return edit


def _used_experts(golden: Path, layer: int) -> tuple[int, int]:
    index = GoldenStore(golden).load(f"layer_{layer}.router").output[2]
    counts = index.flatten().bincount()
    top = counts.argsort(descending=True)
    return int(top[0]), int(top[1])


def _two_input_ids(golden: Path) -> tuple[int, int]:
    ids = GoldenStore(golden).manifest["inputs"]["input_ids"][0]
    a = ids[0]
    b = next(i for i in ids if i != a)
    return a, b


# name: (arch, the point that must fail first, edit factory (golden dir) -> (tensor edit, config edit))
CASES = {
    "gate_up_swapped": ("mixtral", "layer_2.experts", lambda g: (swap_gate_up(2), None)),
    "gate_up_swapped_gpt_oss": ("gpt_oss", "layer_2.experts", lambda g: (swap_gate_up(2), None)),
    "two_experts_swapped": (
        "qwen3_moe", "layer_2.experts", lambda g: (swap_experts(2, *_used_experts(g, 2)), None)
    ),
    "router_rows_permuted": ("olmoe", "layer_2.router", lambda g: (permute_router_rows(2), None)),
    "router_rows_permuted_gpt_oss": ("gpt_oss", "layer_1.router", lambda g: (permute_router_rows(1), None)),
    "score_bias_dropped_minimax": ("minimax_m2", "layer_2.router", lambda g: (drop_score_bias(2), None)),
    "score_bias_dropped_deepseek": ("deepseek_v3", "layer_2.router", lambda g: (drop_score_bias(2), None)),
    "post_attn_norm_lost": (
        "qwen2_moe", "layer_2.post_attn_norm",
        lambda g: (lose_weight("model.layers.2.post_attention_layernorm.weight"), None),
    ),
    "input_norm_lost": (
        "minimax_m2", "layer_1.input_norm",
        lambda g: (lose_weight("model.layers.1.input_layernorm.weight"), None),
    ),
    "final_norm_lost": ("deepseek_v3", "final_norm", lambda g: (lose_weight("model.norm.weight"), None)),
    "rope_theta_changed": (
        "mixtral", "rotary", lambda g: (None, lambda c: c["rope_parameters"].update(rope_theta=40000.0))
    ),
    "o_proj_heads_permuted": ("qwen3_moe", "layer_2.attention", lambda g: (permute_o_proj_heads(2, 4), None)),
    "shared_expert_scaled_deepseek": (
        "deepseek_v3", "layer_2.shared_experts", lambda g: (scale("shared_experts.down_proj", 2, 1.5), None)
    ),
    "shared_expert_scaled_qwen2": (
        "qwen2_moe", "layer_2.shared_experts", lambda g: (scale("shared_expert.down_proj", 2, 1.5), None)
    ),
    "embedding_rows_swapped": ("olmoe", "embedding", lambda g: (swap_embedding_rows(*_two_input_ids(g)), None)),
    "lm_head_scaled": ("minimax_m2", "logits", lambda g: (scale("lm_head.weight", None, 1.25), None)),
    # Llama 4: a router that returns (scores, logits), experts run on every token ([E*T, H] rows)
    "router_rows_permuted_llama4": ("llama4_text", "layer_2.router", lambda g: (permute_router_rows(2), None)),
    "experts_scaled_llama4": (
        "llama4_text", "layer_1.experts", lambda g: (scale("experts.down_proj", 1, 1.5), None)
    ),
    # LFM2-MoE: a short convolution for attention on some layers; a sigmoid router in the module's dtype
    "conv_scaled_lfm2": ("lfm2_moe", "layer_2.attention", lambda g: (scale("conv.in_proj.weight", 2, 1.5), None)),
    "expert_bias_dropped_lfm2": ("lfm2_moe", "layer_3.router", lambda g: (scale("expert_bias", 3, 0.0), None)),
}  # fmt: skip


# -- code faults: a port's code, not its weights, is wrong ------------------------------------------
#
# Each is a set of attributes of transformers' modeling modules replaced while `code_fault` is
# active, around an in-process pytester run. The modules must have been imported before pytester's
# module snapshot (the `_import_everything_once` fixture does it), else the run builds its model
# from a module the patch never reached.


def _router_softmax_in_its_dtype(self, hidden_states):
    """A softmax router that takes the softmax in the logits' dtype (bf16 for a bf16 candidate)
    instead of float32: the routing weights' error doubles and near-ties appear."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits, dim=-1)  # the bug: no dtype=torch.float
    top, index = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top.to(router_logits.dtype), index


def _mask_one_ahead(create_mask):
    """A causal mask built one position off: every token also sees the next one."""

    def create(*args, **kwargs):
        mask = create_mask(*args, **kwargs)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] > 1:
            mask = mask.clone()
            mask[..., :, 1:] = mask[..., :, :-1].clone()
        return mask

    return create


def _cache_written_one_early(update):
    """A decode step that writes the new token's key and value one position early: the previous
    token's entry moves behind it. Full attention reads the same set of keys (the step's output is
    right); only the cache write shows it."""

    def wrapped(self, key_states, value_states, *args, **kwargs):
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] == 1 and self.keys.shape[-2] > 1:
            order = list(range(self.keys.shape[-2]))
            order[-2], order[-1] = order[-1], order[-2]
            self.keys, self.values = self.keys[:, :, order], self.values[:, :, order]
            return self.keys, self.values
        return keys, values

    return wrapped


def _rope_skipped_in_decode(apply):
    """The new token of a decode step rotated as if at position 0 (no rotation)."""

    def wrapped(q, k, cos, sin, *args, **kwargs):
        if q.shape[-2] == 1:
            return q, k
        return apply(q, k, cos, sin, *args, **kwargs)

    return wrapped


def _decode_mask_hides_last(create_mask):
    """A decode step's mask that hides the last cache entry (the new token's own key)."""

    def create(*args, **kwargs):
        mask = create_mask(*args, **kwargs)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2] == 1:
            mask = mask.clone()
            mask[..., -1] = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        return mask

    return create


def _rope_table_ends_at_512(forward):
    """A decode graph whose RoPE table holds 512 positions: a step whose token is at position 512 or
    beyond reads past its end and rotates the new query and key as at position 0 (cos 1, sin 0), while
    the prefill and the steps before position 512 are right (the shape of NxDI PR #106's decode bug)."""

    def wrapped(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if hidden_states.shape[-2] == 1 and past >= 512:
            cos, sin = position_embeddings
            position_embeddings = (torch.ones_like(cos), torch.zeros_like(sin))
        return forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)

    return wrapped


def _positions_from_the_pad(forward):
    """A model that ignores the position ids it is given and counts positions from the first column,
    padding included: a left-padded row's real tokens sit at the wrong positions."""

    def wrapped(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        return forward(self, *args, **kwargs)

    return wrapped


_QWEN3 = "transformers.models.qwen3_moe.modeling_qwen3_moe"
_MIXTRAL = "transformers.models.mixtral.modeling_mixtral"
# name: [(module, attribute path, replacement factory (original -> replacement))]
CODE_FAULTS: dict[str, list[tuple[str, str, Callable]]] = {
    "router_softmax_bf16": [
        (_QWEN3, "Qwen3MoeTopKRouter.forward", lambda original: _router_softmax_in_its_dtype),
        (_MIXTRAL, "MixtralTopKRouter.forward", lambda original: _router_softmax_in_its_dtype),
    ],
    "causal_mask_one_ahead": [
        (_QWEN3, "create_causal_mask", _mask_one_ahead),
        (_MIXTRAL, "create_causal_mask", _mask_one_ahead),
    ],
    "decode_cache_written_one_early": [("transformers.cache_utils", "DynamicLayer.update", _cache_written_one_early)],
    "decode_new_token_at_position_0": [(_QWEN3, "apply_rotary_pos_emb", _rope_skipped_in_decode)],
    "decode_mask_hides_last_entry": [(_QWEN3, "create_causal_mask", _decode_mask_hides_last)],
    "positions_from_the_pad": [(_QWEN3, "Qwen3MoeModel.forward", _positions_from_the_pad)],
    "decode_rope_table_ends_at_512": [(_QWEN3, "Qwen3MoeAttention.forward", _rope_table_ends_at_512)],
}


@contextlib.contextmanager
def code_fault(name: str):
    """Replace the attributes of fault `name` while the context is active."""
    undo = []
    try:
        for module_name, path, make in CODE_FAULTS[name]:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            original = getattr(owner, attr)
            setattr(owner, attr, make(original))
            undo.append((owner, attr, original))
        yield
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)
