"""The test suite under the thread and load settings a user's machine may have (issue 34).

Runs `python -m pytest -n 2` (or the quick loop with --quick) once per setting, one after another,
and prints each run's wall time and pytest's closing line:

- omp1, omp2, omp4: OMP_NUM_THREADS=1, 2, 4 (tests/conftest.py's default is 1 where it is unset);
- busy: the default threads beside one busy process per core (a pure-Python spin loop each, started
  before the suite and stopped after it), as when a build or another job shares the machine.

    python benchmarks/suite_matrix.py                      # all four settings, the whole suite
    python benchmarks/suite_matrix.py --quick omp4 busy    # the quick loop (-m "not slow"), two settings
    python benchmarks/suite_matrix.py omp2 --pytest tests/test_metrics.py

Exit status 1 when any run fails. Every run must pass: a test that passes or fails by the machine's
CPU, threads or load is a bug in the test (docs/development.md, "Machine-independent tests").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from busy import busy_cores

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "omp1": {"OMP_NUM_THREADS": "1"},
    "omp2": {"OMP_NUM_THREADS": "2"},
    "omp4": {"OMP_NUM_THREADS": "4"},
    "busy": {},
}


def run(name: str, quick: bool, extra: list[str], logs: Path | None = None) -> tuple[int, float, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(SETTINGS[name])
    argv = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider"]
    argv += ["-m", "not slow"] * quick + extra
    start = time.monotonic()
    with busy_cores(name == "busy"):
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{name}.log").write_text(proc.stdout + proc.stderr)
    lines = [li for li in proc.stdout.splitlines() if li.strip()]
    closing = lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:]
    if proc.returncode:
        failed = [li for li in proc.stdout.splitlines() if li.startswith(("FAILED", "ERROR"))]
        closing += "".join(f"\n    {li}" for li in failed[:20])
    return proc.returncode, wall, closing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="*", metavar="SETTING", help=f"of {', '.join(SETTINGS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help='the quick loop (-m "not slow")')
    parser.add_argument("--pytest", action="append", default=[], metavar="ARG", help="one more pytest argument")
    parser.add_argument("--logs", type=Path, metavar="DIR", help="write each run's whole output to DIR/SETTING.log")
    args = parser.parse_args()
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        parser.error(f"no setting {unknown[0]!r}: choose from {', '.join(SETTINGS)}")
    worst = 0
    for name in args.settings or list(SETTINGS):
        code, wall, closing = run(name, args.quick, args.pytest, args.logs)
        worst = max(worst, int(code != 0))
        print(f"{name:5}  {wall / 60:5.1f} min  exit {code}  {closing}", flush=True)
    return worst


if __name__ == "__main__":
    sys.exit(main())
