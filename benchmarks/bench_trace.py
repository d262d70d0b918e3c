"""Compiled candidates on a deep checkpoint: how many graphs `--hw trace` compiles for 48 layers,
and what the first run (cold cache) and a second run (every graph from the cache) cost against
`--hw cpu` (the same modules, eager). Optionally `--hw compile` too (inductor; slow to compile on
two cores).

    python benchmarks/bench_trace.py [--layers 48] [--keep DIR] [--with-compile]

The checkpoint and golden are those of bench_replay.py (Mixtral-style, hidden 512, 16 experts,
~54 MB float32 per layer, golden of 32 tokens); the candidate runs in bfloat16. Each run is a fresh
process; wall time includes the imports.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench_replay import PYTEST_CHILD, child, prepare


def run(golden: Path, root: Path, hw: str, cache: Path, report: Path) -> dict:
    args = ["--golden-dir", str(golden), "--dtype", "bfloat16", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            "--rootdir", str(root), "--hw", hw, "--parity-report", str(report)]  # fmt: skip
    if hw != "cpu":
        args += ["--hw-option", f"cache_dir={cache}"]
    out = child(PYTEST_CHILD, *args)
    summary = json.loads((report / "comparison_summary.json").read_text())
    return {**out, "graphs": summary.get("graphs"), "passed": summary["passed"], "total": summary["total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--keep", type=Path, default=None, help="write (and reuse) the checkpoint and golden here")
    ap.add_argument("--with-compile", action="store_true", help="also --hw compile (inductor)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        _, golden = prepare(root, args.layers)
        results = {"cpu": run(golden, root, "cpu", root / "unused", root / "report-cpu")}
        for hw in ("trace", "compile") if args.with_compile else ("trace",):
            cache = root / f"cache-{hw}"
            shutil.rmtree(cache, ignore_errors=True)
            results[f"{hw}, cold cache"] = run(golden, root, hw, cache, root / f"report-{hw}-1")
            results[f"{hw}, warm cache"] = run(golden, root, hw, cache, root / f"report-{hw}-2")
        base = results["cpu"]["wall_s"]
        for name, r in results.items():
            graphs = r["graphs"]
            made = (
                f"{graphs['graphs']} graphs ({graphs['layer_graphs']} for the {graphs['layers']} decoder layers), "
                f"compiled {graphs['compiled']} in {graphs['compile_seconds']:.1f} s, {graphs['from_cache']} cached"
                if graphs
                else "eager"
            )
            print(f"--hw {name:<20} {r['passed']}/{r['total']} passed  wall {r['wall_s']:6.1f} s "
                  f"(x{r['wall_s'] / base:.2f} of cpu)  peak RSS {r['peak_rss_mb']:6.0f} MB  {made}")  # fmt: skip


if __name__ == "__main__":
    main()
