"""NxD's mesh process groups on gloo: the one device piece expert parallelism needs on the CPU.

NxD builds its MoE's expert-parallel and MoE tensor-parallel groups
(`neuronx_distributed.modules.moe.moe_process_group.init_tensor_expert_parallel_moe_process_groups`)
as torch_xla's SPMD groups: `torch.distributed.new_group(MESH[0], pg_options={"xla_pg_options":
{"mesh": MESH}})`, one group whose collectives run on each rank over that rank's row of MESH, the
rows read back as `group._mesh` (`parallel_state.get_expert_parallel_rank_from_global_rank` maps
every global rank to its expert-parallel rank by them). That is torch_xla's `new_xla_process_group`
(torch_xla/distributed/xla_backend.py), which takes an XLA world. On gloo, `new_group` ignores the
mesh: rank 0 gets a group of MESH[0] without `_mesh`, a rank outside MESH[0] none at all.

`install` puts a gloo port of `new_xla_process_group` in front of `new_group` in a rank: where a call
carries an XLA mesh, every rank joins the creation of a gloo group per row (gloo creates a group
with every rank of the world taking part), keeps its own row's, and the group answers `_mesh` with
the mesh torch_xla would give it (its rules for the whole world and for a one-rank group kept).
Collectives on it then run over the rank's row, as on the device. Any other call is passed on as it
was, and any other group still has no `_mesh`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist

_MESHES: dict[Any, list[list[int]]] = {}  # the groups made here -> the mesh torch_xla would give them
# this rank's group of each mesh made: every module NxD builds asks for its plan's groups again, and each
# gloo group holds connections to its peers, so one mesh's group is made once per rank and handed out
# after (every rank asks in the same order, so all of them find it or none)
_MADE: dict[tuple[tuple[int, ...], ...], Any] = {}
_ORIGINAL: dict[str, Any] = {}
# NxD keeps the MoE's groups per process, made by the first MoE module built; a rank builds modules
# of other plans after it (TP 2, then TP 1 x EP 2 on the same ranks), so each build starts afresh.
MOE_GROUPS = (
    "_MOE_TKG_TENSOR_MODEL_PARALLEL_GROUP",
    "_MOE_TKG_EXPERT_MODEL_PARALLEL_GROUP",
    "_MOE_CTE_TENSOR_MODEL_PARALLEL_GROUP",
    "_MOE_CTE_EXPERT_MODEL_PARALLEL_GROUP",
)


def _mesh_of(group: Any) -> list[list[int]]:
    """`ProcessGroup._mesh`: the mesh of a group made here; AttributeError for any other, as before
    (a pybind ProcessGroup takes no attribute of its own, so the class answers for the groups)."""
    try:
        return _MESHES[group]
    except (KeyError, TypeError):
        raise AttributeError(f"'{type(group).__name__}' object has no attribute '_mesh'") from None


def mesh_of(ranks: list[int], mesh: list[list[int]], world: int) -> list[list[int]]:
    """The mesh torch_xla gives `new_group(ranks, pg_options={"xla_pg_options": {"mesh": mesh}})`."""
    if ranks == list(range(world)):
        return [ranks]
    if len(ranks) == 1:
        return [[r] for r in range(world)]
    return mesh


def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None, **kwargs: Any):
    """`torch.distributed.new_group`, with torch_xla's mesh groups made of gloo groups (see the module)."""
    original = _ORIGINAL["new_group"]
    mesh = None
    if isinstance(pg_options, dict) and isinstance(pg_options.get("xla_pg_options"), dict):
        mesh = pg_options["xla_pg_options"].get("mesh")
    if mesh is None or ranks is None:
        return original(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kwargs)
    mesh = mesh_of(list(ranks), [list(row) for row in mesh], dist.get_world_size())
    key = tuple(tuple(row) for row in mesh)
    if key in _MADE:
        return _MADE[key]
    me, mine = dist.get_rank(), None
    for row in mesh:
        group = original(ranks=row, timeout=timeout, backend="gloo", **kwargs)
        if me in row:
            mine = group
    if mine is None:
        raise ValueError(f"rank {me} is in no row of the mesh {mesh}")
    _MESHES[mine] = mesh
    _MADE[key] = mine
    return mine


def install() -> None:
    """In a rank, after its gloo world is up: the port in front of `new_group` (torch_xla's own, where
    importing torch_xla put one there), `_mesh` on process groups."""
    if _ORIGINAL:
        return
    with contextlib.suppress(ImportError):  # torch_xla replaces dist.new_group when imported: stand in front of it
        import torch_xla.distributed.xla_backend  # noqa: F401
    _ORIGINAL["new_group"] = dist.new_group
    dist.ProcessGroup._mesh = property(_mesh_of)  # type: ignore[attr-defined]
    dist.new_group = new_group


def fresh_moe_groups() -> None:
    """Forget the MoE groups NxD made for the last module: the next builds its own plan's."""
    try:
        from neuronx_distributed.modules.moe import moe_process_group
    except ImportError:
        return
    for name in MOE_GROUPS:
        if hasattr(moe_process_group, name):
            setattr(moe_process_group, name, None)
