"""`--hw vllm`'s backend: the candidate checkpoint built once as vLLM's own model (vLLM's config,
model class and weight loader, on the CPU or the device the installed vLLM runs on, TP 1), and each
point replayed on vLLM's submodule of it, on the golden's inputs."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ...errors import BackendError, PointUnavailable
from ...golden import GoldenRecord
from ...points import Point
from .. import Backend, BackendSetup, CandidateOutput
from .archs import ARCHS, cpu_routing, fresh_ropes, refused
from .attention import attention_context, check
from .deepseek import DeepseekCalls
from .drill import drill_call
from .imports import check_version, import_vllm, upstream_warnings, vllm_version
from .parallel import OPTIONS, Plan, Ranks, check_plan, parallel_config, rank_groups
from .quant import build_quantized, experts_words, refusal, scheme_of, vllm_reason
from .ran import vllm_ran
from .taught import as_given, for_requests, forced_words, golden_routing, logits_words, unroutable

# model_type -> the attribute of vLLM's decoder layer that holds its MoE block (its gate is its router,
# its `experts` vLLM's MoE runner: the runner's `router` selects the experts, its `routed_experts` run
# them); the other differences between vLLM's model files: `archs.ARCHS`
MOE_BLOCKS = {model_type: arch.block for model_type, arch in ARCHS.items()}
# model_type -> the calls of its points that differ from the ones here (DeepSeek-V3's MLA, dense MLP, MoE)
ARCH_CALLS = {"deepseek_v3": DeepseekCalls}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}


class VllmBackend(Backend):
    """`--hw vllm`: vLLM's own model of the golden's architecture, built from the candidate checkpoint by
    vLLM's loader (`load_weights`, `process_weights_after_loading`) and called module by module: the
    embedding, the norms, the rotary table, the router (its gate and vLLM's expert selection), the experts
    (vLLM's fused MoE on the golden's routing), the MoE block, the final norm and the logits (the lm_head
    through vLLM's logits processor), the attention and the decoder layer (`attention`)."""

    name = "vllm"
    forces_routing = True
    options = OPTIONS  # tp_degree, ep_degree: `parallel`
    parallel_keys = ("tp", "ep")

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        self.version = vllm_version()
        check_version(self.version)
        if self.golden.model_type not in MOE_BLOCKS:
            raise BackendError(
                f"--hw vllm has no module map for {self.golden.model_type} (it replays {', '.join(MOE_BLOCKS)}); "
                "compare a dump of vLLM's run with --hw dump"
            )
        if setup.model_dir is None:
            raise BackendError("--hw vllm needs the Hugging Face checkpoint vLLM loads: pass --model DIR")
        if self.dtype not in DTYPES:
            raise BackendError(f"--hw vllm runs float32, bfloat16 or float16, not {self.dtype}")
        self.arch_calls = ARCH_CALLS[self.golden.model_type](self) if self.golden.model_type in ARCH_CALLS else None
        self.parallel = Plan(self.hw_options["tp_degree"], self.hw_options["ep_degree"])
        check_plan(self.golden.config, self.parallel, "--hw-option tp_degree", "--hw-option ep_degree")
        import_vllm()
        self.arch = ARCHS[self.golden.model_type]
        self.model: Any = None
        self.build_seconds = 0.0
        self.ranks = Ranks(self)  # the rank processes of a plan built on ranks (`parallel`)
        self._notes: list[str] = []  # what the call in progress says of itself (a routing taught: `taught`)
        self.config = self._vllm_config()  # vLLM's reading of the checkpoint: a refusal is a usage error
        self.device = torch.device(self.config.device_config.device or "cpu")
        build_quantized(self)  # a quantized checkpoint: built now, so that a scheme vLLM refuses is a usage error

    def _vllm_config(self) -> Any:
        """vLLM's config over the checkpoint (`enforce_eager`); BackendError with vLLM's reason where it refuses
        the checkpoint, or the config lacks a field vLLM's model file reads."""
        from vllm.config import ModelConfig, VllmConfig

        try:
            with upstream_warnings():
                model_config = ModelConfig(
                    model=str(self.setup.model_dir), dtype=DTYPES[self.dtype], enforce_eager=True, seed=0
                )
                config = VllmConfig(model_config=model_config, parallel_config=parallel_config(self.parallel))
        except Exception as exc:  # vLLM refuses the checkpoint (pydantic's ValidationError, ValueError, ...)
            if scheme_of(self.setup.model_dir) is not None:  # a quantization it does not take in this dtype
                raise refusal(self, exc) from None
            raise BackendError(f"--hw vllm: vLLM refuses {self.setup.model_dir}: {vllm_reason(exc)}") from None
        self.arch.check_config(self.golden.model_type, model_config.hf_config, self.setup.model_dir)
        return config

    def start(self) -> None:
        """vLLM's model of the checkpoint, built once by vLLM's loader."""
        if self.model is not None:  # built while the run was set up (a quantized checkpoint)
            return
        if self.parallel.ranked:  # its ranks build it, one process each
            self.build_seconds = max(f["seconds"] for f in self.ranks.start(self.parallel))
            return
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        started = time.perf_counter()
        model_config = self.config.model_config
        with set_current_vllm_config(self.config), upstream_warnings(), refused(self.setup.model_dir):
            _model_parallel(self.device) if self.parallel.rank is None else rank_groups(self.device, self.parallel)
            fresh_ropes()
            loader = get_model_loader(self.config.load_config)
            # the loader's own `load_model` calls torch.accelerator.empty_cache(), which torch 2.13 refuses on
            # a host without an accelerator: its steps are taken here one by one
            with set_default_torch_dtype(model_config.dtype):
                with self.device:
                    model = loader.create_model(vllm_config=self.config, model_config=model_config)
                loader.load_weights(model, model_config)
                process_weights_after_loading(model, model_config, self.device)
        self.model = model.eval()
        self.build_seconds = time.perf_counter() - started

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        with (
            set_current_vllm_config(self.config),
            set_forward_context(None, self.config),
            torch.no_grad(),
            upstream_warnings(),
        ):
            yield

    def _layer(self, point: Point) -> Any:
        return self.model.model.layers[point.layer]

    def _block(self, point: Point) -> Any:
        return getattr(self._layer(point), self.arch.block)

    def _attn(self, point: Point) -> Any:
        return getattr(self._layer(point), self.arch.attention)

    def module(self, path: str) -> torch.nn.Module:
        """vLLM's module at a golden module path (`model.layers.0.mlp.gate`): vLLM's names for the
        architecture's MoE block, attention and embedding (`archs`)."""
        if self.parallel.ranked:
            raise BackendError(
                f"--hw vllm at {self.parallel.words}: vLLM's modules live in the rank processes; call the point "
                "(candidate.call(record)), or take a module at tp_degree=1"
            )
        try:
            return self.model.get_submodule(self.arch.path(path))
        except AttributeError:
            raise BackendError(f"vLLM's {type(self.model).__name__} has no module {path}") from None

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        return self._run(point, golden, None)

    def run_routed(self, point: Point, golden: GoldenRecord, force: Callable[[Any], Any]) -> CandidateOutput:
        return self._run(point, golden, force)

    def check_plan(self, plan: dict[str, int]) -> None:
        check_plan(self.golden.config, Plan.of(plan), "tp", "ep")

    def run_plan(self, point: Point, golden: GoldenRecord, plan: dict[str, int]) -> CandidateOutput:
        wanted = Plan.of(plan)
        if wanted.key == self.parallel.key:  # the run's own plan
            return self._run(point, golden, None)
        return self.ranks.run(wanted, point, golden, None)

    def explain(self, point: Point, golden: GoldenRecord) -> dict[str, Any]:
        return self.ranks.explain(point, golden)

    def _run(self, point: Point, golden: GoldenRecord, force: Callable[[Any], Any] | None) -> CandidateOutput:
        if self.parallel.ranked:
            return self.ranks.run(self.parallel, point, golden, force)
        call = getattr(self.arch_calls, f"_{point.component}", None) or getattr(self, f"_{point.component}", None)
        if call is None:
            raise PointUnavailable(f"{point.id}: --hw vllm has no call for a {point.component} point")
        started = time.perf_counter()
        self._notes = []
        with self._context(), cpu_routing(point, lambda: self._block(point)):
            output, routing = call(point, golden, force)
        info = {
            "notes": [f"vLLM {self.version}'s {type(self.model).__name__}, module {self._where(point)}", *self._notes]
        }
        cache = None
        if isinstance(output, CandidateOutput):  # an attention's: with its cache after the call
            output, cache = output.output, output.cache
        return CandidateOutput(output, routing, seconds=time.perf_counter() - started, info=info, cache=cache)

    def ran(self, point: Point) -> dict[str, str] | None:
        """vLLM's module at the point: its class, dtypes, fused MoE kernel and attention backend (`vllm.ran`);
        None where the modules live in rank processes."""
        if self.parallel.ranked or self.model is None:
            return None
        try:
            return vllm_ran(self.module(self.golden.entry(point)["module"]))
        except BackendError:
            return None

    def _where(self, point: Point) -> str:
        entry = self.golden.entry(point)
        try:
            return self.module(entry["module"]).__class__.__name__
        except BackendError:
            return "?"

    # ---------------------------------------------------------------------------------- the calls
    def _embedding(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        ids = golden.args[0]
        return getattr(self.model.model, self.arch.embedding)(ids.reshape(-1)).reshape(*ids.shape, -1), None

    def _norm(self, module: Any, golden: GoldenRecord) -> torch.Tensor:
        x = golden.args[0]
        return module(x.reshape(-1, x.shape[-1])).reshape(x.shape)

    def _input_norm(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        return self._norm(getattr(self._layer(point), NORMS[point.component]), golden), None

    _post_attn_norm = _input_norm

    def _final_norm(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        return self._norm(self.model.model.norm, golden), None

    def _logits(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        x = golden.args[0]
        logits = self.model.logits_processor(self.model.lm_head, x.reshape(-1, x.shape[-1]))
        return logits.reshape(*x.shape[:-1], -1), None

    def _rotary(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """The cos and sin vLLM's rotary embedding applies at the golden's positions, read from its table
        (`cos_sin_cache`: cos then sin over half the rotary dimensions, repeated for the NeoX style)."""
        rotary = getattr(self.model.model.layers[0], self.arch.attention).rotary_emb
        positions = golden.kwargs.get("position_ids", golden.args[1] if len(golden.args) > 1 else None)
        if positions is None or not getattr(rotary, "is_neox_style", False):
            raise PointUnavailable(f"{point.id}: --hw vllm reads vLLM's NeoX-style rotary table at given positions")
        cos, sin = rotary.cos_sin_cache.index_select(0, positions.reshape(-1)).chunk(2, dim=-1)
        shape = (*positions.shape, -1)
        if self.arch.rotary_half:  # the golden's layout: each rotated pair's cos and sin once
            return (cos.reshape(shape), sin.reshape(shape)), None
        return (torch.cat([cos, cos], -1).reshape(shape), torch.cat([sin, sin], -1).reshape(shape)), None

    def _attention(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """vLLM's attention module (qkv projection, q/k norms, rotary, vLLM's attention backend, o projection)
        on the golden's hidden states and positions, over a paged cache and metadata built for the call."""
        attn = self._attn(point)
        check(point, attn.attn, golden)
        hidden, positions = golden.kwargs["hidden_states"], golden.kwargs["position_ids"]
        with attention_context(self.config, attn.attn, golden, self.device) as state:
            rows = state["requests"]  # the batch's real tokens, as vLLM's flat token axis
            out = attn(positions=rows.flat(positions), hidden_states=rows.flat(hidden))
        return CandidateOutput((rows.unflat(out), None), cache=state.get("cache")), None

    def _output(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, Any]:
        """vLLM's decoder layer (its norms fused with the residual adds, attention, MoE block): its output is
        vLLM's (hidden, residual) summed, what the next layer's input norm adds."""
        layer = self._layer(point)
        attn = self._attn(point).attn
        check(point, attn, golden)
        hidden, positions = golden.args[0], golden.kwargs["position_ids"]
        taught = lambda: for_requests(golden_routing(self, point), golden, state["requests"])  # noqa: E731
        with (
            attention_context(self.config, attn, golden, self.device) as state,
            self._routing(self._block(point), force, taught) as seen,
        ):
            rows = state["requests"]  # the batch's real tokens, as vLLM's flat token axis
            out, residual = layer(positions=rows.flat(positions), hidden_states=rows.flat(hidden), residual=None)
        routing = tuple(rows.unflat(t).flatten(0, 1) for t in seen[-1]) if seen else None
        return rows.unflat(out + residual), routing

    def _select(self, block: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vLLM's routing of `x`: the gate's logits, then the MoE runner's own expert selection."""
        logits = self.arch.router_logits(block, x)
        weights, ids = block.experts.router.select_experts(hidden_states=x, router_logits=logits)
        return logits, weights, ids

    def _router(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        x = golden.args[0]
        block = self._block(point)
        flat = x.reshape(-1, x.shape[-1])
        try:
            logits, weights, ids = self._select(block, flat)
        except AssertionError as exc:  # a routing vLLM's CPU router has no path for: its gate's logits alone
            said = unroutable(exc)
            if said is None:
                raise
            self._notes.append(logits_words(block.experts.router, said))
            return self.arch.router_logits(block, flat), None
        return (logits, weights.to(x.dtype), ids.long()), None

    def _experts(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, None]:
        """vLLM's routed experts (its fused MoE through the quant method's `apply`) on the golden's routing."""
        x, ids, weights = golden.args[:3]
        routed = self._block(point).experts.routed_experts
        if routed.quant_method.is_monolithic:
            raise PointUnavailable(
                f"{point.id}: vLLM's {type(routed.quant_method).__name__} routes inside its kernel (monolithic): "
                "its experts cannot be given the golden's routing"
            )
        flat = x.reshape(-1, x.shape[-1])
        out = routed.forward_modular(
            flat, topk_weights=weights.reshape(flat.shape[0], -1).float(), topk_ids=ids.reshape(flat.shape[0], -1).int()
        )
        out = self._block(point).experts._maybe_reduce_final_output(out, None)  # vLLM's all-reduce at TP/EP > 1
        return out.reshape(x.shape), None

    def _moe(self, point: Point, golden: GoldenRecord, force: Any) -> tuple[Any, Any]:
        """vLLM's MoE block whole; its runner's expert selection seen (and, with `force`, replaced)."""
        x = golden.args[0]
        block = self._block(point)
        with self._routing(block, force, lambda: golden_routing(self, point)) as seen:
            out = block(x.reshape(-1, x.shape[-1]))
        return out.reshape(x.shape), (seen[-1] if seen else None)

    @contextlib.contextmanager
    def _routing(self, block: Any, force: Any, taught: Callable[[], Any] | None = None) -> Iterator[list]:
        """The MoE runner's expert selection seen as (logits, weights, ids), and replaced by `force(it)`. Where
        vLLM's router has no path for the model's routing here (its CPU router: `taught`), the block runs on
        the golden's routing, `taught()`, and shows none of its own."""
        router = block.experts.router
        seen: list[tuple[torch.Tensor, ...]] = []
        select = router.select_experts

        def selecting(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            try:
                weights, ids = select(*args, **kwargs)
            except AssertionError as exc:
                said = unroutable(exc)
                given = taught() if said is not None and force is None and taught is not None else None
                if given is None:
                    raise
                self._notes.append(forced_words(router, said))
                return as_given(*given, kwargs["router_logits"].shape[0])
            routing = (kwargs["router_logits"], weights, ids.long())
            if force is not None:
                routing = tuple(force(routing))
            seen.append(routing)
            return routing[1].to(weights.dtype), routing[2].to(ids.dtype)

        router.select_experts = selecting
        try:
            yield seen
        finally:
            del router.select_experts

    def drill_call(self, point: Point, golden: GoldenRecord) -> tuple[Any, list, dict, bool]:
        return drill_call(self, point, golden)  # vLLM's module of the point, called as `run` calls it

    def closing_lines(self, rows: list[dict[str, Any]]) -> list[str]:
        name = type(self.model).__name__ if self.model is not None else self.ranks.model_name
        if name is None:
            return []
        quantized = experts_words(self.model, MOE_BLOCKS, self.golden.model_type) if self.model is not None else None
        ranks = f": {self.parallel.tp} ranks, one process each" if self.parallel.ranked else ""
        words = f" ({self.parallel.words}{ranks})" + (f", its experts {quantized}" if quantized else "")
        built = f"built by vLLM's loader on {self.device} in {self.build_seconds:.1f} s"
        return [f"--hw vllm: vLLM {self.version}'s {name} {built}{words}"]

    def close(self) -> None:
        self.ranks.close()
        self.model = None


def _model_parallel(device: torch.device) -> None:
    """vLLM's process groups, once per process: one rank (gloo on the CPU)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    handle = tempfile.NamedTemporaryFile(prefix="moe-parity-vllm-", delete=False)  # noqa: SIM115 - a rendezvous file
    handle.close()
    Path(handle.name).unlink()
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{handle.name}",
        local_rank=0,
        backend="gloo" if device.type == "cpu" else "nccl",
    )
    initialize_model_parallel(1, 1)
