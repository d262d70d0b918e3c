"""`--hw vllm`: replay on vLLM's own modules. The candidate checkpoint is built once as vLLM's model
of its architecture (`Qwen3MoeForCausalLM`, `MixtralForCausalLM`): vLLM's `VllmConfig` over the
checkpoint, its model class, its weight loader (`load_weights`, `process_weights_after_loading`), one
rank (gloo on the CPU), and each point is called on vLLM's submodule for it under vLLM's forward
context, on the golden's inputs: the embedding, the norms, the rotary table, the router (the gate and
the MoE runner's expert selection), the experts (vLLM's fused MoE through its quant method, given the
golden's routing), the MoE block (its selection seen, or replaced with --parity-routing), the final
norm and the logits (the lm_head through vLLM's logits processor), the attention and the decoder
layer (over a paged KV cache and attention metadata built per call by vLLM's own cache update and
metadata builder: `attention`), prefill and decode.

The package: `imports` (vLLM's imports, its version range, the install line), `attention` (vLLM's
forward context for one attention call), `window` (sliding-window layers' past and cache), `archs` (what
differs between vLLM's model files: Qwen3-MoE, Mixtral, GPT-OSS, MiniMax-M2), `parallel` (TP and EP > 1: the
model built on ranks, one process each, their plans and evidence), `taught` (a MoE block vLLM cannot route
here, MiniMax-M2's on the CPU, run on the golden's routing), `backend` (the backend)."""

from .backend import MOE_BLOCKS, VllmBackend
from .imports import INSTALL, SUPPORTED, check_version, import_vllm, vllm_version

__all__ = [
    "INSTALL",
    "MOE_BLOCKS",
    "SUPPORTED",
    "VllmBackend",
    "check_version",
    "import_vllm",
    "vllm_version",
]
