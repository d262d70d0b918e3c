"""The `moe-parity` command: tiny models, golden recordings, a look inside a golden, offline
comparison of dumps, and reports redrawn and compared run to run.
Exit codes: 0 success, 1 a comparison failed, 2 bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import compat
from .model.attention import DEFAULT_BUDGET_MIB
from .points import positive_int

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _fail(message: str) -> int:
    print(f"moe-parity: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _positive_int(text: str) -> int:
    """`points.positive_int` as argparse reports it ("argument --decode-steps: expected ...")."""
    try:
        return positive_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add_arguments in (  # each command's options beside the command, in the help's order
        _tiny_model_arguments,
        _golden_arguments,
        _scan_arguments,
        _compare_arguments,
        _demo_arguments,
        _show_arguments,
        _drill_ops_arguments,
        _routes_arguments,
        _sweep_arguments,
        _report_arguments,
        _diff_arguments,
        _audit_arguments,
        _estimate_arguments,
    ):
        add_arguments(sub)
    return parser


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 1.0:
        raise argparse.ArgumentTypeError(f"the factor must be above 1, got {text}")
    return value


def _quiet_transformers() -> None:
    from .session import quiet_transformers

    quiet_transformers()


def _tiny_model_arguments(sub: Any) -> None:
    tiny = sub.add_parser("tiny-model", help="write a deterministic tiny random-init MoE checkpoint")
    tiny.add_argument("--arch", required=True, help="a transformers model_type, e.g. minimax_m2")
    tiny.add_argument("--out", required=True, type=Path, help="directory to write the checkpoint to")
    tiny.add_argument("--layers", type=_positive_int, default=None, help="decoder layers (default: the config's)")
    tiny.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    tiny.add_argument(
        "--shard-size",
        default="500KB",
        help="max safetensors shard size, hub-style sharding (default: 500KB)",
    )


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from .record.tiny import available_archs, write_tiny_model

    archs = available_archs()
    if args.arch not in archs:
        return _fail(f"unknown --arch {args.arch!r}; available: {', '.join(archs)}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        return _fail(f"{args.out} exists and is not empty; choose another --out")
    _quiet_transformers()
    out = write_tiny_model(args.arch, args.out, layers=args.layers, seed=args.seed, max_shard_size=args.shard_size)
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote tiny {args.arch} (seed {args.seed}) to {out}: {len(files)} files, {size / 1e6:.2f} MB")
    return EXIT_OK


def _noise_dtype(text: str | None, golden_dtype: str) -> str | None:
    """The --noise-dtype, checked before anything is recorded; BadInput naming what is wrong."""
    from .dtypes import dtype_name, parse_dtype
    from .errors import BadInput

    if text is None:
        return None
    try:
        name = dtype_name(parse_dtype(text, floating=True))
    except ValueError:
        raise BadInput(f"--noise-dtype {text!r} is not a floating-point torch dtype (e.g. bfloat16)") from None
    try:
        same = name == dtype_name(parse_dtype(golden_dtype))
    except ValueError:
        return name  # record_golden reports the bad --dtype
    if same:
        raise BadInput(f"--noise-dtype {name} is the dtype the reference records in: pick a lower one, e.g. bfloat16")
    return name


def _golden_arguments(sub: Any) -> None:
    golden = sub.add_parser("golden", help="record the reference model's golden run")
    golden.add_argument("--model", required=True, type=Path, help="reference checkpoint directory")
    golden.add_argument("--out", required=True, type=Path, help="golden directory to write")
    src = golden.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="text to tokenize with the model's tokenizer")
    src.add_argument("--input-ids", type=_int_list, help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help='several prompts, recorded as one padded batch: one per line, as text or JSONL ({"text": ...} or '
        '{"ids": [...]}); points are judged on the real tokens, and failures name the rows',
    )
    golden.add_argument(
        "--padding-side", choices=("left", "right"), default="right", help="where --prompts rows are padded"
    )
    golden.add_argument(
        "--pad-to", type=_positive_int, default=None, metavar="N", help="pad --prompts rows to N tokens (a fixed shape)"
    )
    golden.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        metavar="B",
        help="pad the --prompts batch to B rows (the extra rows are padding only, as a fixed batch size runs them)",
    )
    golden.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="tokens of deterministic input ids when neither --prompt nor --input-ids is given (default: 16)",
    )
    golden.add_argument(
        "--sweep-lengths",
        default=None,
        metavar="N,N,...",
        help="a length sweep: one golden per length under OUT/len_N, the same prompt family (each a prefix of the "
        "longest; a short --prompt or --input-ids repeated), for `moe-parity sweep OUT`",
    )
    _golden_run_arguments(golden)


def _golden_run_arguments(golden: Any) -> None:
    """How `moe-parity golden` runs the reference: dtype, placement, what it keeps."""
    golden.add_argument("--dtype", default="float32", help="dtype to run the reference in (default: float32)")
    golden.add_argument("--device", default="cpu", help="device for a single-device run (default: cpu)")
    golden.add_argument("--device-map", default=None, help="accelerate device map: auto, balanced, sequential, ...")
    golden.add_argument(
        "--max-memory", default=None, help="per-device memory caps, e.g. 40GB (every GPU) or 0:60GiB,1:60GiB,cpu:200GiB"
    )
    golden.add_argument(
        "--offload-folder",
        type=Path,
        default=None,
        metavar="DIR",
        help="accelerate disk offload: weights that fit under no --max-memory cap are read from here "
        "(a folder this run creates is removed after it)",
    )
    golden.add_argument(
        "--stream",
        action="store_true",
        help="hold two decoder layers at a time, read from the checkpoint as the forward reaches them: "
        "a reference larger than the host's memory, on one device, without an offload folder",
    )
    golden.add_argument(
        "--layers",
        default=None,
        metavar="A-B",
        help="record only these decoder layers (e.g. 10-20, or 1,17,20-29); embedding and rotary come with "
        "layer 0, final norm and logits with the last layer",
    )
    golden.add_argument(
        "--noise-dtype",
        default=None,
        metavar="DTYPE",
        help="also run the reference in this dtype (e.g. bfloat16), isolated and chained, and keep its own error at "
        "every point: the noise floor that candidates in that dtype are judged against (noise_factor)",
    )
    golden.add_argument(
        "--decode-steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help="after the prefill, also record N greedy decode steps with a KV cache (points step_1.* .. step_N.*)",
    )
    golden.add_argument(
        "--decode-at",
        default=None,
        metavar="P,P,...",
        help="record the decode steps that land at these absolute positions (increasing, e.g. 511,512,513): the "
        "prefill is sized to the first (without --prompt, --input-ids or --seq-len) and the steps between are run, "
        "not recorded; with --decode-steps N, steps 1..N are recorded too",
    )
    golden.add_argument(
        "--capture-tokens",
        default=None,
        metavar="SPEC",
        help="keep only these token positions of every prefill point's output (e.g. 0-63,last-64) and none of "
        "their inputs: a long context's golden on a disk budget, judged in --parity-mode chain",
    )
    golden.add_argument(
        "--attention-budget",
        dest="attention_budget_mb",
        type=float,
        default=DEFAULT_BUDGET_MIB,
        metavar="MIB",
        help=f"the most eager attention's score arrays may hold at once (default {DEFAULT_BUDGET_MIB:g}): a longer "
        "prompt runs the model's own eager attention a block of query rows at a time, so recording 16k tokens "
        "holds no T x T scores; 0 runs it whole",
    )
    golden.add_argument("--overwrite", action="store_true", help="replace an existing golden directory")
    golden.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the checkpoint's own modeling code (off by default)",
    )
    golden.add_argument("-q", "--quiet", action="store_true", help="print only the closing line")


def cmd_golden(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from .errors import ParityError
    from .record.run import GoldenRequest

    _quiet_transformers()
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    try:
        noise_dtype = _noise_dtype(args.noise_dtype, args.dtype)
        # the request's options are the command line's, by the same names
        named = {f.name: getattr(args, f.name) for f in fields(GoldenRequest) if f.name not in ("model_dir", "out")}
        named["decode_steps"] = args.decode_steps or 0
        if args.sweep_lengths is not None:
            return _golden_sweep(args, named, noise_dtype, say)
        request = GoldenRequest(args.model, args.out, **named)
        result = request.record(progress=say)
        seconds = result.seconds
        if noise_dtype is not None:
            seconds += _noise_floor(args, result.out, noise_dtype, say)
    except ParityError as exc:  # bad input, an unreadable checkpoint, a model that does not run
        return _fail(str(exc))
    noise = f", noise floor in {noise_dtype}" if noise_dtype else ""
    if result.decode:
        noise = f", prefill and {result.decode}{noise}"
    print(
        f"golden written: {result.points} points, {result.bytes / 1e6:.2f} MB{noise}, {seconds:.1f} s -> {result.out}"
    )
    return EXIT_OK


def _noise_floor(args: argparse.Namespace, golden: Path, dtype: Any, say: Any) -> float:
    """`--noise-dtype`: the reference's own error recorded into `golden`; the seconds it took."""
    from .replay.noise import record_noise

    device = args.device if not args.device_map else ("cuda" if _cuda() else "cpu")
    return record_noise(
        golden, dtype, model_dir=args.model, device=device, trust_remote_code=args.trust_remote_code, progress=say
    )["recorded"]["seconds"]


def _golden_sweep(args: argparse.Namespace, named: dict[str, Any], noise_dtype: Any, say: Any) -> int:
    """`moe-parity golden --sweep-lengths`: one golden per length, the sweep's manifest written last (a
    sweep cut short reads as none). Every length is checked against the model's context first."""
    import shutil

    from .record.run import GoldenRequest
    from .sweep import DIR, SweepError, family, parse_lengths, write_manifest

    try:
        lengths = parse_lengths(args.sweep_lengths)
    except SweepError as exc:
        return _fail(str(exc))
    for flag, value in (("--prompts", args.prompts), ("--decode-at", args.decode_at),
                        ("--capture-tokens", args.capture_tokens), ("--seq-len", args.seq_len)):  # fmt: skip
        if value is not None:
            return _fail(f"--sweep-lengths sets each golden's length from one prompt family; drop {flag}")
    out = args.out
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        return _fail(f"{out} exists and is not empty; choose another --out (or --overwrite)")
    longest = GoldenRequest(args.model, out / "check", **{**named, "seq_len": max(lengths)}).check()  # the context
    ids = family(longest.ids, lengths)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seconds = 0.0
    for length in lengths:
        say(f"length {length}:")
        options = {**named, "prompt": None, "input_ids": ids[length], "seq_len": None}
        result = GoldenRequest(args.model, out / DIR.format(length=length), **options).record(progress=say)
        seconds += result.seconds
        if noise_dtype is not None:
            seconds += _noise_floor(args, result.out, noise_dtype, say)
    write_manifest(out, lengths)
    noise = f", noise floor in {noise_dtype}" if noise_dtype else ""
    print(f"length sweep written: {len(lengths)} goldens ({', '.join(map(str, lengths))} tokens){noise}, "
          f"{seconds:.1f} s -> {out}")  # fmt: skip
    return EXIT_OK


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
    from .errors import GoldenError
    from .session import SetupError
    from .sweep import Sweep, SweepError, draw_sweep, run_sweep, sweep_lines

    _quiet_transformers()
    try:
        sweep = Sweep.read(args.sweep)
        result = run_sweep(
            sweep, hw=args.hw, model=args.model, dtype=args.dtype, hw_options=args.hw_option, mode=args.mode
        )
    except (SweepError, SetupError, GoldenError) as exc:
        return _fail(str(exc))
    picture = draw_sweep(result, args.plot or sweep.root / "sweep.png")
    for line in sweep_lines(result, str(picture) if picture else None):
        print(line)
    if args.json is not None and (failed := _write_json(args.json, result.to_json())) is not None:
        return failed
    return EXIT_FAILED if result.defect is not None else EXIT_OK


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _show_arguments(sub: Any) -> None:
    show = sub.add_parser("show", help="list the points of a golden directory")
    show.add_argument("golden", type=Path)
    show.add_argument("--verify", action="store_true", help="check every file's sha256")
    show.add_argument(
        "--inputs", action="store_true", help="show each point's call: args, kwargs and output, with shapes and dtypes"
    )


def cmd_show(args: argparse.Namespace) -> int:
    from .golden import GoldenError, GoldenStore
    from .golden.spec import describe
    from .points import describe_layers

    try:
        store = GoldenStore(args.golden, verify=args.verify)
        if args.verify:
            store.verify_all()
    except GoldenError as exc:
        return _fail(str(exc))
    m = store.manifest
    model = m["model"]
    print(f"{args.golden}: {model['model_type']} from {model['path']}")
    print(f"  {len(m['points'])} points, {len(m['files'])} files, {m['stats']['bytes'] / 1e6:.2f} MB")
    rows = f"{store.sequences} rows of " if store.sequences > 1 else ""
    padded = f", padded {m['inputs'].get('padding_side')}" if store.padded else ""
    print(f"  {rows}{m['inputs']['seq_len']} tokens{padded}, recorded in {m['record']['dtype']} on "
          f"{m['record']['devices']}")  # fmt: skip
    for i, prompt in enumerate(store.prompts):
        print(f"    row {i}: {prompt}")
    if "layers" in m["record"]:
        print(f"  a slice: layers {describe_layers(store.layers)} of {model.get('num_hidden_layers')}")
    if store.decode_steps:
        print(f"  then {store.describe_steps()}")
    if args.inputs:
        ids = m["inputs"]["input_ids"]
        rows = ids if ids and isinstance(ids[0], list) else [ids]
        for i, row in enumerate(rows):
            print(f"  input ids{f' (row {i})' if len(rows) > 1 else ''}: {', '.join(map(str, row))}")
        if store.decode_steps:
            tokens = ", ".join(f"step_{k} {t}" for k, t in enumerate(store.decode_tokens, 1))
            print(f"  decode tokens (the reference's greedy choice fed at each step): {tokens}")
    for point in store.points:
        entry = store.entry(point)
        outputs = describe(entry["output"], entry["tensors"], "out")
        if not args.inputs:
            shapes = ", ".join(text.removeprefix("tensor ") for _, text in outputs if text.startswith("tensor"))
            print(f"  {point.id:<28} {point.module:<40} out {shapes}")
            continue
        print(f"  {point.id}  ({point.module})")
        tensors = entry["tensors"]
        calls = [row for i, spec in enumerate(entry["inputs"]["args"]) for row in describe(spec, tensors, f"args.{i}")]
        calls += [
            row for k, spec in entry["inputs"]["kwargs"].items() for row in describe(spec, tensors, f"kwargs.{k}")
        ]
        for path, text in calls + outputs:
            print(f"    {path:<36} {text}")
    if args.verify:
        print("  all files match their sha256")
    return EXIT_OK


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


def cmd_compare(args: argparse.Namespace) -> int:
    """A dump compared offline: the same session, rows and summary lines as `pytest --hw dump`."""
    from .errors import GoldenError
    from .judge.tolerances import parse_override
    from .session import ParitySession, RunOptions, SetupError

    try:
        tolerances = [parse_override(t) for t in args.tol]
    except ValueError as exc:
        return _fail(f"--tol: {exc}")
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
    options = RunOptions(
        golden_dir=args.golden,
        hw="dump",
        model=args.candidate,
        dtype=args.dtype,
        mode=args.mode,
        hw_options=hw_options,
        batch=args.rows is not None,
        cli_tolerances=tolerances,
        report_dir=args.report,
        plots=args.plots == "yes",
        flags=flags,
        freeze_gc=True,
    )
    try:
        session = ParitySession(options)
    except (SetupError, GoldenError) as exc:
        return _fail(str(exc))
    try:
        rows = list(session.run_all(items=True))
        nothing = session.nothing_compared()
        if nothing is not None:
            return _fail(nothing)
        session.write_reports()
        for line, _ in session.closing_lines():
            print(line)
    except (SetupError, GoldenError) as exc:
        return _fail(str(exc))
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

    from .golden import GoldenStore
    from .record.run import record_golden
    from .record.tiny import fixtures_dir

    bundled = fixtures_dir() / "demo"
    _quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="moe-parity-demo-") as tmp:
        out = args.out or Path(tmp) / "golden"
        print(f"1. recording the bundled tiny MiniMax-M2 ({bundled / 'model'}) -> {out}")
        seq_len = GoldenStore(bundled / "golden").manifest["inputs"]["seq_len"]
        try:
            result = record_golden(
                bundled / "model", out, seq_len=seq_len, overwrite=True, progress=lambda m: print("   " + m)
            )
        except Exception as exc:  # a BadInput here means --out is unusable
            return _fail(str(exc))
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

    from .judge.metrics import compare_tensors

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


def _report_arguments(sub: Any) -> None:
    report = sub.add_parser(
        "report",
        help="redraw a report's pictures and print its summary from the JSON; --merge: the shards of a sharded run "
        "made one run's report (exit 1 where it failed or lacks a shard, 2 if they are not one run)",
    )
    report.add_argument(
        "report", type=Path, nargs="?", help="a --parity-report directory (or its comparison_report.json)"
    )
    report.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="the --parity-report directories of a run's shards (--parity-layers selections of one golden, candidate "
        "and settings): merged into --out",
    )
    report.add_argument("--out", type=Path, metavar="DIR", help="where --merge writes the merged run's reports")
    report.add_argument(
        "--previous",
        type=Path,
        metavar="DIR",
        help="with --merge: the previous run's merged report, diffed against tonight's (absent: said, not a failure)",
    )


def cmd_report(args: argparse.Namespace) -> int:
    """Redraw the pictures of a --parity-report directory from its JSON and print its summary."""
    if args.merge is not None or args.out is not None or args.previous is not None:
        return _report_merge(args)
    if args.report is None:
        return _fail("give a --parity-report DIR to redraw, or --merge DIR... --out DIR")
    from .report.block import bug_report, bug_report_text
    from .report.files import plots_line, read_report, report_rows
    from .report.html import DIFF_FILE, HTML_FILE, load_diff, write_html
    from .report.plots import PlotsUnavailable, render_plots
    from .report.summary import summary_lines, summary_table

    try:
        report = read_report(args.report)
    except ValueError as exc:
        return _fail(str(exc))
    directory = args.report if args.report.is_dir() else args.report.parent
    rows = report_rows(report)
    points = [r for r in rows if r.kind != "op"]  # a drill's ops are its table, not points
    try:  # the pictures are what this command is for: without matplotlib, say so and fail
        written = render_plots(points, directory)
    except PlotsUnavailable as exc:
        return _fail(str(exc))
    try:  # the page shows them: written again with them, and with a diff.json beside the report
        page = write_html(directory, report, pictures=written)
    except OSError as exc:
        return _fail(f"{directory}: cannot write {HTML_FILE} ({exc})")
    _, not_shown = load_diff(directory, report)
    print(f"moe-parity report: {directory} ({_describe_run(report)}, {len(points)} points)")
    for line in summary_table(rows):
        print(line)
    for line, _ in summary_lines(rows):
        print(line)
    print(f"page: {page}" + (f" ({DIFF_FILE} not shown: {not_shown})" if not_shown else ""))
    print(plots_line(written, directory))
    for line in bug_report_text(bug_report(rows, report)):
        print(line)
    return EXIT_OK


def _report_merge(args: argparse.Namespace) -> int:
    """`moe-parity report --merge DIR... --out DIR`: exit 0 when the merged run is whole and every item passed,
    1 when an item failed or errored or the run lacks a shard (named, in the output and the merged summary), 2
    when the directories are not the shards of one run."""
    from .report.merge import MergeError, merge, merge_lines, problem_lines, write_merged
    from .report.summary import summary_lines, summary_table

    if args.report is not None:
        return _fail(f"--merge takes the shards' directories; {args.report} is one more: add it after --merge")
    if not args.merge or args.out is None:
        return _fail("--merge DIR... and --out DIR go together: the shards' reports, and where the merged one goes")
    if args.out.resolve() in {p.resolve() for p in args.merge}:
        return _fail(f"--out {args.out} is one of the shards: write the merged report elsewhere")
    try:
        merged = merge(args.merge)
    except MergeError as exc:
        return _fail(str(exc))
    try:
        written = write_merged(merged, args.out)
    except OSError as exc:
        return _fail(f"--out {args.out}: cannot write the merged report ({exc})")
    for line in merge_lines(merged):
        print(line)
    for line in summary_table(merged.rows):
        print(line)
    for line, _ in summary_lines(merged.rows, report_dir=args.out):
        print(line)
    for line in [*problem_lines(merged), *written]:
        print(line)
    if args.previous is not None:
        for line in _previous_lines(args.previous, args.out):
            print(line)
    return EXIT_OK if merged.passed else EXIT_FAILED


def _previous_lines(previous: Path, tonight: Path) -> list[str]:
    """The previous run's report diffed against tonight's merged one, best effort: a previous report
    that is not there or not comparable is said in a line, never a failure (a first night has none)."""
    from .report.files import read_report
    from .report.history import comparable, diff_reports
    from .report.html import write_diff

    if not previous.exists():
        return [f"no previous report at {previous}: nothing to diff against (a first run)"]
    try:
        old, new = read_report(previous), read_report(tonight)
    except ValueError as exc:
        return [f"previous report not read: {exc}"]
    reason = comparable(old, new)
    if reason is not None:
        return [f"previous report not diffed: {reason}"]
    diff = diff_reports(old, new)
    lines = diff.lines(str(previous), str(tonight), 2.0)
    try:  # the merged run's page shows the diff too (diff.json beside its report)
        write_diff(tonight, new, diff.to_json(str(previous), str(tonight), 2.0))
    except OSError as exc:
        lines.append(f"the diff is not on the page: {exc}")
    return lines


def _describe_run(report: dict) -> str:
    return (
        f"{report.get('model_type', '?')} on --hw {report.get('hw', '?')} in {report.get('dtype', '?')}, "
        f"{report.get('mode', 'isolated')} mode"
    )


def _diff_arguments(sub: Any) -> None:
    diff = sub.add_parser(
        "diff", help="points that got worse from one report to the next (exit 1 when any did, 2 if not comparable)"
    )
    diff.add_argument("old", type=Path, help="the earlier --parity-report directory (or its JSON)")
    diff.add_argument("new", type=Path, help="the later one")
    diff.add_argument(
        "--factor", type=_factor, default=2.0, help="a figure counts as worse beyond this factor (default 2)"
    )
    diff.add_argument(
        "--min-error",
        type=float,
        default=1e-3,
        help="a rel_l2 below this is rounding, whatever its growth (default 1e-3)",
    )
    diff.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the diff as JSON (as NEW/diff.json, report.html shows it: moe-parity report NEW)",
    )


def cmd_diff(args: argparse.Namespace) -> int:
    """Points that got worse between two reports: exit 1 when any did, 2 when they are not comparable."""
    from .report.files import read_report
    from .report.history import comparable, diff_reports

    try:
        old, new = read_report(args.old), read_report(args.new)
    except ValueError as exc:
        return _fail(str(exc))
    reason = comparable(old, new)
    if reason is not None:
        return _fail(reason)
    result = diff_reports(old, new, factor=args.factor, min_error=args.min_error)
    if not result.common:
        return _fail(f"{args.old} and {args.new} share no point; nothing to compare")
    for line in result.lines(str(args.old), str(args.new), args.factor):
        print(line)
    as_json = result.to_json(str(args.old), str(args.new), args.factor)
    if args.json is not None and (failed := _write_json(args.json, as_json)) is not None:
        return failed
    return EXIT_FAILED if result.worse else EXIT_OK


def _checkpoint_report(args: argparse.Namespace, run, lines, as_json) -> tuple[int | None, Any]:
    """Run `run()` (audit or estimate), print `lines(result)` and write `as_json(result)` to --json;
    (exit code, result), the exit code set only on bad input."""
    from .errors import BadInput

    try:
        result = run()
    except BadInput as exc:
        return _fail(str(exc)), None
    for line in lines(result):
        print(line)
    failed = _write_json(args.json, as_json(result)) if args.json is not None else None
    return (failed, None) if failed is not None else (None, result)


def _write_json(path: Path, data: Any) -> int | None:
    """`--json FILE`: `data` written there (its folder made); None, or exit 2 with one line where it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        return _fail(f"--json {path}: cannot write it ({exc})")
    return None


def _audit_arguments(sub: Any) -> None:
    audit = sub.add_parser(
        "audit",
        help="a checkpoint's dtypes and expert-fusion memory from its safetensors headers (exit 1 on a finding)",
    )
    audit.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors)")
    audit.add_argument(
        "--expect-dtype", default=None, help="the dtype every tensor should have (default: config.json's)"
    )
    audit.add_argument("--json", type=Path, default=None, help="also write the audit as JSON to this file")


def cmd_audit(args: argparse.Namespace) -> int:
    """Exit 1 when a tensor is in an unexpected dtype, 2 on bad input; headers only are read."""
    from .record.audit import audit, text_lines

    code, result = _checkpoint_report(
        args, lambda: audit(args.model, args.expect_dtype), lambda r: text_lines(r, args.model), lambda r: r.to_dict()
    )
    if code is not None:
        return code
    return EXIT_FAILED if result.findings else EXIT_OK


def _scan_arguments(sub: Any) -> None:
    scan = sub.add_parser(
        "scan",
        help="find the prompts that show a problem: rank them by how far the candidate's next tokens leave the "
        "reference's (exit 1 if any is beyond tolerance)",
    )
    scan.add_argument("--model", required=True, type=Path, help="reference checkpoint directory")
    which = scan.add_mutually_exclusive_group(required=True)
    which.add_argument("--candidate", type=Path, help="the candidate checkpoint (a converted port), run here")
    which.add_argument(
        "--write-inputs",
        type=Path,
        metavar="DIR",
        help="write the teacher-forced sequences to DIR/inputs.jsonl for a port to run elsewhere (then --logits DIR)",
    )
    which.add_argument(
        "--logits",
        type=Path,
        metavar="DIR",
        help="the candidate is the logits a port wrote in DIR per prompt (<name>.safetensors or .pt, [tokens, vocab]) "
        "for the sequences of DIR/inputs.jsonl",
    )
    scan.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help='one prompt per line, text or JSONL ({"text": ...} or {"ids": [...]}); default: the built-in set '
        "(lengths around 2^k, repeated tokens, a long-range copy; numbers, code, languages with a tokenizer)",
    )
    scan.add_argument(
        "--hw",
        default=None,
        metavar="NAME",
        help="run --candidate through this backend's whole-model run (cpu, cuda, or a third-party backend whose "
        "chain_kind is 'model') instead of with transformers on --device",
    )
    scan.add_argument(
        "--hw-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the --hw backend (repeatable), as pytest's --hw-option",
    )
    scan.add_argument("--dtype", default="bfloat16", help="the candidate's dtype (default: bfloat16)")
    scan.add_argument("--device", default="cpu", help="device for the three runs (default: cpu)")
    scan.add_argument(
        "--new-tokens",
        type=_positive_int,
        default=8,
        metavar="N",
        help="tokens the reference continues each prompt with, greedily; all are judged teacher-forced (default: 8)",
    )
    scan.add_argument(
        "--batch-size", type=_positive_int, default=8, metavar="B", help="prompts per forward (default: 8)"
    )
    scan.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every prompt's figures as JSON")
    scan.add_argument("--plot", type=Path, default=None, metavar="FILE", help="a ranked bar chart (PNG; needs [plots])")
    scan.add_argument(
        "--record-worst", type=_positive_int, default=None, metavar="K", help="record goldens of the K worst prompts"
    )
    scan.add_argument("--out", type=Path, default=None, metavar="DIR", help="where --record-worst writes its goldens")
    scan.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modeling code")
    scan.add_argument("-q", "--quiet", action="store_true", help="print only the table and the closing line")


def cmd_scan(args: argparse.Namespace) -> int:
    from .errors import BadInput
    from .scan import ScanRequest, plot, record_worst, table, write_json

    _quiet_transformers()
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    if (args.record_worst is None) != (args.out is None):
        return _fail("--record-worst K and --out DIR go together: the goldens of the K worst prompts go in DIR")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        return _fail(f"--out {args.out} is not empty; choose a new directory for the goldens")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--plot needs matplotlib: pip install -e '.[plots]'")
    request = ScanRequest(
        args.model, args.candidate, prompts=args.prompts, dtype=args.dtype, device=args.device,
        new_tokens=args.new_tokens, batch_size=args.batch_size, trust_remote_code=args.trust_remote_code,
        logits_dir=args.logits, hw=args.hw, hw_options=args.hw_option,
    )  # fmt: skip
    if args.hw is None and args.hw_option:
        return _fail("--hw-option sets the --hw backend's options: add --hw NAME")
    if args.logits is not None and args.prompts is not None:
        return _fail("--logits reads the prompts of DIR/inputs.jsonl (written by --write-inputs); drop --prompts")
    if args.write_inputs is not None and (args.record_worst or args.json or args.plot):
        return _fail("--write-inputs only writes the sequences; --record-worst, --json and --plot go with the scan "
                     "itself (--candidate, or --logits once the port wrote them)")  # fmt: skip
    try:
        if args.write_inputs is not None:
            request.write_inputs(args.write_inputs, lambda msg: print(msg, flush=True))
            return EXIT_OK
        results = request.run(say)
        if args.record_worst:
            record_worst(args.model, args.out, results, args.record_worst, say, device=args.device)
    except BadInput as exc:
        return _fail(str(exc))
    for line in table(results):
        print(line)
    if args.json is not None:
        meta = {"model": str(args.model), "candidate": str(args.candidate or args.logits), "dtype": args.dtype,
                "new_tokens": args.new_tokens, "prompts_file": str(args.prompts) if args.prompts else None}  # fmt: skip
        write_json(args.json, results, meta)
    if args.plot is not None:
        from .dtypes import parse_dtype
        from .judge.tolerances import default_tolerance

        plot(args.plot, results, default_tolerance(parse_dtype(args.dtype), "logits").noise_factor)
    beyond = [r for r in results if r.beyond]
    worst = f"; worst: {beyond[0].name} ({'; '.join(beyond[0].why)})" if beyond else ""
    print(f"scan: {len(beyond)} of {len(results)} prompts beyond tolerance{worst}")
    return EXIT_FAILED if beyond else EXIT_OK


def _estimate_arguments(sub: Any) -> None:
    estimate = sub.add_parser(
        "estimate", help="weights, activations, golden size and whether a placement fits, from headers and config"
    )
    estimate.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors)")
    estimate.add_argument("--seq-len", type=_positive_int, default=16, help="tokens of the golden run (default: 16)")
    estimate.add_argument("--dtype", default=None, help="dtype to run in (default: the weights as stored)")
    estimate.add_argument("--max-memory", default=None, help="devices to place on, e.g. 0:60GiB,1:60GiB,cpu:200GiB")
    estimate.add_argument("--json", type=Path, default=None, help="also write the estimate as JSON to this file")
    shards = estimate.add_argument_group(
        "a sharded nightly",
        "each shard's --parity-layers (balanced by each layer's replay cost) and wall; the JSON's `shards` list is a "
        "GitHub matrix",
    )
    shards.add_argument("--shards", type=_positive_int, default=None, metavar="N", help="split the run into N shards")
    shards.add_argument(
        "--budget", default=None, metavar="TIME", help="a shard's time budget (60m, 1h30m): how many shards fit it"
    )
    shards.add_argument(
        "--cores", type=_positive_int, default=None, metavar="N", help="a runner's cores (scales a CPU's throughput)"
    )
    shards.add_argument(
        "--from-report",
        type=Path,
        default=None,
        metavar="DIR",
        help="take the throughput from a previous run's report (its points' measured seconds) instead of a quick "
        "calibration on this host",
    )
    shards.add_argument(
        "--hw", default=None, help="the backend the shards run (default cpu): neuron, trace, compile run every expert"
    )
    shards.add_argument(
        "--workers", type=_positive_int, default=1, metavar="N", help="pytest-xdist workers per shard (default 1)"
    )
    shards.add_argument(
        "--setup", default=None, metavar="TIME", help="a shard job's own setup (install, download), added to each"
    )


def cmd_estimate(args: argparse.Namespace) -> int:
    """Exit 1 when the placement given does not fit, or the shards do not fit --budget; 2 on bad input."""
    from .record.audit import estimate, estimate_lines

    sharded = args.shards is not None or args.budget is not None
    asked = [f for f, v in (("--cores", args.cores), ("--from-report", args.from_report), ("--hw", args.hw),
                            ("--setup", args.setup)) if v is not None]  # fmt: skip
    if asked and not sharded:
        return _fail(f"{asked[0]} goes with --shards N or --budget TIME (a sharded nightly's figures)")

    def run() -> dict[str, Any]:
        result = estimate(args.model, args.seq_len, args.dtype, args.max_memory)
        if sharded:
            result.update(_shard_plan(args, result))
        return result

    def lines(result: dict[str, Any]) -> list[str]:
        from .record.shards import shard_lines

        plan = result.get("shard_plan")
        return estimate_lines(result) + (shard_lines(plan, args.hw or "cpu", args.seq_len) if plan else [])

    code, result = _checkpoint_report(args, run, lines, lambda r: r)
    if code is not None:
        return code
    if result.get("shard_plan", {}).get("fits") is False:
        return EXIT_FAILED
    return EXIT_FAILED if result.get("placement", {}).get("fits") is False else EXIT_OK


def _shard_plan(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """`estimate --shards/--budget`: the shards' --parity-layers (`shards`, a GitHub matrix) and the plan."""
    from .model.checkpoint import read_config
    from .record.shards import calibrate, from_report, parse_duration, plan_shards, replay_units

    budget = parse_duration(args.budget) if args.budget is not None else None
    setup = parse_duration(args.setup, "--setup") if args.setup is not None else 0.0
    hw = args.hw or "cpu"
    per_layer = result["per_layer"]["capture_bytes"]
    reads = {u: b + (per_layer if u.startswith("layer_") else 0) for u, b in result["weights_bytes"].items()}
    units = replay_units(args.model, args.seq_len, reads, hw)
    if args.from_report is not None:
        model_type = read_config(args.model).get("model_type")
        speed = from_report(args.from_report, args.model, model_type, args.cores)
    else:
        speed = calibrate(args.model, args.seq_len, args.dtype, args.cores)
        if hw not in ("cpu", "trace", "compile"):
            speed.notes.append(f"a CPU's figures: for --hw {hw} pass --from-report with a previous run's report")
    plan = plan_shards(units, speed, shards=args.shards, budget_s=budget, setup_s=setup, workers=args.workers)
    return {"shards": [sel for sel, _ in plan.shards], "shard_plan": plan.to_json()}


def _drill_ops_arguments(sub: Any) -> None:
    ops = sub.add_parser(
        "drill-ops",
        help="record the reference's ops at some points into a golden, for --parity-drill where the golden's model "
        "cannot run (the Neuron SDK's stack) or is not copied",
    )
    ops.add_argument("golden", type=Path, help="golden directory (the ops go to its drill/ folder)")
    ops.add_argument(
        "--points", required=True, action="append", help="point ids or glob patterns, comma-separated (repeatable)"
    )
    ops.add_argument(
        "--dtype",
        action="append",
        default=None,
        help="the candidate's dtype, whose run of the reference gives each op its noise floor (repeatable; "
        "default: bfloat16)",
    )
    ops.add_argument("--model", type=Path, default=None, help="the golden's model (default: where it was recorded)")
    ops.add_argument(
        "--trust-remote-code", action="store_true", help="allow the checkpoint's own modeling code (off by default)"
    )


def cmd_drill_ops(args: argparse.Namespace) -> int:
    """The reference's ops at the points asked for, captured on the golden's model and stored with
    the golden (`drill.store`). Exit 2 on bad input, or where the model does not reproduce the golden."""
    from .drill import REPRODUCE_TOL, Driller, DrillError, drill_patterns, selects, store
    from .dtypes import parse_dtype
    from .errors import GoldenError
    from .golden import GoldenStore

    _quiet_transformers()
    try:
        golden = GoldenStore(args.golden)
        dtypes = [parse_dtype(d, floating=True) for d in args.dtype or ["bfloat16"]]
    except (GoldenError, ValueError) as exc:
        return _fail(str(exc))
    patterns = drill_patterns(args.points)
    points = [p for p in golden.points if selects(patterns, p.id)]
    if not points:
        return _fail(f"--points {','.join(patterns)} matches no point of this golden (see moe-parity show)")
    model = args.model or (golden.local_model() or (None,))[0]
    if model is None or not Path(model).is_dir():
        where = model or golden.manifest["model"].get("path")
        return _fail(f"the golden's model is not at {where}: pass it with --model DIR")
    driller = Driller(golden, Path(model), None, trust_remote_code=args.trust_remote_code)
    written = 0
    try:
        for point in points:
            graphs, error = driller.capture(point, dtypes)
            if error is not None and error > REPRODUCE_TOL:
                return _fail(
                    f"{point.id}: the model at {model} does not reproduce the golden (relative L2 {error:.2e}): "
                    "pass the golden's own model with --model"
                )
            size = store.save(golden.root, point.id, graphs)
            written += size
            ops = len(graphs["float32"].compute())
            print(f"{point.id}: {ops} ops in {', '.join(graphs)}, {size / 1e6:.2f} MB", flush=True)
    except (DrillError, store.StoreError) as exc:
        return _fail(str(exc))
    finally:
        driller.close()
    print(f"drill ops written: {len(points)} points, {written / 1e6:.2f} MB -> {golden.root / store.DIR}")
    return EXIT_OK


def _routes_arguments(sub: Any) -> None:
    routes = sub.add_parser(
        "routes",
        help="an engine's routed-experts trace (tokens, moe_layers, top_k) against the golden's routing "
        "(exit 1 where a layer routes otherwise); --write: the golden's routing as a trace",
    )
    routes.add_argument("golden", type=Path)
    routes.add_argument("trace", type=Path, nargs="?", help="the engine's trace: .npy, .safetensors, .pt or .json")
    routes.add_argument(
        "--dtype",
        default="bfloat16",
        help="the engine's router dtype: flips within its rounding are ties",
    )
    routes.add_argument("--json", type=Path, metavar="FILE", help="also write the verdict per layer as JSON")
    routes.add_argument(
        "--write", type=Path, metavar="FILE", help="write the golden's own routing as a trace (for routing replay)"
    )


def cmd_routes(args: argparse.Namespace) -> int:
    """`moe-parity routes`: see `routes`. Exit 1 where a layer's real flips exceed its limit."""
    from .dtypes import parse_dtype
    from .errors import GoldenError
    from .golden import GoldenStore
    from .routes import TraceError, golden_trace, judge_routes, read_trace, routes_lines, write_trace

    if (args.trace is None) == (args.write is None):
        return _fail("give the engine's TRACE to judge, or --write FILE to write the golden's routing (one of them)")
    try:
        dtype = parse_dtype(args.dtype, floating=True)
    except ValueError:
        return _fail(f"--dtype {args.dtype!r} is not a floating-point torch dtype (e.g. bfloat16)")
    try:
        golden = GoldenStore(args.golden)
        if args.write is not None:
            ids = golden_trace(golden)
            write_trace(args.write, ids)
            print(f"routes: the golden's routing {list(ids.shape)} (tokens, moe_layers, top_k) -> {args.write}")
            return EXIT_OK
        result = judge_routes(golden, read_trace(args.trace), dtype, str(args.trace))
    except (GoldenError, TraceError) as exc:
        return _fail(str(exc))
    for line in routes_lines(result):
        print(line)
    if args.json is not None and (failed := _write_json(args.json, result.to_json())) is not None:
        return failed
    return EXIT_FAILED if result.first_divergence is not None else EXIT_OK


COMMANDS = {
    "drill-ops": cmd_drill_ops,
    "tiny-model": cmd_tiny_model,
    "golden": cmd_golden,
    "compare": cmd_compare,
    "show": cmd_show,
    "demo": cmd_demo,
    "report": cmd_report,
    "diff": cmd_diff,
    "audit": cmd_audit,
    "estimate": cmd_estimate,
    "scan": cmd_scan,
    "routes": cmd_routes,
    "sweep": cmd_sweep,
}


# Commands that run transformers' own modules of the golden's architecture (its transformers 5 layout)
NEEDS_TRANSFORMERS_5 = {"tiny-model", "golden", "demo", "audit", "estimate", "drill-ops", "scan"}


def main(argv: Sequence[str] | None = None) -> int:
    from .host import bound_onednn_caches

    args = build_parser().parse_args(argv)
    bound_onednn_caches()  # before any bf16 forward: the noise floor's, a scan's, a compare's
    if args.command in NEEDS_TRANSFORMERS_5 and compat.MAJOR < 5:
        print(f"moe-parity {args.command}: {compat.needs_transformers_5()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("moe-parity: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `moe-parity show G | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
