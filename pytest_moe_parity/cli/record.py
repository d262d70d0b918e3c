"""`moe-parity tiny-model` and `moe-parity golden`: what is recorded (a tiny checkpoint, a golden, a
length sweep of goldens, the reference's noise floor)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..model.attention import DEFAULT_BUDGET_MIB
from ..words import counted
from .common import EXIT_OK, Command, cuda_available, int_list_arg, positive_int_arg, quiet_transformers


def _tiny_model_arguments(sub: Any) -> None:
    tiny = sub.add_parser("tiny-model", help="write a deterministic tiny random-init MoE checkpoint")
    tiny.add_argument("--arch", required=True, help="a transformers model_type, e.g. minimax_m2")
    tiny.add_argument("--out", required=True, type=Path, help="directory to write the checkpoint to")
    tiny.add_argument("--layers", type=positive_int_arg, default=None, help="decoder layers (default: the config's)")
    tiny.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    tiny.add_argument(
        "--quant",
        default=None,
        metavar="SCHEME",
        help="write it quantized in the hub's layout of SCHEME: fp8-block[:N] (DeepSeek-V3/Qwen3-FP8, blocks of "
        "N, 128 by default), fp8-channel, fp8-tensor, int8-channel (compressed-tensors) or mxfp4 (GPT-OSS)",
    )
    tiny.add_argument(
        "--kv-scales",
        action="store_true",
        help="add a k_scale/v_scale per attention (an FP8 KV cache's scales, from a few calibration tokens)",
    )
    tiny.add_argument(
        "--shard-size",
        default="500KB",
        help="max safetensors shard size, hub-style sharding (default: 500KB)",
    )


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from ..record.tiny import available_archs, write_tiny_model

    archs = available_archs()
    if args.arch not in archs:
        raise BadInput(f"unknown --arch {args.arch!r}; available: {', '.join(archs)}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise BadInput(f"{args.out} exists and is not empty; choose another --out")
    if args.quant is not None:
        from ..model.quant import parse_weight_scheme

        try:
            scheme, _ = parse_weight_scheme(args.quant)
        except ValueError as exc:
            raise BadInput(f"--quant {exc}") from None
        if scheme == "mxfp4" and args.arch != "gpt_oss":
            raise BadInput(
                f"--quant mxfp4 is GPT-OSS's layout (its fused experts); --arch {args.arch} has no such release"
            )
    quiet_transformers()
    out = write_tiny_model(
        args.arch, args.out, layers=args.layers, seed=args.seed, max_shard_size=args.shard_size,
        quant=args.quant, kv_scales=args.kv_scales,
    )  # fmt: skip
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir())
    quant = f", {args.quant or 'fp8-block'}" if args.quant or args.kv_scales else ""
    kv = " with KV-cache scales" if args.kv_scales else ""
    print(f"wrote tiny {args.arch} (seed {args.seed}{quant}){kv} to {out}: {len(files)} files, {size / 1e6:.2f} MB")
    return EXIT_OK


def _noise_dtype(text: str | None, golden_dtype: str) -> str | None:
    """The --noise-dtype, checked before anything is recorded; BadInput naming what is wrong."""
    from ..dtypes import dtype_name, parse_dtype

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
    src.add_argument("--input-ids", type=int_list_arg, help="comma-separated token ids, e.g. 1,2,3")
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
        "--pad-to",
        type=positive_int_arg,
        default=None,
        metavar="N",
        help="pad --prompts rows to N tokens (a fixed shape)",
    )
    golden.add_argument(
        "--batch-size",
        type=positive_int_arg,
        default=None,
        metavar="B",
        help="pad the --prompts batch to B rows (the extra rows are padding only, as a fixed batch size runs them)",
    )
    golden.add_argument(
        "--seq-len",
        type=positive_int_arg,
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
    _golden_quant_arguments(golden)


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
    _golden_noise_arguments(golden)
    golden.add_argument(
        "--decode-steps",
        type=positive_int_arg,
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


def _golden_quant_arguments(golden: Any) -> None:
    """A quantized checkpoint's options (docs/quantization.md)."""
    golden.add_argument(
        "--reference-quant",
        choices=("dequant", "native"),
        default=None,
        help="a quantized checkpoint (fp8, compressed-tensors, mxfp4): how the reference's matmuls run: dequant "
        "(default: weights dequantized as each layer is read, what transformers does on a CPU) or native "
        "(the maker's quantized kernels, where transformers runs them here)",
    )


def _golden_noise_arguments(golden: Any) -> None:
    """The reference's own error beside its golden: the noise floors."""
    golden.add_argument(
        "--noise-dtype",
        default=None,
        metavar="DTYPE",
        help="also run the reference in this dtype (e.g. bfloat16), isolated and chained, and keep its own error at "
        "every point: the noise floor that candidates in that dtype are judged against (noise_factor)",
    )
    golden.add_argument(
        "--noise-quant",
        action="append",
        default=[],
        metavar="SPEC",
        help="also run the reference under a candidate's quantization, isolated and chained, and keep its own error "
        "at every point: the floor a candidate quantized so is judged against (pytest --noise-quant SPEC). SPEC is "
        "WEIGHTS[+ACTIVATIONS][+kv-fp8]: fp8-block[:N], fp8-channel, fp8-tensor, mxfp4 or int8-channel; "
        "dynamic-token, dynamic-tensor or static; repeatable, and beside --noise-dtype",
    )


def cmd_golden(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from ..record.run import GoldenRequest

    quiet_transformers()
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    noise_dtype = _noise_dtype(args.noise_dtype, args.dtype)
    args.noise_quant = _noise_quants(args)
    # the request's options are the command line's, by the same names
    named = {f.name: getattr(args, f.name) for f in fields(GoldenRequest) if f.name not in ("model_dir", "out")}
    named["decode_steps"] = args.decode_steps or 0
    if args.sweep_lengths is not None:
        return _golden_sweep(args, named, noise_dtype, say)
    request = GoldenRequest(args.model, args.out, **named)
    result = request.record(progress=say)
    seconds = result.seconds + _noise_floors(args, result.out, noise_dtype, say)
    noise = _said_floors(noise_dtype, args.noise_quant)
    if result.decode:
        noise = f", prefill and {result.decode}{noise}"
    print(
        f"golden written: {counted(result.points, 'point')}, {result.bytes / 1e6:.2f} MB{noise}, {seconds:.1f} s -> "
        f"{result.out}"
    )
    return EXIT_OK


def _noise_quants(args: argparse.Namespace) -> list[Any]:
    """The --noise-quant specs, each checked against the model and the golden's dtype before anything is
    recorded (BadInput, one sentence)."""
    from ..replay.noise import check_quant

    specs = [check_quant(args.model, text, args.dtype, args.trust_remote_code) for text in args.noise_quant]
    return list({spec.name: spec for spec in specs}.values())


def _said_floors(dtype: Any, quants: list[Any]) -> str:
    said = [f"noise floor in {dtype}"] if dtype else []
    said += [f"quantization floor {spec.name}" for spec in quants]
    return "".join(f", {s}" for s in said)


def _noise_floors(args: argparse.Namespace, golden: Path, dtype: Any, say: Any) -> float:
    """`--noise-dtype` and each `--noise-quant`: the reference's own error recorded into `golden`; the
    seconds they took."""
    from ..replay.noise import record_noise

    device = args.device if not args.device_map else ("cuda" if cuda_available() else "cpu")
    runs = ([(dtype, None)] if dtype is not None else []) + [(None, spec) for spec in args.noise_quant]
    return sum(
        record_noise(
            golden, d, quant=q, model_dir=args.model, device=device, trust_remote_code=args.trust_remote_code,
            progress=say,
        )["recorded"]["seconds"]
        for d, q in runs
    )  # fmt: skip


def _golden_sweep(args: argparse.Namespace, named: dict[str, Any], noise_dtype: Any, say: Any) -> int:
    """`moe-parity golden --sweep-lengths`: one golden per length, the sweep's manifest written last (a
    sweep cut short reads as none). Every length is checked against the model's context first."""
    import shutil

    from ..record.run import GoldenRequest
    from ..sweep import DIR, family, parse_lengths, write_manifest

    lengths = parse_lengths(args.sweep_lengths)
    for flag, value in (("--prompts", args.prompts), ("--decode-at", args.decode_at),
                        ("--capture-tokens", args.capture_tokens), ("--seq-len", args.seq_len)):  # fmt: skip
        if value is not None:
            raise BadInput(f"--sweep-lengths sets each golden's length from one prompt family; drop {flag}")
    out = args.out
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise BadInput(f"{out} exists and is not empty; choose another --out (or --overwrite)")
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
        seconds += result.seconds + _noise_floors(args, result.out, noise_dtype, say)
    write_manifest(out, lengths)
    noise = _said_floors(noise_dtype, args.noise_quant)
    print(f"length sweep written: {len(lengths)} goldens ({', '.join(map(str, lengths))} tokens){noise}, "
          f"{seconds:.1f} s -> {out}")  # fmt: skip
    return EXIT_OK


TINY_MODEL = Command("tiny-model", _tiny_model_arguments, cmd_tiny_model, needs_transformers_5=True)
GOLDEN = Command("golden", _golden_arguments, cmd_golden, needs_transformers_5=True)
