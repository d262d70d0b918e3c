"""`--hw nxdi`'s backend: per point, NxDI's module of that component built (`calls.NxdiPoint`, by
NxDI's `build_module` or the CPU build's), with that unit's converted weights (`weights`), called on
the golden's inputs in NxDI's form; at TP > 1 on the CPU, what the ranks say (`evidence`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from ...errors import BackendError, PointUnavailable
from ...golden import GoldenRecord
from ...model.archs import declared_experts
from ...model.checkpoint import weight_map
from ...points import Point, layer_group
from ...tree import CacheState, first_tensor, leaves
from .. import Backend, BackendSetup, CandidateOutput, HwOption, on_off, one_of, positive_int
from .calls import (
    NxdiPoint,
    RankCapture,
    attention_inputs,
    cache_after,
    cache_of,
    chunk_size,
    chunked_attention_inputs,
    deinterleaved,
    experts_inputs,
    mla_inputs,
    rank_kv_heads,
    router_as_reference,
)
from .evidence import merge, rank_evidence, ranks_differing, tp_differential
from .imports import INSTALL, import_nxdi, nxdi_hf_config, upstream_warnings
from .precision import OPTIONS as PRECISION_OPTIONS
from .precision import after_config, plan_settings
from .ran import nxdi_ran
from .tables import TABLES, Component, attribute, load_module_table, resolve, tables
from .weights import (
    QUANTIZED,
    back_to_reference,
    convert_unit,
    nxdi_cast_state,
    quantized_state,
    stored_unit,
    table_conversion,
    under,
    unit_state,
)

BUILDS = ("neuron", "cpu")


build_choice = one_of(*BUILDS)


class NxdiBackend(Backend):
    """`--hw nxdi [--hw-option tp_degree=N] [--hw-option ep_degree=E] [--hw-option build=cpu]`: NxDI's
    modules of the golden's architecture, traced and compiled for a Neuron device (`build=neuron`), or
    run on the CPU as NxDI's own CPU inference runs them (`build=cpu`: one process per rank, gloo). A
    plan is NxDI's: `tp_degree` ranks, every layer sharded over them; with expert parallelism the MoE's
    experts are split over `ep_degree` groups of them (moe_ep_degree) and sharded over the rest
    (moe_tp_degree = tp_degree / ep_degree)."""

    name = "nxdi"
    parallel_keys = ("tp", "ep")
    options = (
        HwOption("tp_degree", "tensor-parallel degree of each built module: its ranks (default: 1)", positive_int, 1),
        HwOption(
            "ep_degree",
            "expert-parallel degree of the MoE (NxDI's moe_ep_degree; it divides tp_degree, the MoE's experts sharded "
            "over the rest: moe_tp_degree = tp_degree / ep_degree; default: 1)",
            positive_int,
            1,
        ),
        HwOption(
            "block_size",
            "the MoE's blockwise matmul block size (NxDI's blockwise_matmul_config.block_size; default: NxDI's): "
            "a prefill of tokens x top_k at least this runs NxD's blockwise experts, the path expert parallelism takes",
            positive_int,
            None,
        ),
        HwOption(
            "build",
            "neuron: traced and compiled by NxDI's build_module on a Neuron host (the default); cpu: NxDI's "
            "real modules on this machine's CPU, one process per rank, as NxDI's CPU inference runs them",
            build_choice,
            "neuron",
        ),
        HwOption(
            "tp_diff",
            "with build=cpu and tp_degree > 1: also run each point at TP 1 and name where the two part (on/off)",
            on_off,
            False,
        ),
        HwOption(
            "quantized",
            "int8 or f8e4m3: NxDI's own quantization (neuron_config.quantized, per_channel_symmetric at this "
            "quantization_dtype); the weight items judge the quantized state dict NxDI writes, each weight within its "
            "format's rounding at its output channel's scale (default: off)",
            one_of(*QUANTIZED),
            None,
        ),
        *PRECISION_OPTIONS,
        HwOption("workdir", "where converted checkpoints and compiler artifacts go (default: a temporary directory)"),
        HwOption("compiler_args", "neuronx-cc arguments (default: NxDI's own)"),
    )

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        if importlib.util.find_spec("neuronx_distributed_inference") is None:
            raise BackendError(f"--hw nxdi needs neuronx-distributed-inference, which is not installed: {INSTALL}")
        table = load_module_table(self.golden.model_type)
        if table is None:
            raise BackendError(
                f"--hw nxdi has no NxDI module table for {self.golden.model_type} (tables: {', '.join(tables())}); "
                f"add one to {TABLES}, or compare an NxDI tensor capture with --hw dump"
            )
        if setup.model_dir is None:
            raise BackendError("--hw nxdi needs the Hugging Face checkpoint NxDI converts: pass --model DIR")
        self.cpu = self.hw_options["build"] == "cpu"
        if self.cpu:
            from .cpu import standins

            standins.install()
            self._cpu_mode = os.environ.get("NXD_CPU_MODE")
            os.environ["NXD_CPU_MODE"] = "1"  # NxDI's modules take their CPU branches (plain-math RMSNorm)
        with upstream_warnings():
            import_nxdi()
        self.table = table
        self.tp, self.ep = self.hw_options["tp_degree"], self.hw_options["ep_degree"]
        self._check_plan(self.tp, self.ep, "--hw-option tp_degree", "--hw-option ep_degree")
        if self.hw_options["tp_diff"] and not (self.cpu and self.tp > 1):
            raise BackendError(
                "--hw-option tp_diff=on compares TP 1 with TP N on the CPU: it needs build=cpu and tp_degree above 1"
            )
        self.weights = weight_map(setup.model_dir)
        self._check_layout(setup.model_dir)
        self._check_quantized(setup.model_dir)
        self._quantized: dict[str, torch.Tensor] | None = None  # NxDI's quantized state dict, once written
        self.config: Any = None
        self._configs: dict[tuple, Any] = {}  # per plan and precision settings: (tp, ep, settings)
        self._layer_configs: dict[tuple, list[Any]] = {}  # each decoder layer's, per plan and settings
        self.raised: dict[str, str] = {}  # the precision search's settings over the options' (`precision`)
        self._last: tuple[Any, ...] = (None,)  # the last point run at TP > 1 on the CPU: id, spec, inputs, output
        self._built: dict[tuple, Any] = {}
        self._converted: dict[tuple[int | None, int, int], dict[str, torch.Tensor]] = {}  # one unit's, per plan
        self._workdir: Path | None = None

    def _check_layout(self, model_dir: Path) -> None:
        """A checkpoint in a layout the application's conversion does not read is a usage error, in one sentence."""
        want = self.table.checkpoint_quant
        if not want:
            return
        from ...model.checkpoint import read_config

        method = (read_config(model_dir).get("quantization_config") or {}).get("quant_method")
        if method != want["quant_method"]:
            held = f"is quantized with {method}" if method else "is not quantized"
            raise BackendError(
                f"--hw nxdi: {want['why']}, and {model_dir} {held}: pass the {want['quant_method']} checkpoint"
            )

    def _check_quantized(self, model_dir: Path) -> None:
        """`quantized=` on a model NxDI's quantization does not take is a usage error, in one sentence."""
        dtype = self.hw_options["quantized"]
        if dtype is None:
            return
        from ...model.checkpoint import read_config
        from ...model.quant import layout

        if layout(read_config(model_dir), str(model_dir)) is not None:
            raise BackendError(
                f"--hw-option quantized={dtype}: {model_dir} is quantized already, and NxDI's per-channel "
                "quantization quantizes a float checkpoint; pass the unquantized model, or drop quantized="
            )
        application = resolve(self.table.application) if self.table.application else None
        if not hasattr(application, "save_quantized_state_dict"):
            raise BackendError(
                f"--hw-option quantized={dtype}: NxDI's {self.table.application or 'tree'} has no "
                f"{'save_quantized_state_dict' if application else f'application for {self.golden.model_type}'}: "
                "NxDI cannot quantize this model"
            )

    def _check_plan(self, tp: int, ep: int, said_tp: str, said_ep: str) -> None:
        """A plan NxD cannot shard the golden's model by is a usage error, not a run of errors."""
        config = self.golden.config
        experts = declared_experts(config)[1]
        if ep > 1 and not experts:
            raise BackendError(f"{said_ep}={ep}: the golden's model ({self.golden.model_type}) has no routed experts")
        if ep > 1 and self.table.no_expert_parallelism:
            raise BackendError(
                f"{said_ep}={ep}: {self.table.no_expert_parallelism}; compare expert parallelism on dumps of the "
                "device runs under each plan (--hw dump --hw-option plans=DIR)"
            )
        if tp % ep:
            raise BackendError(
                f"{said_ep}={ep}: NxDI splits the {tp} rank(s) of {said_tp}={tp} into moe_tp_degree x moe_ep_degree, "
                f"so the expert-parallel degree divides the TP degree; e.g. {said_tp}={2 * ep} with {said_ep}={ep}"
            )
        sizes = {
            "the vocabulary": config.get("vocab_size"),
            "the hidden size": config.get("hidden_size") or config.get("d_model"),
        }
        degrees = [("the TP degree", tp, sizes)]
        if experts:
            moe = {
                "each expert's intermediate size": config.get("moe_intermediate_size")
                or config.get("intermediate_size")
                or (config.get("ffn_config") or {}).get("ffn_hidden_size")  # DBRX's
            }
            if ep > 1:
                degrees += [("the MoE's TP degree", tp // ep, moe), ("the EP degree", ep, {"the experts": experts})]
            else:
                sizes.update(moe)
        bad, sizes_wrong = [], 0
        for degree, by, named in degrees:
            wrong = [f"{what} ({size})" for what, size in named.items() if size and size % by]
            sizes_wrong += len(wrong)
            if wrong:
                bad.append(f"{', '.join(wrong[:-1])}{' and ' if len(wrong) > 1 else ''}{wrong[-1]} by {degree} ({by})")
        if bad:
            raise BackendError(
                f"{said_tp}={tp}{f' with {said_ep}={ep}' if ep > 1 else ''}: NxD shards {'; and '.join(bad)}, which "
                f"does not divide {'it' if sizes_wrong == 1 else 'them'}; use degrees that do (e.g. 1 or 2)"
            )

    def start(self) -> None:
        if self.config is not None:  # started already (weight items run before the first point)
            return
        import tempfile

        self.config = self._config(self.tp, self.ep)
        if self.hw_options["workdir"]:
            self._workdir = Path(self.hw_options["workdir"]).expanduser()
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="moe-parity-nxdi-")
            self._workdir = Path(self._tmp.name)

    def _config(self, tp: int, ep: int = 1) -> Any:
        """NxDI's inference config of the golden's model at TP `tp` and EP `ep` under the precision
        settings (`precision_settings`; made once per plan and settings)."""
        settings = self.precision_settings()
        key = (tp, ep, tuple(sorted(settings.items())))
        if key not in self._configs:
            plan: dict[str, Any] = {"tp_degree": tp, "torch_dtype": self.dtype, **plan_settings(settings)}
            if ep > 1:
                plan.update(moe_tp_degree=tp // ep, moe_ep_degree=ep)
            if self.hw_options["block_size"]:
                plan["blockwise_matmul_config"] = {"block_size": self.hw_options["block_size"]}
            with upstream_warnings():
                hf_config = nxdi_hf_config(self.setup.model_dir)
                for name, value in self.table.config_defaults.items():
                    if getattr(hf_config, name, None) is None:
                        setattr(hf_config, name, copy.deepcopy(value))
                hf_adapter = resolve("neuronx_distributed_inference.utils.hf_adapter:load_pretrained_config")
                neuron_config = resolve(self.table.neuron_config)(**plan)
                self._configs[key] = resolve(self.table.config)(
                    neuron_config, load_config=hf_adapter(hf_config=hf_config)
                )
                after_config(self._configs[key], settings)
        return self._configs[key]

    def precision_settings(self) -> dict[str, str]:
        """The precision settings given (`--hw-option router_dtype=...`), the search's over them."""
        given = {o.name: self.hw_options[o.name] for o in PRECISION_OPTIONS if self.hw_options[o.name]}
        if {"router_dtype", "attention_dtype"} & set(self.raised):  # a module's own dtype holds only so
            given["cast_type"] = "as-declared"
        return {**given, **self.raised}

    def _spec_inputs(self, point: Point, golden: GoldenRecord) -> tuple[Component, tuple[torch.Tensor, ...]]:
        """The table's entry of the point's component and its inputs in the module's form."""
        spec = self.table.components.get(point.component)
        if spec is None:
            why = self.table.unavailable.get(point.component, "the table names no NxDI module for it")
            raise PointUnavailable(f"{point.id}: not built by --hw nxdi: {why}")
        if self.config is None:
            self.start()
        return spec, self._inputs(point, spec, golden)

    @property
    def forces_routing(self) -> bool:  # type: ignore[override]
        """The CPU build replaces the MoE's router output inside NxDI's own MoE module (the ranks run it)."""
        return self.cpu and "router" in self.table.components and "moe" in self.table.components

    def run_routed(self, point: Point, golden: GoldenRecord, force: Any) -> CandidateOutput:
        """NxDI's MoE module of `point` with its router's output replaced: the router module's own output
        (logits, affinities over every expert, top-k ids), `force`d, back in NxDI's form (the forced
        top-k weights scattered over the experts) and given to the router inside the MoE."""
        if not self.forces_routing or point.component != "moe":
            return super().run_routed(point, golden, force)
        spec, inputs = self._spec_inputs(point, golden)
        router = self.table.components["router"]
        with torch.no_grad(), upstream_warnings():
            own = tuple(self._module(point, "router", router, inputs)(*inputs))
            logits, affinities, index = own[:3]
            _, weights, ids = force(own)[:3]
            ids = ids.reshape(index.shape).to(index.device)
            dense = torch.zeros_like(affinities).scatter(-1, ids.long(), weights.reshape(ids.shape).to(affinities))
            forced = dataclasses.replace(spec, inputs="forced", forced=router.call or "router")
            module = self._module(point, "moe_forced", forced, (*inputs, dense, ids))
            output = module(*inputs, dense, ids)
        return CandidateOutput(
            output, (logits, dense, ids), info={"nxdi_module": spec.module.format(layer=point.layer)}
        )

    def check_plan(self, plan: dict[str, int]) -> None:
        self._check_plan(plan.get("tp", 1), plan.get("ep", 1), "tp", "ep")

    def run_plan(self, point: Point, golden: GoldenRecord, plan: dict[str, int]) -> CandidateOutput:
        """The point's module built at TP `plan["tp"]` and EP `plan["ep"]` (the ranks' own evidence left
        to the point's item)."""
        return self._run(point, golden, plan.get("tp", 1), plan.get("ep", 1))

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        return self._run(point, golden)

    def _run(self, point: Point, golden: GoldenRecord, tp: int | None = None, ep: int | None = None) -> CandidateOutput:
        spec, inputs = self._spec_inputs(point, golden)
        cache = None
        info: dict[str, Any] = {"nxdi_module": spec.module.format(layer=point.layer)}
        degree, experts = (self.tp, self.ep) if tp is None else (tp, ep or 1)
        with torch.no_grad(), upstream_warnings():
            module = self._module(point, point.component, spec, inputs, tp=degree, ep=experts)
            output = module(*inputs)
            if spec.outputs:  # the outputs the golden's module gives (DBRX's router: its logits)
                output = output[0] if spec.outputs == 1 else tuple(output[: spec.outputs])
            if spec.inputs == "experts":  # NxD's experts give [tokens, hidden]; the reference's, its input's shape
                output = output.reshape(first_tensor([*golden.args, *golden.kwargs.values()]).shape)
            if self.cpu and self.tp > 1 and tp is None:
                merge(info, self._parallel_evidence(point, spec, inputs, module))
            routing = None
            if spec.inputs == "mla":
                output, rotary, latent = output
                past = cache_of(golden)
                if past is not None:  # the latent cache, the same on every rank: this step's appended
                    cache = CacheState(
                        past.layer,
                        torch.cat([past.keys, latent[:, None].to(past.keys.dtype)], dim=2),
                        torch.cat([past.values, deinterleaved(rotary)[:, None].to(past.values.dtype)], dim=2),
                    )
            elif spec.inputs == "attention":
                output, keys, values, *caught = output
                routing = tuple(caught) or None
                past = cache_of(golden)
                if past is not None and degree == 1:  # at TP > 1 K, V are rank 0's heads
                    # the past the call was given, but a chunked layer's (NxDI's chunk-sized slots): the golden's
                    chunked = past.window is not None and chunk_size(self.golden.config, point.layer)
                    held = (past.keys, past.values) if chunked else (inputs[3], inputs[4])
                    cache = cache_after(past, *held, keys, values)
            elif point.routed_block and "router" in self.table.components:  # what the block's router chose
                router = self.table.components["router"]
                routing = tuple(self._module(point, "router", router, inputs, tp=degree, ep=experts)(*inputs))
                if spec.scores:  # with its router's top-k affinities scattered over the experts, as Llama 4's
                    _, affinities, ids = routing[:3]
                    dense = torch.zeros_like(affinities).scatter(-1, ids.long(), affinities.gather(-1, ids.long()))
                    output = (output.reshape(-1, output.shape[-1]), dense)
        return CandidateOutput(output, routing, info=info, cache=cache, ran=self._ran(point, spec, degree, experts))

    def _ran(self, point: Point, spec: Component, tp: int, ep: int) -> dict[str, str]:
        """What NxDI ran at the point (`nxdi.ran`): its factory under the neuron config it was built with."""
        config = copy.copy(self._config(tp, ep))
        config.neuron_config = copy.copy(config.neuron_config)
        config.neuron_config.is_prefill_stage = point.step is None if spec.config else None
        for name, value in spec.neuron_set.items():
            setattr(config.neuron_config, name, value)
        return nxdi_ran(spec.factory, point.component, config, spec.submodule)

    def drill_call(self, point: Point, golden: GoldenRecord) -> tuple[Any, list, dict, bool]:
        """`--parity-drill` on the CPU build: NxDI's module of the point, captured op by op on its
        ranks (at TP > 1, their graphs joined into one: `drill.ranks`)."""
        if not self.cpu:
            raise NotImplementedError(
                "--hw nxdi drills its CPU build (--hw-option build=cpu): on a Neuron device NxDI runs the module as "
                "one traced graph, with no ops to capture one by one; drill the same NxDI code with build=cpu"
            )
        spec, inputs = self._spec_inputs(point, golden)
        with upstream_warnings():
            module = self._module(point, point.component, spec, inputs)
        read_as = None
        if point.component == "router" and not spec.topk_weights:  # affinities read as the verdict reads them
            golden_w = [t for t in leaves(self.golden.load(point).output) if isinstance(t, torch.Tensor)][1]
            read_as = functools.partial(router_as_reference, golden_w=golden_w)
        return RankCapture(module, read_as), list(inputs), {}, False

    def _parallel_evidence(self, point: Point, spec: Component, inputs: tuple[torch.Tensor, ...], module: Any):
        """What the ranks' own outputs say at TP > 1 (the CPU build holds every rank's): whether they
        agree, as NxD's replicated outputs must, and where they do not, whether their sum is the golden
        output (a missing all-reduce). With `tp_diff`, the TP 1 differential of every point too. Notes
        for the row, and the hint of the point if it fails."""
        firsts = [first_tensor(o) for o in module.rank_outputs]
        self._last = (point.id, spec, inputs, firsts[0])
        differ = ranks_differing(firsts)
        if not differ and not self.hw_options["tp_diff"]:
            return {}
        expected = first_tensor(self.golden.load(point).output)  # what the backend is handed has no output
        out = rank_evidence(firsts, differ, expected) if differ else {}
        if self.hw_options["tp_diff"]:
            merge(out, self._tp_differential(point, expected))
        return out

    def explain(self, point: Point, golden: GoldenRecord) -> dict[str, Any]:
        """A failed point at TP > 1 on the CPU: the TP 1 differential (unless every point had it)."""
        if not (self.cpu and self.tp > 1) or self.hw_options["tp_diff"] or self._last[0] != point.id:
            return {}
        with torch.no_grad(), upstream_warnings():
            return self._tp_differential(point, first_tensor(golden.output))

    def _tp_differential(self, point: Point, expected: torch.Tensor) -> dict[str, Any]:
        """The same point built at TP 1, against the last point's output at TP N."""
        _, spec, inputs, at_tp = self._last
        single = first_tensor(self._module(point, point.component, spec, inputs, tp=1)(*inputs))
        return tp_differential(at_tp, single, expected, self.tp)

    def _inputs(self, point: Point, spec: Component, golden: GoldenRecord) -> tuple[torch.Tensor, ...]:
        if spec.inputs == "attention":
            cache = cache_of(golden)
            chunk = chunk_size(self.golden.config, point.layer)
            if cache is not None and cache.window is not None and chunk:
                return chunked_attention_inputs(golden, chunk)
            if cache is not None and cache.window is not None and not self.table.window_cache:
                raise PointUnavailable(
                    f"{point.id}: not built by --hw nxdi: a sliding-window layer's cache (NxDI's windowed "
                    "attention keeps its own rolling layout); compare it with --hw dump on an NxDI capture"
                )
            if cache is not None and self._rank_kv_heads() is None:
                raise PointUnavailable(
                    f"{point.id}: not built by --hw nxdi at tp_degree={self.hw_options['tp_degree']}: NxDI pads "
                    f"{self.config.num_attention_heads} attention heads to a multiple of it, and which rank holds "
                    "which kv heads of the cache is then not known here; use a TP degree that divides the heads, "
                    "or compare an NxDI capture"
                )
            return attention_inputs(golden)
        if spec.inputs == "mla":
            return mla_inputs(golden)
        values = [*golden.args, *golden.kwargs.values()]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if spec.inputs == "experts":
            hidden, index, weights = tensors[:3]
            return experts_inputs(hidden, index, weights, declared_experts(self.golden.config)[1])
        return (tensors[0],)  # the hidden states, or a token-id tensor for the embedding

    def _unit(self, layer: int | None, tp: int | None = None, ep: int = 1) -> dict[str, torch.Tensor]:
        """NxDI's conversion of this unit (its layer renamed to 0) under the plan (the conversion writes
        rank tensors), converted once and kept while its points run."""
        key = (layer, tp or self.tp, ep if tp else self.ep)
        if key not in self._converted:
            if any(k[0] != layer for k in self._converted):  # one unit at a time
                self._converted.clear()
            layout = self.table.checkpoint
            if self.table.application:
                convert = resolve(self.table.application).convert_hf_to_neuron_state_dict
            else:  # NxDI ships no application for this model: the table's own layout for NxD's modules
                convert = functools.partial(table_conversion, rules=self.table.conversion or {})
            state = unit_state(self.setup.model_dir, layer, self.weights, layout)
            self._converted[key] = convert_unit(
                state,
                convert,
                self._config(*key[1:]),
                int(layer is not None),
                layout.get("layer_count", "num_hidden_layers"),
            )
        return self._converted[key]

    def _weights(self, layer: int | None, module: str, tp: int, ep: int) -> dict[str, torch.Tensor]:
        """NxDI's converted tensors of `module` (a path in NxDI's model) for this unit."""
        return under(self._unit(layer, tp, ep), module.format(layer=0) + ".")

    def held_weights(self, layer: int | None) -> dict[str, torch.Tensor] | None:
        """What NxDI's conversion made of the candidate checkpoint's unit, mapped back by the
        table's inverse rules (None: the table has none, and the checkpoint itself is compared)."""
        if self.table.weights is None:
            return None
        if self.config is None:
            self.start()
        return back_to_reference(self._unit(layer), self.table.weights, layer)

    def held_quantized(self, layer: int | None) -> dict[str, Any] | None:
        """With `quantized=`: the unit's tensors of the quantized state dict NxDI writes, as stored,
        under the reference's names (None: the option is off)."""
        dtype = self.hw_options["quantized"]
        if dtype is None:
            return None
        if self.config is None:
            self.start()
        if self._quantized is None:
            assert self._workdir is not None
            application = resolve(self.table.application)
            with upstream_warnings():
                path = self._workdir / f"quantized.{dtype}.pt"
                self._quantized = quantized_state(application, self.setup.model_dir, self.config, dtype, path)
        return stored_unit(self._quantized, layer, self.table.weights or {"prefix": "model."}, QUANTIZED[dtype])

    def quantized_words(self) -> str | None:
        dtype = self.hw_options["quantized"]
        return None if dtype is None else f"NxDI's quantized state dict (per_channel_symmetric {dtype})"

    def _rank_kv_heads(self, tp: int | None = None) -> list[list[int]] | None:
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        return rank_kv_heads(tp or self.tp, heads, kv_heads)

    def _call_kwargs(self, spec: Component, layer: int | None, tp: int, ep: int) -> dict[str, Any]:
        """The attention call's fixed keywords (`call_kwargs`), "$rope" read as whether the point's layer
        applies the rotary embedding (NxDI's config's `no_rope_layers`: 0 for Llama 4's NoPE layers)."""
        rope = list(getattr(self._config(tp, ep), "no_rope_layers", None) or [])
        return {k: (bool(rope[layer]) if rope and layer is not None else True) if v == "$rope" else v
                for k, v in spec.call_kwargs.items()}  # fmt: skip

    def _kwargs(self, spec: Component, prefill: bool, tp: int, ep: int, layer: int | None = None) -> dict[str, Any]:
        """The factory's keywords (`args`: config attributes, dotted for the neuron config's; `literals`:
        "$dtype", "$layer" the point's decoder layer, "$new module:Class" a fresh instance); the config
        (the layer's, where NxDI makes one per layer) as NxDI gives its context-encoding model
        (`is_prefill_stage=True`) or its token-generation model (False), whose code paths differ."""
        base = self._config(tp, ep)
        if self.table.layer_configs and layer is not None:
            key = (tp, ep, tuple(sorted(self.precision_settings().items())))
            if key not in self._layer_configs:
                with upstream_warnings():
                    self._layer_configs[key] = resolve(self.table.layer_configs)(base)
            base = self._layer_configs[key][layer]
        kwargs = {k: attribute(base, v) for k, v in spec.args.items()}
        kwargs.update({k: self._literal(v, layer) for k, v in spec.literals.items()})
        if spec.config:
            config = copy.copy(base)
            config.neuron_config = copy.copy(base.neuron_config)
            config.neuron_config.is_prefill_stage = prefill
            for name, source in spec.config_set.items():
                setattr(config, name, getattr(base, source))
            for name, value in spec.neuron_set.items():
                setattr(config.neuron_config, name, value)
            kwargs["config"] = config
        return kwargs

    def _literal(self, value: Any, layer: int | None) -> Any:
        if value == "$dtype":
            return self.dtype
        if value == "$layer":
            return layer
        if isinstance(value, str) and value.startswith("$new "):
            return resolve(value[len("$new ") :])()
        return value

    def _module(
        self,
        point: Point,
        name: str,
        spec: Component,
        inputs: tuple[torch.Tensor, ...],
        tp: int | None = None,
        ep: int | None = None,
    ) -> Any:
        tp, ep = (self.tp, self.ep) if tp is None else (tp, ep or 1)
        if self.cpu and tp > 1 and spec.cpu_tp1_only:
            raise PointUnavailable(
                f"{point.id}: not built by --hw nxdi at tp_degree={tp} on the CPU: {spec.cpu_tp1_only}"
            )
        settings = tuple(sorted(self.precision_settings().items()))
        key = (point.layer, name, tuple((tuple(t.shape), t.dtype) for t in inputs), tp, ep, settings)
        if key not in self._built:
            from safetensors.torch import load_file, save_file

            if self.cpu:
                from .cpu.ranks import build_module
            else:
                build_module = resolve("neuronx_distributed_inference.utils.testing:build_module")
            converted = self._weights(point.layer, spec.module, tp, ep)
            neuron_config = self._config(tp, ep).neuron_config
            # NxDI's get_state_dict casts the checkpoint so, and only so
            if getattr(neuron_config, "cast_type", "config") == "config":
                converted = nxdi_cast_state(converted, neuron_config.torch_dtype)
            for name in spec.rank_buffers:  # NxD's SPMDRank: some conversions write it, some leave it to the loader
                converted.setdefault(name, torch.arange(tp, dtype=torch.int32))
            assert self._workdir is not None
            unit = "model" if point.layer is None else layer_group(point.layer)
            # (hidden, mask, positions, K, V), or MLA's (hidden, mask, positions, past [B, S, D])
            token_generation = spec.inputs in ("attention", "mla") and len(inputs) > 3
            past_len = inputs[3].shape[2 if spec.inputs == "attention" else 1] if token_generation else 0
            shape = "x".join(map(str, inputs[0].shape)) + (f".past{past_len}" if token_generation else "")
            where = self._workdir / (f"{unit}.{name}.{shape}.tp{tp}" + (f".ep{ep}" if ep > 1 else ""))
            where.mkdir(parents=True, exist_ok=True)
            checkpoint = where / "checkpoint.safetensors"
            state = {f"inner.{k}": v.contiguous() for k, v in converted.items()}
            kv_heads = self._rank_kv_heads(tp) if token_generation and tp > 1 and spec.inputs == "attention" else None
            if kv_heads is not None:  # the wrapper's own: its SPMDRank and which kv heads each rank holds
                state["rank_util.rank"] = torch.arange(tp, dtype=torch.int32)
                state["kv_heads"] = torch.tensor(kv_heads, dtype=torch.int32)
            save_file(state, str(checkpoint))
            if any(k[0] != point.layer for k in self._built):  # one unit's modules at a time
                self._release()
            self._built[key] = build_module(
                NxdiPoint,
                example_inputs=[tuple(inputs)],
                module_init_kwargs={
                    "factory": spec.factory,
                    "kwargs": self._kwargs(spec, prefill=point.step is None, tp=tp, ep=ep, layer=point.layer),
                    "call": spec.call,
                    "form": spec.inputs,
                    "routing": spec.routing,
                    "kv_heads": kv_heads,
                    "seq_len": 1 if point.step is not None else self.golden_seq_len(),
                    "forced": spec.forced,
                    "submodule": spec.submodule,
                    "buffers": {k: int(getattr(self._config(tp, ep), v)) for k, v in spec.buffers.items()},
                    "topk_weights": self._topk_weights(spec, tp, ep),
                    "call_kwargs": self._call_kwargs(spec, point.layer, tp, ep),
                    "before_call": spec.before_call,
                },
                tp_degree=tp,
                compiler_args=self.hw_options["compiler_args"],
                compiler_workdir=str(where / "compiler"),
                checkpoint_path=str(checkpoint),
                checkpoint_loader_fn=load_file,
            )
        return self._built[key]

    def _topk_weights(self, spec: Component, tp: int, ep: int) -> dict[str, Any]:
        """How the model weighs a router's top-k affinities (the table's `topk_weights`, read off the config)."""
        if not spec.topk_weights:
            return {}
        config = self._config(tp, ep)
        return {
            "normalize": bool(getattr(config, spec.topk_weights["normalize"])),
            "scale": float(getattr(config, spec.topk_weights["scale"])),
        }

    def golden_seq_len(self) -> int:
        """The prefill's tokens per sequence (NxD's experts pick the context-encoding path by it)."""
        ids = self.golden.manifest.get("inputs", {}).get("input_ids") or [[]]
        return len(ids[0])

    def _release(self) -> None:
        """Drops the built modules (on the CPU build, from their ranks too)."""
        for module in self._built.values():
            if hasattr(module, "release"):
                module.release()
        self._built.clear()

    def close(self) -> None:
        self._release()
        self._converted.clear()
        self._quantized = None
        if getattr(self, "cpu", False):
            from .cpu.ranks import close_pools

            close_pools()
            if self._cpu_mode is None:
                os.environ.pop("NXD_CPU_MODE", None)
            else:
                os.environ["NXD_CPU_MODE"] = self._cpu_mode
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()
