"""Intra-op threads that fit the cores other processes leave free, for passes of many small operations.

A metric pass runs about twenty torch operations per chunk, each one of OpenMP's parallel regions when
the chunk is larger than torch's grain (32768 elements). When the process's threads outnumber the cores
other work leaves free (another pytest worker, a build, a second model), every region waits for its
descheduled threads' next time slice: the full metric set on two 256 MB tensors took 0.15 s to 14 s
with two threads beside two busy processes on two cores, against 0.13-0.17 s on one thread. So such a
pass looks, at most every `_RECHECK_S` seconds, at how many threads are runnable on the machine
(Linux's /proc/loadavg) less this process's own, and runs on the cores left (at least one).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

__all__ = ["fitted_threads", "free_cores"]

# Below this many elements no operation of the pass opens a parallel region (torch's grain size).
_GRAIN = 32768
_RECHECK_S = 0.05
_last: tuple[float, int | None] = (-1.0, None)


def _runnable_own() -> int:
    """This process's threads that are running or waiting for a core (state R)."""
    count = 0
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # the thread ended meanwhile
            continue
        state = stat.rindex(b")") + 2  # the state follows the command name, which may hold spaces
        count += stat[state : state + 1] == b"R"
    return count


def free_cores() -> int | None:
    """The cores this process may run on that no other process's runnable thread takes now (at least
    one); None where the machine does not say (no /proc/loadavg)."""
    try:
        with open("/proc/loadavg", "rb") as fh:
            runnable = int(fh.read().split()[3].split(b"/")[0])
        others = max(0, runnable - _runnable_own())
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    except (OSError, ValueError, IndexError):
        return None
    return max(1, cores - others)


def _cached_free_cores() -> int | None:
    global _last
    now = time.monotonic()
    if now - _last[0] > _RECHECK_S:
        _last = (now, free_cores())
    return _last[1]


@contextlib.contextmanager
def fitted_threads(numel: int) -> Iterator[int]:
    """Run the block on torch's intra-op threads, or on fewer when other processes leave fewer cores
    free; yields the count used. Tensors too small to open parallel regions are left alone."""
    threads = torch.get_num_threads()
    free = _cached_free_cores() if numel > _GRAIN and threads > 1 else None
    if free is None or free >= threads:
        yield threads
        return
    torch.set_num_threads(free)
    try:
        yield free
    finally:
        torch.set_num_threads(threads)
