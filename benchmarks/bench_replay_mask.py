"""Replaying a long golden's attention: what its causal mask costs the replay's peak memory.

    python benchmarks/bench_replay_mask.py [--seq-len 8192] [--trees /tmp/before,.]

A tiny qwen3_moe checkpoint (its context raised to fit) is recorded at `--seq-len` tokens, layer 0
only; then `pytest -k layer_0.attention --hw cpu` judges that one isolated point, in float32 and in
bfloat16, each in a fresh process, for each tree given (a checkout, e.g. a `git worktree` of an
older commit). Its attention runs in blocks of query rows (the default `attention_budget`), so the
mask is what is left: made whole, it is `T x T` float32 (256 MiB at 8192 tokens) and, in bfloat16,
its cast copy; made a block of rows at a time (`golden.spec.CausalRows`), nothing of that size.

glibc's adaptive mmap threshold leaves freed blocks of tens of MB resident and so hides what a run
holds at once; the runs are measured with it fixed at 1 MiB (`MALLOC_MMAP_THRESHOLD_`), as
`moe-parity golden` fixes it for itself (`map_large_allocations`), and once without (`--no-fix`).

Measured on 2 cores (8192 tokens; peak RSS of the pytest process; `--trees /tmp/old,.` and again
with `--no-fix`):

    tree                           dtype     peak (threshold fixed)   peak (glibc's default)
    c0a036b (mask made whole)      float32   685 MB                   1746 MB
    c0a036b                        bfloat16  941 MB                   941 MB
    b8e21e7 (a block of rows)      float32   434 MB                   1025 MB
    b8e21e7                        bfloat16  434 MB                   478 MB
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


_PEAK = (
    "import resource, subprocess, sys\n"
    "run = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:] if run.returncode else '')\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(run.returncode)\n"
)


def peak_of(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    """The peak RSS in MB of `cmd`, run under a process of its own (RUSAGE_CHILDREN keeps the
    largest child's peak, so each measurement gets a fresh parent)."""
    proc = subprocess.run([sys.executable, "-c", _PEAK, *cmd], env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return int(proc.stdout.split()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--trees", default=str(ROOT), help="comma-separated checkouts to measure (default: this one)")
    ap.add_argument("--no-fix", action="store_true", help="leave glibc's mmap threshold adaptive")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mask-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cli = [sys.executable, "-m", "pytest_moe_parity.cli"]
        subprocess.run([*cli, "tiny-model", "--arch", "qwen3_moe", "--out", str(work / "m")], env=env, check=True,
                       capture_output=True)  # fmt: skip
        config = json.loads((work / "m" / "config.json").read_text())
        config["max_position_embeddings"] = max(args.seq_len, config.get("max_position_embeddings", 0))
        (work / "m" / "config.json").write_text(json.dumps(config))
        golden = [*cli, "golden", "--model", str(work / "m"), "--out", str(work / "g"), "--seq-len", str(args.seq_len)]
        subprocess.run([*golden, "--layers", "0", "--quiet"], env=env, check=True, capture_output=True)
        print(f"{args.seq_len} tokens, layer_0.attention isolated on --hw cpu, glibc's mmap threshold "
              f"{'adaptive' if args.no_fix else 'fixed at 1 MiB'}")  # fmt: skip
        for tree in args.trees.split(","):
            tree_env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            if not args.no_fix:
                tree_env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
            for dtype in ("float32", "bfloat16"):
                cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--golden-dir", str(work / "g"),
                       "--model", str(work / "m"), "--hw", "cpu", "--dtype", dtype, "-k", "layer_0.attention",
                       "--no-parity-weights"]  # fmt: skip
                peak = peak_of(cmd, tree_env, work)
                print(f"  {tree}  {dtype:<9} peak {peak:.0f} MB")


if __name__ == "__main__":
    main()
