"""What the routing differentials cost: a MoE block's routing item (`--parity-routing ids+weights`: the
block replayed three times and judged three times) against the block's own item, and `moe-parity
routes` on a trace of N tokens.

    python benchmarks/bench_routing.py [--arch qwen3_moe] [--seq-len 256] [--tokens 65536]

Prints the seconds of a block's item and of its routing item (median of 5, the layer already loaded),
and of judging a routed-experts trace of --tokens tokens over the golden's layers (the golden's own
routing, tiled: the judge's work, not the golden's reading, scales with the trace)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.record.run import record_golden
from pytest_moe_parity.record.tiny import write_tiny_model
from pytest_moe_parity.replay.routing import RoutingEntry, RoutingItems
from pytest_moe_parity.routes import golden_routers, golden_trace, judge_routes
from pytest_moe_parity.session import ParitySession, RunOptions, quiet_transformers


def median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=65536)
    args = parser.parse_args()
    quiet_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model(args.arch, root / "model", layers=2, seed=0)
        record_golden(model, root / "golden", seq_len=args.seq_len)
        session = ParitySession(RunOptions(golden_dir=root / "golden", dtype="bfloat16", routing="ids+weights"))
        block = next(p for p in session.points if p.component == "moe")
        session.runner.run(block)  # loads the layer
        routing = session.checkers["routing"]
        assert isinstance(routing, RoutingItems)
        entry = RoutingEntry(block)
        point_s = median_seconds(lambda: session.runner.run(block))
        routing_s = median_seconds(lambda: routing.check(entry, {}))
        print(f"{args.arch}, {args.seq_len} tokens: {block.id} {point_s * 1e3:.1f} ms, "
              f"{entry.id} {routing_s * 1e3:.1f} ms ({routing_s / point_s:.1f}x)")  # fmt: skip
        session.close()

        store = GoldenStore(root / "golden")
        own = golden_trace(store)
        repeats = -(-args.tokens // own.shape[0])
        trace = own.repeat(repeats, 1, 1)[: args.tokens]
        big = _tiled_golden(store, repeats)
        seconds = median_seconds(lambda: judge_routes(big, trace, torch.bfloat16), repeats=3)
        print(f"routes: {args.tokens} tokens x {len(golden_routers(store))} MoE layers judged in {seconds:.2f} s")


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


if __name__ == "__main__":
    main()
