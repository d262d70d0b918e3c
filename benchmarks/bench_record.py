"""Recording cost: wall time, golden size and peak RSS of `moe-parity golden` for every tiny
architecture, and for a 48-layer tiny-width model.

    python benchmarks/bench_record.py [--out benchmarks/out] [--seq-len 16]

Each recording runs in its own process, so its peak RSS is its own (ru_maxrss of that process).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from pytest_moe_parity.cli import main
code = main(sys.argv[1:])
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"code": code, "wall_s": wall, "peak_rss_mb": rss}))
"""


def run(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None, help="keep models and goldens here (default: a temp dir)")
    ap.add_argument("--seq-len", type=int, default=16)
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-record-"))
    from pytest_moe_parity.record.tiny import available_archs

    cases = [(arch, None) for arch in available_archs()] + [("minimax_m2", 48), ("minimax_m2", 4)]
    rows = []
    for arch, layers in cases:
        name = f"{arch}-{layers or 'default'}"
        model, golden = root / f"model-{name}", root / f"golden-{name}"
        shutil.rmtree(model, ignore_errors=True)
        tiny = ["tiny-model", "--arch", arch, "--out", str(model)] + (["--layers", str(layers)] if layers else [])
        run(*tiny)
        r = run(
            "golden", "--model", str(model), "--out", str(golden), "--seq-len", str(args.seq_len), "--overwrite", "-q"
        )
        manifest = json.loads((golden / "manifest.json").read_text())
        rows.append(
            {
                "model": name,
                "layers": manifest["model"]["num_hidden_layers"],
                "points": len(manifest["points"]),
                "load_s": manifest["stats"]["load_seconds"],
                "record_s": manifest["stats"]["record_seconds"],
                "process_wall_s": round(r["wall_s"], 2),
                "golden_kb": round(sum(f["bytes"] for f in manifest["files"].values()) / 1024, 1),
                "peak_rss_mb": round(r["peak_rss_mb"], 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print()
    header = ("layers", 7), ("points", 7), ("load s", 8), ("record s", 10), ("process s", 11), ("golden KB", 11)
    print(f"{'model':<22}" + "".join(f"{h:>{w}}" for h, w in header) + f"{'peak RSS MB':>13}")
    for r in rows:
        print(
            f"{r['model']:<22}{r['layers']:>7}{r['points']:>7}{r['load_s']:>8.2f}{r['record_s']:>10.2f}{r['process_wall_s']:>11.2f}"
            f"{r['golden_kb']:>11.1f}{r['peak_rss_mb']:>13.1f}"
        )
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
