"""What a precision search costs (`--parity-precision-search`, issue 55): for each component of one
decoder layer, how many runs of the point the bisection takes and its seconds, on a tiny checkpoint whose
bf16 candidate is made to fail every point by a float32-sized limit.

    python benchmarks/bench_precision_search.py [--arch qwen3_moe] [--layer 1] [--rel-l2 2e-3] [--keep DIR]

A tiny `--arch` checkpoint (`moe-parity tiny-model`) and its float32 golden are written; pytest then runs the
layer's points on `--hw cpu --dtype bfloat16` with `--parity-tol '*:rel_l2=LIMIT'` (a limit under what bf16
compute reaches, above a bf16 output's own rounding: every component fails) and `--parity-precision-search
'layer_N.*'`, and this prints, per point, the search's verdict, the op groups it found, the number of op
groups that ran, the runs it took (2 + log2 of the groups + one per group of the prefix tried without it) and
its seconds, from the report's `PrecisionRow`s. The search's cost is its runs times the point's own call (each
run is the point's call with some ops beside it in float32), so it grows with the point's size: a router is a
few ops, a decoder layer every op of attention and MoE.

Measured on this project's 2-core host beside two test runs (torch 2.13.0+cpu, transformers 5.24; the
tiny-model qwen3_moe, layer 1, 16 tokens, `--rel-l2 2e-3`):

    point                    verdict    groups  runs  seconds  found
    layer_1.input_norm       precision       2     4    0.067  elementwise
    layer_1.attention        precision      11    16    0.699  q_proj:matmul, q_norm:elementwise, ...
    layer_1.post_attn_norm   precision       2     4    0.026  elementwise
    layer_1.router           precision       3     3    0.030  matmul
    layer_1.experts          precision       3     6    0.227  elementwise, matmul, act_fn:activation
    layer_1.moe              precision       6    10    1.531  gate:elementwise, experts:elementwise, ...
    layer_1.output           precision      22    19    1.656  input_layernorm:elementwise, ...

With every point failing, each search ends in a set of groups (none is a defect: every point passes with
all its groups in float32, none with none); at a limit of 1e-4 every point is a defect instead, as it
should be: a bf16 output's own rounding is above it whatever runs in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--rel-l2", default="2e-3", help="the limit every point gets (bf16 compute misses it)")
    parser.add_argument("--keep", type=Path, help="a directory to keep the checkpoint, golden and report in")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-precision-"))
    work.mkdir(parents=True, exist_ok=True)
    model, golden, report = work / f"{args.arch}-model", work / f"{args.arch}-golden", work / "report"
    cli = (sys.executable, "-m", "pytest_moe_parity.cli")
    if not (model / "config.json").exists():
        run(*cli, "tiny-model", "--arch", args.arch, "--out", str(model))
    if not (golden / "manifest.json").exists():
        run(*cli, "golden", "--model", str(model), "--out", str(golden))
    points = f"layer_{args.layer}.*"
    pytest = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--no-parity-weights")
    done = subprocess.run(
        (*pytest, "--golden-dir", str(golden), "--model", str(model), "--hw", "cpu", "--dtype", "bfloat16",
         "--parity-layers", str(args.layer), "--parity-tol", f"*:rel_l2={args.rel_l2}",
         "--parity-precision-search", points, "--parity-report", str(report)),
        cwd=work, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    rows = json.loads((report / "comparison_report.json").read_text())["points"]
    searched = [r for r in rows if r.get("kind") == "precision" or "precision_verdict" in r]
    if not searched:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        print("no precision rows in the report: see pytest's output above", file=sys.stderr)
        return 1
    print(f"{'point':<24} {'verdict':<10} {'groups':>6} {'runs':>5} {'seconds':>8}  found")
    for row in searched:
        verdict = row.get("precision_verdict") or row.get("status")
        found = ", ".join(row.get("raised") or []) or "-"
        point = row["id"].rsplit("::", 1)[0]
        units, runs = len(row.get("units") or []), len(row.get("runs") or [])
        seconds = row.get("search_seconds")
        print(f"{point:<24} {verdict:<10} {units:>6} {runs:>5} {seconds if seconds is not None else '-':>8}  {found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
