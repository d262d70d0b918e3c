"""`moe-parity show`, `drill-ops`, `routes` and `scan`: a look inside a golden (its points, the
reference's ops, its routing against an engine's) and the prompts that show a problem."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..words import counted
from .common import EXIT_FAILED, EXIT_OK, Command, positive_int_arg, quiet_transformers, write_json


def _show_arguments(sub: Any) -> None:
    show = sub.add_parser("show", help="list the points of a golden directory")
    show.add_argument("golden", type=Path)
    show.add_argument("--verify", action="store_true", help="check every file's sha256")
    show.add_argument(
        "--inputs", action="store_true", help="show each point's call: args, kwargs and output, with shapes and dtypes"
    )


def cmd_show(args: argparse.Namespace) -> int:
    from ..golden import GoldenStore
    from ..golden.spec import describe
    from ..points import describe_layers

    store = GoldenStore(args.golden, verify=args.verify)
    if args.verify:
        store.verify_all()
    m = store.manifest
    model = m["model"]
    print(f"{args.golden}: {model['model_type']} from {model['path']}")
    size = m["stats"]["bytes"] / 1e6
    print(f"  {counted(len(m['points']), 'point')}, {counted(len(m['files']), 'file')}, {size:.2f} MB")
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
    from ..drill import REPRODUCE_TOL, Driller, drill_patterns, selects, store
    from ..dtypes import parse_dtype
    from ..golden import GoldenStore

    quiet_transformers()
    golden = GoldenStore(args.golden)
    try:
        dtypes = [parse_dtype(d, floating=True) for d in args.dtype or ["bfloat16"]]
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    patterns = drill_patterns(args.points)
    points = [p for p in golden.points if selects(patterns, p.id)]
    if not points:
        raise BadInput(f"--points {','.join(patterns)} matches no point of this golden (see moe-parity show)")
    model = args.model or (golden.local_model() or (None,))[0]
    if model is None or not Path(model).is_dir():
        where = model or golden.manifest["model"].get("path")
        raise BadInput(f"the golden's model is not at {where}: pass it with --model DIR")
    driller = Driller(golden, Path(model), None, trust_remote_code=args.trust_remote_code)
    written = 0
    try:
        for point in points:
            graphs, error = driller.capture(point, dtypes)
            if error is not None and error > REPRODUCE_TOL:
                raise BadInput(
                    f"{point.id}: the model at {model} does not reproduce the golden (relative L2 {error:.2e}): "
                    "pass the golden's own model with --model"
                )
            size = store.save(golden.root, point.id, graphs)
            written += size
            ops = len(graphs["float32"].compute())
            print(f"{point.id}: {counted(ops, 'op')} in {', '.join(graphs)}, {size / 1e6:.2f} MB", flush=True)
    finally:
        driller.close()
    print(f"drill ops written: {counted(len(points), 'point')}, {written / 1e6:.2f} MB -> {golden.root / store.DIR}")
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
    from ..dtypes import parse_dtype
    from ..golden import GoldenStore
    from ..routes import golden_trace, judge_routes, read_trace, routes_lines, write_trace

    if (args.trace is None) == (args.write is None):
        raise BadInput("give the engine's TRACE to judge, or --write FILE to write the golden's routing (one of them)")
    try:
        dtype = parse_dtype(args.dtype, floating=True)
    except ValueError:
        raise BadInput(f"--dtype {args.dtype!r} is not a floating-point torch dtype (e.g. bfloat16)") from None
    golden = GoldenStore(args.golden)
    if args.write is not None:
        ids = golden_trace(golden)
        write_trace(args.write, ids)
        print(f"routes: the golden's routing {list(ids.shape)} (tokens, moe_layers, top_k) -> {args.write}")
        return EXIT_OK
    result = judge_routes(golden, read_trace(args.trace), dtype, str(args.trace))
    for line in routes_lines(result):
        print(line)
    if args.json is not None:
        write_json(args.json, result.to_json())
    return EXIT_FAILED if result.first_divergence is not None else EXIT_OK


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
        type=positive_int_arg,
        default=8,
        metavar="N",
        help="tokens the reference continues each prompt with, greedily; all are judged teacher-forced (default: 8)",
    )
    scan.add_argument(
        "--batch-size", type=positive_int_arg, default=8, metavar="B", help="prompts per forward (default: 8)"
    )
    scan.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every prompt's figures as JSON")
    scan.add_argument("--plot", type=Path, default=None, metavar="FILE", help="a ranked bar chart (PNG; needs [plots])")
    scan.add_argument(
        "--record-worst", type=positive_int_arg, default=None, metavar="K", help="record goldens of the K worst prompts"
    )
    scan.add_argument("--out", type=Path, default=None, metavar="DIR", help="where --record-worst writes its goldens")
    scan.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modeling code")
    scan.add_argument("-q", "--quiet", action="store_true", help="print only the table and the closing line")


def cmd_scan(args: argparse.Namespace) -> int:
    from ..scan import ScanRequest, plot, record_worst, table, write_json

    quiet_transformers()
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    if (args.record_worst is None) != (args.out is None):
        raise BadInput("--record-worst K and --out DIR go together: the goldens of the K worst prompts go in DIR")
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        raise BadInput(f"--out {args.out} is not empty; choose a new directory for the goldens")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BadInput("--plot needs matplotlib: pip install -e '.[plots]'") from None
    request = ScanRequest(
        args.model, args.candidate, prompts=args.prompts, dtype=args.dtype, device=args.device,
        new_tokens=args.new_tokens, batch_size=args.batch_size, trust_remote_code=args.trust_remote_code,
        logits_dir=args.logits, hw=args.hw, hw_options=args.hw_option,
    )  # fmt: skip
    if args.hw is None and args.hw_option:
        raise BadInput("--hw-option sets the --hw backend's options: add --hw NAME")
    if args.logits is not None and args.prompts is not None:
        raise BadInput("--logits reads the prompts of DIR/inputs.jsonl (written by --write-inputs); drop --prompts")
    if args.write_inputs is not None and (args.record_worst or args.json or args.plot):
        raise BadInput("--write-inputs only writes the sequences; --record-worst, --json and --plot go with the scan "
                     "itself (--candidate, or --logits once the port wrote them)")  # fmt: skip
    if args.write_inputs is not None:
        request.write_inputs(args.write_inputs, lambda msg: print(msg, flush=True))
        return EXIT_OK
    results = request.run(say)
    if args.record_worst:
        record_worst(args.model, args.out, results, args.record_worst, say, device=args.device)
    for line in table(results):
        print(line)
    if args.json is not None:
        meta = {"model": str(args.model), "candidate": str(args.candidate or args.logits), "dtype": args.dtype,
                "new_tokens": args.new_tokens, "prompts_file": str(args.prompts) if args.prompts else None}  # fmt: skip
        write_json(args.json, results, meta)
    if args.plot is not None:
        from ..dtypes import parse_dtype
        from ..judge.tolerances import default_tolerance

        plot(args.plot, results, default_tolerance(parse_dtype(args.dtype), "logits").noise_factor)
    beyond = [r for r in results if r.beyond]
    worst = f"; worst: {beyond[0].name} ({'; '.join(beyond[0].why)})" if beyond else ""
    print(f"scan: {len(beyond)} of {len(results)} prompts beyond tolerance{worst}")
    return EXIT_FAILED if beyond else EXIT_OK


SHOW = Command("show", _show_arguments, cmd_show)
DRILL_OPS = Command("drill-ops", _drill_ops_arguments, cmd_drill_ops, needs_transformers_5=True)
ROUTES = Command("routes", _routes_arguments, cmd_routes)
SCAN = Command("scan", _scan_arguments, cmd_scan, needs_transformers_5=True)
