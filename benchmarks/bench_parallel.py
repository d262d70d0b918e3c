"""What the parallel differential costs on NxDI's own modules (`--hw nxdi --hw-option build=cpu`):
each point's `::parallel` item (the point's module built and run under plan A and under plan B, B judged
against A and each against the golden) against the point's own item, per plan pair, in one process.

    python benchmarks/bench_parallel.py --golden G --model M [--plans "tp=1:tp=2;tp=2:tp=2,ep=2"]
        [--block-size 16] [--points attention,experts,moe,output]

It runs on the Neuron SDK's stack (transformers 4.57, NxDI and NxD on PYTHONPATH: what
`.ci/neuron-leg` sets up) against a golden recorded under transformers 5 (the leg's
`$MOE_PARITY_T5_GOLDENS/qwen3_moe-golden` and `-model`). Times are medians of 5, the module of each
plan already built (the first call of an item builds them: printed apart). On this project's 2-core
host, qwen3_moe's tiny model, 16 tokens (the point's own item at plan A's degrees):

    tp=1:tp=2         layer_0.attention  8.6 ms, ::parallel 29.5 ms (3.4x); first call 477 ms
    tp=1:tp=2         layer_0.experts  17.3 ms, ::parallel 33.2 ms (1.9x); first call 42 ms
    tp=1:tp=2         layer_0.moe  19.6 ms, ::parallel 44.8 ms (2.3x); first call 59 ms
    tp=1:tp=2         layer_0.output  22.4 ms, ::parallel 47.0 ms (2.1x); first call 66 ms
    tp=2:tp=2,ep=2    layer_0.attention  19.5 ms, ::parallel 29.3 ms (1.5x); first call 362 ms
    tp=2:tp=2,ep=2    layer_0.experts  27.4 ms, ::parallel 41.1 ms (1.5x); first call 70 ms
    tp=2:tp=2,ep=2    layer_0.moe  25.8 ms, ::parallel 51.9 ms (2.0x); first call 67 ms
    tp=2:tp=2,ep=2    layer_0.output  40.7 ms, ::parallel 57.2 ms (1.4x); first call 103 ms

(a parallel item runs the point under both plans, each over its ranks' pipes, and judges three
pairs; the first call also starts a plan's ranks and builds its modules).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_differentials import median_seconds

from pytest_moe_parity.replay.parallel import ParallelEntry
from pytest_moe_parity.session import ParitySession, RunOptions


def bench(golden: Path, model: Path, plans: str, block_size: int | None, components: list[str]) -> None:
    options = ["build=cpu"] + ([f"block_size={block_size}"] if block_size else [])
    plan_a = plans.split(":")[0]
    degrees = dict(part.split("=") for part in plan_a.split(","))
    options += [f"tp_degree={degrees.get('tp', 1)}", f"ep_degree={degrees.get('ep', 1)}"]
    session = ParitySession(RunOptions(golden_dir=golden, hw="nxdi", model=model, hw_options=options, parallel=plans))
    try:
        items = session.checkers["parallel"]
        for component in components:
            point = next((p for p in session.points if p.component == component and p.step is None), None)
            if point is None:
                continue
            entry = ParallelEntry(point, items.place(point))
            session.runner.run(point)
            started = time.perf_counter()
            row, failure = items.check(entry, {})
            first = time.perf_counter() - started
            assert row.status == "passed", failure
            point_s = median_seconds(lambda point=point: session.runner.run(point))
            parallel_s = median_seconds(lambda entry=entry: items.check(entry, {}))
            print(f"{plans:<16}  {point.id}  {point_s * 1e3:.1f} ms, ::parallel {parallel_s * 1e3:.1f} ms "
                  f"({parallel_s / point_s:.1f}x); first call {first * 1e3:.0f} ms")  # fmt: skip
    finally:
        session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--plans", default="tp=1:tp=2;tp=2:tp=2,ep=2", help="plan pairs A:B, separated by ;")
    parser.add_argument("--block-size", type=int, default=16, help="NxD's blockwise block size (EP's prefill path)")
    parser.add_argument("--points", default="attention,experts,moe,output", help="components, the first layer's")
    args = parser.parse_args()
    for plans in args.plans.split(";"):
        bench(args.golden, args.model, plans, args.block_size, args.points.split(","))


if __name__ == "__main__":
    main()
