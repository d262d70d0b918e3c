"""The gloo port of torch_xla's mesh process groups (`backends/nxdi/cpu/meshes.py`), which NxD's
expert-parallel MoE builds: run here in a real gloo world of four processes, without NxD (the
Neuron-stack leg runs NxD's own MoE on it: tests_neuron/test_real_nxdi.py)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pytest_moe_parity.backends.nxdi.cpu import meshes

WORLD = 4
MESH = [[0, 2], [1, 3]]  # NxD's expert-parallel mesh at TP 2 x EP 2: each row one group


@pytest.mark.parametrize(
    "ranks, expected",
    [([0, 2], MESH), ([0, 1, 2, 3], [[0, 1, 2, 3]]), ([1], [[0], [1], [2], [3]])],
    ids=["a-row", "the-world", "one-rank"],
)
def test_a_group_gets_the_mesh_torch_xla_gives_it(ranks: list[int], expected: list[list[int]]) -> None:
    assert meshes.mesh_of(ranks, MESH, WORLD) == expected


def _rank(rank: int, store: str, out: multiprocessing.Queue) -> None:
    os.environ.pop("MASTER_ADDR", None)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        meshes.install()
        plain = dist.new_group([0, 1, 2, 3])  # no mesh: passed on as it was
        group = dist.new_group(MESH[0], pg_options={"xla_pg_options": {"mesh": MESH}})
        again = dist.new_group(MESH[0], pg_options={"xla_pg_options": {"mesh": MESH}})  # the next module's
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)  # over this rank's row of the mesh, as on the device
        try:
            plain_mesh = plain._mesh
        except AttributeError as exc:
            plain_mesh = str(exc)
        out.put((rank, group._mesh, dist.get_process_group_ranks(group), float(value), plain_mesh, again is group))
    finally:
        dist.destroy_process_group()


def test_each_rank_reduces_over_its_own_row_of_the_mesh(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, mesh, members, total, plain, same in results:
        assert same, rank  # a mesh's group is made once per rank (gloo groups hold connections)
        row = MESH[rank % 2]
        assert mesh == MESH, rank
        assert members == row, rank
        assert total == sum(row), rank  # 0 + 2 on ranks 0 and 2, 1 + 3 on ranks 1 and 3
        assert plain == "'ProcessGroup' object has no attribute '_mesh'", rank
