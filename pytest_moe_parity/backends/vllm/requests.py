"""The golden's batch as vLLM's requests: each row of a golden call one request of its real tokens only
(a padded batch's padding left out, as vLLM's scheduler never sees it), its real past (the golden's KV
cache slots the row's attention mask lets it see) written first into blocks of its own. The layout of
the flat token axis vLLM's modules take, the paged cache's slots of each request, and the way back to the
golden's [batch, tokens, ...] layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...golden import GoldenRecord
from ...tree import CacheState


@dataclass
class Requests:
    """`rows[r]`: the batch row of request r; `tokens[r]`: the indices (on the call's token axis) of its new
    tokens; `past[r]`: the indices (on the golden past's position axis) of the cached tokens it holds;
    `block_size`: the paged cache's. Request r's tokens, past then new, take its blocks' slots in order."""

    rows: list[int]
    tokens: list[torch.Tensor]
    past: list[torch.Tensor]
    batch: int
    length: int  # the call's tokens per row
    block_size: int
    # the positions before a request's held past (a sliding-window layer's dropped ones): their slots are
    # left empty, so the past and the new tokens take the slots of their own positions
    offset: int = 0

    @classmethod
    def of(cls, golden: GoldenRecord, past: CacheState | None, block_size: int, offset: int = 0) -> Requests:
        """The requests of a golden attention (or decoder layer) call: a row's real tokens are the keys its
        last query sees in the golden's attention mask (left or right padding alike); with no mask, all."""
        positions = golden.kwargs["position_ids"]
        batch, length = positions.shape[0], positions.shape[-1]
        held = 0 if past is None else past.keys.shape[2]
        visible = _visible(golden.kwargs.get("attention_mask"), batch, held + length, prefill=not held)
        rows, tokens, pasts = [], [], []
        for row in range(batch):
            seen = visible[row]
            # a decode step's new token runs on every row (a finished row's is fed padding: its keys and
            # values are written as the golden's are); a prefill's, only where the mask says it is real
            new = torch.arange(length) if held else seen[held:].nonzero().flatten()
            if new.numel():
                rows.append(row)
                tokens.append(new)
                pasts.append(seen[:held].nonzero().flatten())
        return cls(rows, tokens, pasts, batch, length, block_size, offset)

    @property
    def count(self) -> int:
        return len(self.rows)

    def held(self, r: int) -> int:
        return int(self.past[r].numel())

    def total(self, r: int) -> int:
        """Request r's slots up to its last new token (its offset's empty ones first)."""
        return self.offset + self.held(r) + int(self.tokens[r].numel())

    @property
    def blocks(self) -> list[int]:
        """Each request's number of blocks."""
        return [-(-self.total(r) // self.block_size) for r in range(self.count)]

    def block_table(self) -> torch.Tensor:
        """[requests, most blocks]: request r's blocks, after those of the requests before it (0 past its own)."""
        counts = self.blocks
        table = torch.zeros(self.count, max(counts, default=1), dtype=torch.int32)
        start = 0
        for r, n in enumerate(counts):
            table[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        return table

    def slots(self, r: int, start: int, end: int) -> torch.Tensor:
        """The paged cache's slots of request r's tokens start..end-1 (past then new)."""
        at = torch.arange(start, end)
        return self.block_table()[r, at // self.block_size].long() * self.block_size + at % self.block_size

    def past_slots(self) -> torch.Tensor:
        return torch.cat([self.slots(r, self.offset, self.offset + self.held(r)) for r in range(self.count)])

    def new_slots(self) -> torch.Tensor:
        return torch.cat([self.slots(r, self.offset + self.held(r), self.total(r)) for r in range(self.count)])

    @property
    def whole(self) -> bool:
        """Every token of every row runs (no padding): the flat token axis is the batch's, reshaped."""
        return self.count == self.batch and all(int(t.numel()) == self.length for t in self.tokens)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, ...] -> the requests' new tokens in order, [N, ...] (vLLM's flat token axis)."""
        if self.whole:
            return t.reshape(-1, *t.shape[2:])
        return torch.cat([t[row, index] for row, index in zip(self.rows, self.tokens, strict=True)])

    def unflat(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [batch, tokens, ...], zeros at the tokens no request ran (padding, left out of the verdict)."""
        if self.whole:
            return flat.reshape(self.batch, self.length, *flat.shape[1:])
        out = flat.new_zeros(self.batch, self.length, *flat.shape[1:])
        at = 0
        for row, index in zip(self.rows, self.tokens, strict=True):
            out[row, index] = flat[at : at + index.numel()]
            at += index.numel()
        return out

    def flat_past(self, t: torch.Tensor) -> torch.Tensor:
        """A golden past [batch, kv_heads, positions, head_dim] -> each request's held tokens in order,
        [tokens, kv_heads, head_dim] (what vLLM's cache update takes)."""
        parts = [t[row][:, index].transpose(0, 1) for row, index in zip(self.rows, self.past, strict=True)]
        return torch.cat(parts).contiguous()

    def query_start_loc(self) -> torch.Tensor:
        lengths = torch.tensor([0, *(int(t.numel()) for t in self.tokens)])
        return lengths.cumsum(0).to(torch.int32)

    def seq_lens(self) -> torch.Tensor:
        return torch.tensor([self.total(r) for r in range(self.count)], dtype=torch.int32)

    def cache_as_golden(self, read: list[tuple[torch.Tensor, torch.Tensor]], past: CacheState) -> CacheState:
        """The layer's cache after the call in the golden's layout ([batch, kv_heads, past + new, head_dim]),
        from `read` (per request, its slots' keys and values, [kv_heads, total, head_dim]): a request's held
        tokens at their past positions, its new ones after the past. The positions no request holds (the
        padding's past) are the past the call was given: vLLM never held them, so they are not in question."""
        out = []
        for which, given in enumerate((past.keys, past.values)):
            cache = torch.cat([given, given.new_zeros(*given.shape[:2], self.length, given.shape[3])], dim=2)
            for r, row in enumerate(self.rows):
                held = self.held(r)
                cache[row][:, self.past[r]] = read[r][which][:, :held].to(cache.dtype)
                cache[row][:, given.shape[2] + self.tokens[r]] = read[r][which][:, held:].to(cache.dtype)
            out.append(cache)
        return CacheState(past.layer, out[0], out[1], past.window)


def _visible(mask: torch.Tensor | None, batch: int, keys: int, prefill: bool = False) -> torch.Tensor:
    """[batch, keys] bool: each row's real keys. A 2-D mask: a padding mask, 1 where a token is real. A 4-D
    mask (additive floats or booleans): on a decode step, the keys its last query sees; on a prefill, the
    tokens whose own query sees itself and no later key (a sliding window's last query does not see the
    first tokens, which are real; a padding token's query sees nothing, or everything where the reference's
    attention unmasks fully masked rows)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4):
        return torch.ones(batch, keys, dtype=torch.bool)
    if mask.dim() == 2:  # a padding mask, 1 where a token is real
        return mask[:, -keys:].bool().cpu()
    sees = mask[:, 0, :, -keys:]
    sees = sees if sees.dtype == torch.bool else sees == 0
    if prefill and sees.shape[1] == keys:
        itself = sees.diagonal(dim1=1, dim2=2)
        later = torch.triu(sees, diagonal=1).any(-1)
        return (itself & ~later).cpu()
    return sees[:, -1].cpu()
