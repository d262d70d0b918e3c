"""Chain mode: the candidate computes its own inputs, as in a real run, so a point's error is what
it inherits from the points before it plus what it introduces.

How depends on what the backend offers (`Backend.chain_kind`):

- `"model"`: the candidate runs its own whole-model forward (its own masks, positions, routing) on
  the golden's input ids, once, and every point's output is captured (`Backend.run_model`).
- `"points"`: each point is run on its golden call with every input that the golden recorded as an
  earlier point's output (or a residual sum of two) replaced by the candidate's own chained output
  of that point (compiled backends: the same graphs as the isolated run, other inputs).
- `"recorded"`: what the backend returns already is the candidate's own run (a dump).

**Routing near-ties.** A token whose top-k experts differ from the golden's at some layer (a
near-tie that rounding tipped the other way, or a real flip) follows other experts by design; from
then on its hidden state, and through attention every later token's, departs from the golden's for
reasons that are no port's bug. Where the run can be steered (the `points` chain, and whole-model
runs that accept `steer`), such a token's decoder-layer output is put back to the golden's, so the
divergence does not spread, and the token itself is left out of later verdicts; where it cannot (a
dump, a third-party whole-model run), the token and every later token of its sequence are left out.
The reference's own chained run (the noise floor) is recorded both ways: steered, for the chains
that are steered, and free (`"free"`), for those that cannot be (a dump's flips are the port's own,
as the free reference's are its own), so a verdict compares like with like, and each is judged on
the tokens both runs kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..backends import Backend, CandidateOutput
from ..errors import BackendFailure, PointUnavailable
from ..golden import GoldenRecord, GoldenStore
from ..golden.spec import Spec
from ..judge.routing import router_triple, routing_view
from ..model.calls import cache_key, output_tensors
from ..points import ROUTER, Point, layer_group
from ..tree import first_tensor, map_structure

# a streamed chain's consumer: a point, its golden record, the candidate's chained output of it
Judge = Callable[[Point, GoldenRecord, CandidateOutput], None]


@dataclass(frozen=True)
class ChainSetup:
    """What a chain is given by the runner that owns it: the golden, the backend, whether a chain that
    can be steered is (the noise floor's free run: not), and the runner's two calls it needs: start
    the backend (once), and one point's candidate output on a golden record."""

    golden: GoldenStore
    backend: Backend
    start: Callable[[Point], None]
    call: Callable[[Point, GoldenRecord], CandidateOutput]
    steer: bool = True


class Chain:
    """The candidate's chained output of each point, and the tokens its routing sent elsewhere."""

    steered = False  # whether near-tie tokens are put back to the golden's after their layer
    decodes = False  # whether the chain runs the decode steps too (else they are judged isolated)

    def __init__(self, setup: ChainSetup):
        self.setup = setup
        self.golden: GoldenStore = setup.golden
        self.backend: Backend = setup.backend
        self._taint: dict[str, list[int]] = {}  # routing point id -> tokens routed unlike the golden there
        ids = self.golden.manifest["inputs"]["input_ids"]
        self._sequences = len(ids)
        kept = self.golden.captured_tokens  # --capture-tokens: the positions a prefill point keeps
        self._seq_len = len(kept) if kept is not None else len(ids[0]) if ids else 0

    def output(self, point: Point, record: GoldenRecord) -> CandidateOutput:
        raise NotImplementedError

    # -- tokens routed unlike the golden ------------------------------------------------------------
    def _length(self, point: Point) -> int:
        """Tokens per sequence in a point's tensors: the prompt's, or the one new token of a decode step."""
        return 1 if point.step is not None else self._seq_len

    def tokens(self, point: Point) -> int:
        """How many tokens a point's tensors have a row for."""
        return self._sequences * self._length(point)

    def tainted(self, point: Point) -> list[int]:
        """Tokens left out of `point`'s chained verdict: routed unlike the golden at an earlier layer
        (and, where the run could not be steered, every later token of the same sequence)."""
        tokens: set[int] = set()
        for source in self.golden.points:  # a decode step's token: routed unlike at its own step
            if _routes(source) and _before(source, point) and source.step == point.step:
                tokens.update(self._disagreement(source))
        length = self._length(point)
        if tokens and not self.steered and length:
            first: dict[int, int] = {}
            for t in tokens:  # the first tainted position of each sequence
                seq = t // length
                first[seq] = min(first.get(seq, t), t)
            tokens = {seq * length + pos for seq, t in first.items() for pos in range(t % length, length)}
        return sorted(tokens)

    def _load(self, point: Point, **kwargs: Any) -> GoldenRecord:
        """A point's golden record, its causal mask as the backend takes it (`Backend.row_masks`)."""
        return self.golden.load(point, row_masks=self.backend.row_masks, **kwargs)

    def _disagreement(self, source: Point) -> list[int]:
        """The tokens a router point, or the router inside a routed block, routed unlike the golden
        (a compiled decoder layer may round its way to a near-tie its router point did not)."""
        if source.id not in self._taint:
            try:
                out = self.output(source, self._load(source))
            except (PointUnavailable, BackendFailure):
                self._take_disagreement(source, None, None)
            else:
                self._take_disagreement(source, out.output, out.routing)
        return self._taint[source.id]

    def _take_disagreement(self, point: Point, output: Any, routing: Any) -> None:
        """Keep a routing point's tokens routed unlike the golden for the later points' verdicts, taken
        while its output is held: a router's own output, a routed block's routing."""
        if _routes(point) and point.id not in self._taint:
            self._taint[point.id] = self.disagreement(point, output if point.component == ROUTER else routing)

    def disagreement(self, source: Point, own: Any) -> list[int]:
        """Tokens whose top-k experts in `own` (a router's output) differ from the golden router's."""
        router = source if source.component == ROUTER else self.golden.router_of(source)
        if router is None:
            return []
        own = self.golden.keep_tokens(source, own)  # (the positions a --capture-tokens golden keeps)
        tokens = routing_disagreements(self._load(router).output, own)
        padding = self.golden.padding(source)  # a padding token's routing is not judged, nor does it taint
        if padding is None or not tokens:
            return tokens
        pads = set(padding[0])
        return [t for t in tokens if t not in pads]

    def steer(self, point: Point, output: Any, routing: Any) -> Any:
        """A decoder layer's chained output with the rows of the tokens its routing sent unlike the
        golden's put back to the golden's (in the candidate's dtype); other points unchanged."""
        if point.component != "output" or routing is None:
            return output
        tokens = self.disagreement(point, routing)
        mine = first_tensor(output)
        if not tokens or mine is None:
            return output
        golden = first_tensor(self._load(point).output)
        if golden is None or golden.numel() != mine.numel():
            return output
        fixed = mine.detach().clone()
        rows = fixed.reshape(-1, fixed.shape[-1])
        rows[tokens] = golden.reshape(-1, golden.shape[-1])[tokens].to(device=rows.device, dtype=rows.dtype)
        if isinstance(output, torch.Tensor):
            return fixed
        replaced = False

        def swap(t: Any) -> Any:
            nonlocal replaced
            if t is mine and not replaced:
                replaced = True
                return fixed
            return t

        return map_structure(output, swap)

    def routing(self, point: Point, own: Any) -> Any:
        """The routing a point's chained output followed: its own (a routed block's graph gives
        it), else its router's chained output."""
        if own is not None or not point.follows_router:
            return own
        router = self.golden.router_of(point)
        if router is None:
            return None
        try:
            out = self.output(router, self._load(router)).output
        except (PointUnavailable, BackendFailure):
            return None
        return tuple(out) if isinstance(out, tuple | list) else None

    def close(self) -> None:
        pass


class ModelChain(Chain):
    """One whole-model forward of the candidate, every point captured (steered where the backend
    accepts it, `Backend.steers_chain`, and the runner does not ask for the free run)."""

    def __init__(self, setup: ChainSetup):
        super().__init__(setup)
        # a --capture-tokens golden keeps no rows to put back: its chain runs free
        can_steer = setup.steer and self.golden.captured_tokens is None
        self.steered = bool(getattr(self.backend, "steers_chain", False)) and can_steer
        self.decodes = bool(getattr(self.backend, "chains_decode", False)) and self.golden.decode_steps > 0
        self._outputs: dict[str, Any] | None = None
        self.seconds = 0.0
        # A run asks for the points in forward order: the group (layer) of the last point asked for,
        # the points whose outputs were let go since (`_let_go_before`), and whether outputs are
        # being let go or streamed (a point asked for meanwhile lets nothing go)
        self._group: str | None = None
        self._let_go: set[str] = set()
        self._holding = True

    def _steer(self, point: Point, output: Any, outputs: dict[str, Any]) -> Any:
        router = self.golden.router_of(point) if point.routed_block else None
        return self.steer(point, output, outputs.get(router.id) if router is not None else None)

    def _run(self) -> dict[str, Any]:
        if self._outputs is None:
            self._outputs = self._forward()
        return self._outputs

    def _forward(self, **seen: Any) -> dict[str, Any]:
        """The candidate's whole-model run on the golden's input ids (its batch's mask and positions,
        and the decode steps where the backend chains them), steered where the chain is."""
        ids = torch.tensor(self.golden.manifest["inputs"]["input_ids"], dtype=torch.long)
        self.setup.start(self.golden.points[0])
        started = time.perf_counter()
        extra = {"decode_tokens": self.golden.decode_tokens} if self.decodes else {}
        inputs = self.golden.manifest["inputs"]
        if self.golden.padded:  # the batch's mask and positions, as a serving stack passes them
            names = ("attention_mask", "position_ids")
            extra["padding"] = {k: torch.tensor(inputs[k], dtype=torch.long) for k in names}
        if self.steered:
            extra["steer"] = self._steer
        try:
            outputs = self.backend.run_model(ids, self.points, **extra, **seen)
        except (PointUnavailable, Handed):
            raise
        except Exception as exc:
            raise BackendFailure("the candidate's whole-model run", exc) from exc
        self.seconds = time.perf_counter() - started
        return outputs

    @property
    def points(self) -> list[Point]:
        """The points the whole-model run captures: the prefill's, and the decode steps' where it runs them."""
        return [p for p in self.golden.points if p.step is None or self.decodes]

    def stream(self, judge: Judge) -> None:
        """One whole-model run, each point's golden record and output handed to `judge` (in forward order) as the
        forward produces it, where the backend can (`Backend.streams_chain`): the run then holds the
        running layer's outputs, not the model's, which a judge of every point on a deep model at a
        long prompt needs (the noise floor's chained runs). Each routing point's disagreement with the
        golden is taken as it passes, for the later points' verdicts. An exception `judge` raises
        ends the run and is raised again as it was."""
        if not getattr(self.backend, "streams_chain", False):  # the whole run held, then handed over
            for point in self.points:
                if point.id in self._run():
                    self._hand(point, judge)
            self.close()
            return

        def seen(point: Point, output: Any, outputs: dict[str, Any]) -> None:
            self._outputs = outputs  # what the running layer produced so far
            try:
                self._hand(point, judge)
            except Exception as exc:
                raise Handed(exc) from exc

        self._holding = False  # the backend keeps the running layer's outputs alone
        try:
            self._forward(seen=seen)
        except Handed as handed:
            raise handed.__cause__ from None
        finally:
            self._holding = True
            self.close()

    def _hand(self, point: Point, judge: Judge) -> None:
        record = self._load(point)
        out = self.output(point, record)
        self._take_disagreement(point, out.output, out.routing)  # for the later points: its output will be gone
        judge(point, record, out)

    def output(self, point: Point, record: GoldenRecord) -> CandidateOutput:
        outputs = self._run()
        if point.id not in outputs and point.id in self._let_go:  # asked for again: the model runs again
            self.close()
            outputs = self._run()
        if point.id not in outputs:
            raise PointUnavailable(f"{point.id} was not called by the candidate's whole-model run")
        cache = outputs.get(cache_key(point.id))  # a decode step's attention: the cache it left
        out = CandidateOutput(outputs[point.id], self.routing(point, None), 0.0, {"chain": "model"}, cache=cache)
        if self._holding:
            self._let_go_before(point, outputs)
        return out

    def _let_go_before(self, point: Point, outputs: dict[str, Any]) -> None:
        """Once a point of a later group (layer) is asked for, the earlier groups' outputs go: a pytest
        run holds the running layer's outputs, not the model's (each routing point's disagreement with
        the golden taken first, for the later points' verdicts). One asked for again runs the model
        again."""
        if point.group == self._group:
            return
        self._group = point.group
        earlier = []
        for p in self.points:
            if p.group == point.group:
                break
            if p.id in outputs:
                earlier.append(p)
        self._holding = False  # the disagreements below ask for routers' outputs: nothing goes meanwhile
        try:
            for p in (p for p in earlier if _routes(p)):
                self._take_disagreement(p, outputs[p.id], self.routing(p, None))
        finally:
            self._holding = True
        for p in earlier:
            del outputs[p.id]
            outputs.pop(cache_key(p.id), None)
            self._let_go.add(p.id)

    def close(self) -> None:
        self._outputs = None
        self._group = None
        self._let_go.clear()


class PointChain(Chain):
    """Each point on its golden call, with the inputs that earlier points produced taken from the
    candidate's own chained outputs. Points run in forward order; asking for a later point first
    runs the ones before it."""

    steered = True

    def __init__(self, setup: ChainSetup):
        super().__init__(setup)
        self._done: dict[str, CandidateOutput | PointUnavailable | BackendFailure] = {}
        self._next = 0  # the index of the first point (in forward order) not computed yet
        self._layers: list[int] = []
        self._missing: dict[str, list[str]] = {}  # point -> inputs left golden (their origin is missing)
        self.calls = 0  # points computed: once each in a forward-order run

    def output(self, point: Point, record: GoldenRecord) -> CandidateOutput:
        index = self.golden.point_ids.index(point.id)
        if point.id not in self._done and index < self._next:  # asked again after its layer was forgotten
            self._done.clear()
            self._layers.clear()
            self._next = 0
        for earlier in self.golden.points[self._next : index + 1]:  # each point once, in forward order
            self._compute(earlier)
        self._next = max(self._next, index + 1)
        out = self._done[point.id]
        if isinstance(out, PointUnavailable | BackendFailure):
            raise out
        info = {"chain": "points"}
        if self._missing.get(point.id):
            info["notes"] = [
                f"chain: {', '.join(self._missing[point.id])} stayed golden (the point that produces it "
                "was not run by the candidate)"
            ]
        return CandidateOutput(out.output, self.routing(point, out.routing), out.seconds, info, cache=out.cache)

    def _chained(self, point: Point):
        missing = self._missing[point.id] = []

        def lookup(origin: Spec) -> torch.Tensor | None:
            if "sum" in origin:
                parts = [lookup(o) for o in origin["sum"]]
                return parts[0] + parts[1] if all(p is not None for p in parts) else None
            done = self._done.get(origin["point"])
            if isinstance(done, CandidateOutput):
                found = output_tensors(done.output)
                if origin["leaf"] < len(found):
                    return found[origin["leaf"]]
            missing.append(f"{origin['point']}.out[{origin['leaf']}]")
            return None

        return lookup

    def _compute(self, point: Point) -> None:
        self.calls += 1
        record = self._load(point, chained=self._chained(point))
        try:
            out = self.setup.call(point, record)
        except (PointUnavailable, BackendFailure) as exc:  # raised again for this point, golden for later ones
            self._done[point.id] = exc
            out = None
        else:
            out.output = self.steer(point, _to_cpu(out.output), out.routing)
            self._done[point.id] = out
        # before this layer's outputs are forgotten
        self._take_disagreement(point, *((None, None) if out is None else (out.output, out.routing)))
        self._forget_old(point)

    def _disagreement(self, source: Point) -> list[int]:
        if source.id not in self._taint:
            self.output(source, self._load(source))
        return self._taint.get(source.id, [])

    def _forget_old(self, point: Point) -> None:
        """Keep the outputs of this layer and the one before (and of model-level points)."""
        if point.layer is None or (self._layers and self._layers[-1] == point.layer):
            return
        self._layers.append(point.layer)
        for old in self._layers[:-2]:
            for pid in [p for p in self._done if p.startswith(f"{layer_group(old)}.")]:
                del self._done[pid]
        del self._layers[:-2]

    def close(self) -> None:
        self._done.clear()
        self._layers.clear()
        self._next = 0


class RecordedChain(Chain):
    """The backend's outputs are the candidate's own run already (a dump of it): its decode steps too,
    each on the cache its own prefill and earlier steps wrote."""

    def __init__(self, setup: ChainSetup):
        super().__init__(setup)
        self.decodes = self.golden.decode_steps > 0

    def output(self, point: Point, record: GoldenRecord) -> CandidateOutput:
        out = self.setup.call(point, record)
        out.info = {**out.info, "chain": "recorded"}
        return CandidateOutput(out.output, self.routing(point, out.routing), out.seconds, out.info, cache=out.cache)


class Handed(Exception):
    """What a streamed chain's judge raised, carried out of the candidate's forward unchanged."""


def _routes(point: Point) -> bool:
    """A point that makes routing decisions: a router, or a routed block (the router inside it)."""
    return point.layer is not None and (point.component == ROUTER or point.routed_block)


def _before(source: Point, point: Point) -> bool:
    """Whether a routing decision reaches `point` through the hidden states: decisions of earlier
    layers reach a layer's points; every decision reaches the model-level points after the layers."""
    if point.layer is None:
        return source.order < point.order
    return source.layer < point.layer


def routing_disagreements(golden: Any, candidate: Any) -> list[int]:
    """Tokens whose top-k expert sets differ between two router outputs (logits, weights, top-k ids)."""
    golden, candidate = routing_view(golden), routing_view(candidate)
    if not (router_triple(golden) and router_triple(candidate)):
        return []
    k = golden[2].shape[-1]
    g, c = golden[2].reshape(-1, k), candidate[2].reshape(-1, k).to("cpu")
    if g.shape != c.shape:
        return []
    return (g.sort(dim=-1).values != c.sort(dim=-1).values).any(dim=-1).nonzero().flatten().tolist()


def _to_cpu(obj: Any) -> Any:
    return map_structure(obj, lambda t: t.detach().to("cpu") if isinstance(t, torch.Tensor) else t)


def make_chain(setup: ChainSetup) -> Chain:
    kind = setup.backend.chain_kind
    return {"model": ModelChain, "points": PointChain, "recorded": RecordedChain}[kind](setup)
