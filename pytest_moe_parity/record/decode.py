"""Decode steps after the prefill: which to run and which to record (`--decode-steps`, `--decode-at`),
and recording them with a transformers DynamicCache."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import BadInput
from ..golden import Recorded
from ..model.calls import cache_kwarg, next_inputs
from ..points import Point, describe_steps
from .capture import GoldenRecorder


def parse_positions(text: str | Sequence[int] | None) -> list[int]:
    """`--decode-at 511,512,513` -> [511, 512, 513]; BadInput for a part that is not a position or a
    list that does not increase."""
    if text is None:
        return []
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else [str(p) for p in text]
    positions: list[int] = []
    for part in parts:
        if not part.isdigit():
            raise BadInput(
                f"--decode-at: {part!r} is not a token position; give increasing positions, e.g. 511,512,513"
            )
        n = int(part)
        if positions and n <= positions[-1]:
            raise BadInput(
                f"--decode-at {','.join(parts)}: positions must increase ({n} comes after {positions[-1]}); "
                "list each once, in order"
            )
        positions.append(n)
    if not positions:
        raise BadInput("--decode-at names no position; give increasing positions, e.g. 511,512,513")
    return positions


@dataclass(frozen=True)
class DecodePlan:
    """The decode steps of a recording: `run` greedy steps after a prefill of `prefill` tokens (step k
    feeds the token at absolute position prefill + k - 1), of which the steps in `recorded` are
    recorded as `step_k.*` points (the others are run for their cache, not stored)."""

    prefill: int
    run: int
    recorded: tuple[int, ...]

    @classmethod
    def make(cls, prefill: int, steps: int, positions: Sequence[int], context: Any) -> DecodePlan:
        """Steps 1..`steps` and those at `positions`, checked against the prefill and the model's
        context (`max_position_embeddings`): BadInput in one sentence."""
        early = [p for p in positions if p < prefill]
        if early:
            raise BadInput(
                f"--decode-at {early[0]} lies inside the prefill of {prefill} tokens (positions 0-{prefill - 1}); the "
                f"first decode step is at position {prefill}: ask for positions from {prefill} on, or a shorter prompt"
            )
        if isinstance(context, int) and context > 0 and positions and positions[-1] >= context:
            raise BadInput(
                f"--decode-at {positions[-1]} is beyond the model's context of {context} tokens "
                f"(max_position_embeddings: positions 0-{context - 1}); ask for positions below {context}"
            )
        recorded = sorted(set(range(1, steps + 1)) | {p - prefill + 1 for p in positions})
        return cls(prefill, recorded[-1] if recorded else 0, tuple(recorded))

    def position(self, step: int) -> int:
        return self.prefill + step - 1

    def describe(self) -> str:
        """`3 decode steps (positions 511-513)`, `2 of 413 decode steps (positions 100, 512)`."""
        return describe_steps(self.recorded, self.run, self.prefill)


def decode_cache(model: Any) -> Any:
    """The DynamicCache decode steps run with; BadInput where a layer's cache holds no keys and values
    (the recurrent state of a Mamba or linear-attention layer), which decode recording cannot store."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    other = sorted({type(layer).__name__ for layer in cache.layers if not isinstance(layer, DynamicLayer)})
    if other:
        raise BadInput(
            f"--decode-steps: this model's cache has {', '.join(other)} layers (a recurrent state, not keys "
            "and values); decode steps are recorded for attention KV caches only: record without --decode-steps "
            "(and --decode-at)"
        )
    return cache


def end_of_sequence(model: Any) -> list[int]:
    """The model's end-of-sequence token ids (its generation config's, else its config's); [] for none."""
    config = getattr(model, "generation_config", None)
    found = getattr(config, "eos_token_id", None)
    if found is None:
        found = getattr(model.config, "eos_token_id", None)
    ids = found if isinstance(found, list | tuple) else [found]
    return [int(i) for i in ids if isinstance(i, int)]


def record_decode(
    model: Any,
    points: list[Point],
    inputs: dict[str, torch.Tensor],
    plan: DecodePlan,
    on_group: Callable[[str, list[Recorded]], None],
    say: Callable[[str], None],
    written: Callable[[], int] = lambda: 0,
    pad_id: int | None = None,
) -> dict[str, Any]:
    """After the prefill, `plan.run` greedy decode steps with a transformers DynamicCache: the prefill
    runs again with the cache (not recorded: its points are), then each step of `plan.recorded` has its
    points recorded as `step_k.*`, the cache each module reads stored as its layer's tensors (the steps
    between are run for their cache only). Each recorded step's line says what it wrote and took, the
    first also what all the steps will (at least: each step stores the cache, which grows). Returns the
    manifest's "decode" entry: the steps run, the token fed at each (a batch's: a token per row), and
    those recorded. A padded batch decodes each row at its own position (`next_inputs`); a row of a
    batch that is fed its end-of-sequence token is finished, and is fed `pad_id` from the next step on,
    as generate() feeds it (the entry's "finished": row -> the step that fed its end of sequence; the
    steps after judge it no more)."""
    started, before = time.perf_counter(), written()
    cache = decode_cache(model)
    out = model(**inputs, use_cache=True, **{cache_kwarg(model): cache})
    padding = {k: v for k, v in inputs.items() if k in ("attention_mask", "position_ids")} or None
    rows = inputs["input_ids"].shape[0]
    order = max(p.order for p in points) + 1
    tokens: list[Any] = []
    wanted = set(plan.recorded)
    ends = end_of_sequence(model) if rows > 1 and pad_id is not None else []
    done = torch.zeros(rows, dtype=torch.bool)
    finished: dict[str, int] = {}
    for step in range(1, plan.run + 1):
        chosen = out.logits[:, -1].float().argmax(-1)
        if ends:  # a finished row is fed padding; a row fed its end of sequence now is finished
            chosen = torch.where(done.to(chosen.device), torch.full_like(chosen, int(pad_id)), chosen)
            now = torch.isin(chosen.cpu(), torch.tensor(ends)) & ~done
            finished.update({str(r): step for r in now.nonzero().flatten().tolist()})
            done |= now
        token = chosen.tolist() if rows > 1 else int(chosen[0])
        tokens.append(token)
        feed = {**next_inputs(chosen, padding), "use_cache": True}
        if step not in wanted:  # run for the cache the recorded steps read
            out = model(**feed, **{cache_kwarg(model): cache})
            continue
        step_points = [replace(p, step=step, order=order + i) for i, p in enumerate(points)]
        order += len(points)
        with GoldenRecorder(model, step_points, on_group) as rec:
            out = model(**feed, **{cache_kwarg(model): cache})
            missing = rec.finish()
        if missing:
            say(f"note: decode step {step} never called {', '.join(missing[:4])}; not recorded")
        size, seconds = (written() - before) / 1e6, time.perf_counter() - started
        ahead, n = "", len(plan.recorded)
        if step == plan.recorded[0] and n > 1:  # each step stores the cache, which grows: at least this
            ahead = f"; all {n}: at least {size * n:.1f} MB, {seconds * n:.0f} s"
        recorded = len(step_points) - len(missing)
        said = f"tokens {', '.join(map(str, token))}" if isinstance(token, list) else f"token {token}"
        say(
            f"  step_{step} (pos {plan.position(step)}): {said}, {recorded} points "
            f"[{size:.2f} MB, {seconds:.1f}s so far{ahead}]"
        )
    entry: dict[str, Any] = {"steps": plan.run, "tokens": tokens, "cache": type(cache).__name__}
    if finished:
        entry["finished"] = finished
    if len(plan.recorded) < plan.run:
        entry["recorded"] = list(plan.recorded)
    return entry
