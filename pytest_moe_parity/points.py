"""Capture points: the components, their forward order, how a point is named, and which points
are routed blocks. Point ids are built and parsed here and nowhere else.

A point id reads `embedding`, `layer_17.attention` or, for decode step 3, `step_3.layer_17.attention`,
so that `-k layer_17`, `-k router` and `-k "layer_3 and experts"` select naturally. No torch import:
the pytest plugin reads this module at startup even when it is inert."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import BadInput

# Inside one decoder layer, the parts come before the wholes that contain them, so that
# `pytest -x` stops at the smallest diverging component. This tuple *is* the forward order:
# the recorder plans points by walking it.
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

# What a whole point's replay runs inside it (of its own layer and step): where a part failed first,
# the whole shows that failure too.
PARTS = {
    "moe": ("router", "experts", "shared_experts"),
    "output": LAYER_COMPONENTS[: LAYER_COMPONENTS.index("output")],
}

ATTENTION = "attention"
ROUTER = "router"
EXPERTS = "experts"
OUTPUT = "output"  # a decoder layer's output: its last point
LOGITS = "logits"
CONFIG = "config"  # the config item: the candidate checkpoint's config against the reference's
WEIGHTS = "weights"  # the weight items: `layer_N.weights`, and `weights` for the model-level modules
# Points that contain a router: judged over the tokens whose top-k routing agrees between golden
# and candidate (a near-tie flip changes a token's output by design), so replaying them needs the
# golden router's output and, from the backend, the candidate's own routing.
ROUTED_BLOCKS = frozenset({"moe", "output"})
# Points whose output follows a router's decision: the routed blocks, and the experts, which take the
# routing as input (the golden's in isolated replay; the candidate's own in a dump or a chained run,
# where its flipped tokens are left out too).
FOLLOWS_ROUTER = ROUTED_BLOCKS | {EXPERTS}

_ID_RE = re.compile(r"^(?:step_(\d+)\.)?(?:layer_(\d+)\.)?([a-z_]+)$")


def point_id(component: str, layer: int | None = None, step: int | None = None) -> str:
    """`layer_17.attention`, `embedding`, `step_3.layer_17.attention`."""
    return in_step(component if layer is None else f"{layer_group(layer)}.{component}", step)


def weights_id(layer: int | None) -> str:
    """The weight item of a decoder layer (`layer_17.weights`), or of the model-level modules (None)."""
    return point_id(WEIGHTS, layer)


def step_prefix(step: int | None) -> str:
    """What the names of decode step `step` start with: `step_3.`; nothing for the prefill (None)."""
    return "" if step is None else f"step_{step}."


def in_step(name: str, step: int | None) -> str:
    """`name` (a point id, a layer, a dumped tensor's name) as decode step `step` calls it."""
    return step_prefix(step) + name


def describe_steps(recorded: list[int] | tuple[int, ...], run: int, prefill: int) -> str:
    """Decode steps in words, with the absolute positions of the tokens they compute (step k after a
    prefill of P tokens is at position P + k - 1): `3 decode steps (positions 511-513)`,
    `2 of 413 decode steps (positions 100, 512)`."""
    n = len(recorded)
    positions = [prefill + k - 1 for k in recorded]
    contiguous = positions == list(range(positions[0], positions[-1] + 1))
    where = f"{positions[0]}-{positions[-1]}" if contiguous and n > 1 else ", ".join(map(str, positions))
    counted = f"{n} decode step{'s' if n > 1 else ''}" if n == run else f"{n} of {run} decode steps"
    return f"{counted} (position{'s' if n > 1 else ''} {where})"


def layer_group(layer: int) -> str:
    """The name of a decoder layer as a unit: its golden file, its xdist group, its weights."""
    return f"layer_{layer}"


def parse_point_id(pid: str) -> tuple[int | None, int | None, str]:
    """`step_3.layer_17.attention` -> (3, 17, "attention"); ValueError if it is not a point id."""
    m = _ID_RE.match(pid)
    if not m or m.group(3) not in COMPONENTS:
        raise ValueError(f"not a capture point id: {pid!r}")
    step, layer, component = m.groups()
    if layer is None and component in LAYER_COMPONENTS:
        raise ValueError(f"not a capture point id: {pid!r} ({component} belongs to a layer)")
    return (int(step) if step is not None else None), (int(layer) if layer is not None else None), component


@dataclass(frozen=True)
class Point:
    """One (step, layer, component) of the model whose call is recorded and replayed."""

    component: str
    layer: int | None = None
    module: str = ""  # dotted path of the module from the model root
    order: int = 0  # position in forward order among the golden's points
    step: int | None = None  # decode step; None for the prefill
    router_kind: str | None = None  # routers and routed blocks: how the router scores experts
    score_bias: str | None = None  # dotted path of the router's score-correction bias, if any
    # Named once, when the point is made (read on every lookup, row and report line):
    id: str = field(init=False, repr=False, compare=False)  # `step_3.layer_17.attention`
    # the golden file the point is stored in: its layer, or the model-level point itself (for a
    # decode step, prefixed with it: `step_3.layer_17`)
    group: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"unknown component {self.component!r}; known: {', '.join(COMPONENTS)}")
        if (self.layer is None) != (self.component not in LAYER_COMPONENTS):
            raise ValueError(f"{self.component}: layer {self.layer!r} does not fit a {self.component} point")
        object.__setattr__(self, "id", point_id(self.component, self.layer, self.step))
        unit = layer_group(self.layer) if self.layer is not None else self.component
        object.__setattr__(self, "group", in_step(unit, self.step))

    @property
    def routed_block(self) -> bool:
        return self.component in ROUTED_BLOCKS

    @property
    def follows_router(self) -> bool:
        return self.component in FOLLOWS_ROUTER

    @property
    def router_id(self) -> str | None:
        """The id of the router whose routing this point follows (same layer and step)."""
        return point_id(ROUTER, self.layer, self.step) if self.follows_router and self.layer is not None else None

    @classmethod
    def parse(cls, pid: str, **fields: Any) -> Point:
        step, layer, component = parse_point_id(pid)
        return cls(component, layer, step=step, **fields)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **{k: v for k, v in asdict(self).items() if k not in ("id", "group")}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Point:
        """A point from its manifest entry (which also holds the recorded call)."""
        point = cls(
            data["component"],
            data.get("layer"),
            module=data.get("module", ""),
            order=int(data.get("order", 0)),
            step=data.get("step"),
            router_kind=data.get("router_kind"),
            score_bias=data.get("score_bias"),
        )
        if point.id != data.get("id", point.id):
            raise ValueError(f"point entry {data.get('id')!r} does not match its component and layer")
        return point


def is_point_template(text: str) -> bool:
    """Whether `text` is a point id, `{layer}` standing for a layer number (`layer_{layer}.attention`)."""
    try:
        parse_point_id(text.replace("{layer}", "0"))
    except ValueError:
        return False
    return True


TEMPLATE_EXAMPLES = "e.g. embedding, layer_{layer}.attention, logits"


def positive_int(text: object) -> int:
    """A whole number of at least 1 (`--decode-steps`, `--hw-option tp_degree=`, `--parity-threads`):
    the one parser of such values; ValueError saying what is wrong, each caller names its option."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected a whole number of at least 1, got {value}")
    return value


class RangeError(BadInput, ValueError):
    """A part of a list of ranges that is not a number (`kind` "number") or not LOW-HIGH with
    0 <= LOW <= HIGH (`kind` "range"): each caller says it in its own words."""

    def __init__(self, part: str, kind: str):
        super().__init__(f"{part!r} is not a {kind}")
        self.part, self.kind = part, kind


def parse_ranges(text: str) -> list[int]:
    """`1,17,20-29` -> [1, 17, 20, ..., 29], sorted, each once ([] for none); RangeError naming the
    first bad part. The one parser of such lists: layers, NeuronCores."""
    found: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        low, dash, high = part.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise RangeError(part, "number") from None
        if first < 0 or last < first:
            raise RangeError(part, "range")
        found.update(range(first, last + 1))
    return sorted(found)


def parse_layers(text: str) -> list[int]:
    """`1,17,20-29` -> [1, 17, 20, ..., 29]; ValueError naming the bad part."""
    try:
        layers = parse_ranges(text)
    except RangeError as exc:
        if exc.kind == "number":
            raise ValueError(f"{exc.part!r} is not a layer number or a range like 20-29") from None
        raise ValueError(f"{exc.part!r} is not a range of layers (expected LOW-HIGH with 0 <= LOW <= HIGH)") from None
    if not layers:
        raise ValueError(f"no layer in {text!r}; expected e.g. 1,17,20-29")
    return layers


def layers_option(text: str | None, flag: str, error: type[Exception] = ValueError) -> list[int] | None:
    """A layer option's value (`--parity-layers`, `--layers`): its layers, None where it is empty,
    else `error` saying `flag TEXT: what is wrong`."""
    if text is None or not str(text).strip():
        return None
    try:
        return parse_layers(text)
    except ValueError as exc:
        raise error(f"{flag} {text}: {exc}") from None


def describe_layers(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[str] = []
    for n in sorted(set(layers)):
        if runs and n == int(runs[-1].rpartition("-")[2]) + 1:
            runs[-1] = f"{runs[-1].partition('-')[0]}-{n}"
        else:
            runs.append(str(n))
    return ", ".join(runs)
