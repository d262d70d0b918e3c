"""What each point ran, as the reports say it: a row's `ran` (what `Backend.ran` and the call said: the
module's class, the dtypes of its weights and compute, the attention, experts and MoE implementations, a
compiled graph's breaks; the keys of `backends.ran`) in words (:func:`ran_words`), a run's closing line
(:func:`ran_line`: each implementation and dtype with the points that ran it), and run to run
(:class:`RanChange`, :func:`ran_changes`: `moe-parity diff` gives a point whose kernel, implementation
or dtype changed a line of its own, whatever its verdict did)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..words import counted
from .rows import Row

# the keys in the order they are said (others after them, by name); where a thing came from (a compile
# cache hit) is said but not compared run to run
ORDER = (
    "module", "weights", "compute", "stage", "attention", "experts", "moe", "router", "quant", "linear",
    "attention_backend", "dumped", "output", "graph", "compiler", "graph_breaks", "break", "graphs", "recompiles",
    "fallback", "cache",
)  # fmt: skip
PROVENANCE = ("cache",)
# what the closing line counts (the module's class is each point's own; a break's reason is long)
COUNTED = (
    "weights", "compute", "output", "attention", "experts", "moe", "router", "quant", "linear", "attention_backend",
    "graph", "compiler", "graph_breaks", "recompiles", "fallback", "cache",
)  # fmt: skip


def ordered(ran: dict[str, Any]) -> list[tuple[str, str]]:
    """A `ran` dict's items in the order they are said."""
    rank = {k: i for i, k in enumerate(ORDER)}
    return sorted(((str(k), str(v)) for k, v in ran.items()), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0]))


def ran_words(ran: dict[str, Any] | None, *, skip: tuple[str, ...] = ()) -> str:
    """`module Qwen3MoeAttention, weights bfloat16, compute bfloat16, attention eager` ("" for none)."""
    return ", ".join(f"{k} {v}" for k, v in ordered(ran or {}) if k not in skip)


def ran_of(row: Row) -> dict[str, str] | None:
    return getattr(row, "ran", None)


def ran_counts(rows: list[Row]) -> dict[str, dict[str, int]]:
    """Each implementation and dtype the points ran (`COUNTED`'s keys), with how many points (or chained
    verdicts) ran it, the most first: `{"attention": {"eager": 16}, ...}` (comparison_summary.json's `ran`)."""
    said: dict[str, dict[str, int]] = {}
    for row in rows:
        for mode_row in row.by_mode().values():
            for key, value in ordered(ran_of(mode_row) or {}):
                if key in COUNTED:
                    said.setdefault(key, {}).setdefault(value, 0)
                    said[key][value] += 1
    return {k: dict(sorted(said[k].items(), key=lambda kv: -kv[1])) for k in sorted(said, key=COUNTED.index)}


def ran_line(rows: list[Row]) -> str | None:
    """The run's closing line: each dtype and implementation the points ran, with how many points ran
    it (`ran: weights bfloat16 (9 points); compute bfloat16 (8), float32 (1); attention eager (2)`);
    None where no backend said."""
    parts, first = [], True
    for key, values in ran_counts(rows).items():
        shown = []
        for value, n in values.items():
            shown.append(f"{value} ({counted(n, 'point') if first else n})")
            first = False
        parts.append(f"{key} " + ", ".join(shown))
    return "ran: " + "; ".join(parts) if parts else None


@dataclass
class RanChange:
    """What a point ran otherwise in one mode from one report to the next: (key, old, new), "-" where
    one report does not say the key."""

    id: str
    mode: str
    changes: list[tuple[str, str, str]] = field(default_factory=list)

    def line(self) -> str:
        said = "; ".join(f"{key} {old} -> {new}" for key, old, new in self.changes)
        return f"{self.id:<28} {self.mode:<9} {said}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "mode": self.mode,
                "changes": [{"what": k, "old": o, "new": n} for k, o, n in self.changes]}  # fmt: skip


def ran_changes(old: Row, new: Row) -> list[RanChange]:
    """The modes in which `new` ran otherwise than `old` (both said what they ran; where a thing came
    from, `PROVENANCE`, aside)."""
    out = []
    old_modes, new_modes = old.by_mode(), new.by_mode()
    for mode in (m for m in new_modes if m in old_modes):
        a, b = ran_of(old_modes[mode]), ran_of(new_modes[mode])
        if not a or not b:  # a report that does not say (an older one, a backend that cannot): nothing to tell
            continue
        keys = [k for k, _ in ordered({**a, **b}) if k not in PROVENANCE]
        changes = [(k, a.get(k, "-"), b.get(k, "-")) for k in keys if a.get(k) != b.get(k)]
        if changes:
            out.append(RanChange(new.id, mode, changes))
    return out
