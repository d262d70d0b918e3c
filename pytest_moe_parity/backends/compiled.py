"""Compiled candidates: each point's module as a function of positional tensors, compiled once per
layer kind, then fed each layer's weights. Shared by the CPU twins `--hw trace` (torch.jit.trace) and
`--hw compile` (torch.compile) and by `--hw neuron` (torch_neuronx.trace): only the compile, load and
weight-swap steps differ (`CompiledBackend._compile`, `_load`, `_swap`).

- **Positional call.** The golden call (args, kwargs, nested tuples and dicts) is flattened to a
  tuple of tensors; everything else (None, flags, numbers) is closed over. Parameters the module
  received as arguments (MiniMax-M2's score bias) are inputs too, taken from the candidate. Outputs
  come back flat and are rebuilt into the module's own structure.
- **Routing.** A compiled graph cannot be hooked, so for the points that contain a router the
  wrapper returns the router's outputs as extra graph outputs, captured while tracing.
- **One graph per layer kind.** Points whose module class and source, structure (non-tensor
  attributes, parameter and buffer shapes; the layer index aside), model config, call (input shapes,
  dtypes, constants) and compile settings are equal share one graph; each layer's weights are
  swapped in before it runs.
- **A cache across runs.** Traces are saved (`torch.jit.save`) under the graph key with a JSON record
  of what the key was made of and the file's sha256; a record that does not match, or a file that
  does not load, is discarded and rebuilt, never trusted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import time
import warnings
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BackendError, ParityError, PointUnavailable
from ..files import atomic_write_text
from ..golden import GoldenRecord
from ..golden.spec import named_tensor, resolve_params
from ..golden.store import sha256_file
from ..judge.routing import with_experts_call
from ..model.calls import cache_states, in_kept_dtype, with_cache_kwarg
from ..points import Point
from ..tree import flatten, unflatten
from . import Backend, BackendSetup, CandidateOutput, HwOption
from .experts import DENSE
from .experts import register as register_dense_experts
from .hf import TorchBackend
from .ran import Ran, compute_dtype

CACHE_FORMAT = 1


class NotTraceable(ParityError):
    """A point's module cannot be captured as a static graph (data-dependent control flow or shapes)."""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/pytest-moe-parity (~/.cache/pytest-moe-parity)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pytest-moe-parity"


# -- the positional call -------------------------------------------------------------------------


@dataclass
class FlatCall:
    """A recorded call as positional tensors plus the structure that rebuilds (args, kwargs)."""

    inputs: tuple[torch.Tensor, ...]
    spec: Any

    def rebuild(self, flat: tuple[torch.Tensor, ...]) -> tuple[list[Any], dict[str, Any]]:
        args, kwargs = unflatten(self.spec, flat)
        return list(args), dict(kwargs)

    def signature(self) -> dict[str, Any]:
        """What of the call a graph depends on: input shapes and dtypes, and the closed-over rest."""
        return {
            "inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in self.inputs],
            "structure": json.dumps(self.spec, sort_keys=True, default=repr),
        }


def flatten_call(args: list[Any], kwargs: dict[str, Any], resolve: Callable[[str], torch.Tensor]) -> FlatCall:
    """The tensors of a call, in order; parameters passed as arguments resolved by `resolve(name)`."""
    inputs, spec = flatten(resolve_params((list(args), dict(kwargs)), resolve))
    return FlatCall(tuple(inputs), spec)


class PointModule(nn.Module):
    """A point's module called with positional tensors only (what torch_neuronx.trace takes): it
    returns the module's output tensors, flat, then the router's outputs when `router` names the
    point's router submodule (a router that gives its logits alone, DBRX's, with the top-k weights and
    ids its `experts` submodule is called with). `out_spec` rebuilds the output structure."""

    def __init__(self, module: nn.Module, call_spec: Any, router: str | None = None, experts: str | None = None):
        super().__init__()
        self.mod = module
        self.call_spec = call_spec
        self.router = router
        self.out_spec: Any = None
        self.n_outputs = 0
        self._captured: list[Any] = []
        self._experts_call: list[Any] = []
        if router is not None:
            module.get_submodule(router).register_forward_hook(self._capture)
            if experts is not None:
                module.get_submodule(experts).register_forward_pre_hook(self._called, with_kwargs=True)

    def _capture(self, module: nn.Module, args: Any, output: Any) -> None:
        self._captured.append(output)

    def _called(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._experts_call.append((args, kwargs))

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = unflatten(self.call_spec, flat)
        self._captured.clear()
        self._experts_call.clear()
        out = self.mod(*args, **kwargs)
        leaves, self.out_spec = flatten(out)
        self.n_outputs = len(leaves)
        routing: list[torch.Tensor] = []
        if self.router is not None and self._captured:  # as the router gives it: read after the graph runs
            seen = with_experts_call(self._captured[-1], self._experts_call[-1] if self._experts_call else None)
            routing = flatten(seen)[0][:3]
        return (*leaves, *routing)


# -- what makes two points share a graph ----------------------------------------------------------

# Attributes that number a layer and change nothing a graph computes (checked by the twins' tests).
_LAYER_NUMBER = re.compile(r"(^|_)layer_(idx|id|index|number)$")


class OpModule(nn.Module):
    """One ATen op of a drill as a module of positional tensors (its other arguments closed over,
    as a point's are in `PointModule`): what a compiler is given to run the op alone."""

    def __init__(self, func: Any, call: FlatCall):
        super().__init__()
        self.func, self.call = func, call

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = self.call.rebuild(flat)
        return tuple(t.clone() for t in flatten(self.func(*args, **kwargs))[0])


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    return isinstance(value, tuple | list) and all(_plain(v) for v in value)


@functools.cache
def _source_hash(cls: type) -> str:
    try:
        text = inspect.getsource(cls)
    except (OSError, TypeError):
        text = f"{cls.__module__}.{cls.__qualname__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def module_signature(module: nn.Module) -> list[Any]:
    """Class, source, non-tensor attributes and tensor shapes of every submodule; the values of
    non-persistent buffers (they are not swapped with the weights: rotary's inv_freq, say)."""
    sig = []
    for name, sub in module.named_modules():
        cls = type(sub)
        attrs = sorted(
            (k, repr(v))
            for k, v in vars(sub).items()
            if not k.startswith("_") and k != "training" and not _LAYER_NUMBER.search(k) and _plain(v)
        )
        params = [(n, list(p.shape), str(p.dtype)) for n, p in sub.named_parameters(recurse=False)]
        buffers = []
        for n, b in sub.named_buffers(recurse=False):
            entry = [n, list(b.shape), str(b.dtype)]
            if n in sub._non_persistent_buffers_set:
                entry.append(hashlib.sha256(b.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()[:16])
            buffers.append(entry)
        sig.append([name, f"{cls.__module__}.{cls.__qualname__}", _source_hash(cls), attrs, params, buffers])
    return sig


def graph_key(module: nn.Module, call: FlatCall, router: str | None, settings: dict[str, Any]) -> tuple[str, dict]:
    """The key of the graph a point needs, and what it was made of (kept beside cached traces)."""
    made_of = {"module": module_signature(module), "call": call.signature(), "router": router, **settings}
    text = json.dumps(made_of, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32], made_of


# -- compiled graphs and their cache --------------------------------------------------------------


@dataclass
class Graph:
    """A compiled point function: positional tensors in, flat outputs (then routing) out."""

    key: str
    handle: Any  # what the backend compiled (a ScriptModule, a torch.compile'd wrapper, ...)
    out_spec: Any
    n_outputs: int
    origin: str  # "compiled" or "cache"
    compile_s: float
    state_keys: list[str]  # the names its weights go by (`mod.` + the module's own)
    weights_of: str | None = None  # the module path whose weights the graph holds
    ran: Ran = field(default_factory=dict)  # what compiling it said (`backends.ran`: compile's graph breaks)

    def rebuild(self, outputs: Any) -> tuple[Any, tuple[torch.Tensor, ...] | None]:
        flat = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        routing = flat[self.n_outputs :]
        return unflatten(self.out_spec, flat[: self.n_outputs]), (tuple(routing) if routing else None)


@dataclass
class TraceCache:
    """Saved traces under `root`: `<key>.pt` and `<key>.json` (what the key was made of, the file's
    sha256). `notes` says what was discarded and why."""

    root: Path
    notes: list[str] = field(default_factory=list)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}.pt", self.root / f"{key}.json"

    def load(self, key: str, made_of: dict[str, Any], loader: Callable[[Path], Any]) -> tuple[Any, dict] | None:
        """The cached trace and its record, or None (nothing cached, or an entry that is discarded)."""
        pt, meta = self._paths(key)
        if not pt.is_file() and not meta.is_file():
            return None
        reason = None
        try:
            record = json.loads(meta.read_text())
            if record.get("format") != CACHE_FORMAT or record.get("key") != key:
                reason = "a foreign or older record"
            elif json.dumps(record.get("made_of"), sort_keys=True) != json.dumps(
                json.loads(json.dumps(made_of, sort_keys=True, default=repr)), sort_keys=True
            ):
                reason = "a record made of something else"
            elif sha256_file(pt) != record.get("sha256"):
                reason = "a trace file that does not match its sha256"
            else:
                return loader(pt), record
        except (OSError, ValueError) as exc:
            reason = f"unreadable ({type(exc).__name__}: {exc})"
        except Exception as exc:  # the loader's own failure: torch.jit.load raises RuntimeError and more
            reason = f"a trace that does not load ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        self.notes.append(f"cache entry {key[:12]} discarded and rebuilt: {reason}")
        for path in (pt, meta):
            path.unlink(missing_ok=True)
        return None

    def save(self, key: str, made_of: dict[str, Any], saver: Callable[[Path], None], extra: dict[str, Any]) -> None:
        """Write the trace, then its record (last: an entry without a record is discarded)."""
        self.root.mkdir(parents=True, exist_ok=True)
        pt, meta = self._paths(key)
        tmp = pt.with_name(f".{pt.name}.tmp-{os.getpid()}")
        saver(tmp)
        os.replace(tmp, pt)
        record = {"format": CACHE_FORMAT, "key": key, "sha256": sha256_file(pt), "made_of": made_of, **extra}
        atomic_write_text(meta, json.dumps(record, sort_keys=True, default=repr) + "\n")


def _options_with(*extra: HwOption) -> tuple[HwOption, ...]:
    return (*TorchBackend.options, *extra)


class CompiledBackend(TorchBackend):
    """The transformers modules of the candidate checkpoint, each point compiled (see the module
    docstring). Subclasses implement `_compile` and `_swap`, and `_save`/`_load` to be cached."""

    chain_kind = "points"  # the same graphs, fed the candidate's own earlier outputs
    forces_routing = False  # a block's graph holds its router: nothing to replace between them
    run_routed = Backend.run_routed
    options = _options_with(
        HwOption("cache_dir", "where compiled graphs are kept between runs (default: ~/.cache/pytest-moe-parity)"),
    )
    cacheable = True  # traces saved with torch.jit.save

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        experts = self.hw_options["experts"] or "dense"  # checked by TorchBackend
        self.experts = DENSE if experts == "dense" else experts
        root = Path(self.hw_options["cache_dir"]).expanduser() if self.hw_options["cache_dir"] else default_cache_dir()
        self.cache_root = root.resolve()
        self.cache = TraceCache(self.cache_root / self.name)
        self.graphs: dict[str, Graph] = {}
        self._config_hash: str | None = None

    # -- what subclasses provide ----------------------------------------------------------------
    @abstractmethod
    def _compile(self, wrapper: PointModule, inputs: tuple[torch.Tensor, ...], key: str) -> Any:
        """Compile `wrapper` for these example inputs; the result is called with positional tensors."""

    @abstractmethod
    def _swap(self, handle: Any, state: dict[str, torch.Tensor]) -> None:
        """Put a layer's weights (the wrapper's state_dict names: `mod.` + the module's) in the graph."""

    def _state_keys(self, handle: Any) -> list[str]:
        """The names of the weights a compiled graph takes (what `_swap` receives)."""
        return list(handle.state_dict())

    def _save(self, handle: Any, path: Path) -> None:
        with _quiet_jit():
            torch.jit.save(handle, str(path))

    def _load(self, path: Path) -> Any:
        with _quiet_jit():
            return torch.jit.load(str(path))

    def settings(self) -> dict[str, Any]:
        """What of the backend a graph depends on (versions, dtype, flags)."""
        return {
            "backend": self.name,
            "torch": torch.__version__,
            "dtype": str(self.dtype),
            "experts": self.experts,
            "config": self._config_hash,
        }

    # -- the drill: one op at a time through the compiler ------------------------------------------
    def op_runner(self) -> Callable[[Any, list, dict], Any]:
        """Each computing op compiled alone (once per op and call signature: shapes, dtypes and the
        other arguments), views and factories run eagerly; the compiled ops are kept for the session
        (and on disk where this backend's traces are)."""
        compiled: dict[str, Any] = self.__dict__.setdefault("_ops", {})
        settings = self.settings()

        def run(node: Any, args: list, kwargs: dict) -> Any:
            if node.layout:
                return node.func(*args, **kwargs)
            # the eager call gives the outputs' structure; an op that writes its inputs writes copies
            # there, and the compiled op the inputs themselves (the replay's own copies)
            copies = [a.clone() if i in node.mutates and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
            eager = node.func(*copies, **kwargs)
            leaves, spec = flatten((list(args), dict(kwargs)))
            call = FlatCall(tuple(leaves), spec)  # what the op depends on: its op, its call's signature
            key = (
                "op-"
                + hashlib.sha256(
                    json.dumps([str(node.func), settings, call.signature()], sort_keys=True, default=repr).encode()
                ).hexdigest()[:24]
            )
            module, inputs = OpModule(node.func, call), call.inputs
            if key not in compiled:
                cached = self.cache.load(key, {"op": str(node.func)}, self._load) if self.cacheable else None
                if cached is not None:
                    compiled[key] = cached[0]
                else:
                    with torch.no_grad():
                        # compiling runs the op: on copies, or an op that writes its inputs writes twice
                        compiled[key] = self._compile(module.eval(), tuple(t.clone() for t in inputs), key)
                    if self.cacheable:
                        handle = compiled[key]
                        self.cache.save(key, {"op": str(node.func)}, lambda path: self._save(handle, path), {})
            with torch.no_grad():
                out = compiled[key](*inputs)
            return unflatten(flatten(eager)[1], out if isinstance(out, tuple | list) else (out,))

        return run

    @contextlib.contextmanager
    def drilling(self):
        """The drill captures the module as the reference runs it (eager experts, not the dense ones
        compiled for the points); each of its ops then goes through this backend's compiler."""
        config = self._model().model.config
        config._experts_implementation = "eager"
        try:
            yield
        finally:
            config._experts_implementation = self.experts

    # -- the run --------------------------------------------------------------------------------
    def start(self) -> None:
        super().start()
        assert self.lazy is not None
        register_dense_experts()
        self.lazy.model.config._experts_implementation = self.experts
        config = json.dumps(self.lazy.model.config.to_dict(), sort_keys=True, default=repr)
        self._config_hash = hashlib.sha256(config.encode()).hexdigest()[:16]

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        if cache_states(golden.args) or cache_states(golden.kwargs):
            raise PointUnavailable(
                f"{point.id} reads the KV cache: compiled decode graphs (a cache as graph inputs and "
                f"outputs) are not built yet; replay decode steps with --hw cpu or cuda"
            )
        lazy = self._model()
        module = lazy.module(point.module)
        kwargs = with_cache_kwarg(module, golden.kwargs)  # a prefill's `cache=None`, by the name it takes
        args, kwargs = in_kept_dtype(module, golden.args, kwargs)
        call = flatten_call(args, kwargs, lambda name: named_tensor(lazy.model, name))
        router = self._router_path(point)
        key, made_of = graph_key(module, call, router, self.settings())
        graph = self.graphs.get(key)
        info: dict[str, Any] = {"graph": key[:12]}
        if graph is None:
            graph = self.graphs[key] = self._graph(key, made_of, module, call, router, point)
            info.update(origin=graph.origin, compile_s=round(graph.compile_s, 3))
        else:
            info["origin"] = "reused"
        if graph.weights_of != point.module:
            with torch.no_grad():
                self._swap(graph.handle, _weights(module, graph.state_keys))
            graph.weights_of = point.module
        started = time.perf_counter()
        with torch.no_grad(), self._watch() as seen:
            outputs = graph.handle(*call.inputs)
        seconds = time.perf_counter() - started
        output, routing = graph.rebuild(outputs)
        if self.cache.notes:
            info["notes"] = self.cache.notes[:]
            self.cache.notes.clear()
        self._calls = {point.id: (compute_dtype((args, kwargs)), None)}
        ran = {"graph": self.graph_words, **graph.ran, **seen, "cache": info["origin"]}
        return CandidateOutput(output, routing, seconds, info, ran=ran)

    graph_words = "torch.jit.trace"  # how a point's graph is made, in what ran (`ran["graph"]`)

    def _watch(self) -> contextlib.AbstractContextManager[Ran]:
        """The context a compiled graph is called in, giving what the call adds to what ran (compile: its
        recompiles)."""
        return contextlib.nullcontext({})

    def _router_path(self, point: Point) -> str | None:
        """The router inside the point's module, whose outputs the graph also returns."""
        router = self.golden.router_of(point)
        if router is None or not router.module.startswith(point.module + "."):
            return None  # no router inside (the experts take the routing as input)
        return router.module.removeprefix(point.module + ".")

    def _experts_path(self, point: Point) -> str | None:
        """The experts inside the point's module beside its router (their call: a logits-only router's top-k)."""
        router = self.golden.router_of(point)
        experts = self.golden.experts_of(router) if router is not None else None
        if experts is None or not experts.module.startswith(point.module + "."):
            return None
        return experts.module.removeprefix(point.module + ".")

    def _graph(
        self, key: str, made_of: dict[str, Any], module: nn.Module, call: FlatCall, router: str | None, point: Point
    ) -> Graph:
        if self.cacheable:
            cached = self.cache.load(key, made_of, self._load)
            if cached is not None:
                handle, record = cached
                keys = self._state_keys(handle)
                return Graph(key, handle, record["out_spec"], record["n_outputs"], "cache", 0.0, keys)
        # The graph owns a copy of the module: the lazy model evicts layers as the run moves on.
        experts = self._experts_path(point) if router is not None else None
        wrapper = PointModule(copy.deepcopy(module), call.spec, router, experts).eval().requires_grad_(False)
        started = time.perf_counter()
        with torch.no_grad(), _strict_tracing(point):
            handle = self._compile(wrapper, call.inputs, key)
        compile_s = time.perf_counter() - started
        if wrapper.out_spec is None:  # the wrapper never ran: the graph is traced lazily; run it once
            with torch.no_grad():
                handle(*call.inputs)
        keys = self._state_keys(handle)
        graph = Graph(key, handle, wrapper.out_spec, wrapper.n_outputs, "compiled", compile_s, keys, point.module)
        if self.cacheable:
            extra = {"out_spec": graph.out_spec, "n_outputs": graph.n_outputs, "point": point.id}
            self.cache.save(key, made_of, lambda path: self._save(handle, path), extra)
        return graph


def _weights(module: nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """A layer's tensors under the graph's names. TorchScript keeps non-persistent buffers (rotary's
    inv_freq) in a saved trace's state_dict, so they are given too; equal by the graph key anyway."""
    tensors = {f"mod.{n}": t for n, t in (*module.named_parameters(), *module.named_buffers())}
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise BackendError(f"the compiled graph takes weights the module lacks: {', '.join(missing[:4])}")
    return {k: tensors[k] for k in keys}


@contextlib.contextmanager
def _quiet_jit():
    """torch.jit is deprecated in favour of torch.compile, and it is what torch_neuronx traces with."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


@contextlib.contextmanager
def _strict_tracing(point: Point):
    """Tracing that freezes a data-dependent branch or shape is an error of that point, not a
    silently wrong graph: torch.jit's TracerWarnings become NotTraceable."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if issubclass(w.category, torch.jit.TracerWarning):
            message = str(w.message).splitlines()[0]
            raise NotTraceable(
                f"{point.id} cannot be traced to a static graph: {message} "
                f"({Path(w.filename).name}:{w.lineno}); a data-dependent shape or branch, e.g. an experts "
                "loop over the routed tokens (use --hw-option experts=dense)"
            )


class TraceBackend(CompiledBackend):
    """`--hw trace`: each point through torch.jit.trace, the CPU twin of `--hw neuron`."""

    name = "trace"

    def _compile(self, wrapper: PointModule, inputs: tuple[torch.Tensor, ...], key: str) -> Any:
        with _quiet_jit():
            return torch.jit.trace(wrapper, inputs, check_trace=False)

    def _swap(self, handle: Any, state: dict[str, torch.Tensor]) -> None:
        handle.load_state_dict(state)


class CompileBackend(CompiledBackend):
    """`--hw compile`: each point through torch.compile (inductor, static shapes). Its cache is
    inductor's own, kept in `cache_dir/inductor`: a second run compiles from cached kernels."""

    name = "compile"
    cacheable = False
    options = (
        *CompiledBackend.options,
        HwOption(
            "compiler",
            "the torch.compile backend: a registered name (inductor, aot_eager, ...) or module:function "
            "(default: inductor)",
        ),
    )

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        self.compiler: Any = self.hw_options["compiler"] or "inductor"
        if ":" in self.compiler:
            module, _, attr = self.compiler.partition(":")
            try:
                self.compiler = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise BackendError(
                    f"--hw-option compiler={self.hw_options['compiler']}: cannot import it ({exc}); "
                    "give a registered torch.compile backend or module:function importable from here"
                ) from None

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "compiler": self.hw_options["compiler"] or "inductor"}

    def start(self) -> None:
        import torch._dynamo.config as dynamo

        # Every graph is PointModule.forward of another wrapper: past dynamo's recompile limit (8
        # entries per code object) it would silently run the rest eagerly.
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4096)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4096)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_root / "inductor")
        super().start()

    def _compile(self, wrapper: PointModule, inputs: tuple[torch.Tensor, ...], key: str) -> Any:
        compiled = torch.compile(wrapper, dynamic=False, backend=self.compiler)
        compiled(*inputs)  # torch.compile compiles on the first call
        return _Compiled(compiled, wrapper)

    graph_words = "torch.compile"

    def _graph(self, key, made_of, module, call, router, point) -> Graph:
        from torch._dynamo.utils import counters

        before = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        compiled = DynamoCounts()
        graph = super()._graph(key, made_of, module, call, router, point)
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        # neither: dynamo reused code it compiled earlier in this process for an equal module
        graph.origin = "compiled" if misses > before[1] else "cache" if hits > before[0] else "reused"
        graph.ran = {"compiler": str(self.hw_options["compiler"] or "inductor"), **compiled.said()}
        return graph

    @contextlib.contextmanager
    def _watch(self):
        counted = DynamoCounts()
        seen: Ran = {}
        yield seen
        frames = counted.frames()
        if frames:  # the guards of the graph compiled for this point failed on its own call: dynamo compiled again
            seen["recompiles"] = str(frames)

    def _state_keys(self, handle: Any) -> list[str]:
        return list(handle.wrapper.state_dict())

    def _swap(self, handle: Any, state: dict[str, torch.Tensor]) -> None:
        handle.wrapper.load_state_dict(state)  # in place: the compiled code reads the same tensors


class DynamoCounts:
    """torch._dynamo's counters from now on: the frames it converted, those it gave up on (run eagerly:
    a fallback), the graphs it made and the graph breaks with their reasons."""

    def __init__(self) -> None:
        from torch._dynamo.utils import counters

        self.counters = counters
        self.before = self._now()

    def _now(self) -> tuple[int, int, int, dict[str, int]]:
        c = self.counters
        return c["frames"]["total"], c["frames"]["ok"], c["stats"]["unique_graphs"], dict(c["graph_break"])

    def frames(self) -> int:
        return self._now()[0] - self.before[0]

    def said(self) -> Ran:
        """What was compiled since: `graph_breaks` (and the first's reason, `break`), `graphs`, `fallback`."""
        total, ok, graphs, breaks = self._now()
        new = {k: n - self.before[3].get(k, 0) for k, n in breaks.items() if n > self.before[3].get(k, 0)}
        said: Ran = {"graph_breaks": str(sum(new.values()))}
        if new:
            said["break"] = next(iter(new)).strip().splitlines()[0][:160]
        if graphs - self.before[2] > 1:
            said["graphs"] = str(graphs - self.before[2])
        failed = (total - self.before[0]) - (ok - self.before[1])
        if failed > 0:
            said["fallback"] = f"eager for {failed} frame{'s' * (failed > 1)} dynamo could not compile"
        return said


@dataclass
class _Compiled:
    """A torch.compile'd wrapper and the wrapper whose tensors it reads."""

    compiled: Callable[..., Any]
    wrapper: PointModule

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.compiled(*inputs)
