"""The `cpu` and `cuda` backends: the candidate checkpoint's transformers modules, weights read
per layer on demand (see `model.lazy_model`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..golden import GoldenRecord
from ..golden.spec import resolve_params
from ..host import HeldThreads
from ..judge.routing import with_experts_call
from ..model.attention import DEFAULT_BUDGET_MIB, attention_within
from ..model.calls import (
    OutputCapture,
    cache_kwarg,
    cache_state,
    in_kept_dtype,
    next_inputs,
    with_cache_kwarg,
    with_live_caches,
)
from ..model.checkpoint import weight_map
from ..model.emulate import Emulation, QuantSpec, parse_spec
from ..model.lazy_model import LazyModel
from ..points import ATTENTION, Point
from ..tree import whole_masks
from ..words import counted
from . import Backend, BackendError, BackendSetup, CandidateOutput, HwOption, non_negative, positive_int
from .ran import Ran, compute_dtype, module_ran


class TorchBackend(Backend):
    """`--hw cpu`: the transformers model of the candidate checkpoint, in --dtype."""

    name = "cpu"
    runs_transformers_modules = True
    chain_kind = "model"
    steers_chain = True
    chains_decode = True
    streams_chain = True
    forces_routing = True
    captures_parts = True
    row_masks = True  # `run` makes a causal mask a block of query rows at a time where attention runs in blocks
    options = (
        HwOption("device", "torch device to run on, e.g. cuda:1 (default: cpu; cuda for --hw cuda)"),
        HwOption("max_layers", "decoder layers kept in memory at once (default: 2)", positive_int, 2),
        HwOption(
            "threads",
            "intra-op threads of the forwards (default: torch's, less one while the next layer is read ahead)",
            positive_int,
        ),
        HwOption(
            "attention_budget",
            f"MiB eager attention's score arrays may hold at once; a longer prompt runs the attention a block of "
            f"query rows at a time, as `moe-parity golden` records it (default: {DEFAULT_BUDGET_MIB:g}; 0: whole)",
            non_negative,
            DEFAULT_BUDGET_MIB,
        ),
        HwOption(
            "quant",
            "run the candidate under an emulated quantization, a SPEC as `moe-parity golden --noise-quant` takes it "
            "(e.g. fp8-block:128+dynamic-token+kv-fp8): its projections' weights through the scheme as each layer "
            "loads, its activations and K/V through e4m3 (--hw cpu and cuda)",
            lambda text: parse_spec(text, flag=""),
        ),
        HwOption(
            "attention",
            "the candidate's attention implementation, by transformers' name: eager (the default, as the golden "
            "records it), sdpa, flex_attention, ... (what each point ran: the report's `ran`)",
        ),
        HwOption(
            "experts",
            "the candidate's experts implementation, by transformers' name: eager (the default; dense for trace, "
            "compile and neuron: static shapes), batched_mm, grouped_mm, dense, ...",
        ),
    )
    device_type = "cpu"
    emulates = ("cpu", "cuda")  # the backends that take `quant` (hooks: nothing a trace or a compile keeps)

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        spec = self.hw_options["device"] or self.device_type
        try:
            self.device = torch.device(spec)
        except RuntimeError:
            raise BackendError(f"--hw-option device={spec}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendError(f"--hw {self.name} needs a CUDA device, and torch sees none; use --hw cpu")
            if self.device.index is not None and self.device.index >= torch.cuda.device_count():
                raise BackendError(f"device {spec} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
        if setup.model_dir is None:
            raise BackendError(f"--hw {self.name} needs a candidate checkpoint: pass --model DIR")
        try:
            self._weights = weight_map(setup.model_dir)  # the shard index only: no tensor is read
        except CheckpointError as exc:
            raise BackendError(str(exc)) from None
        check_implementations(self.hw_options["attention"], self.hw_options["experts"])
        self.lazy: LazyModel | None = None
        self._plan: list[str] = []
        self._threads = HeldThreads()  # `threads`, set for the forwards until close
        self._calls: dict[str, tuple[str | None, int | None]] = {}  # point id -> its inputs' dtypes, attention's block
        self._block: int | None = None  # the query rows per block of the last whole-model run's attention
        self.emulation: Emulation | None = None  # --hw-option quant: the candidate's quantization, emulated
        spec = self.hw_options["quant"]
        if spec is not None:
            if self.name not in self.emulates:
                raise BackendError(
                    f"--hw-option quant: a quantization is emulated on --hw cpu and cuda, not {self.name}"
                )
            self.lazy = self._lazy()  # its skeleton, on the meta device: the spec checked against it now
            self.emulation = self._emulation(spec)

    def _lazy(self) -> LazyModel:
        return LazyModel(
            self.setup.model_dir,
            dtype=self.dtype,
            device=self.device,
            trust_remote_code=self.setup.trust_remote_code,
            max_layers=self.hw_options["max_layers"],
            fit_threads=self.hw_options["threads"] is None,
            weights=self._weights,
        )

    def _emulation(self, spec: QuantSpec) -> Emulation:
        """The emulation of `spec` on the candidate's model; the weights of a checkpoint already in the
        scheme are the checkpoint's own. BackendError where the model cannot take the spec."""
        lazy = self.lazy
        assert lazy is not None
        own = lazy.dequantizer.layout.name if lazy.dequantizer is not None else None
        try:
            emulation = Emulation(spec, lazy.model, where=str(self.setup.model_dir), weights=own != spec.weights_name)
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        emulation.checkpoint_scales(list(lazy.weight_map), lambda key: read_tensor(lazy, key))
        lazy.on_load.append(emulation.quantize_unit)
        return emulation

    def start(self) -> None:
        threads = self.hw_options["threads"]
        if threads is not None:
            self._threads.set(threads)
        if self.lazy is None:
            self.lazy = self._lazy()
        config = self.lazy.model.config
        if self.hw_options["attention"]:
            config._attn_implementation = self.hw_options["attention"]
        if self.hw_options["experts"]:
            config._experts_implementation = experts_name(self.hw_options["experts"])
        self.lazy.plan(self._plan)
        if self.emulation is not None:
            self.emulation.attach()
            if self.emulation.missing():
                self._calibrate(self.emulation)

    def _calibrate(self, emulation: Emulation) -> None:
        """The static and KV scales the checkpoint lacks, computed over one forward of the golden's own
        input ids (its batch's mask and positions), the weights already through the scheme."""
        golden, lazy = self.golden, self.lazy
        assert lazy is not None
        if golden is None:
            raise BackendError(
                f"--hw-option quant={emulation.spec.name}: {len(emulation.missing())} static scales are not in the "
                "checkpoint, and there is no golden to compute them from"
            )
        inputs = golden.manifest["inputs"]
        ids = torch.tensor(inputs["input_ids"], dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        padding = {}
        if golden.padded:
            padding = {
                k: torch.tensor(inputs[k], dtype=torch.long).to(self.device) for k in ("attention_mask", "position_ids")
            }
        with emulation.calibrating(), lazy.streaming() as model, torch.no_grad(), self._attention(*ids.shape)[0]:
            model(input_ids=ids.to(self.device), use_cache=False, **padding)

    def batch_dependence(self) -> str | None:
        spec = self.emulation.spec if self.emulation is not None else None
        if spec is None or spec.batch_invariant:
            return None
        return f"--hw-option quant={spec.name}: each projection's input is rounded with one scale over the whole batch"

    def closing_lines(self, rows: list[dict[str, Any]]) -> list[str]:
        if self.emulation is None:
            return []
        spec = self.emulation.spec
        said = "; ".join([spec.describe(), *self.emulation.describe_scales()])
        return [f"candidate quantization emulated (--hw-option quant={spec.name}): {said}"]

    def _model(self) -> LazyModel:
        if self.lazy is None:
            self.start()
        assert self.lazy is not None
        return self.lazy

    def _attention(self, rows: int, tokens: int) -> tuple[contextlib.AbstractContextManager, int | None]:
        """Eager attention whole, or a block of query rows at a time where the score arrays of `rows` x
        `tokens` queries would exceed the `attention_budget` option (`model.attention`); and the rows
        per block (None: whole); another implementation (`--hw-option attention`) as it is."""
        if self.hw_options["attention"] not in (None, "eager"):
            return contextlib.nullcontext(), None
        return attention_within(self._model().model, tokens, rows, self.hw_options["attention_budget"])

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        return self._run(point, golden)

    def run_routed(self, point: Point, golden: GoldenRecord, force: Callable[[Any], Any]) -> CandidateOutput:
        return self._run(point, golden, force)

    def run_parts(
        self, point: Point, golden: GoldenRecord, parts: list[Point], seen: dict[str, Any]
    ) -> CandidateOutput:
        return self._run(point, golden, parts=(parts, seen))

    def _run(
        self,
        point: Point,
        golden: GoldenRecord,
        force: Callable[[Any], Any] | None = None,
        parts: tuple[list[Point], dict[str, Any]] | None = None,
    ) -> CandidateOutput:
        lazy = self._model()
        module = lazy.module(point.module)
        attention, block = self._attention(self.golden.sequences, self.golden.prefill_tokens)
        args, kwargs = golden.args, golden.kwargs
        if block is None:  # attention whole: its causal mask too
            args, kwargs = whole_masks(args), whole_masks(kwargs)
        args = resolve_params(args, lazy.model)
        kwargs = with_cache_kwarg(module, resolve_params(kwargs, lazy.model))
        args, kwargs, caches = with_live_caches(args, kwargs, lazy.model.config)  # decode steps
        args, kwargs = in_kept_dtype(module, args, kwargs)
        routing: list[Any] = []
        experts_call: list[Any] = []  # what a router giving its logits alone (DBRX's) had its experts called with
        handles = []
        router = self.golden.router_of(point)
        if router is not None and point.routed_block:  # the router runs inside: see its routing (or replace it)

            def seen(module: nn.Module, args: Any, out: Any) -> Any:
                routing.append(out if force is None else force(out))
                return routing[-1]

            def called(module: nn.Module, args: Any, kwargs: Any) -> None:
                experts_call.append((args, kwargs))

            handles.append(lazy.module(router.module).register_forward_hook(seen))
            experts = self.golden.experts_of(router)
            if experts is not None and experts.module != point.module:
                handles.append(lazy.module(experts.module).register_forward_pre_hook(called, with_kwargs=True))
        capture = contextlib.nullcontext()
        if parts is not None:  # the parts' outputs, as this call makes them
            capture = OutputCapture(lazy.model, parts[0], calls={p.id: self.golden.call_values(p) for p in parts[0]})
        started = time.perf_counter()
        try:
            with torch.no_grad(), attention, capture:
                output = module(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if parts is not None:
            parts[1].update(capture.outputs)
        self._calls = {point.id: (compute_dtype((args, kwargs)), block)}  # what `ran` reads: the last call's
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        cache = None
        if caches and point.component == ATTENTION:  # a decode step: what the attention wrote
            state, live = caches[0]
            cache = cache_state(live, state.layer)
        seen_routing = with_experts_call(routing[0], experts_call[0] if experts_call else None) if routing else None
        readable = isinstance(seen_routing, tuple | list)  # a lone tensor is no routing a verdict can read
        return CandidateOutput(output, tuple(seen_routing) if readable else None, seconds, cache=cache)

    def run_model(
        self,
        input_ids: torch.Tensor,
        points: list[Point],
        steer: Any = None,
        decode_tokens: list[int] | list[list[int]] = (),
        padding: dict[str, torch.Tensor] | None = None,
        seen: Any = None,
    ) -> dict[str, Any]:
        """The candidate's own forward, its layers loaded as they run (a few in memory at once), on a
        padded batch with its attention mask and position ids; with `decode_tokens`, then one step
        per token on its own DynamicCache (the golden's tokens are fed, so every step sees the same
        inputs as the golden's)."""
        from transformers import DynamicCache

        from ..model.calls import OutputCapture

        lazy = self._model()
        outputs: dict[str, Any] = {}
        blocks, self._block = self._attention(*input_ids.shape)
        golden = self.golden  # none for a scan's runs
        calls = {p.id: golden.call_values(p) for p in points} if golden is not None else {}  # of a module called twice
        with lazy.streaming() as model, torch.no_grad(), blocks:
            cache = DynamicCache(config=model.config) if decode_tokens else None
            with OutputCapture(model, [p for p in points if p.step is None], steer, seen, calls) as capture:
                padded = {k: v.to(self.device) for k, v in (padding or {}).items()}
                model(
                    input_ids=input_ids.to(self.device),
                    use_cache=cache is not None,
                    **padded,
                    **{cache_kwarg(model): cache},
                )
            outputs.update(capture.outputs)
            for step, token in enumerate(decode_tokens, 1):
                with OutputCapture(model, [p for p in points if p.step == step], steer, seen, calls) as capture:
                    chosen = torch.tensor(token if isinstance(token, list) else [token], device=self.device)
                    feed = next_inputs(chosen, padded or None)  # a padded batch: each row at its own position
                    model(**feed, use_cache=True, **{cache_kwarg(model): cache})
                outputs.update(capture.outputs)
        return outputs

    def module(self, path: str) -> nn.Module:
        return self._model().module(path)

    def ran(self, point: Point) -> Ran | None:
        """The module's class, the dtypes of its weights and of the call it was given, its attention and
        experts implementations, and the quantization emulated or dequantized: read from the model's
        skeleton (nothing is loaded for it); a point of a whole-model run has no call of its own."""
        if self.lazy is None:
            return None
        module = self.lazy.model.get_submodule(point.module)
        compute, block = self._calls.get(point.id, (None, self._block))
        attention = f"eager in blocks of {counted(block, 'query row')}" if block is not None else None
        said = module_ran(module, self.lazy.model.config, compute, attention)
        if self.emulation is not None:
            targets = self.emulation.targets
            if any(n == point.module or n.startswith(point.module + ".") for n in (*targets.linears, *targets.experts)):
                said["quant"] = f"emulated {self.emulation.spec.name}"
        dequantizer = self.lazy.dequantizer
        if dequantizer is not None and "quant" not in said and said.get("weights"):
            said["quant"] = f"dequantized from {dequantizer.layout.name}"
        return said

    def drill_call(self, point: Point, golden: GoldenRecord) -> tuple[nn.Module, list, dict, bool]:
        lazy = self._model()
        module = lazy.module(point.module)
        args = resolve_params(whole_masks(golden.args), lazy.model)  # the drill captures attention whole
        kwargs = with_cache_kwarg(module, resolve_params(whole_masks(golden.kwargs), lazy.model))
        args, kwargs, _ = with_live_caches(list(args), kwargs, lazy.model.config)  # decode steps: the past
        args, kwargs = in_kept_dtype(module, args, kwargs)
        return module, list(args), kwargs, True

    def plan(self, points: list[Point]) -> None:
        self._plan = [p.module for p in points]
        if self.lazy is not None:
            self.lazy.plan(self._plan)

    def read_stats(self) -> dict[str, Any] | None:
        if self.lazy is None:
            return None
        stats = self.lazy.stats
        return {
            "units": sorted(self.lazy.loaded_units | set(self.lazy.evicted)),
            "keys": list(stats.keys),
            "bytes": stats.bytes,
            "files": sorted(stats.files),
        }

    def close(self) -> None:
        if self.emulation is not None:
            self.emulation.detach()
        if self.lazy is not None:
            self.lazy.close()
        self._threads.restore()


def experts_name(name: str) -> str:
    """An experts implementation's name as transformers' config takes it (`dense`: this package's own,
    registered here)."""
    from .experts import DENSE
    from .experts import register as register_dense

    return register_dense() if name in ("dense", DENSE) else name


def check_implementations(attention: str | None, experts: str | None) -> None:
    """BackendError naming an attention or experts implementation transformers does not have (its lists
    cost a slow import: only for a name that is not one of the usual ones)."""
    if attention not in (None, "eager", "sdpa"):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if attention not in ALL_ATTENTION_FUNCTIONS.valid_keys():
            names = ", ".join(["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()])
            raise BackendError(f"--hw-option attention={attention}: not an attention implementation; one of {names}")
    if experts not in (None, "dense", "eager"):
        from transformers.integrations.moe import ExpertsInterface

        from .experts import DENSE

        names = ["dense", "eager", *sorted(k for k in ExpertsInterface().valid_keys() if k != DENSE)]
        if experts not in names:
            raise BackendError(
                f"--hw-option experts={experts}: not an experts implementation; one of {', '.join(names)}"
            )


def read_tensor(lazy: LazyModel, key: str) -> torch.Tensor:
    """One tensor of the checkpoint a lazy model reads (a scale: small), by its key."""
    from safetensors import safe_open

    with safe_open(str(lazy.model_dir / lazy.weight_map[key]), framework="pt") as fh:
        return fh.get_tensor(key)


class CudaBackend(TorchBackend):
    """`--hw cuda`: as `cpu`, on a CUDA device."""

    name = "cuda"
    device_type = "cuda"
