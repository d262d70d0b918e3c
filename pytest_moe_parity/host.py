"""The process's own state, with one owner: torch's intra-op threads (held and put back; fitted to
the cores other processes leave free), glibc's heap (freed pages handed back, large allocations
mapped on their own), and the garbage collector (long-lived objects frozen out of its walks). Every
change here is process-wide; each is undone by whoever made it, or said to be left set.

Threads fitted to free cores:
Intra-op threads that fit the cores other processes leave free, for passes of many small operations.

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
import ctypes
import ctypes.util
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "HeldThreads", "fitted_threads", "free_cores", "freeze_long_lived", "malloc_trim", "map_large_allocations",
]  # fmt: skip


# -- threads --------------------------------------------------------------------------------------
class HeldThreads:
    """torch's intra-op threads (the calling thread's setting under OpenMP), changed for a while and
    put back by `restore` to what they were when first held: the session's, a backend's forwards' and
    a lazy model's read-ahead all change this process state and give it back on close."""

    def __init__(self) -> None:
        self.before: int | None = None  # torch's threads when first held (None: not held)

    def hold(self) -> None:
        """Remember the threads to put back, without changing them (once)."""
        import torch

        if self.before is None:
            self.before = torch.get_num_threads()

    def set(self, count: int) -> None:
        import torch

        self.hold()
        if count != torch.get_num_threads():
            torch.set_num_threads(count)

    def restore(self) -> None:
        import torch

        if self.before is not None:
            torch.set_num_threads(self.before)
            self.before = None


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
    import torch

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


# -- the heap (glibc; a no-op elsewhere) ----------------------------------------------------------
def malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc). Expert tensors of a few MB fall below glibc's
    adaptive mmap threshold after the first frees and are then carved from the heap, where freed
    layers would otherwise stay resident."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_allocations(threshold: int = 2**20) -> None:
    """Serve every allocation of `threshold` bytes or more from its own mapping, handed back to the OS
    when freed (glibc; a no-op elsewhere). glibc otherwise raises its mmap threshold to the size of
    each large block freed, and a long prompt's activations (tens of MB each) then come from a heap
    whose freed pages stay resident: at 4096 tokens that moved a recording's peak between 0.95 and
    1.35 GB from run to run, against 0.84 GB with this. Process-wide, and left set."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(M_MMAP_THRESHOLD, int(threshold))


def gib(n: int) -> str:
    """A size in bytes as people read one: GiB, MiB or KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# oneDNN's primitive cache and PyTorch's LRU cache of oneDNN ops (bf16 matmuls on the CPU), each read
# from the environment when first used; the library defaults keep up to 1024 entries each.
ONEDNN_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = 64) -> None:
    """Cap the caches of oneDNN's bf16 CPU matmuls at `capacity` entries each, unless the user set them
    (their variables are read on first use: set before the first bf16 forward). A run over many layers
    otherwise grows by what every new layer's primitives keep until the caches' 1024 entries fill:
    measured on 2 cores, 48 Mixtral-style layers (hidden 512, 16 experts) in bfloat16, malloc'd memory
    +5 to +10 MB a layer for the first ~20 layers (+140 MB in all: a noise floor's or a bf16 replay's
    peak growing with depth), flat after the second layer with 64 entries each, at no measurable cost
    in time (1024, 256, 64 and 16 entries within the run-to-run spread of ~10 %)."""
    for name in ONEDNN_CACHES:
        os.environ.setdefault(name, str(int(capacity)))


def _load_libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


# -- the garbage collector ------------------------------------------------------------------------
def freeze_long_lived() -> bool:
    """Keep the objects alive now (once the backend has started) out of the garbage collector's
    sight, until the runner's `close()` thaws them. torch, transformers, the modeling code and the
    candidate's skeleton are some 400k objects, which every full collection would walk again for
    nothing: on 48 Mixtral-style layers, the collections during a run and pytest's two at its end
    took ~0.7 s of ~10 s after imports, and 0.02 s frozen. Nothing is frozen where the collector is
    off, or where someone froze objects before us (a thaw would be theirs to do)."""
    if not gc.isenabled() or gc.get_freeze_count():
        return False
    gc.freeze()
    return True
