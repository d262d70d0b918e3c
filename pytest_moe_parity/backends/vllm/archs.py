"""What differs between vLLM's model files of the architectures `--hw vllm` replays: where each keeps its
MoE block, router, attention and embedding, the layout of the golden's rotary table, and the config
fields vLLM's model file reads that a checkpoint written by transformers may lack. The calls themselves
are the same for all (keyword arguments `positions`, `hidden_states`, `residual`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BackendError, PointUnavailable
from ...points import Point
from .quant import vllm_reason
from .taught import unroutable


@dataclass(frozen=True)
class VllmArch:
    """One architecture's vLLM model file, as the backend reads it."""

    model_file: str  # vllm/model_executor/models/<model_file>.py
    block: str  # the decoder layer's attribute holding the MoE block (its `experts` is vLLM's MoE runner)
    gate: str = "gate"  # the block's router linear (vLLM's GateLinear)
    attention: str = "self_attn"  # the decoder layer's attention module (its `attn` is vLLM's Attention)
    embedding: str = "embed_tokens"  # the model's token embedding
    # the golden's rotary table holds the cos and sin of each rotated pair once (transformers' GPT-OSS),
    # not repeated over both halves
    rotary_half: bool = False
    # config.json fields vLLM's model file reads with no default (the released checkpoints have them;
    # transformers' own config class may not write them)
    needs: tuple[str, ...] = ()

    def path(self, golden_path: str) -> str:
        """vLLM's module path for a golden (transformers) module path."""
        names = golden_path.split(".")
        if names[:2] == ["model", "embed_tokens"]:
            names[1] = self.embedding
        if len(names) > 3 and names[:2] == ["model", "layers"]:
            names[3] = {"mlp": self.block, "self_attn": self.attention}.get(names[3], names[3])
        return ".".join(names)

    def router_logits(self, block: Any, x: torch.Tensor) -> torch.Tensor:
        """The router's logits of `x` by the block's own gate (GPT-OSS's returns no bias: a tensor)."""
        out = getattr(block, self.gate)(x)
        return out[0] if isinstance(out, tuple) else out

    def check_config(self, model_type: str, config: Any, where: Any) -> None:
        """BackendError, in one sentence, where the checkpoint's config lacks a field vLLM's model reads."""
        missing = [name for name in self.needs if not hasattr(config, name)]
        if missing:
            raise BackendError(
                f"--hw vllm: vLLM's {self.model_file}.py reads {', '.join(missing)} from the config.json of {where}, "
                f"which has no such field (the released {model_type} checkpoints have it): add it to config.json"
            )


ARCHS = {
    "qwen3_moe": VllmArch("qwen3_moe", "mlp"),
    "mixtral": VllmArch("mixtral", "block_sparse_moe"),
    # GPT-OSS: attention with learned sinks (`attn.sinks`), YaRN rotary, sliding-window layers (even ones);
    # router with a bias; experts with biases and the clamped SwiGLU (vLLM's `swigluoai` activation)
    "gpt_oss": VllmArch("gpt_oss", "mlp", gate="router", attention="attn", embedding="embedding", rotary_half=True),
    # MiniMax-M2: q/k RMSNorm over all heads, partial rotary (`rotary_dim`), sigmoid routing with
    # `e_score_correction_bias` (vLLM has the parameter only where config.json says `use_routing_bias: true`,
    # and refuses to load the checkpoint's otherwise)
    # DeepSeek-V3 (vLLM's deepseek_v2.py): MLA attention, grouped top-k with the score correction bias, shared
    # experts, dense first layers: its calls in `deepseek.DeepseekCalls`
    "deepseek_v3": VllmArch("deepseek_v2", "mlp"),
    "minimax_m2": VllmArch("minimax_m2", "block_sparse_moe", needs=("rotary_dim", "scoring_func", "use_routing_bias")),
}


def fresh_ropes() -> None:
    """vLLM keeps its rotary embeddings in a process-wide cache (`get_rope`'s `_ROPE_DICT`, keyed by their
    parameters and the dtype asked for: GPT-OSS asks float32 in every run) and a rotary embedding's forward
    casts its table to the query's dtype in place: a model built after another in the same process would
    reuse the other's table, bfloat16-rounded after a bfloat16 run. A build starts as an engine's process
    does, with none."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()


@contextlib.contextmanager
def refused(model_dir: Any) -> Iterator[None]:
    """vLLM's refusal to build its model of a checkpoint (a quantization with no kernel on this device, a
    config field its model file reads, a weight it has no parameter for) in one sentence with vLLM's own
    reason: the backend fails to start and the run stops before its first point."""
    try:
        yield
    except (NotImplementedError, AttributeError, ValueError, KeyError) as exc:
        raise BackendError(f"--hw vllm: vLLM refuses {model_dir}: {vllm_reason(exc)}") from None


@contextlib.contextmanager
def cpu_routing(point: Point, block: Callable[[], Any]) -> Iterator[None]:
    """vLLM's CPU router (`CPURouter._compute_routing`) computes softmax top-k, grouped top-k and
    sqrtsoftplus routing only, and asserts so on any other (MiniMax-M2's sigmoid top-k with its score
    correction bias): a point whose call routes on it is PointUnavailable, with vLLM's own assertion."""
    try:
        yield
    except AssertionError as exc:
        said = unroutable(exc)
        if said is None:
            raise
        router = block().experts.router
        raise PointUnavailable(
            f"{point.id}: vLLM's {type(router).__name__} cannot route this model on the CPU: {said} for "
            f"scoring_func={router.scoring_func!r}"
        ) from None
