"""Candidate backends: the contract between the parity run and whatever runs the candidate.

A backend gives, for one capture point, the candidate's output on that point's golden inputs.
Backends are registered under the entry-point group `pytest_moe_parity.backends` (the built-in
`cpu`, `cuda` and `dump` too, in this package's `pyproject.toml`) and selected with `--hw NAME`.

Lifecycle, once per session (per xdist worker):

1. `__init__(setup)` at configure time: validate cheaply (a missing package or device, an unusable
   candidate, a bad `--hw-option`) and raise `BackendError` with one sentence: the run stops with a
   usage error before any test. No weights are read here.
2. `start()` once, before the first point: load, compile.
3. `run(point, golden)` per point (and, in chain mode, `run_model` once where `chain_kind = "model"`).
   `golden` holds the point's recorded call with every floating tensor already cast to
   `backend.dtype` and moved to `backend.device`; parameters the module received as arguments
   are `ParamRef` placeholders (resolve them with `resolve_params`). Raise `PointUnavailable` for
   a point the candidate does not have (it is skipped). Any other exception is reported as an
   error of the backend at that point, never as a divergence.
4. `close()` at the end.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..dtypes import parse_dtype
from ..errors import BackendError, PointUnavailable
from ..golden import GoldenRecord, GoldenStore
from ..golden.spec import ParamRef, resolve_params
from ..points import Point, positive_int
from ..tree import CacheState

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from torch import nn

__all__ = [
    "CHAIN_KINDS",
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendError",
    "BackendSetup",
    "CacheState",
    "CandidateOutput",
    "GoldenRecord",
    "HwOption",
    "ParamRef",
    "Point",
    "PointUnavailable",
    "backend_class",
    "on_off",
    "one_of",
    "positive_int",
    "registry",
    "resolve_params",
]

ENTRY_POINT_GROUP = "pytest_moe_parity.backends"
# How a backend takes part in a chained run (`Backend.chain_kind`): see the class's comment.
CHAIN_KINDS = ("model", "points", "recorded")


@dataclass(frozen=True)
class HwOption:
    """A setting a backend accepts as `--hw-option NAME=VALUE` (ini: `parity_hw_options`)."""

    name: str
    help: str
    parse: Callable[[str], Any] = str  # raises ValueError for a bad value
    default: Any = None


@dataclass
class BackendSetup:
    """What a backend is built from."""

    # None where the backend is built for its whole-model run alone (`moe-parity scan --hw`, which has
    # no golden): a backend with chain_kind "model" must not need it to start or for `run_model`
    golden: GoldenStore
    model_dir: Path | None  # the candidate (--model): a checkpoint, or a directory of dumped tensors
    dtype: torch.dtype | None = None  # --dtype; None: the backend's native dtype, else the golden's
    options: dict[str, str] = field(default_factory=dict)  # --hw-option values, parsed by the backend
    trust_remote_code: bool = False
    workers: int = 1  # processes running points (xdist's -n), for backends that share devices
    worker: int | None = None  # this process's index among them (None: not an xdist worker)


@dataclass
class CandidateOutput:
    """What the candidate produced for one point.

    `output` has the structure of the golden output (a tensor, or a tuple such as attention's
    `(out, attn_weights)` or a router's `(logits, weights, top_k_index)`). `routing` is for the
    points that contain a router (`moe`, `output`): the candidate's own router output
    `(logits, top_k_weights, top_k_index)` on this call. With it, tokens whose top-k experts differ
    from the golden (a near-tie can flip in bf16) are left out of the verdict and listed; without it
    every token is compared, so a single flipped token can fail a healthy block, and the failure
    text says that the backend did not expose the routing."""

    output: Any
    routing: tuple[torch.Tensor, ...] | None = None
    seconds: float = 0.0
    # What the backend says about this point, kept in its report row (compiled backends: the graph,
    # whether it was compiled, loaded from the cache or reused, and the compile seconds). Two keys are
    # read: "notes" (lines added to the row's notes) and "hint" (the cause the failure text names if
    # the point fails, in place of the component's usual one: the backend's own evidence).
    info: dict[str, Any] = field(default_factory=dict)
    # decode steps: the attention's layer of the KV cache after the call (what it wrote), where the
    # backend can show it; compared with the golden's cache write
    cache: CacheState | None = None
    # what ran for this call, where only the call can say it (compile's graph breaks): merged over
    # `Backend.ran(point)` into the point's row (`backends.ran` names the keys)
    ran: dict[str, str] | None = None


class Backend(ABC):
    """Base class of candidate backends (see the module docstring for the lifecycle)."""

    name: ClassVar[str] = "?"
    # The candidate is a transformers checkpoint: its config is checked against the golden's.
    needs_checkpoint: ClassVar[bool] = True
    # runs transformers' own modules of the golden's architecture (laid out as transformers 5 does):
    # a usage error where transformers 4 is installed (the Neuron SDK's stack)
    runs_transformers_modules: ClassVar[bool] = False
    # The settings this backend accepts through --hw-option.
    options: ClassVar[tuple[HwOption, ...]] = ()
    # How the backend takes part in a chained run (--parity-mode chain): "model": `run_model` runs
    # the candidate's own whole-model forward; "points": `run` accepts any inputs, so the run feeds
    # each point the candidate's own earlier outputs; "recorded": what `run` returns already is the
    # candidate's own run (a dump of it). None: it cannot chain. (A backend that sets `chain`, the
    # name this had in earlier development versions, is read the same.)
    chain_kind: ClassVar[str | None] = None
    steers_chain: ClassVar[bool] = False  # run_model honours `steer`
    chains_decode: ClassVar[bool] = False  # run_model takes `decode_tokens`: the steps after the prefill
    streams_chain: ClassVar[bool] = False  # run_model takes `seen`: each output handed over as it returns
    # `run` takes a golden's causal mask as a `tree.RowMask` (made a block of query rows at a time, for
    # attention run in blocks: `model.attention`) instead of a tensor; it makes it whole where it needs it
    # (`tree.whole_masks`). Off: every mask is a tensor. A subclass that defines its own `run` has it
    # off unless it sets it again.
    row_masks: ClassVar[bool] = False
    # `run_routed` replaces a router's output inside the block that calls it (--parity-routing)
    forces_routing: ClassVar[bool] = False
    # `run_parts` gives, with a point's output, those of the modules it runs inside it, from the same call
    # (layer-first's probe: `plugin.layer_first`). A subclass that defines its own `run` has it off
    # unless it sets it again.
    captures_parts: ClassVar[bool] = False
    # the parallel settings `run_plan` takes (--parity-parallel), e.g. ("tp",); none: one process
    parallel_keys: ClassVar[tuple[str, ...]] = ()
    # the serving states `run_state` runs a point's call under (--parity-state reused|prefix); none: every
    # call runs afresh, as cpu, cuda, trace and compile do (`stateless` says so in words)
    states: ClassVar[tuple[str, ...]] = ()

    # What the candidate computes in when --dtype is not given (None: the golden's dtype).
    native_dtype: torch.dtype | None = None
    # Where golden inputs are moved before `run`.
    device: torch.device = torch.device("cpu")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "chain" in cls.__dict__ and "chain_kind" not in cls.__dict__:  # the attribute's former name
            cls.chain_kind = cls.__dict__["chain"]
        if "run" in cls.__dict__ and "row_masks" not in cls.__dict__:  # a `run` of its own takes tensors
            cls.row_masks = False  # unless it says otherwise (a subclass of `cpu` that compiles, ...)
        if "run" in cls.__dict__ and "captures_parts" not in cls.__dict__:  # its `run` is not `run_parts`'
            cls.captures_parts = False

    def __init__(self, setup: BackendSetup) -> None:
        self.setup = setup
        self.golden = setup.golden
        self.hw_options = self.parse_options(setup.options)

    @classmethod
    def parse_options(cls, raw: dict[str, str]) -> dict[str, Any]:
        """The backend's options with defaults, from `--hw-option` values; BackendError on an
        unknown key or a bad value."""
        known = {o.name: o for o in cls.options}
        values = {o.name: o.default for o in cls.options}
        for key, value in raw.items():
            option = known.get(key)
            if option is None:
                accepted = f"its options: {', '.join(known)}" if known else "it takes no option"
                raise BackendError(
                    f"--hw-option {key}={value}: the {cls.name} backend has no option {key!r}; {accepted}"
                )
            try:
                values[key] = option.parse(value)
            except (ValueError, TypeError) as exc:
                raise BackendError(f"--hw-option {key}={value}: {exc}") from None
        return values

    @property
    def dtype(self) -> torch.dtype:
        """The candidate's dtype: --dtype, else the backend's native dtype, else the golden's."""
        return self.setup.dtype or self.native_dtype or parse_dtype(self.golden.dtype)

    @property
    def dtype_source(self) -> str:
        """Where the candidate's dtype comes from, for the closing lines."""
        if self.setup.dtype is not None:
            return "--dtype"
        return f"the {self.name} backend" if self.native_dtype is not None else "the golden"

    def closing_lines(self, rows: list[dict[str, Any]]) -> list[str]:
        """Lines the backend adds to the run's closing lines (given every row of the run)."""
        return []

    def start(self) -> None:  # noqa: B027 - optional hook
        """Heavy setup (loading, compiling), once, before the first point."""

    @abstractmethod
    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        """The candidate's output for `point` on the golden inputs in `golden`."""

    def run_parts(
        self, point: Point, golden: GoldenRecord, parts: list[Point], seen: dict[str, Any]
    ) -> CandidateOutput:
        """Backends with `captures_parts`: `run`, the outputs of `parts` (points whose modules run inside
        `point`'s, such as a decoder layer's components) as that call produced them put in `seen`, by
        point id."""
        raise BackendError(f"the {self.name} backend cannot show the outputs of the modules a point runs inside")

    def run_routed(self, point: Point, golden: GoldenRecord, force: Callable[[Any], Any]) -> CandidateOutput:
        """Backends with `forces_routing`: `run` of a point that contains a router (a MoE block), the
        router's output replaced by `force(its own output)` before the block goes on with it (the
        golden's expert ids, or ids and weights: `--parity-routing`); `routing` is what the block was
        given."""
        raise BackendError(f"the {self.name} backend cannot replace a router's output inside its block")

    def check_plan(self, plan: dict[str, int]) -> None:  # noqa: B027 - optional hook
        """`--parity-parallel`: BackendError saying why the candidate cannot run `plan` (its keys are
        among `parallel_keys`), e.g. a degree the model cannot be sharded by. Nothing by default."""

    def run_plan(self, point: Point, golden: GoldenRecord, plan: dict[str, int]) -> CandidateOutput:
        """Backends with `parallel_keys`: `run` of `point` with the candidate built under the parallel
        plan `plan` (e.g. {"tp": 2}), whatever the backend's own settings."""
        raise BackendError(f"the {self.name} backend runs one parallel plan only")

    def stateless(self) -> str:
        """Why this backend has no serving state for `--parity-state` to change (its items' one skip reason)."""
        return (
            f"the {self.name} backend runs each call afresh: it holds no cache slots, buffers or prefix cache "
            "from one request to the next for a state to change"
        )

    def check_state(self, state: Any) -> None:  # noqa: B027 - optional hook
        """`--parity-state`: BackendError saying why the candidate cannot be run in `state` (one of `states`, or
        a directory for a backend that holds recorded runs). Nothing by default."""

    def run_state(self, point: Point, golden: GoldenRecord, state: Any) -> CandidateOutput:
        """Backends with `states`: `run` of `point` as the candidate serves the prompt in `state` ("reused": after
        other requests in the same cache slots and buffers; "prefix": on a prefix-cache hit whose keys and values
        another request wrote), its `run` being the prompt's own clean run (a fresh cache). Its `info` says the
        state in words (`info["state"]`, e.g. "after another request in slot 0"); its `cache`, where the
        backend shows it, the keys and values the point's attention read. A backend that holds recorded runs
        (a dump) takes a directory: the dump of the same prompt taken under another state."""
        raise BackendError(f"the {self.name} backend runs no serving state")

    def run_row(self, point: Point, golden: GoldenRecord, row: int) -> CandidateOutput:
        """`--parity-batch-invariance`: the candidate's output for `point` on row `row` of the golden's
        batch alone (`golden`: the point's call cut to that row's real tokens). By default `run` on that
        call; a backend that holds the candidate's runs (a dump) gives the row's own run."""
        return self.run(point, golden)

    def run_model(
        self,
        input_ids: torch.Tensor,
        points: list[Point],
        steer: Any = None,
        decode_tokens: list[int] | list[list[int]] = (),
        padding: dict[str, torch.Tensor] | None = None,
        seen: Any = None,
    ) -> dict[str, Any]:
        """Backends with `chain_kind = "model"`: the candidate's own forward on `input_ids` ([B, T]),
        building its own masks and positions (from `padding`'s `attention_mask` and `position_ids`,
        [B, T], where the golden's batch is padded: what a serving stack passes the model), and
        every point's output on it (point id -> output,
        structured as the golden's; a router's output is its routing). Backends that declare
        `steers_chain` call `steer(point, output, outputs_so_far)` as each point returns and go on
        with what it returns (it puts the rows of near-tie tokens back to the golden's). Backends
        that declare `chains_decode` then run one decode step per token of `decode_tokens` (a batch's:
        a token per row, each row at its own position: `model.calls.next_inputs`) with their own KV
        cache, masks and positions, capturing the `step_k.*` points among `points`. Backends that
        declare `streams_chain` take `seen(point, output, outputs_so_far)` too: each output handed
        over as it returns, and only the running layer's kept (`model.calls.OutputCapture`), so a
        consumer that judges as the forward goes holds one layer's outputs, not the model's."""
        raise BackendError(f"the {self.name} backend has no whole-model run")

    def module(self, path: str) -> nn.Module:
        """The candidate's torch module at a point's module path (for custom tests)."""
        raise BackendError(f"the {self.name} backend has no torch modules; use candidate.call(record)")

    def drill_call(self, point: Point, golden: GoldenRecord) -> tuple[nn.Module, list, dict, bool]:
        """`--parity-drill`: the candidate's torch module at `point`, the arguments it takes for the
        golden call in `golden` (as `run` receives it), and whether it runs the reference's own code
        (True: its ops carry the reference's module paths; False: a port's own modules, matched to
        the reference's ops by value). Its ops are captured eagerly on the backend's device; a module
        that runs elsewhere (NxDI's ranks, each a process) gives instead an object with
        `capture_ops(capture, args, kwargs, router=...)` that calls `capture` (the drill's
        `capture_ops`) where it runs and returns each rank's (graph, output), which the drill joins,
        and, optionally, `read_as`: a function of its outputs that reads them as the point does."""
        raise NotImplementedError(
            f"the {self.name} backend gives no torch modules to drill into (it implements no drill_call)"
        )

    def drilling(self) -> contextlib.AbstractContextManager:
        """`--parity-drill`: the context the candidate's module is captured in (default: none)."""
        return contextlib.nullcontext()

    def op_runner(self) -> Callable[[Any, list, dict], Any] | None:
        """`--parity-drill`: how this backend runs one captured op (`runner(node, args, kwargs)`,
        `node.func` an ATen op), where it runs ops otherwise than eagerly on its device (a
        compiler); None: the ops as captured are the candidate's."""
        return None

    def plan(self, points: list[Point]) -> None:  # noqa: B027 - optional hook
        """The points the run will ask for, in the order it asks (a backend may read ahead)."""

    def held_weights(self, layer: int | None) -> dict[str, torch.Tensor] | None:
        """The weights this backend holds for a unit (a decoder layer; None: the model-level
        modules), mapped back to the reference's names and layout, for weight items; None where it
        holds the candidate checkpoint's as transformers loads them (then the checkpoint is read)."""
        return None

    def held_quantized(self, layer: int | None) -> dict[str, Any] | None:
        """The weights this backend holds quantized for a unit, as stored (`judge.quant_weights.Stored`),
        under the reference's names, for weight items to judge within their format's rounding; None
        where it quantizes none itself."""
        return None

    def quantized_words(self) -> str | None:
        """How this backend quantizes the weights it holds, for the weight items' header (None: it does not)."""
        return None

    def ran(self, point: Point) -> dict[str, str] | None:
        """What the candidate ran for `point`'s call that just returned (its module's class, the dtypes of
        its weights and compute, the attention and experts implementations, ...: the keys of `backends.ran`),
        kept in the point's report row; None: the backend cannot say (the default)."""
        return None

    def read_stats(self) -> dict[str, Any] | None:
        """What was read from the candidate so far (reported in comparison_summary.json)."""
        return None

    def batch_dependence(self) -> str | None:
        """What in the candidate makes a row's output depend on the other rows of its batch by design (an
        activation scale shared over the batch), in words, for `--parity-batch-invariance`; None: nothing."""
        return None

    def explain(self, point: Point, golden: GoldenRecord) -> dict[str, Any]:
        """Called for a point that failed, with the golden record and its output: what more the
        backend can say (`{"notes": [...], "hint": "..."}`, as in `CandidateOutput.info`), e.g. a
        differential run it does only where something is wrong. Nothing by default."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def non_negative(text: str) -> float:
    """An HwOption parser: a number of at least 0."""
    value = float(text)
    if not value >= 0:
        raise ValueError(f"expected a number of at least 0, got {text!r}")
    return value


_SWITCH = {"on": True, "1": True, "true": True, "yes": True, "off": False, "0": False, "false": False, "no": False}


def on_off(text: str) -> bool:
    """An HwOption parser for a switch: on/off (or 1/0, true/false, yes/no)."""
    if text.lower() not in _SWITCH:
        raise ValueError(f"expected on or off, got {text!r}")
    return _SWITCH[text.lower()]


def one_of(*choices: str) -> Callable[[str], str]:
    """An HwOption parser that takes one of `choices`."""

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def plan_name(plan: dict[str, int]) -> str:
    """A parallel plan as it is spelled (`tp=2,ep=2`): on the command line, in messages, and as the name
    of the directory a dump of the run under it is in."""
    return ",".join(f"{k}={v}" for k, v in plan.items())


def parse_hw_options(items: Iterable[str]) -> dict[str, str]:
    """`KEY=VALUE` strings (later ones win) -> {KEY: VALUE}; ValueError naming a malformed one."""
    options: dict[str, str] = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--hw-option {item!r} is not KEY=VALUE (e.g. --hw-option device=cuda:1)")
        options[key.strip()] = value.strip()
    return options


_REGISTRY: dict[str, EntryPoint | type[Backend]] = {}


def registry() -> dict[str, EntryPoint | type[Backend]]:
    """Backend name -> its entry point (loaded on use) or class; read once per process."""
    if not _REGISTRY:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _REGISTRY.setdefault(ep.name, ep)
    return _REGISTRY


def backend_class(name: str) -> type[Backend]:
    """The backend registered as `name`; KeyError if there is none, BackendError if it cannot be loaded."""
    value = registry()[name]
    if not isinstance(value, type):
        try:
            value = value.load()
        except ImportError as exc:
            raise BackendError(f"backend {name!r} cannot be imported ({exc})") from None
    if not (isinstance(value, type) and issubclass(value, Backend)):
        raise BackendError(f"entry point {name!r} in {ENTRY_POINT_GROUP} is not a pytest_moe_parity Backend")
    return value
