"""`moe-parity audit` and `moe-parity estimate`: a checkpoint read from its headers and config (its
dtypes and quantization; its memory, golden size, placement and a sharded nightly's shards); and
`moe-parity dequantize`: a quantized checkpoint's unquantized copy, written one layer at a time."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import BadInput
from .common import EXIT_FAILED, EXIT_OK, Command, positive_int_arg, write_json


def _checkpoint_report(args: argparse.Namespace, run, lines, as_json) -> Any:
    """Run `run()` (audit or estimate), print `lines(result)` and write `as_json(result)` to --json;
    the result."""
    result = run()
    for line in lines(result):
        print(line)
    if args.json is not None:
        write_json(args.json, as_json(result))
    return result


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
    """Exit 1 when a tensor is in an unexpected dtype (or, quantized, a projection is left unquantized that
    the config does not say), 2 on bad input (a quantized checkpoint its layout cannot read); headers only."""
    from ..record.audit import audit, text_lines

    result = _checkpoint_report(
        args, lambda: audit(args.model, args.expect_dtype), lambda r: text_lines(r, args.model), lambda r: r.to_dict()
    )
    return EXIT_FAILED if result.failed else EXIT_OK


def _estimate_arguments(sub: Any) -> None:
    estimate = sub.add_parser(
        "estimate", help="weights, activations, golden size and whether a placement fits, from headers and config"
    )
    estimate.add_argument("--model", required=True, type=Path, help="checkpoint directory (safetensors)")
    estimate.add_argument("--seq-len", type=positive_int_arg, default=16, help="tokens of the golden run (default: 16)")
    estimate.add_argument("--dtype", default=None, help="dtype to run in (default: the weights as stored)")
    estimate.add_argument("--max-memory", default=None, help="devices to place on, e.g. 0:60GiB,1:60GiB,cpu:200GiB")
    estimate.add_argument("--json", type=Path, default=None, help="also write the estimate as JSON to this file")
    shards = estimate.add_argument_group(
        "a sharded nightly",
        "each shard's --parity-layers (balanced by each layer's replay cost) and wall; the JSON's `shards` list is a "
        "GitHub matrix",
    )
    shards.add_argument(
        "--shards", type=positive_int_arg, default=None, metavar="N", help="split the run into N shards"
    )
    shards.add_argument(
        "--budget", default=None, metavar="TIME", help="a shard's time budget (60m, 1h30m): how many shards fit it"
    )
    shards.add_argument(
        "--cores", type=positive_int_arg, default=None, metavar="N", help="a runner's cores (scales a CPU's throughput)"
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
        "--workers", type=positive_int_arg, default=1, metavar="N", help="pytest-xdist workers per shard (default 1)"
    )
    shards.add_argument(
        "--setup", default=None, metavar="TIME", help="a shard job's own setup (install, download), added to each"
    )


def cmd_estimate(args: argparse.Namespace) -> int:
    """Exit 1 when the placement given does not fit, or the shards do not fit --budget; 2 on bad input."""
    from ..record.audit import estimate, estimate_lines

    sharded = args.shards is not None or args.budget is not None
    asked = [f for f, v in (("--cores", args.cores), ("--from-report", args.from_report), ("--hw", args.hw),
                            ("--setup", args.setup)) if v is not None]  # fmt: skip
    if asked and not sharded:
        raise BadInput(f"{asked[0]} goes with --shards N or --budget TIME (a sharded nightly's figures)")

    def run() -> dict[str, Any]:
        result = estimate(args.model, args.seq_len, args.dtype, args.max_memory)
        if sharded:
            result.update(_shard_plan(args, result))
        return result

    def lines(result: dict[str, Any]) -> list[str]:
        from ..record.shards import shard_lines

        plan = result.get("shard_plan")
        return estimate_lines(result) + (shard_lines(plan, args.hw or "cpu", args.seq_len) if plan else [])

    result = _checkpoint_report(args, run, lines, lambda r: r)
    if result.get("shard_plan", {}).get("fits") is False:
        return EXIT_FAILED
    return EXIT_FAILED if result.get("placement", {}).get("fits") is False else EXIT_OK


def _shard_plan(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """`estimate --shards/--budget`: the shards' --parity-layers (`shards`, a GitHub matrix) and the plan."""
    from ..model.checkpoint import read_config
    from ..record.shards import calibrate, from_report, parse_duration, plan_shards, replay_units

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


def _dequantize_arguments(sub: Any) -> None:
    dequantize = sub.add_parser(
        "dequantize",
        help="write an unquantized copy of a quantized checkpoint (fp8, compressed-tensors, mxfp4), one decoder "
        "layer at a time",
    )
    dequantize.add_argument("--model", required=True, type=Path, help="the quantized checkpoint directory")
    dequantize.add_argument("--out", required=True, type=Path, help="a new directory for the copy")
    dequantize.add_argument(
        "--dtype", default="bfloat16", help="the dequantized weights' dtype: bfloat16 (default), float16, float32"
    )
    dequantize.add_argument("--json", type=Path, default=None, help="also write what was written as JSON here")


def cmd_dequantize(args: argparse.Namespace) -> int:
    """Exit 0 once the copy is complete; 2 on bad input (nothing is left at --out)."""
    from ..record.dequantize import dequantize_checkpoint, dequantize_lines

    def run() -> dict[str, Any]:
        return dequantize_checkpoint(args.model, args.out, args.dtype, progress=lambda line: print(f"  {line}"))

    _checkpoint_report(args, run, dequantize_lines, lambda r: r)
    return EXIT_OK


AUDIT = Command("audit", _audit_arguments, cmd_audit, needs_transformers_5=True)
ESTIMATE = Command("estimate", _estimate_arguments, cmd_estimate, needs_transformers_5=True)
DEQUANTIZE = Command("dequantize", _dequantize_arguments, cmd_dequantize)
