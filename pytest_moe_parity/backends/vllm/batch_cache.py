"""`vllm-dump` of a batch golden: each decode step's KV cache, every request's read back from the engine's
paged cache, put in the golden's layout ([batch, kv_heads, positions, head_dim]).

The engine runs each row of the batch as a request of its real tokens only; the golden's cache holds its
padding's keys and values too, which the engine never computes. A request's positions go to their golden
columns (its prompt's tokens at their places in its row, decode step k at column prefill + k - 1); the
columns no request holds (the padding's) are the past the golden's step was given, as `--hw vllm` fills
them (`requests.Requests.cache_as_golden`): vLLM never held them, so they are not in question."""

from __future__ import annotations

from typing import Any

import torch

from ...golden import GoldenStore
from ...points import step_prefix
from .attention import past_of


def add_batch_caches(dump: dict[int | None, dict[str, Any]], tap: Any, golden: GoldenStore, rows: list[Any]) -> int:
    """Each decode step's cache of each layer of a batch golden, where every row is a request and the layer
    keeps every position (a sliding-window layer's cache is left out); the caches added."""
    if len(rows) != golden.sequences:  # a row of padding only ran no request: its cache is nobody's
        return 0
    wanted, width, added = set(golden.point_ids), golden.prefill_tokens, 0
    for step in golden.recorded_steps:
        for layer in golden.layers:
            pid = f"{step_prefix(step)}layer_{layer}.attention"
            past = past_of(golden.load(pid)) if pid in wanted else None
            if past is None or past.window is not None:
                continue
            name = f"layer_{layer}.attention.cache"
            found = [tap.rows_of(row.request, name).get(len(row.tokens) + step - 1) for row in rows]
            if any(f is None for f in found):
                continue
            dtype = found[0][0][0].dtype
            caches = [torch.cat([t.to(dtype), t.new_zeros(*t.shape[:2], 1, t.shape[3]).to(dtype)], 2)
                      for t in (past.keys, past.values)]  # fmt: skip
            for row, ((keys, values),) in zip(rows, found, strict=True):
                slots = torch.tensor([*row.slots, *(width + j for j in range(step))])
                for cache, read in zip(caches, (keys, values), strict=True):
                    cache[row.row][:, slots] = read[:, : slots.numel()]
            dump.setdefault(step, {}).update({f"{pid}.cache.keys": caches[0], f"{pid}.cache.values": caches[1]})
            added += 1
    return added
