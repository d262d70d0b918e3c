"""The names of the capture-point components, in forward order (no torch import: the pytest
plugin reads them at startup even when it is inert)."""

# Inside one decoder layer, the parts come before the wholes that contain them, so that
# `pytest -x` stops at the smallest diverging component.
LAYER_COMPONENTS = (
    "input_norm",
    "attention",
    "post_attn_norm",
    "router",
    "experts",
    "shared_experts",
    "moe",
    "mlp",
    "output",
)
MODEL_HEAD = ("embedding", "rotary")
MODEL_TAIL = ("final_norm", "logits")
COMPONENTS = MODEL_HEAD + LAYER_COMPONENTS + MODEL_TAIL
