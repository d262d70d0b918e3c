"""Replay one point on the candidate and judge it: the engine shared by the pytest plugin and the
command line. `prepare` runs the candidate (its failures are the backend's errors), `judge` decides."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..backends import Backend, CandidateOutput
from ..backends.ran import merged
from ..dtypes import dtype_name
from ..errors import BackendFailure, BackendStartFailure, PointUnavailable, UnusableOutput
from ..golden import GoldenRecord, GoldenStore
from ..golden.spec import CausalRows, ParamRef
from ..host import freeze_long_lived
from ..judge.result import PointResult
from ..judge.routing import router_triple, routing_view, with_experts_call
from ..judge.tolerances import Override, Tolerance, resolve
from ..judge.verdict import Case, judge_point
from ..points import EXPERTS, LOGITS, ROUTER, Point
from ..tree import first_tensor, leaves, map_structure
from .floors import NoiseFloor, combined, combined_tokens

if TYPE_CHECKING:
    from .chain import ChainSetup

MODES = ("isolated", "chain", "both")


# -- golden inputs as the candidate receives them: cast to its dtype and device --------------------------


def _cast_input(t: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """Golden tensors to the candidate's dtype and device. Additive-mask entries at the golden
    dtype's minimum map to the candidate dtype's minimum, as the candidate would build them."""
    if isinstance(t, CausalRows):
        return t.cast(dtype, device)
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point() and t.dtype != dtype:
        low = torch.finfo(t.dtype).min
        masked = t == low
        t = t.to(dtype)
        if bool(masked.any()):
            t = t.masked_fill(masked, torch.finfo(dtype).min)
    return t.to(device)


def cast_inputs(obj: Any, dtype: torch.dtype, device: torch.device) -> Any:
    return map_structure(obj, lambda leaf: leaf if isinstance(leaf, ParamRef) else _cast_input(leaf, dtype, device))


def candidate_inputs(record: GoldenRecord, dtype: torch.dtype, device: torch.device) -> GoldenRecord:
    """The record a backend receives: the golden call with its inputs cast, and without the golden
    output and extras (what the candidate must produce is not shown to it)."""
    args, kwargs = cast_inputs(record.args, dtype, device), cast_inputs(record.kwargs, dtype, device)
    return replace(record, args=args, kwargs=kwargs, output=None, extras={})


@dataclass
class Prepared:
    """A point whose candidate output is ready to be judged: on the golden inputs (`candidate`,
    None in chain mode) and on its own chained inputs (`chained`, in chain and both modes)."""

    point: Point
    golden: GoldenRecord
    candidate: CandidateOutput | None
    chained: CandidateOutput | None = None


class ParityRunner:
    """Replays golden points on one backend. The backend starts on the first point."""

    def __init__(
        self,
        golden: GoldenStore,
        backend: Backend,
        *,
        cli_tolerances: list[Override] = (),
        ini_tolerances: list[Override] = (),
        mode: str = "isolated",
        freeze_gc: bool = False,
        steer: bool = True,
        floor: NoiseFloor | None = None,
    ):
        self.golden = golden
        self.backend = backend
        self.dtype = backend.dtype
        # the noise floor the ratios divide by (`replay.floors`): by default the candidate dtype's own
        self.floor = floor or NoiseFloor(dtype_name(self.dtype))
        self.cli_tolerances = list(cli_tolerances)
        self.ini_tolerances = list(ini_tolerances)
        self.started = False
        self.start_failure: BackendStartFailure | None = None  # what start() raised, raised again after
        self.freeze_gc = freeze_gc  # whether start() may freeze the objects alive then
        self.keeps_tokens = golden.captured_tokens is not None  # --capture-tokens: outputs kept at some tokens
        self._froze = False  # whether it did (close() thaws them)
        self._router_cache: dict[str, GoldenRecord] = {}
        self.mode = mode
        self.steer = steer  # whether a chain that can be steered is (the noise floor's free run: not)
        self.chain = None
        if mode != "isolated":
            from .chain import make_chain

            self.chain = make_chain(self.chain_setup())

    def chain_setup(self) -> ChainSetup:
        """What this runner's chain is given (the chain never holds the runner itself)."""
        from .chain import ChainSetup

        return ChainSetup(self.golden, self.backend, self.start, self.call, self.steer)

    def tolerance(self, pid: str | Point, marker: dict[str, Any] | None = None) -> tuple[Tolerance, list[str]]:
        point = pid if isinstance(pid, Point) else self.golden.point(pid)
        return resolve(
            point.id, point.component, self.dtype, marker=marker, cli=self.cli_tolerances, ini=self.ini_tolerances,
            quantized=self.floor.spec is not None,
        )  # fmt: skip

    def start(self, point: Point) -> None:
        """Start the backend before its first point. Its failure is the backend's, said once: every
        later point raises the same failure, never a second start."""
        if self.start_failure is not None:
            raise self.start_failure
        if not self.started:
            try:
                self.backend.start()
            except (PointUnavailable, KeyboardInterrupt):
                raise
            except Exception as exc:
                self.start_failure = BackendStartFailure(point.id, exc)
                raise self.start_failure from exc
            self.started = True
            self._froze = self.freeze_gc and freeze_long_lived()

    def call(
        self,
        point: Point,
        record: GoldenRecord,
        force: Callable[[Any], Any] | None = None,
        row: int | None = None,
        plan: dict[str, int] | None = None,
        parts: tuple[list[Point], dict[str, Any]] | None = None,
        state: Any = None,
    ) -> CandidateOutput:
        """The backend's output for a golden record (with `force`, its router's output replaced:
        `Backend.run_routed`; with `row`, the record is that row of the batch alone: `Backend.run_row`;
        with `plan`, the candidate built under that parallel plan: `Backend.run_plan`; with `parts`, the
        outputs of those points' modules as the call made them put in its dict: `Backend.run_parts`);
        anything it raises but `PointUnavailable` is a `BackendFailure` (an error of the backend, not a
        divergence)."""
        self.start(point)
        inputs = candidate_inputs(record, self.dtype, self.backend.device)
        try:
            if parts is not None:
                return self.backend.run_parts(point, inputs, *parts)
            if force is not None:
                return self.backend.run_routed(point, inputs, force)
            if row is not None:
                return self.backend.run_row(point, inputs, row)
            if plan is not None:
                return self.backend.run_plan(point, inputs, plan)
            if state is not None:
                return self.backend.run_state(point, inputs, state)
            return self.backend.run(point, inputs)
        except PointUnavailable:
            raise
        except Exception as exc:
            raise BackendFailure(point.id, exc) from exc

    def prepare(self, pid: str | Point) -> Prepared:
        """Read the point's golden record and run the candidate on it (isolated), and on its own
        inputs (chain)."""
        point = self.golden.point(pid)
        record = self.golden.load(point, row_masks=self.backend.row_masks)
        chained = self._chained(point)
        isolated = self.call(point, record) if self.mode != "chain" or not chained else None
        own = self.chain.output(point, record) if chained else None
        return Prepared(point, record, isolated, own)

    def _chained(self, point: Point) -> bool:
        """Whether a point gets a chained verdict: in chain and both modes, the prefill's points, and
        the decode steps' where the chain runs them (a whole-model run with its own cache); other
        decode steps are judged on the golden's inputs."""
        return self.chain is not None and (point.step is None or self.chain.decodes)

    def score_bias(self, point: Point, record: GoldenRecord) -> Any:
        """The golden's score-correction bias a point's routing is read with (sigmoid routers): a
        router's own record's, else its router's; None where there is none."""
        if point.component == ROUTER:
            return record.extras.get("score_bias")
        router = self.golden.router_of(point)
        return self.router_record(router).extras.get("score_bias") if router is not None else None

    def golden_routing(self, router: Point) -> Any:
        """The golden's routing at `router`: its record's output; for a router that gives its logits
        alone (DBRX's: its block softmaxes them, takes the top k and renormalises), those logits with
        the top-k weights and ids its layer's experts were called with: the triple the verdicts read
        (which tokens flipped), from the reference's own run."""
        out = self.router_record(router).output
        experts = self.golden.experts_of(router)
        if not isinstance(out, torch.Tensor) or experts is None:
            return out
        key = f"{experts.id}:routing"
        if key not in self._router_cache:
            record = self.golden.load(experts)
            self._router_cache[key] = record  # cleared with the router's (one layer at a time)
        record = self._router_cache[key]
        return with_experts_call(out, (*record.args, *record.kwargs.values()))

    def router_record(self, router: Point) -> GoldenRecord:
        if router.id not in self._router_cache:
            self._router_cache.clear()  # one layer at a time
            self._router_cache[router.id] = self.golden.load(router)
        return self._router_cache[router.id]

    def judge(self, prepared: Prepared, marker: dict[str, Any] | None = None) -> PointResult:
        """The verdict (both modes: the isolated one holding the chained one)."""
        point, record = prepared.point, prepared.golden
        results = [
            self.judge_output(point, record, cand, mode, marker)
            for mode, cand in (("isolated", prepared.candidate), ("chain", prepared.chained))
            if cand is not None
        ]
        result = results[0]
        if len(results) > 1:
            result.add_chained(results[1])
        return result

    def judge_output(
        self, point: Point, record: GoldenRecord, cand: CandidateOutput, mode: str, marker: dict[str, Any] | None
    ) -> PointResult:
        """One output of the candidate against the golden: in the isolated mode, the dtype's limits
        (and the noise ratio where the golden has the reference's own error); chained, the noise
        ratio (the dtype's limits where the golden has no noise figures)."""
        tol, sources = self.tolerance(point, marker)
        kept = self.keeps_tokens and point.step is None
        if kept:  # --capture-tokens: the candidate's output at the token positions the golden keeps
            cand = replace(cand, output=self.golden.keep_tokens(point, cand.output),
                           routing=self.golden.keep_tokens(point, cand.routing))  # fmt: skip
        facts = self.facts(point, self.noise_figures_for(mode))  # one read of the store
        golden_out, last_note = last_token_logits(point, record.output, cand.output, self.golden)
        if last_note:  # the golden's logits at each row's last real token: no padding, no per-token figures
            facts = replace(facts, noise=None, noise_tokens=None, padding=None)
        router, noise = facts.router, facts.noise
        golden_router = self.golden_routing(router) if router is not None and point.component != ROUTER else None
        bias = self.score_bias(point, record)
        chained = mode == "chain" and self.chain is not None
        try:
            case = Case(
                point,
                golden_out,
                cand.output,
                tol,
                self.dtype,
                config=facts.config,
                router=router,
                golden_router=golden_router,
                candidate_router=cand.routing,
                score_bias=bias,
                fixed=mode == "isolated" or noise is None,
                noise=noise,
                exclude=(self.chain.tainted(point), self.chain.tokens(point)) if chained else None,
                cache_write=_cache_write(record, cand),
                noise_tokens=facts.noise_tokens,
                padding=facts.padding,
                sequences=facts.sequences,
                floor=self.floor.scheme,
            )
            result = judge_point(case)
        except (ValueError, RuntimeError, IndexError, TypeError) as exc:
            raise BackendFailure(point.id, UnusableOutput(unusable(point, record.output, cand.output, exc))) from exc
        if mode == "isolated" and "cache_after.keys" in record.extras and cand.cache is None:
            result.notes.append("the backend does not show its KV cache: the cache write is not compared")
        if self.chain is not None and not self._chained(point):
            result.notes.append(
                f"decode steps are judged on the golden's inputs: the {self.backend.name} backend does not chain them"
            )
        if kept:
            result.notes.append(f"judged on the {self.golden.describe_captured()} the golden keeps (--capture-tokens)")
        if last_note:
            result.notes.append(last_note)
        result.mode = mode
        result.tolerance_sources = sources
        result.seconds = cand.seconds
        result.golden_dtype = facts.dtype
        result.position = facts.position
        for row, prompt in zip(result.rows, facts.prompts, strict=False):
            row.prompt = prompt
        result.backend = cand.info
        result.ran = said_ran(self.backend, point, cand)
        result.notes.extend(cand.info.get("notes", []))
        hint = cand.info.get("hint")
        if not result.passed:
            more = self.backend.explain(point, record)
            result.notes.extend(more.get("notes", []))
            hint = hint or more.get("hint")
        if not result.passed and hint:  # the backend's own evidence (e.g. its ranks') names the cause
            result.hint = hint
        return result

    def judge_between(
        self, point: Point, reference: Any, candidate: Any, routing: tuple = (None, None, None), bias: Any = None
    ) -> PointResult:
        """`candidate` judged against `reference` (two outputs of the candidate under two conditions, or
        one against the golden's) by the point's tolerance and the dtype's limits. `routing`: the point's
        router and the two runs' own routings (candidate's, reference's): a routed block's tokens that the
        two runs routed otherwise (beyond rounding) are left out, as a block's verdict leaves them."""
        router, routed, own = routing
        follows = point.follows_router and point.component != EXPERTS
        own = routing_view(own)
        golden_router = own if follows and own is not None and router_triple(own) else None
        tol, _ = self.tolerance(point)
        if point.component == ROUTER:  # a router that gives every expert's affinity: its top-k's, as both read
            reference, candidate = _topk_form(reference), _topk_form(candidate)
        case = Case(
            point, _detached(reference), _detached(candidate), tol, self.dtype, config=self.golden.config,
            router=router, golden_router=golden_router, candidate_router=routed if golden_router is not None else None,
            score_bias=bias if point.component == ROUTER or golden_router is not None else None,
        )  # fmt: skip
        try:
            return judge_point(case)
        except (ValueError, RuntimeError, IndexError, TypeError) as exc:
            raise BackendFailure(point.id, UnusableOutput(unusable(point, reference, candidate, exc))) from exc

    def noise_figures_for(self, mode: str) -> str:
        """The set of noise figures (which of the reference's own runs) a verdict in `mode` is read
        against: `"isolated"`, or the chained run steered as this chain is (`"chain"`), or free
        (`"free"`, where the golden has it)."""
        unsteered = mode == "chain" and self.chain is not None and not self.chain.steered
        figures = self.golden.unsteered_noise(self.floor.key) if unsteered else mode  # a mode's own run: its name
        return figures

    def facts(self, point: Point, figures: str) -> Any:
        """What `point` is judged with beside its record (`GoldenStore.facts`), its noise figures this run's
        floor's: a quantization floor's with the candidate dtype's own added where the floor says so."""
        facts = self.golden.facts(point, self.floor.key, figures)
        if self.floor.combine is None:
            return facts
        own = self.golden.facts(point, self.floor.combine, figures)
        return replace(
            facts,
            noise=combined(facts.noise, own.noise),
            noise_tokens=combined_tokens(facts.noise_tokens, own.noise_tokens),
        )

    def run(self, pid: str | Point, marker: dict[str, Any] | None = None) -> PointResult:
        return self.judge(self.prepare(pid), marker)

    def plan(self, points: list[Point]) -> None:
        """The points this run will prepare, in order: the backend may read their weights ahead, the
        golden computes their files' sha256s ahead (`GoldenStore.plan`)."""
        self.backend.plan(points)
        self.golden.plan(points)

    def close(self) -> None:
        self._router_cache.clear()
        try:
            if self.chain is not None:
                self.chain.close()
            self.backend.close()
        finally:
            self.golden.close()
            if self._froze:
                gc.unfreeze()
                self._froze = False


def said_ran(backend: Backend, point: Point, cand: CandidateOutput) -> dict[str, str] | None:
    """What the candidate ran for `point`: the backend's words on the call that just returned
    (`Backend.ran`) with the call's own (`CandidateOutput.ran`) over them. Saying it never fails a
    point: a backend that cannot is said to."""
    try:
        own = backend.ran(point)
    except Exception as exc:  # a third party's `ran`: its failure is a word in the row, not an error
        own = {"ran": f"not said ({type(exc).__name__}: {exc})"}
    return merged(own, cand.ran)


def _topk_form(out: Any) -> Any:
    """A router's (logits, affinities [T, E], top-k ids [T, k]) (NxDI's RouterTopK) as (logits, the
    top-k ids' affinities [T, k], ids); any other output as it is."""
    if not router_triple(out):
        return out
    logits, weights, ids = out[:3]
    if weights.shape[-1] == logits.shape[-1] and ids.shape[-1] < logits.shape[-1]:
        flat = weights.reshape(-1, weights.shape[-1]).gather(
            1, ids.reshape(-1, ids.shape[-1]).long().to(weights.device)
        )
        return (logits, flat.reshape(ids.shape), ids, *out[3:])
    return out


def _detached(obj: Any) -> Any:
    return map_structure(obj, lambda t: t.detach().to("cpu") if isinstance(t, torch.Tensor) else t)


def _cache_write(record: GoldenRecord, cand: CandidateOutput) -> tuple | None:
    """A decode step's attention: the golden's KV cache after the call and the candidate's, where the
    backend shows it (`CandidateOutput.cache`; `cpu`/`cuda` do)."""
    keys, values = record.extras.get("cache_after.keys"), record.extras.get("cache_after.values")
    if keys is None or values is None or cand.cache is None:
        return None
    return (keys, values), cand.cache


def _shapes(obj: Any) -> str:
    parts = [str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves(obj)]
    return ", ".join(parts) or "nothing"


def unusable(point: Point, golden: Any, candidate: Any, exc: BaseException) -> str:
    """Why a candidate output cannot be judged, in one sentence."""
    return (
        f"{point.id}: the candidate's output ({_shapes(candidate)}) cannot be judged against the golden's "
        f"({_shapes(golden)}): {exc}; give this point the golden's layout (or map it to another tensor)"
    )


def last_token_logits(point: Point, golden: Any, candidate: Any, store: GoldenStore) -> tuple[Any, str]:
    """A prefill's logits that the candidate gives for each row's last token only ([B, 1, V] or
    [B, V], what NxDI's context encoding returns) against the golden's [B, S, V]: the golden's at each
    row's last real token (its attention mask's last 1), and the note that says so; else the golden's
    output as it is, and "". A port that takes another index (the last position of a right-padded
    row) fails here, on the rows it got wrong."""
    g, c = first_tensor(golden), first_tensor(candidate)
    if point.component != LOGITS or point.step is not None or store.captured_tokens is not None:
        return golden, ""
    if g is None or c is None or g.dim() != 3 or g.shape[1] < 2 or c.shape[0] != g.shape[0]:
        return golden, ""
    if c.shape[-1] != g.shape[-1] or not (c.dim() == 2 or (c.dim() == 3 and c.shape[1] == 1)):
        return golden, ""
    masks = store.manifest.get("inputs", {}).get("attention_mask")
    length = g.shape[1]
    last = [max((i for i, m in enumerate(row) if m), default=length - 1) for row in masks] if masks else None
    if last is None or len(last) != g.shape[0]:
        last = [length - 1] * g.shape[0]
    picked = g[torch.arange(g.shape[0]), torch.tensor(last)]
    picked = picked.unsqueeze(1) if c.dim() == 3 else picked
    said = ", ".join(map(str, last))
    note = (
        f"last-token logits {list(c.shape)}: judged against the golden's logits at each row's last real token "
        f"(positions {said})"
    )
    return picked if isinstance(golden, torch.Tensor) else _replace_first(golden, picked), note


def _replace_first(output: Any, tensor: torch.Tensor) -> Any:
    """`output` (a tuple of tensors) with its first tensor replaced."""
    items = list(output)
    index = next(i for i, item in enumerate(items) if isinstance(item, torch.Tensor))
    items[index] = tensor
    return type(output)(items) if isinstance(output, tuple) else items
