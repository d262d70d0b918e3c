"""NxD's modules on the CPU, one process per tensor-parallel rank, as NxDI's own CPU inference
runs them (`NeuronApplicationBase.to_cpu`): `NXD_CPU_MODE=1`, a gloo process group of `tp_degree`
ranks, `initialize_model_parallel(tp_degree, skip_collective_init=True)` (NxD's MoE splits those
ranks into expert-parallel and MoE tensor-parallel groups: XLA mesh groups on the device, made of
gloo groups here by `meshes`); per module: built from its class and keywords, the checkpoint sharded
by NxD's `get_sharded_checkpoint` for each rank and loaded. Like NxDI's `build_module`, it casts
nothing: the module and checkpoint keep their dtypes. The collectives NxD's layers call (all-reduce,
all-gather) run for real over gloo.

`build_module` has the signature of NxDI's `utils.testing.build_module`, whose trace to a NEFF
and compile cannot run here: a test or a user's script swaps one for the other. What it returns
is called like the traced model (positional tensors, rank 0's outputs) and also keeps every
rank's outputs of its last call (`rank_outputs`), the per-rank evidence a TP failure needs."""

from __future__ import annotations

import ast
import atexit
import contextlib
import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import meshes, standins


class RankFailure(RuntimeError):
    """A rank's process raised: the message is its exception and where it was raised."""


# -- the rank's side ------------------------------------------------------------------------------
def _load(module: torch.nn.Module, state: dict[str, torch.Tensor], rank: int, tp_degree: int) -> list[str]:
    """NxD's sharded loading (`get_sharded_checkpoint`, then `load_state_dict(strict=False)` as
    NxDI's CPU path does), refusing a module that would keep initial values for tensors the
    checkpoint lacks (NxD's loading would leave them as initialised, quietly); returns the checkpoint
    keys NxD dropped as unknown to the module (`RankedModule.dropped_keys`: in a clean NxDI build the
    names its preshard hooks copied elsewhere, e.g. q_proj into qkv_proj, so not a finding). NxD's
    SPMDRank (a rank inside a traced graph) holds `arange(world_size)` in a checkpoint, as its
    docstring asks; where a checkpoint leaves it out (NxDI's own module tests do), that is put in."""
    from neuronx_distributed.parallel_layers.layers import SPMDRank
    from neuronx_distributed.trace.trace import get_sharded_checkpoint

    for name, sub in module.named_modules():  # its documented checkpoint value, where one leaves it out
        if isinstance(sub, SPMDRank):
            state.setdefault(f"{name}.rank" if name else "rank", torch.arange(sub.world_size, dtype=torch.int32))
    # a tensor the module holds under two names (GPT-OSS's MoE shares the decoder layer's post-attention
    # norm as its `rmsnorm`) is loaded by either: its other names are not wanted
    names: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        get_sharded_checkpoint(state, module, rank, tp_degree)
    dropped: list[str] = []
    for warning in said:  # NxD drops what its preshard hooks left unknown to the module, and warns only
        text = str(warning.message)
        if text.startswith(REDUNDANT):
            dropped += ast.literal_eval(text[len(REDUNDANT) :].strip())
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    missing = sorted(group[0] for group in names.values() if not set(group) & set(state))
    if missing:
        raise RankFailure(
            f"the checkpoint has no tensor for {len(missing)} of the module's ({', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''}): NxD would leave them at their initial values"
        )
    module.load_state_dict(state, strict=False)
    return dropped


KEPT = 64  # modules a rank holds at most
REDUNDANT = "Removing redundant keys from checkpoint:"  # NxD's preprocess_checkpoint


class XlaSemantics(torch.overrides.TorchFunctionMode):
    """What a traced graph computes where eager torch is stricter: torch_xla's `torch.where` takes a
    non-boolean condition as `condition != 0` (checked with torch_xla 2.9 on its CPU device), and
    NxDI's own module tests feed a float mask to token generation's `torch.where`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.where and args and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool:
            args = (args[0] != 0, *args[1:])
        return func(*args, **kwargs)


# What NxD says on the CPU only, about the CPU: its blockwise experts (the expert-parallel MoE's path)
# fall back from the NKI kernel to their torch implementation, which is what runs here.
CPU_NOTICES = ("Cannot run blockwise NKI kernel on CPU",)


@contextlib.contextmanager
def _cpu_notices():
    """NxD's notices about running on the CPU kept out of a run that errors on warnings."""
    with warnings.catch_warnings():
        for notice in CPU_NOTICES:
            warnings.filterwarnings("ignore", message=notice, category=UserWarning)
        yield


def _serve(rank: int, tp_degree: int, store: str, conn: Any, threads: int) -> None:
    os.environ["NXD_CPU_MODE"] = "1"
    standins.install()
    torch.set_num_threads(threads)
    modules: dict[int, torch.nn.Module] = {}
    try:
        from neuronx_distributed.parallel_layers import parallel_state

        if torch.distributed.is_initialized():  # forked from a process that had a group: not this rank's
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp_degree)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_degree, skip_collective_init=True)
        meshes.install()  # NxD's expert-parallel groups, XLA mesh groups on the device
        conn.send(("ok", None))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(("error", _describe(exc, rank)))
        return
    while True:
        op, *args = conn.recv()
        try:
            if op == "close":
                break
            if op == "build":
                handle, path, module_cls, kwargs, checkpoint, loader = args
                for entry in path:
                    if entry not in sys.path:
                        sys.path.append(entry)
                while len(modules) >= KEPT:  # the oldest first, where the parent did not drop them
                    modules.pop(next(iter(modules)))
                meshes.fresh_moe_groups()
                with torch.no_grad():
                    torch.manual_seed(0)
                    module = module_cls(**kwargs)
                    dropped = _load(module, loader(checkpoint), rank, tp_degree)
                modules[handle] = module.eval()
                conn.send(("ok", dropped))
            elif op == "drop":
                for handle in args[0]:
                    modules.pop(handle, None)
                continue  # no reply
            elif op == "run":
                handle, inputs = args
                # the rank's own copy: tensors come through the pipe in memory shared with the other ranks
                # and the caller, and a module writing its input in place (GPT-OSS's RMSNorm in float32)
                # must not change theirs (a traced graph's inputs are immutable device buffers)
                inputs = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
                with torch.no_grad(), XlaSemantics(), _cpu_notices():
                    conn.send(("ok", _held(modules, handle)(*inputs)))
            elif op == "capture":  # --parity-drill: the forward op by op (pickled here: an op is sent by name)
                handle, inputs, router, capture = args
                module = _held(modules, handle)
                with XlaSemantics(), _cpu_notices():  # its ops named below the NxDI module it wraps
                    captured = capture(module, list(inputs), {}, router=router, root=getattr(module, "inner", None))
                conn.send(("ok", pickle.dumps(captured)))
        except Exception as exc:
            conn.send(("error", _describe(exc, rank)))
    with contextlib.suppress(Exception):
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _held(modules: dict[int, torch.nn.Module], handle: int) -> torch.nn.Module:
    if handle not in modules:
        raise RankFailure(f"this module was dropped (a rank keeps the last {KEPT} built)")
    return modules[handle]


def _describe(exc: BaseException, rank: int) -> str:
    """`rank R: Error: message (file:line)`, file:line the innermost frame outside this package:
    the upstream code that raised, not our wrapper that called it."""
    ours = str(Path(__file__).resolve().parents[3])
    where = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in where if not f.filename.startswith(ours)]
    frame = (theirs or where)[-1] if where else None
    at = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"rank {rank}: {type(exc).__name__}: {exc}{at}"


# -- the parent's side ----------------------------------------------------------------------------
class RankPool:
    """`tp_degree` processes, each a rank of one gloo group, holding one built module at a time. `serve`
    is what each rank runs, `serve(rank, tp_degree, store, conn, threads)` (NxD's by default; `--hw
    vllm`'s ranks run vLLM's), answering each message with ("ok", payload) or ("error", text);
    `prepare` runs here before the ranks start (NxD's: the Neuron packages' stand-ins)."""

    def __init__(
        self, tp_degree: int, start: str = "fork", serve: Callable = _serve, prepare: Callable | None = standins.install
    ):
        if prepare is not None:
            prepare()
        self.tp_degree = tp_degree
        self._dir = tempfile.TemporaryDirectory(prefix="moe-parity-ranks-")
        if start not in multiprocessing.get_all_start_methods():
            start = "spawn"
        context = multiprocessing.get_context(start)
        # A forked rank runs one thread, as PyTorch's DataLoader workers do: a process forked after
        # its parent ran OpenMP threads can hang at its first parallel op under GNU OpenMP (seen:
        # NxDI's MoE test, whose reference runs first, hung in its experts' __init__). A spawned rank
        # (~10 s of imports) takes its share of the cores.
        threads = 1 if start == "fork" else max(1, torch.get_num_threads() // tp_degree)
        self._conns, self._procs = [], []
        for rank in range(tp_degree):
            parent, child = context.Pipe()
            store = os.path.join(self._dir.name, "store")
            proc = context.Process(target=serve, args=(rank, tp_degree, store, child, threads), daemon=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: a fork beside threads
                proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._handles = 0
        self._gather("start")

    def _gather(self, what: str) -> list[Any]:
        replies = []
        for rank, conn in enumerate(self._conns):
            try:
                replies.append(conn.recv())
            except EOFError:
                code = self._procs[rank].exitcode
                replies.append(("error", f"rank {rank}: its process ended (exit code {code}) during {what}"))
        errors = [payload for status, payload in replies if status == "error"]
        if errors:
            raise RankFailure("; ".join(dict.fromkeys(errors)))
        return [payload for _, payload in replies]

    def _broadcast(self, *message: Any) -> None:
        for conn in self._conns:
            conn.send(message)

    def ask(self, what: str, *message: Any) -> list[Any]:
        """Every rank's answer to `message` (RankFailure naming the ranks that raised); `what` names it
        where a rank's process ends."""
        self._broadcast(*message)
        return self._gather(what)

    def build(self, module_cls: type, kwargs: dict[str, Any], checkpoint: str, loader: Callable) -> RankedModule:
        self._handles += 1
        self._broadcast("build", self._handles, list(sys.path), module_cls, kwargs, checkpoint, loader)
        dropped = self._gather(f"the build of {module_cls.__name__}")[0]
        return RankedModule(self, self._handles, dropped)

    def drop(self, handles: list[int]) -> None:
        """Frees these modules on every rank."""
        if handles and self.alive:
            self._broadcast("drop", handles)

    def run(self, handle: int, inputs: tuple[torch.Tensor, ...]) -> list[Any]:
        self._broadcast("run", handle, tuple(inputs))
        return self._gather("a forward")

    def capture(
        self, handle: int, inputs: tuple[torch.Tensor, ...], router: bool | None, capture: Callable
    ) -> list[tuple[Any, Any]]:
        """Every rank's (op graph, output) of one forward, captured by `capture` (the drill's
        `capture_ops`, sent by reference) in each rank."""
        self._broadcast("capture", handle, tuple(inputs), router, capture)
        return [pickle.loads(data) for data in self._gather("a captured forward")]  # from our own ranks

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("close",))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._dir.cleanup()


class RankedModule:
    """A module built on every rank, called as a traced NxD model is: rank 0's outputs."""

    def __init__(self, pool: RankPool, handle: int, dropped: list[str]):
        self.pool, self.handle = pool, handle
        self.dropped_keys = dropped  # checkpoint keys NxD's loading dropped as unknown to the module
        self.rank_outputs: list[Any] = []

    def __call__(self, *inputs: torch.Tensor) -> Any:
        self.rank_outputs = self.pool.run(self.handle, inputs)
        return self.rank_outputs[0]

    def capture_ops(self, capture: Callable, args: list, kwargs: dict, router: bool | None = None) -> list:
        """`--parity-drill`: every rank's (op graph, output) of a call, captured where it runs."""
        if kwargs:
            raise TypeError("a ranked module is called with positional tensors only")
        return self.pool.capture(self.handle, tuple(args), router, capture)

    def release(self) -> None:
        """Frees the module on its ranks."""
        self.pool.drop([self.handle])


_POOLS: dict[int, RankPool] = {}


# How ranks start: "fork" (they inherit this process's imports; one thread each), or "spawn" (a
# fresh interpreter each, ~10 s of imports, then their share of the cores): NxDI's own module tests,
# whose large references run before the ranks start, take spawn.
START = {"method": "fork"}


def pool(tp_degree: int) -> RankPool:
    """The process's pool of `tp_degree` ranks, started on first use and kept until `close_pools`
    (a TP differential holds two: TP N and TP 1)."""
    current = _POOLS.get(tp_degree)
    if current is None or not current.alive:
        if current is not None:
            current.close()
        _POOLS[tp_degree] = RankPool(tp_degree, START["method"])
    return _POOLS[tp_degree]


@atexit.register
def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def build_module(
    module_cls: type,
    example_inputs: list[tuple[torch.Tensor, ...]],
    module_init_kwargs: dict[str, Any] | None = None,
    tp_degree: int = 1,
    world_size: int | None = None,
    local_ranks_size: int | None = None,
    compiler_args: str | None = None,
    compiler_workdir: str | None = None,
    checkpoint_path: str | None = None,
    priority_model_idx: int | None = 0,
    logical_nc_config: int = 1,
    dry_run: bool = False,
    checkpoint_loader_fn: Callable[[str], dict[str, torch.Tensor]] | None = None,
) -> RankedModule | None:
    """NxDI's `build_module` on the CPU: the module built on `tp_degree` ranks and loaded from
    `checkpoint_path`. The compiler's arguments and workdir have nothing to do
    here; `example_inputs` is checked as NxDI checks it. The world is the TP degree, as NxDI lays it
    out (expert parallelism splits it: moe_tp_degree x moe_ep_degree = tp_degree); a world beyond it
    (pipeline parallelism) is not run on the CPU."""
    if not (
        isinstance(example_inputs, list)
        and all(isinstance(t, tuple) and all(isinstance(x, torch.Tensor) for x in t) for t in example_inputs)
    ):
        raise ValueError("example_inputs must be a list of tensor tuples")
    if len(example_inputs) != 1:
        raise ValueError("example_inputs must contain exactly one input")
    if world_size not in (None, tp_degree):
        raise NotImplementedError(
            f"the CPU build runs a world of tp_degree ranks (expert parallelism inside it): world_size={world_size}, "
            f"tp_degree={tp_degree}"
        )
    if checkpoint_path is None:
        raise NotImplementedError(
            "the CPU build loads a checkpoint (checkpoint_path=...): NxDI's build_module without one saves the "
            "module's own initial weights under an XLA process group, which needs a Neuron device"
        )
    if dry_run:
        return None
    ranks = pool(tp_degree)
    loader = checkpoint_loader_fn or load_torch
    return ranks.build(module_cls, dict(module_init_kwargs or {}), str(checkpoint_path), loader)


def load_torch(path: str) -> dict[str, torch.Tensor]:
    """The default loader: NxDI's is `torch.load`; tensors only here (no pickled code is run)."""
    return torch.load(path, weights_only=True)
