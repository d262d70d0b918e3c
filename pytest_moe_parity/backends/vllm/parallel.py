"""`--hw vllm` under tensor and expert parallelism (`--hw-option tp_degree=N`, `--hw-option ep_degree=N`,
`--parity-parallel A:B`): vLLM's model built on N ranks, one process each (forked, as the NxDI CPU
build's ranks are: its `RankPool`), each rank in a gloo world of N (vLLM's
`init_distributed_environment` and `initialize_model_parallel(N, 1)`, its CPU communicator's own
shared-memory all-reduce), vLLM's config at `tensor_parallel_size=N` (and `enable_expert_parallel`),
vLLM's loader giving each rank its own shards. Every point runs on every rank (the same calls as at
TP 1: `VllmBackend._run`, each rank on its own model) and the run judges rank 0's output, as vLLM's
model runner sees it. Per-rank evidence: whether the ranks agree (vLLM replicates a module's output on
every rank after its collectives), and for a failed MoE point each rank's partial sum before vLLM's
all-reduce against its shard of the checkpoint's experts, which names the rank that computes its
shard otherwise."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import BackendError, PointUnavailable
from ...golden import GoldenRecord
from ...judge.distance import rel_l2_flat
from ...model.checkpoint import weight_map
from ...points import Point
from ...tree import CacheState, first_tensor
from .. import CandidateOutput, HwOption, positive_int
from ..nxdi.cpu.ranks import RankPool, _describe
from ..nxdi.evidence import merge, rank_evidence, ranks_differing

OPTIONS = (
    HwOption(
        "tp_degree",
        "vLLM's tensor_parallel_size: the model built on this many ranks, one process each on the CPU (gloo), "
        "each with its own shards; rank 0's output is judged (default: 1)",
        positive_int,
        1,
    ),
    HwOption(
        "ep_degree",
        "vLLM's expert parallelism (enable_expert_parallel): the MoE's experts split over the tensor-parallel "
        "ranks instead of sharded, so 1 (the default) or tp_degree",
        positive_int,
        1,
    ),
)
# model_type -> the MoE block's attribute and one expert's gate, up and down projections in the checkpoint
EXPERTS = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "minimax_m2": ("block_sparse_moe", "w1", "w3", "w2"),
}
_POOLS = itertools.count()


@dataclass(frozen=True)
class Plan:
    """A parallel plan of vLLM's model: `tp` ranks, the experts split over them with `ep` (= tp) or sharded.
    In a rank's process, `rank` and `store` (its gloo rendezvous file) are set."""

    tp: int = 1
    ep: int = 1
    rank: int | None = None
    store: str | None = None

    @classmethod
    def of(cls, plan: dict[str, int]) -> Plan:
        return cls(plan.get("tp", 1), plan.get("ep", 1))

    @property
    def key(self) -> tuple[int, int]:
        return self.tp, self.ep

    @property
    def words(self) -> str:
        return f"TP {self.tp}" + (f", EP {self.ep}" if self.ep > 1 else "")

    @property
    def ranked(self) -> bool:
        """Built on ranks of their own (this process runs none of them)."""
        return self.rank is None and self.tp > 1


def check_plan(config: dict[str, Any], plan: Plan, said_tp: str, said_ep: str) -> None:
    """A plan vLLM cannot shard the golden's model by is a usage error, in one sentence naming the sizes."""
    tp, ep = plan.tp, plan.ep
    if ep > 1 and ep != tp:
        raise BackendError(
            f"{said_ep}={ep}: vLLM's expert parallelism (enable_expert_parallel) splits the experts over the "
            f"tensor-parallel ranks, so the EP degree is the TP degree ({said_tp}={tp}); e.g. {said_tp}={ep} with "
            f"{said_ep}={ep}"
        )
    wrong = _indivisible(config, tp, ep)
    if wrong:
        fits = next(d for d in range(tp - 1, 0, -1) if not _indivisible(config, d, 1))
        raise BackendError(
            f"{said_tp}={tp}: vLLM shards {' and '.join(wrong)} by the TP degree ({tp}), which does not divide "
            f"{'it' if len(wrong) == 1 else 'them'}; use a degree that does (e.g. {fits})"
        )


def _indivisible(config: dict[str, Any], tp: int, ep: int) -> list[str]:
    """The sizes of the model that vLLM's sharding at `tp` ranks does not divide (its rules: the attention
    heads split; the kv heads split, or replicated where the degree is a multiple of them; each expert's
    intermediate size split unless the experts are split instead)."""
    heads = config.get("num_attention_heads") or 0
    kv = config.get("num_key_value_heads") or heads
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
    wrong = []
    if heads % tp:
        wrong.append(f"the attention heads ({heads})")
    if kv and (kv % tp if kv >= tp else tp % kv):
        wrong.append(f"the kv heads ({kv})")
    if ep == 1 and inter % tp:
        wrong.append(f"each expert's intermediate size ({inter})")
    return wrong


def parallel_config(plan: Plan) -> Any:
    """vLLM's ParallelConfig of the plan."""
    from vllm.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=plan.tp, enable_expert_parallel=plan.ep > 1)


def rank_groups(device: torch.device, plan: Plan) -> None:
    """In a rank's process: vLLM's process groups, this rank of `plan.tp` (gloo on the CPU)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    assert plan.rank is not None
    init_distributed_environment(
        world_size=plan.tp,
        rank=plan.rank,
        distributed_init_method=f"file://{plan.store}",
        local_rank=plan.rank,
        backend="gloo" if device.type == "cpu" else "nccl",
    )
    initialize_model_parallel(plan.tp, 1)


def rank_kv_heads(total: int, tp: int, rank: int) -> list[int]:
    """The kv heads vLLM's QKVParallelLinear gives `rank` of `tp`: an equal share, or where there are fewer
    kv heads than ranks, one head replicated on tp / total consecutive ranks."""
    if total >= tp:
        share = total // tp
        return list(range(rank * share, (rank + 1) * share))
    return [rank // (tp // total)]


def held_kv_heads(total: int) -> list[int]:
    """This process's kv heads of `total` under vLLM's current tensor parallelism (all of them at TP 1)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return rank_kv_heads(total, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank())


# -- a rank's side ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fixed:
    """A forced routing sent to the ranks (the run's `force` is applied here, once, to rank 0's own)."""

    routing: tuple[torch.Tensor, ...]

    def __call__(self, own: Any) -> tuple[torch.Tensor, ...]:
        return self.routing


@contextlib.contextmanager
def _partials() -> Any:
    """Each MoE output this rank computes before vLLM's final all-reduce (its partial sum), in call order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    seen: list[torch.Tensor] = []
    reduce = MoERunner._maybe_reduce_final_output

    def reducing(self: Any, states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(states.detach().clone())
        return reduce(self, states, *args, **kwargs)

    MoERunner._maybe_reduce_final_output = reducing
    try:
        yield seen
    finally:
        MoERunner._maybe_reduce_final_output = reduce


def _facts(backend: Any) -> dict[str, Any]:
    """What a rank holds: its model's class, build time, and its share of the experts (the global experts
    it holds, the columns of each expert's intermediate size), from its first MoE layer."""
    facts: dict[str, Any] = {"model": type(backend.model).__name__, "seconds": backend.build_seconds}
    blocks = (getattr(layer, backend.arch.block, None) for layer in backend.model.model.layers)
    routed = next(
        (b.experts.routed_experts for b in blocks if hasattr(getattr(b, "experts", None), "routed_experts")), None
    )
    if routed is None:
        return facts
    parallel = routed.moe_config.moe_parallel_config
    held = routed.expert_map
    experts = list(range(routed.global_num_experts)) if held is None else (held >= 0).nonzero().flatten().tolist()
    width = routed.intermediate_size_per_partition
    with backend._context():
        foreign = _foreign_expert_computed(routed, backend.dtype)
    kernel = getattr(getattr(routed.quant_method, "moe_kernel", None), "fused_experts", None)
    return {
        **facts,
        "experts": experts,
        "columns": (parallel.tp_rank * width, (parallel.tp_rank + 1) * width),
        "kernel": type(kernel).__name__,
        "foreign": foreign,
    }


def _foreign_expert_computed(routed: Any, dtype: torch.dtype) -> int | None:
    """Under expert parallelism, whether vLLM's experts kernel applies its expert map: a token routed to a
    global expert this rank does not hold must add nothing here. Probed with a global id below the rank's
    count of local experts (the only ids safe to give a kernel that might index its local weights with
    them); the id probed where the kernel computed something for it (it took the global id for a local
    one), else None."""
    held = routed.expert_map
    if held is None:
        return None
    foreign = [g for g in range(min(routed.local_num_experts, held.numel())) if held[g] < 0]
    if not foreign:
        return None
    k = routed.top_k
    x = torch.ones(1, routed.hidden_size, dtype=dtype)
    ids = torch.full((1, k), foreign[0], dtype=torch.int32)
    out = routed.forward_modular(x, topk_weights=torch.full((1, k), 1.0 / k), topk_ids=ids)
    return foreign[0] if bool(out.abs().max() > 0) else None


def _serve(backend: Any, plan: Plan, ident: str, rank: int, world: int, store: str, conn: Any, threads: int) -> None:
    """A rank: vLLM's model built at `plan` in this process (forked: the backend is the parent's), then
    each point's call run on it as asked."""
    torch.set_num_threads(threads)
    os.environ["VLLM_DIST_IDENT"] = ident  # the name of vLLM's CPU shared-memory all-reduce segments
    try:
        _forget_inherited()
        backend.parallel = dataclasses.replace(plan, rank=rank, store=store)
        backend.config = backend._vllm_config()  # vLLM's config at the plan
        backend.model = None
        backend.start()
        conn.send(("ok", None))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", _describe(exc, rank)))
        return
    while True:
        op, *args = conn.recv()
        if op == "close":
            break
        try:
            if op == "facts":
                conn.send(("ok", _facts(backend)))
            elif op == "run":
                point, golden, routing = args
                try:
                    with _partials() as seen:
                        out = backend._run(point, golden, None if routing is None else Fixed(routing))
                except PointUnavailable as exc:
                    conn.send(("ok", ("unavailable", str(exc))))
                    continue
                conn.send(("ok", (out, seen)))
        except Exception as exc:
            conn.send(("error", _describe(exc, rank)))
    _destroy()


def _forget_inherited() -> None:
    """vLLM's process groups of the process this rank was forked from (where it ran one rank of its own),
    and torch's world under them, forgotten without being destroyed: their gloo state lives in threads
    a forked process does not have (destroying them here crashes the rank)."""
    from torch.distributed import distributed_c10d
    from vllm.distributed import parallel_state

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)
    parallel_state._NODE_COUNT = None
    distributed_c10d._world = distributed_c10d._World()


def _destroy() -> None:
    """This rank's own process groups, at its end."""
    from vllm.distributed import parallel_state

    with contextlib.suppress(Exception):
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


# -- the parent's side --------------------------------------------------------------------------------
@dataclass
class _Last:
    """The last point run on ranks: what its explanation needs."""

    point: str
    plan: Plan
    golden: GoldenRecord
    partials: list[list[torch.Tensor]]
    routing: Any


class Ranks:
    """A backend's rank processes: a pool per plan it runs on ranks (its own at TP > 1, and under
    `--parity-parallel` any other than its in-process one)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.pools: dict[tuple[int, int], tuple[RankPool, str, list[dict[str, Any]]]] = {}
        self.last: _Last | None = None

    def start(self, plan: Plan) -> list[dict[str, Any]]:
        """The plan's ranks, started (each builds vLLM's model) on first use; each rank's facts."""
        if plan.key not in self.pools:
            ident = f"moe-parity-vllm-{os.getpid()}-{next(_POOLS)}"
            serve = functools.partial(_serve, self.backend, plan, ident)
            pool = RankPool(plan.tp, "fork", serve=serve, prepare=None)
            self.pools[plan.key] = (pool, ident, pool.ask(f"the build at {plan.words}", "facts"))
        return self.pools[plan.key][2]

    @property
    def model_name(self) -> str | None:
        return next((facts[0]["model"] for _, _, facts in self.pools.values()), None)

    def run(self, plan: Plan, point: Point, golden: GoldenRecord, force: Any) -> CandidateOutput:
        """The point on every rank of `plan`; rank 0's output, with the ranks' evidence."""
        pool, _, facts = self.pools[plan.key] if plan.key in self.pools else (None, None, self.start(plan))
        if pool is not None and not pool.alive:  # a rank's process ended (a crash in vLLM's code): afresh
            self.close(plan)
            facts = self.start(plan)
        pool = self.pools[plan.key][0]
        _check_expert_map(point, plan, facts)
        routing = None
        if force is not None:  # vLLM's gate is replicated: rank 0's own routing stands for every rank's
            own = self._answers(pool, point, golden, None)[0][0].routing
            routing = tuple(t.detach() for t in force(own))
        answers = self._answers(pool, point, golden, routing)
        outs = [out for out, _ in answers]
        first = outs[0]
        info = dict(first.info)
        info["ranks"] = {"tp": plan.tp, "ep": plan.ep, "processes": len(outs)}
        notes = [f"vLLM at {plan.words}: {len(outs)} ranks, one process each (gloo); rank 0's output is judged"]
        firsts = [first_tensor(o.output) for o in outs]
        differ = ranks_differing(firsts) if all(f is not None for f in firsts) else []
        info["notes"] = [*info.get("notes", []), *notes]
        if differ:
            expected = first_tensor(self.backend.golden.load(point).output)
            merge(info, rank_evidence(firsts, differ, expected, stack="vLLM"))
        else:
            info["notes"].append("the ranks' outputs agree, as vLLM's collectives make them")
        self.last = _Last(point.id, plan, golden, [seen for _, seen in answers], first.routing)
        if getattr(self.backend.arch_calls, "latent_cache", False):  # MLA: every rank holds the whole latent
            cache = _agreed([o.cache for o in outs], info)
        else:
            config = self.backend.golden.config
            kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads", 1)
            cache = _gathered([o.cache for o in outs], plan.tp, kv_heads)
        return CandidateOutput(first.output, first.routing, seconds=first.seconds, info=info, cache=cache)

    def _answers(self, pool: RankPool, point: Point, golden: GoldenRecord, routing: Any) -> list[Any]:
        answers = pool.ask(f"{point.id}", "run", point, golden, routing)
        for answer in answers:
            if isinstance(answer, tuple) and answer and answer[0] == "unavailable":
                raise PointUnavailable(answer[1])
        return answers

    def explain(self, point: Point, golden: GoldenRecord) -> dict[str, Any]:
        """A failed MoE point run on ranks: each rank's partial sum against its shard of the checkpoint."""
        last = self.last
        if last is None or last.point != point.id or point.component not in ("experts", "moe"):
            return {}
        if not all(len(seen) == 1 for seen in last.partials):
            return {}
        if point.component == "experts":
            x, ids, weights = golden.args[:3]
        elif last.routing is not None:
            x, (_, weights, ids) = golden.args[0], last.routing[:3]
        else:
            return {}
        facts = self.pools[last.plan.key][2]
        if not all("experts" in f for f in facts):
            return {}
        return shard_evidence(
            self.backend, point, x, ids, weights, [seen[0] for seen in last.partials], facts, last.plan
        )

    def close(self, plan: Plan | None = None) -> None:
        """The ranks of `plan` (of every plan) ended, and the shared memory vLLM's all-reduce left."""
        for key in [k for k in self.pools if plan is None or k == plan.key]:
            pool, ident, _ = self.pools.pop(key)
            pool.close()
            for path in glob.glob(f"/dev/shm/{glob.escape(ident)}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.last = None


# the points whose call runs the MoE's experts kernel
MOE_CALLS = ("experts", "moe", "output")


def _check_expert_map(point: Point, plan: Plan, facts: list[dict[str, Any]]) -> None:
    """A MoE point under expert parallelism where a rank's probe found vLLM's experts kernel computing an
    expert the rank does not hold: not run (on the rank holding the low experts the global ids run past its
    local weights: a read out of bounds, a crash of its process), the finding said instead."""
    found = [(r, f) for r, f in enumerate(facts) if f.get("foreign") is not None]
    if plan.ep == 1 or point.component not in MOE_CALLS or not found:
        return
    rank, held = found[0]
    raise BackendError(
        f"not run at {plan.words}: vLLM's {held['kernel']} does not apply the expert map under "
        f"enable_expert_parallel: rank {rank} (experts {_span(held['experts'])}) computed global expert "
        f"{held['foreign']}, which it does not hold, as its local expert {held['foreign']}; it indexes its "
        f"{len(held['experts'])} local experts with global ids, so the ranks' MoE outputs are wrong, and a rank "
        "given ids past its local experts reads out of bounds (its process crashes)"
    )


def _agreed(caches: list[CacheState | None], info: dict[str, Any]) -> CacheState | None:
    """The ranks' caches where each holds the whole (MLA's latent cache: vLLM's `kv_a_proj_with_mqa` is
    replicated, not sharded): rank 0's, the ranks that hold another said in the row's notes."""
    if not caches or any(c is None for c in caches):
        return None
    first = caches[0]
    differ = [
        r for r, c in enumerate(caches) if not (torch.equal(c.keys, first.keys) and torch.equal(c.values, first.values))
    ]
    if differ:
        ranks = ", ".join(map(str, differ))
        info["notes"].append(f"the ranks' latent caches differ (ranks {ranks} from rank 0's): rank 0's is judged")
    return first


def _gathered(caches: list[CacheState | None], tp: int, total: int) -> CacheState | None:
    """The ranks' KV caches after a decode step (each its own kv heads of `total`) as the model's whole
    cache: each head from the first rank that holds it."""
    if not caches or any(c is None for c in caches):
        return None
    held = [rank_kv_heads(total, tp, r) for r in range(tp)]
    owners = [next((r, held[r].index(h)) for r in range(tp) if h in held[r]) for h in range(total)]
    keys = torch.cat([caches[r].keys[:, i : i + 1] for r, i in owners], dim=1)
    values = torch.cat([caches[r].values[:, i : i + 1] for r, i in owners], dim=1)
    return dataclasses.replace(caches[0], keys=keys, values=values)


def shard_evidence(
    backend: Any, point: Point, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    partials: list[torch.Tensor], facts: list[dict[str, Any]], plan: Plan,
) -> dict[str, Any]:  # fmt: skip
    """Each rank's partial sum of a MoE layer before vLLM's all-reduce against its shard of the checkpoint's
    experts (the experts the rank holds, the columns of their intermediate size it holds: the reference's
    SwiGLU experts restricted to them, in float64, on the same routing): notes, and the hint naming the
    ranks whose partial leaves its shard's when the others' do not."""
    names = EXPERTS.get(backend.golden.model_type)
    if names is None or backend.setup.model_dir is None:
        return {}
    flat = x.reshape(-1, x.shape[-1]).double()
    ids, weights = ids.reshape(flat.shape[0], -1).long(), weights.reshape(flat.shape[0], -1).double()
    read = _expert_reader(Path(backend.setup.model_dir), point.layer, names)
    errors = []
    for partial, held in zip(partials, facts, strict=True):
        expected = torch.zeros_like(flat)
        lo, hi = held["columns"]
        for expert in held["experts"]:
            chosen = ids == expert
            rows = chosen.any(-1)
            if not rows.any():
                continue
            gate, up, down = read(expert)
            h = flat[rows]
            act = torch.nn.functional.silu(h @ gate[lo:hi].T) * (h @ up[lo:hi].T)
            expected[rows] += (weights * chosen).sum(-1)[rows, None] * (act @ down[:, lo:hi].T)
        errors.append(rel_l2_flat(partial.double().reshape(expected.shape), expected))
    floor = min(errors)
    named = [r for r, e in enumerate(errors) if e > max(1e-2, 8 * floor)]
    said = ", ".join(f"rank {r} {e:.3g}" for r, e in enumerate(errors))
    out: dict[str, Any] = {
        "notes": [
            f"each rank's partial sum before vLLM's all-reduce against its shard of the checkpoint's experts: {said}"
        ]
    }
    if named and len(named) < len(errors):
        which = ", ".join(f"rank {r}" for r in named)
        shards = "; ".join(
            f"rank {r}: experts {_span(facts[r]['experts'])}, intermediate columns {facts[r]['columns'][0]}:"
            f"{facts[r]['columns'][1]}"
            for r in named
        )
        out["hint"] = (
            f"{which} of {plan.tp} ({plan.words}): its partial sum leaves its shard of the checkpoint's experts "
            f"({shards}; rel_l2 {', '.join(f'{errors[r]:.3g}' for r in named)}) where the other ranks' match theirs: "
            "that rank's shard was loaded or changed otherwise (a wrong slice, a scale applied on one rank)"
        )
    return out


def _span(experts: list[int]) -> str:
    return f"{experts[0]}-{experts[-1]}" if experts == list(range(experts[0], experts[-1] + 1)) else str(experts)


def _expert_reader(model_dir: Path, layer: int | None, names: tuple[str, ...]) -> Any:
    """expert -> its (gate, up, down) weights from the checkpoint, in float64."""
    from safetensors import safe_open

    files = weight_map(model_dir)
    block, *projections = names

    @functools.cache
    def read(expert: int) -> tuple[torch.Tensor, ...]:
        out = []
        for name in projections:
            key = f"model.layers.{layer}.{block}.experts.{expert}.{name}.weight"
            with safe_open(str(model_dir / files[key]), "pt") as handle:
                out.append(handle.get_tensor(key).double())
        return tuple(out)

    return read
