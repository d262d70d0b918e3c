"""`moe-parity compare`, `demo` and `sweep`: a candidate run against goldens (a dump, the bundled
tiny model, every length of a sweep)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .common import EXIT_FAILED, EXIT_OK, Command, quiet_transformers, write_json


def _compare_arguments(sub: Any) -> None:
    compare = sub.add_parser(
        "compare", help="compare tensors dumped by another framework with a golden (exit 1 on a divergence)"
    )
    compare.add_argument("golden", type=Path, help="golden directory")
    compare.add_argument("candidate", type=Path, help="directory of dumped .safetensors / .pt files")
    compare.add_argument("--map", type=Path, default=None, help="JSON map of point ids to dumped tensor names")
    compare.add_argument("--report", type=Path, default=None, help="write comparison_report/summary.json here")
    compare.add_argument(
        "--plots",
        choices=("yes", "no"),
        default="yes",
        help="draw the report's pictures beside its JSON (default: yes)",
    )
    compare.add_argument("--dtype", default=None, help="the candidate's dtype for the default tolerances")
    compare.add_argument(
        "--mode",
        choices=("isolated", "chain"),
        default=None,
        help="isolated: the dump was taken on the golden's inputs; chain: it is the candidate's own whole-model run, "
        "judged against the reference's own error (needs a golden recorded with --noise-dtype)",
    )
    compare.add_argument(
        "--noise-quant",
        default=None,
        metavar="SPEC",
        help="judge against the golden's floor of the candidate's quantization (moe-parity golden --noise-quant "
        "SPEC), e.g. fp8-block:128+dynamic-token; none: the candidate dtype's floor",
    )
    compare.add_argument(
        "--tol", action="append", default=[], metavar="PATTERN:key=value,...", help="tolerance override; repeatable"
    )
    compare.add_argument(
        "--rows",
        type=Path,
        default=None,
        metavar="DIR",
        help="batch invariance: each row's own dump alone (DIR/row_0, DIR/row_1, ...), compared point by point with "
        "the dump of the batch (the golden of that batch)",
    )
    compare.add_argument(
        "--expected",
        type=Path,
        default=None,
        metavar="DIR",
        help="with a vLLM Neuron plugin capture: the plugin's capture of the HF reference run in the candidate's "
        "dtype, for the plugin's own acceptance terms beside the verdict (docs/vllm.md)",
    )


def cmd_compare(args: argparse.Namespace) -> int:
    """A dump compared offline: the same session, rows and summary lines as `pytest --hw dump`."""
    from ..judge.tolerances import parse_override
    from ..replay.vacuous import dump_refusal, golden_itself, required
    from ..session import ParitySession, RunOptions

    try:
        tolerances = [parse_override(t) for t in args.tol]
    except ValueError as exc:
        raise BadInput(f"--tol: {exc}") from None
    if golden_itself(args.golden, args.candidate):  # the golden against itself, refused as the plugin does
        raise BadInput(dump_refusal(args.candidate, required(False), "CANDIDATE_DIR"))
    flags = {
        "golden": "GOLDEN",
        "model": "CANDIDATE_DIR",
        "dtype": "--dtype",
        "hw": "--hw",
        "layers": "--layers",
        "mode": "--mode",
        "batch": "--rows",
    }
    hw_options = [f"map={args.map.resolve()}"] if args.map else []
    hw_options += [f"rows={args.rows.resolve()}"] if args.rows else []
    hw_options += [f"expected={args.expected.resolve()}"] if args.expected else []
    options = RunOptions(
        golden_dir=args.golden,
        hw="dump",
        model=args.candidate,
        dtype=args.dtype,
        mode=args.mode,
        noise_quant=args.noise_quant,
        hw_options=hw_options,
        batch=args.rows is not None,
        cli_tolerances=tolerances,
        report_dir=args.report,
        plots=args.plots == "yes",
        flags=flags,
        freeze_gc=True,
    )
    session = ParitySession(options)
    try:
        rows = list(session.run_all(items=True))
        nothing = session.nothing_compared()
        if nothing is not None:
            raise BadInput(nothing)
        session.write_reports()
        for line, _ in session.closing_lines():
            print(line)
    finally:
        session.close()
    failed = any(r.status in ("failed", "error") for r in rows)
    return EXIT_FAILED if failed else EXIT_OK


def _demo_arguments(sub: Any) -> None:
    demo = sub.add_parser(
        "demo", help="record the bundled tiny MiniMax-M2, then run the plugin on its golden with a bf16 candidate"
    )
    demo.add_argument("--out", type=Path, default=None, help="where to record (default: a temporary directory)")


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's first command: record, check the recording against the bundled golden, run
    `pytest --golden-dir <bundled golden> --dtype bfloat16` and print its summary."""
    import tempfile

    import pytest

    from ..golden import GoldenStore
    from ..record.run import record_golden
    from ..record.tiny import fixtures_dir

    bundled = fixtures_dir() / "demo"
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="moe-parity-demo-") as tmp:
        out = args.out or Path(tmp) / "golden"
        print(f"1. recording the bundled tiny MiniMax-M2 ({bundled / 'model'}) -> {out}")
        seq_len = GoldenStore(bundled / "golden").manifest["inputs"]["seq_len"]
        try:
            result = record_golden(
                bundled / "model", out, seq_len=seq_len, overwrite=True, progress=lambda m: print("   " + m)
            )
        except Exception as exc:  # a BadInput here means --out is unusable
            raise BadInput(str(exc)) from None
        print(f"   golden written: {result.points} points, {result.bytes / 1e6:.2f} MB, {result.seconds:.1f} s")
        print(f"   {_matches_bundled(GoldenStore(out), GoldenStore(bundled / 'golden'))}")
        print(f"2. pytest --golden-dir {bundled / 'golden'} --hw cpu --dtype bfloat16", flush=True)
        code = pytest.main(
            ["--golden-dir", str(bundled / "golden"), "--hw", "cpu", "--dtype", "bfloat16", "-q",
             "-p", "no:cacheprovider", "--rootdir", tmp, "-c", os.devnull,
             # this process imported the plugin before pytest started: nothing to rewrite
             "-W", "ignore::pytest.PytestAssertRewriteWarning"]
        )  # fmt: skip
    return int(code)


def _matches_bundled(fresh, ref) -> str:
    """Whether a fresh recording reproduces the bundled golden. Another CPU's float32 kernels may
    sum in another order (e.g. AVX-512 against AVX2), so float tensors may differ by rounding."""
    import torch

    from ..judge.metrics import compare_tensors

    if fresh.point_ids != ref.point_ids:
        return "matches the bundled golden: NO (other points: different transformers?)"
    worst = 0.0
    for pid in ref.point_ids:
        a, b = fresh.tensors(pid), ref.tensors(pid)
        if a.keys() != b.keys():
            return f"matches the bundled golden: NO ({pid} records other tensors)"
        for key, t in b.items():
            if torch.equal(a[key], t):
                continue
            if not t.is_floating_point():
                return f"matches the bundled golden: NO ({key} differs)"
            worst = max(worst, compare_tensors(t, a[key]).rel_l2)
    if worst == 0.0:
        return "matches the bundled golden: yes (bitwise)"
    verdict = "yes" if worst <= 1e-5 else "NO"
    return f"matches the bundled golden: {verdict} (float32 rounding of this CPU's kernels, max rel_l2 {worst:.1e})"


def _sweep_arguments(sub: Any) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="a candidate over every length of a sweep (moe-parity golden --sweep-lengths): each layer's error "
        "curve over length beside the reference's own, and whether it is accumulation or a defect (exit 1)",
    )
    sweep.add_argument("sweep", type=Path, help="the sweep's directory")
    sweep.add_argument("--hw", default="cpu", help="the candidate's backend (default: cpu)")
    sweep.add_argument("--model", type=Path, default=None, help="the candidate (default: the goldens' model)")
    sweep.add_argument("--dtype", default=None, help="the candidate's dtype, e.g. bfloat16")
    sweep.add_argument("--hw-option", action="append", default=[], metavar="KEY=VALUE", help="a backend setting")
    sweep.add_argument("--mode", choices=("isolated", "chain"), default=None, help="each point's inputs")
    sweep.add_argument("--json", type=Path, metavar="FILE", help="also write the grid and the verdict as JSON")
    sweep.add_argument("--plot", type=Path, metavar="PNG", help="the curves' picture (default: SWEEP/sweep.png)")


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..sweep import Sweep, draw_sweep, run_sweep, sweep_lines

    quiet_transformers()
    sweep = Sweep.read(args.sweep)
    result = run_sweep(sweep, hw=args.hw, model=args.model, dtype=args.dtype, hw_options=args.hw_option, mode=args.mode)
    picture = draw_sweep(result, args.plot or sweep.root / "sweep.png")
    for line in sweep_lines(result, str(picture) if picture else None):
        print(line)
    if args.json is not None:
        write_json(args.json, result.to_json())
    return EXIT_FAILED if result.defect is not None else EXIT_OK


COMPARE = Command("compare", _compare_arguments, cmd_compare)
DEMO = Command("demo", _demo_arguments, cmd_demo, needs_transformers_5=True)
SWEEP = Command("sweep", _sweep_arguments, cmd_sweep)
