"""The tensor-parallel all-reduce of NxD's row-parallel layers, between the ranks the test
double's build_module runs (one thread per rank, tests/doubles/.../utils/testing.py)."""

import threading

_ranks = threading.local()


class Group:
    """The ranks of one traced call: each rank's tensor in, their sum out to every rank."""

    def __init__(self, size):
        self.size = size
        self.slots = [None] * size
        self.barrier = threading.Barrier(size)

    def all_reduce(self, rank, tensor):
        self.slots[rank] = tensor
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0])
        self.barrier.wait()
        return total


def joined(group, rank):
    """Run the calling thread as `rank` of `group`."""
    _ranks.group, _ranks.rank = group, rank


def rank_and_size():
    """(this thread's rank, the TP degree); (0, 1) outside a traced call."""
    group = getattr(_ranks, "group", None)
    return (0, 1) if group is None else (_ranks.rank, group.size)


def reduce_from_tensor_model_parallel_region(tensor, process_group=None):
    group = getattr(_ranks, "group", None)
    return tensor if group is None else group.all_reduce(_ranks.rank, tensor)
