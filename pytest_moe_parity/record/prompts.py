"""Several prompts recorded as one padded batch (`moe-parity golden --prompts FILE`): reading the
prompts file, and padding the rows to a compiled shape (`--padding-side`, `--pad-to`, `--batch-size`)
with the attention mask and position ids a serving stack gives the model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput

PADDING_SIDES = ("left", "right")


@dataclass(frozen=True)
class Prompt:
    """One line of a prompts file: a text to tokenize, or token ids; `source` the line's other keys,
    carried into the golden's manifest (`moe-parity prompts --from-lm-eval` writes a document's task,
    doc id and both runs' answers there)."""

    text: str | None = None
    ids: tuple[int, ...] | None = None
    source: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def label(self) -> str | None:
        """Where the prompt came from, where its line says (`arc_easy doc 17`)."""
        source = self.source or {}
        if "task" in source and "doc_id" in source:
            return f"{source['task']} doc {source['doc_id']}"
        return None

    def preview(self, width: int = 40) -> str:
        """The prompt in a few words, for the reports (`"The capital of Fra…"`, `ids 5, 17, 3, …`), after
        its label where it has one (`arc_easy doc 17: Which of…`)."""
        label = f"{self.label}: " if self.label else ""
        if self.text is not None:
            flat = " ".join(self.text.split())
            return label + (flat if len(flat) <= width else flat[: width - 1] + "…")
        ids = list(self.ids or ())
        shown = ", ".join(map(str, ids[:6]))
        return f"{label}ids {shown}{', …' if len(ids) > 6 else ''}"


def read_prompts(path: Path | str) -> list[Prompt]:
    """One prompt per line: plain text, or a JSON object with a `text` or an `ids` key (JSONL; its other
    keys kept as the prompt's `source`). Blank lines are skipped. BadInput for a file that is missing,
    empty, or has a line neither form reads."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"--prompts {path} is not a file; give one prompt per line (text, or JSONL with text or ids)")
    prompts: list[Prompt] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(Prompt(text=line))
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"--prompts {path}, line {number}: not valid JSON ({exc.msg})") from None
        text, ids = entry.get("text"), entry.get("ids")
        source = {k: v for k, v in entry.items() if k not in ("text", "ids")} or None
        if isinstance(text, str) and ids is None:
            prompts.append(Prompt(text=text, source=source))
        elif isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            prompts.append(Prompt(ids=tuple(ids), source=source))
        else:
            raise BadInput(
                f'--prompts {path}, line {number}: a JSON line needs a "text" string or an "ids" list of token ids'
            )
    if not prompts:
        raise BadInput(f"--prompts {path} holds no prompt; give one prompt per line (text, or JSONL with text or ids)")
    return prompts


@dataclass(frozen=True)
class Batch:
    """The padded batch a golden records: token ids, attention mask (1: a real token) and position
    ids per row, all `[B, T]`; which rows hold a prompt (the others are padding only)."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    position_ids: list[list[int]]
    padding_side: str
    pad_id: int
    previews: list[str]  # per prompt row
    sources: list[dict[str, Any] | None] = field(default_factory=list)  # per prompt row: its line's other keys

    @property
    def rows(self) -> int:
        return len(self.input_ids)

    @property
    def length(self) -> int:
        return len(self.input_ids[0])

    @property
    def padded(self) -> bool:
        """Whether any row holds padding."""
        return any(0 in row for row in self.attention_mask)

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The forward's inputs: input_ids, attention_mask and position_ids."""
        return {
            name: torch.tensor(rows, dtype=torch.long, device=device)
            for name, rows in (
                ("input_ids", self.input_ids),
                ("attention_mask", self.attention_mask),
                ("position_ids", self.position_ids),
            )
        }

    def manifest(self) -> dict:
        manifest = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "padding_side": self.padding_side,
            "pad_token_id": self.pad_id,
            "prompts": self.previews,
        }
        if any(self.sources):
            manifest["prompt_sources"] = self.sources
        return manifest


def prompt_ids(prompt: Prompt, n: int, tokenize: Callable[[str], list[int]] | None) -> list[int]:
    """Prompt `n`'s token ids: as given, or its text tokenized; BadInput for text without a tokenizer,
    or text that tokenizes to nothing."""
    if prompt.ids is not None:
        return list(prompt.ids)
    if tokenize is None:
        raise BadInput(
            f"--prompts: prompt {n} is text and the model has no tokenizer; give its token ids "
            '(a JSONL line {"ids": [...]})'
        )
    ids = tokenize(prompt.text or "")
    if not ids:
        raise BadInput(f"--prompts: prompt {n} ({prompt.preview()!r}) tokenizes to nothing; give a longer one")
    return ids


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted over each row's real tokens (as transformers' generate does for a padded
    batch): 0.. from a row's first real token; padding at 1."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)


def make_batch(
    prompts: list[Prompt],
    tokenize: Callable[[str], list[int]] | None,
    *,
    vocab: int,
    pad_id: int,
    padding_side: str = "right",
    pad_to: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> Batch:
    """The prompts tokenized and padded to `pad_to` tokens (default: the longest) and `batch_size` rows
    (default: one per prompt; more rows are padding only). BadInput in one sentence for ids outside the
    vocabulary, a prompt longer than `--seq-len` or `--pad-to`, more prompts than `--batch-size`."""
    if padding_side not in PADDING_SIDES:
        raise BadInput(f"--padding-side {padding_side!r}: choose left or right")
    rows: list[list[int]] = []
    for n, prompt in enumerate(prompts):
        ids = prompt_ids(prompt, n, tokenize)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise BadInput(f"--prompts: prompt {n} has token ids {bad[:5]} outside the vocabulary of {vocab} tokens")
        if seq_len is not None and len(ids) > seq_len:
            raise BadInput(
                f"--prompts: prompt {n} has {len(ids)} tokens, beyond --seq-len {seq_len}; shorten it or raise "
                "--seq-len"
            )
        rows.append(ids)
    longest = max(len(r) for r in rows)
    length = pad_to if pad_to is not None else longest
    if length < longest:
        n = max(range(len(rows)), key=lambda i: len(rows[i]))
        raise BadInput(f"--pad-to {length} is shorter than prompt {n} ({longest} tokens); pad to at least {longest}")
    size = batch_size if batch_size is not None else len(rows)
    if size < len(rows):
        raise BadInput(f"--batch-size {size} is smaller than the {len(rows)} prompts; give at least {len(rows)}")
    rows += [[] for _ in range(size - len(rows))]  # padding-only rows, as a fixed batch size runs them
    ids, mask = [], []
    for row in rows:
        pad = [pad_id] * (length - len(row))
        ids.append(pad + row if padding_side == "left" else row + pad)
        ones, zeros = [1] * len(row), [0] * len(pad)
        mask.append(zeros + ones if padding_side == "left" else ones + zeros)
    positions = positions_of(torch.tensor(mask)).tolist()
    return Batch(
        ids, mask, positions, padding_side, pad_id, [p.preview() for p in prompts], [p.source for p in prompts]
    )
