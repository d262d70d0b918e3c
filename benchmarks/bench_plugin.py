"""Plugin cost: one layer of a deep model must cost what one layer of a shallow one costs, and the
plugin must add little to the replays it runs.

    python benchmarks/bench_plugin.py [--repeat 3]

1. `pytest --golden-dir G -k layer_2.` on tiny-width minimax_m2 checkpoints of 4 and 48 layers
   (sharded, hub layout): wall time and peak RSS of the whole pytest process (min of --repeat runs).
2. Per-item overhead: all points of the 48-layer golden through pytest, against a plain Python loop
   doing the same replays and comparisons (ParityRunner.run) in the same process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import pytest
code = pytest.main(sys.argv[1:])
wall = time.perf_counter() - t0
# VmHWM: this address space's peak (ru_maxrss would carry the parent's across fork and exec)
with open("/proc/self/status") as fh:
    peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
print(json.dumps({"code": int(code), "wall_s": wall, "peak_rss_mb": peak}))
"""


def pytest_process(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    last = proc.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    if out["code"] != 0:
        raise SystemExit(proc.stdout[-3000:])
    return out


def prepare(root: Path, layers: int) -> tuple[Path, Path]:
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model

    model = write_tiny_model("minimax_m2", root / f"model-{layers}", layers=layers, max_shard_size="200KB")
    golden = root / f"golden-{layers}"
    record_golden(model, golden, seq_len=32)
    return model, golden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = {}
        for layers in (4, 48):
            model, golden = prepare(root, layers)
            shards = len(list(model.glob("*.safetensors")))
            runs = [
                pytest_process(
                    "--golden-dir",
                    str(golden),
                    "-k",
                    "layer_2.",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--dtype",
                    "bfloat16",
                    "--rootdir",
                    str(root),
                )
                for _ in range(args.repeat)
            ]
            results[layers] = {
                "wall_s": min(r["wall_s"] for r in runs),
                "peak_rss_mb": min(r["peak_rss_mb"] for r in runs),
                "shards": shards,
            }
            print(f"{layers:>2} layers ({shards} shards): -k layer_2.  wall {results[layers]['wall_s']:.2f} s, "
                  f"peak RSS {results[layers]['peak_rss_mb']:.0f} MB")  # fmt: skip
        wall_ratio = results[48]["wall_s"] / results[4]["wall_s"]
        rss_ratio = results[48]["peak_rss_mb"] / results[4]["peak_rss_mb"]
        print(f"48-layer / 4-layer: wall x{wall_ratio:.2f}, peak RSS x{rss_ratio:.2f} (target <= 1.3)")

        # per-item overhead, in one process: plain loop vs pytest on the same points
        import pytest

        from pytest_moe_parity.golden import GoldenStore
        from pytest_moe_parity.session import ParitySession, RunOptions

        golden, model = root / "golden-48", root / "model-48"
        n = len(GoldenStore(golden).point_ids)
        loop_times, pytest_times = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            session = ParitySession(RunOptions(golden_dir=golden, model=model, dtype="bfloat16"))
            rows = list(session.run_all())
            loop_times.append(time.perf_counter() - t0)
            assert all(r["status"] == "passed" for r in rows)
            t0 = time.perf_counter()
            code = pytest.main(
                ["--golden-dir", str(golden), "-q", "-p", "no:cacheprovider", "--dtype", "bfloat16",
                 "--rootdir", str(root), "-W", "ignore::pytest.PytestAssertRewriteWarning"]
            )  # fmt: skip
            pytest_times.append(time.perf_counter() - t0)
            assert code == 0
        loop_t, pytest_t = min(loop_times), min(pytest_times)
        print(
            f"{n} points: plain loop {loop_t:.2f} s ({loop_t / n * 1e3:.2f} ms/point), pytest {pytest_t:.2f} s "
            f"({pytest_t / n * 1e3:.2f} ms/point); plugin overhead {(pytest_t - loop_t) / n * 1e3:.2f} ms/item"
        )


if __name__ == "__main__":
    main()
