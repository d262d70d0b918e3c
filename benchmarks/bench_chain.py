"""Chain mode on a `chain = "points"` backend: calls per point and wall time against the isolated run.

    python benchmarks/bench_chain.py [--layers 4 16] [--repeat 3]

For each depth: a tiny qwen3_moe checkpoint and its golden (32 tokens, bf16 noise floor), then
`pytest --golden-dir G --hw trace --dtype bfloat16` isolated and with `--parity-mode chain`, each in a
fresh process (min wall of --repeat runs, interleaved; one warm-up run fills the trace cache first).
The candidate's `run()` calls are counted in the process by a plugin that wraps the backend. Targets
(issue 22): calls <= 1.1x the points, chained wall <= 1.5x isolated.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import pytest
calls = []

class Count:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        from pytest_moe_parity import plugin
        backend = session.config.stash[plugin.SESSION_KEY].runner.backend
        real = backend.run
        backend.run = lambda point, inputs: calls.append(point.id) or real(point, inputs)

code = pytest.main(sys.argv[1:], plugins=[Count()])
print(json.dumps({"code": int(code), "wall_s": time.perf_counter() - t0, "calls": len(calls)}))
"""


def pytest_process(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["code"] != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from noise_goldens import noise_golden

    from pytest_moe_parity.golden import GoldenStore

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for layers in args.layers:
            _, golden = noise_golden(root, layers, seq_len=32)
            points = len(GoldenStore(golden).point_ids)
            base = ["-q", "-p", "no:cacheprovider", "--golden-dir", str(golden), "--hw", "trace", "--dtype",
                    "bfloat16", "--hw-option", f"cache_dir={root / 'cache'}"]  # fmt: skip
            pytest_process(*base)  # warm-up: fills the trace cache
            best: dict[str, dict] = {}
            for _ in range(args.repeat):
                for mode in ("isolated", "chain"):
                    out = pytest_process(*base, "--parity-mode", mode)
                    if mode not in best or out["wall_s"] < best[mode]["wall_s"]:
                        best[mode] = out
            iso, chain = best["isolated"], best["chain"]
            print(
                f"{layers} layers, {points} points: isolated {iso['wall_s']:.2f} s ({iso['calls']} calls), "
                f"chain {chain['wall_s']:.2f} s ({chain['calls']} calls, x{chain['calls'] / points:.2f} the points), "
                f"chain/isolated x{chain['wall_s'] / iso['wall_s']:.2f}"
            )


if __name__ == "__main__":
    main()
