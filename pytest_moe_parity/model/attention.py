"""Eager attention a block of query rows at a time, for long prompts.

transformers' eager attention holds a layer's `batch x heads x T x T` scores (and two more arrays of
that size while it masks and normalizes them): 8 GiB per array at 16k tokens and 8 heads. Recording
must run eager attention, because a golden stores the inputs and the mask every backend replays. This
module runs the *same* eager function of the model's own modeling file on `rows` query rows at a time
(softmax is per query row, so the rows are computed exactly as eager computes them), with the mask
made a block of rows at a time as well (`LazyMask`): what the attention holds is then
`rows x T` per head, whatever T.

`chunked_attention(model, budget)` switches a loaded model to it for one forward; the golden it records
is the golden eager attention records (a mask spec, the same inputs and outputs within float32
rounding: `tests/test_long.py`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import BadInput

if TYPE_CHECKING:  # torch is imported where it runs: `moe-parity --help` reads the default budget here
    import torch

NAME = "moe_parity_chunked_eager"
SCORE_ARRAYS = 3  # the scores, the masked scores and the probabilities live at once in eager attention
DEFAULT_BUDGET_MIB = 48.0  # `moe-parity golden --attention-budget`'s default


def score_bytes(heads: int, tokens: int, rows: int = 1) -> int:
    """What eager attention's score arrays hold whole (float32) for `rows` x `tokens` queries."""
    return SCORE_ARRAYS * rows * heads * tokens * tokens * 4


class LazyMask:
    """The 4-D float mask `[B, 1, Q, K]` transformers' eager attention would be given, made a block of
    query rows at a time from the mask interface's own arguments (`rows`), or whole (`materialize`)."""

    def __init__(self, make: Callable[..., torch.Tensor | None], kwargs: dict[str, Any]) -> None:
        self._make = make
        self._kwargs = kwargs
        if "cache_position" in kwargs:  # transformers 4.x: the queries' positions
            self.q_length = len(kwargs["cache_position"])
        else:  # transformers 5.x: a length and an offset
            self.q_length = int(kwargs["q_length"])
        self.shape = (int(kwargs["batch_size"]), 1, self.q_length, int(kwargs["kv_length"]))
        self.dtype = kwargs.get("dtype") or __import__("torch").float32

    def rows(self, start: int, stop: int) -> torch.Tensor | None:
        kw = dict(self._kwargs)
        if "cache_position" in kw:
            kw["cache_position"] = kw["cache_position"][start:stop]
        else:
            kw["q_length"] = stop - start
            kw["q_offset"] = kw.get("q_offset", 0) + start
        return self._make(**kw)

    def materialize(self) -> torch.Tensor | None:
        """The whole mask, made once (a mask stored whole is then one tensor wherever it is passed)."""
        if not hasattr(self, "_whole"):
            self._whole = self.rows(0, self.q_length)
        return self._whole


def _mask_interface(**kwargs: Any) -> LazyMask | None:
    from transformers.masking_utils import eager_mask

    mask = LazyMask(eager_mask, kwargs)
    return None if mask.rows(0, 1) is None else mask


def eager_of(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The eager attention function of the modeling file that defines `module`'s class."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def query_rows(batch: int, heads: int, keys: int, budget: int) -> int:
    """How many query rows keep eager attention's score arrays within `budget` bytes (float32)."""
    return max(1, budget // (SCORE_ARRAYS * batch * heads * keys * 4))


class _Chunked:
    """The attention function registered under `NAME`: the module's eager attention on blocks of
    query rows, each with its rows of the mask; the blocks' outputs concatenated in order."""

    budget = 0

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        import torch

        from ..tree import RowMask

        eager = eager_of(module)
        if eager is None:
            raise BadInput(
                f"{type(module).__name__}: its modeling file ({type(module).__module__}) has no "
                "eager_attention_forward to run a long prompt's attention a block of query rows at a time; "
                "pass --attention-budget 0"
            )
        batch, heads, q, _ = query.shape
        rows = query_rows(batch, heads, key.shape[-2], self.budget)
        outputs = []
        for start in range(0, q, rows):
            stop = min(q, start + rows)
            if isinstance(attention_mask, RowMask):  # LazyMask, or a golden's CausalRows
                mask = attention_mask.rows(start, stop)
            elif (
                isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[2] == q
            ):
                mask = attention_mask[:, :, start:stop]
            else:  # none, or one that broadcasts over the queries
                mask = attention_mask
            out, _ = eager(module, query[:, :, start:stop], key, value, mask, **kwargs)
            outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0], None


_CHUNKED = _Chunked()


def _register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(NAME, _CHUNKED)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask_interface)


def attention_heads(config: Any) -> int:
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "num_attention_heads", 0) or 0)


def chunking(config: Any, tokens: int, rows: int, budget: int) -> int | None:
    """The query rows per block for a prefill of `rows` x `tokens` (None where eager attention's
    scores fit `budget` whole)."""
    heads = attention_heads(config)
    if heads <= 0 or score_bytes(heads, tokens, rows) <= budget:
        return None
    return query_rows(rows, heads, tokens, budget)


def budget_bytes(mib: float) -> int:
    """`--attention-budget` in bytes (0: attention whole; any budget above 0 allows one row at least)."""
    return max(1, int(mib * 2**20)) if mib > 0 else 0


def attention_within(model: torch.nn.Module, tokens: int, rows: int, mib: float) -> tuple[Any, int | None]:
    """The context `rows` x `tokens` queries of `model` run their attention in: eager attention whole
    (`contextlib.nullcontext`, None), or a block of query rows at a time where its score arrays would
    exceed `mib` MiB (`chunked_attention`, the rows per block)."""
    budget = budget_bytes(mib)
    block = chunking(model.config, tokens, rows, budget) if budget else None
    return (contextlib.nullcontext() if block is None else chunked_attention(model, budget)), block


@contextlib.contextmanager
def chunked_attention(model: torch.nn.Module, budget: int) -> Iterator[None]:
    """Run `model`'s attention as eager attention a block of query rows at a time, each block's
    score arrays within `budget` bytes."""
    _register()
    config = model.config
    before = config._attn_implementation
    _CHUNKED.budget = budget
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
