"""A busy process per core beside a measurement (`with busy_cores(): ...`), as another pytest
worker, a build or a second job takes the machine: each a pure-Python spin loop (the GIL lets one
thread run at a time, so a process per core), stopped when the block ends."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


@contextlib.contextmanager
def busy_cores(on: bool = True) -> Iterator[None]:
    """One spinning process per core this process may run on while the block runs (none with `on`
    False)."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(cores if on else 0)]
    for proc in spinners:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in spinners:
            proc.join()
