"""The `config` item: the candidate checkpoint's config against the reference's (the golden's
manifest holds it), field by field, before any forward runs. A field the forward reads that differs
(`norm_topk_prob`, `rms_norm_eps`, the rotary settings, expert counts and scaling) fails the item and
is named in the run's header; fields that are metadata (the transformers version, token ids, the
training-only router loss) are not compared, and a checkpoint stored in another dtype than the
reference is a conversion: said, not failed. Keys one side's transformers writes and the other's does
not are listed, not failed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compat import legacy_rope
from ..golden import GoldenStore
from ..model.checkpoint import CheckpointError, read_config
from ..points import CONFIG, Point
from ..report.rows import Row, config_row, unjudged_row
from .checks import Checker, CheckerSetup, Option

# What a config holds that no forward reads: how it was written, how it is loaded, token ids,
# training-only settings and the label maps of other heads.
NOT_READ = frozenset(
    [
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        "auto_map",
        "torch_dtype",
        "dtype",
        "use_cache",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "output_router_logits",
        "router_aux_loss_coef",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "chunk_size_feed_forward",
        "problem_type",
        "is_encoder_decoder",
        "tokenizer_class",
        "attention_dropout",
    ]
)
FIELDS_SHOWN = 8  # differing fields named in the header line


@dataclass(frozen=True)
class ConfigEntry:
    """The config item: before every other item."""

    order: float
    kind = CONFIG
    layer = None
    group = None

    @property
    def id(self) -> str:
        return CONFIG


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A config's fields as compared: the rotary settings under one spelling (transformers 5's
    `rope_parameters` and 4.x's `rope_theta`/`rope_scaling` mean the same), metadata left out."""
    out = {k: v for k, v in config.items() if k not in NOT_READ}
    rope = legacy_rope(config)
    if rope:
        out.pop("rope_parameters", None)
        out.update(rope)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)


def field_differences(golden: dict[str, Any], candidate: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the fields both configs hold with other values, "name: GOLDEN → CANDIDATE"; the fields only one
    holds, "name: only in the golden's (VALUE)")."""
    g, c = _comparable(golden), _comparable(candidate)
    differ = [f"{k}: {_shown(g[k])} → {_shown(c[k])}" for k in sorted(g.keys() & c.keys()) if not _same(g[k], c[k])]
    only = [f"{k}: only in the golden's ({_shown(g[k])})" for k in sorted(g.keys() - c.keys()) if g[k] is not None]
    only += [f"{k}: only in the candidate's ({_shown(c[k])})" for k in sorted(c.keys() - g.keys()) if c[k] is not None]
    return differ, only


class ConfigItems(Checker):
    """The `config` item of a run whose candidate is a checkpoint: its config.json against the
    golden's record of the reference's config."""

    kind = CONFIG
    options = (
        Option("--no-parity-config", "parity_config", {"action": "store_false", "default": True},
               "no config item (by default the candidate checkpoint's config.json is checked against the reference's, "
               "field by field, before any forward)"),
    )  # fmt: skip

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: bool) -> ConfigItems | None:
        return config_items(setup.golden, setup.candidate_dir, list(setup.points)) if value is not False else None

    def __init__(self, golden: GoldenStore, candidate: Path, first: Point):
        self.golden, self.candidate, self._first = golden, candidate, first.id
        self.stored: str | None = None  # the candidate's stored dtype, as its config says
        try:
            config = read_config(candidate)
        except CheckpointError as exc:
            self.differ, self.only, self.error = [], [], str(exc)
        else:
            self.differ, self.only = field_differences(golden.config, config)
            self.error = None
            self.stored = config.get("dtype") or config.get("torch_dtype")

    def before(self, point: Point) -> Iterator[ConfigEntry]:
        if point.id == self._first:
            yield ConfigEntry(self.place(point, before=True))  # before the model-level weight item

    def check(self, entry: ConfigEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        notes = self._notes()
        row = config_row(entry.order, self.differ, notes)
        if self.error is not None:
            return unjudged_row(row, "error", self.error), f"{CONFIG}: {self.error}"
        if not self.differ:
            return row, None
        lines = [
            f"{CONFIG}: the candidate's config ({self.candidate / 'config.json'}) differs from the reference's "
            f"(the golden's manifest) in {len(self.differ)} field(s) the forward reads:",
            *(f"  {d}" for d in self.differ),
            *(f"  note: {n}" for n in notes),
            f"  hint: {row.hint}",
        ]
        return row, "\n".join(lines)

    def _notes(self) -> list[str]:
        notes = []
        if self.error is None and self.stored and str(self.stored).removeprefix("torch.") != self.golden.dtype:
            notes.append(
                f"stored as {self.stored}, the reference recorded in {self.golden.dtype}: a conversion, not judged here"
            )
        if self.only:
            only = "; ".join(self.only[:FIELDS_SHOWN])
            notes.append(f"fields one side's transformers writes and the other's not (not judged): {only}")
        return notes

    def unjudged_row(self, entry: Any, status: str, message: str) -> Row:
        return unjudged_row(config_row(entry.order, [], []), status, message)

    def header_lines(self) -> list[str]:
        if self.error is not None or not self.differ:
            return []
        more = f" (+{len(self.differ) - FIELDS_SHOWN} more)" if len(self.differ) > FIELDS_SHOWN else ""
        return [f"moe-parity: config differs from the golden's: {', '.join(self.differ[:FIELDS_SHOWN])}{more}"]


def config_items(golden: GoldenStore, candidate: Path | None, points: list[Point]) -> ConfigItems | None:
    """The run's config item, where the candidate is a checkpoint (a config.json beside its weights)
    other than the golden's own model (whose config the golden recorded)."""
    if candidate is None or not (candidate / "config.json").is_file() or not points:
        return None
    found = golden.local_model()
    if found is not None and found[0].resolve() == candidate.resolve():
        return None
    return ConfigItems(golden, candidate, points[0])
