"""What the differentials cost, on a tiny model at a given length:

- routing: a MoE block's routing item (`--parity-routing ids+weights`: the block replayed three times
  and judged three times) against the block's own item; `moe-parity routes` on a trace of --tokens
  tokens (the golden's own routing tiled: the judge's work, not the golden's reading, scales with it);
- batch: a point's batch-invariance item (`--parity-batch-invariance`: the point on the batch, then on
  each row alone, each judged twice) against the point's own item, on a batch of --rows rows padded
  left to --seq-len tokens;
- length: `moe-parity sweep` over a sweep of --sweep lengths against one parity run at the longest.

    python benchmarks/bench_differentials.py [--arch qwen3_moe] [--seq-len 256] [--rows 4]
        [--tokens 65536] [--sweep 64,128,256]

Item times are medians of 5, the layer already loaded; each line says what it timed."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.record.tiny import write_tiny_model
from pytest_moe_parity.replay.batch import BatchEntry, BatchItems
from pytest_moe_parity.replay.routing import RoutingEntry, RoutingItems
from pytest_moe_parity.routes import golden_routers, golden_trace, judge_routes
from pytest_moe_parity.session import ParitySession, RunOptions, quiet_transformers
from pytest_moe_parity.sweep import Sweep, run_sweep


def median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_routing(root: Path, arch: str, seq_len: int, tokens: int) -> None:
    session = ParitySession(RunOptions(golden_dir=root / "golden", dtype="bfloat16", routing="ids+weights"))
    block = next(p for p in session.points if p.component == "moe")
    session.runner.run(block)  # loads the layer
    routing = session.checkers["routing"]
    assert isinstance(routing, RoutingItems)
    entry = RoutingEntry(block, routing.place(block))
    point_s = median_seconds(lambda: session.runner.run(block))
    routing_s = median_seconds(lambda: routing.check(entry, {}))
    print(f"routing: {arch}, {seq_len} tokens: {block.id} {point_s * 1e3:.1f} ms, "
          f"{entry.id} {routing_s * 1e3:.1f} ms ({routing_s / point_s:.1f}x)")  # fmt: skip
    session.close()

    store = GoldenStore(root / "golden")
    own = golden_trace(store)
    repeats = -(-tokens // own.shape[0])
    trace = own.repeat(repeats, 1, 1)[:tokens]
    big = _tiled_golden(store, repeats)
    seconds = median_seconds(lambda: judge_routes(big, trace, torch.bfloat16), repeats=3)
    print(f"routes: {tokens} tokens x {len(golden_routers(store))} MoE layers judged in {seconds:.2f} s")


def bench_batch(root: Path, model: Path, arch: str, seq_len: int, rows: int) -> None:
    prompts = root / "prompts.jsonl"
    gen = torch.Generator().manual_seed(0)
    lengths = [seq_len - i * seq_len // (2 * rows) for i in range(rows)]
    prompts.write_text(
        "".join(json.dumps({"ids": torch.randint(4, 200, (n,), generator=gen).tolist()}) + "\n" for n in lengths)
    )
    record_golden(model, root / "batch", prompts=prompts, padding_side="left")
    session = ParitySession(RunOptions(golden_dir=root / "batch", dtype="bfloat16", batch=True))
    items = session.checkers["batch"]
    assert isinstance(items, BatchItems)
    for component in ("attention", "moe", "output"):
        point = next(p for p in session.points if p.component == component)
        session.runner.run(point)
        entry = BatchEntry(point, items.place(point))
        point_s = median_seconds(lambda point=point: session.runner.run(point))
        batch_s = median_seconds(lambda entry=entry: items.check(entry, {}))
        print(f"batch: {arch}, {rows} rows of up to {seq_len} tokens (left-padded): {point.id} {point_s * 1e3:.1f} ms,"
              f" {entry.id} {batch_s * 1e3:.1f} ms ({batch_s / point_s:.1f}x)")  # fmt: skip
    session.close()


def bench_sweep(root: Path, model: Path, lengths: list[int]) -> None:
    from pytest_moe_parity.cli import main

    started = time.perf_counter()
    assert main(["golden", "--model", str(model), "--out", str(root / "sweep"), "--sweep-lengths",
                 ",".join(map(str, lengths)), "--noise-dtype", "bfloat16", "-q"]) == 0  # fmt: skip
    recorded = time.perf_counter() - started
    sweep = Sweep.read(root / "sweep")
    started = time.perf_counter()
    run_sweep(sweep, hw="cpu", model=None, dtype="bfloat16", hw_options=[], mode=None, say=lambda _: None)
    swept = time.perf_counter() - started
    longest = sweep.dirs[lengths[-1]]
    started = time.perf_counter()
    session = ParitySession(RunOptions(golden_dir=longest, dtype="bfloat16", weights=False, config=False))
    list(session.run_all())
    session.close()
    one = time.perf_counter() - started
    print(f"length: sweep of {lengths} recorded (with its bf16 noise floor) in {recorded:.1f} s; moe-parity sweep "
          f"{swept:.1f} s, one parity run at {lengths[-1]} tokens {one:.1f} s ({swept / one:.1f}x)")  # fmt: skip


def _tiled_golden(store: GoldenStore, repeats: int) -> GoldenStore:
    """The golden with its routers' records tiled `repeats` times (as a golden of that many tokens)."""
    loaded = {}

    class Tiled(GoldenStore):
        def load(self, pid, **kwargs):
            record = GoldenStore.load(self, pid, **kwargs)
            point = self.point(pid)
            if point.component != "router":
                return record
            if point.id not in loaded:
                loaded[point.id] = tuple(t.repeat(repeats, *([1] * (t.dim() - 1))) for t in record.output[:3])
            record.output = loaded[point.id]
            return record

    tiled = Tiled(store.root)
    tiled.__dict__["captured_tokens"] = None
    return tiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--sweep", default="64,128,256")
    args = parser.parse_args()
    quiet_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model(args.arch, root / "model", layers=2, seed=0)
        record_golden(model, root / "golden", seq_len=args.seq_len)
        bench_routing(root, args.arch, args.seq_len, args.tokens)
        bench_batch(root, model, args.arch, args.seq_len, args.rows)
        bench_sweep(root, model, [int(n) for n in args.sweep.split(",")])


if __name__ == "__main__":
    main()
