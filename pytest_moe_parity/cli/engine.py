"""`moe-parity vllm-dump`: vLLM's engine run on a golden's prompts, hooked, written as a dump for `--hw dump`
and a routed-experts trace for `moe-parity routes` (`backends.vllm.engine`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import EXIT_OK, Command, positive_int_arg


def _arguments(sub: Any) -> None:
    parser = sub.add_parser(
        "vllm-dump",
        help="run vLLM's engine on a golden's prompts with hooks on its modules: a dump for --hw dump",
    )
    parser.add_argument("--model", type=Path, required=True, help="the checkpoint vLLM's engine loads")
    parser.add_argument("--golden", type=Path, required=True, help="the golden whose prompts and decode steps it runs")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the dump")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: the golden's)")
    parser.add_argument(
        "--max-batched-tokens",
        type=positive_int_arg,
        default=None,
        help="the engine's tokens per forward (vLLM's max_num_batched_tokens): below the prompts' total, it chunks "
        "prefills and runs them beside other requests' decode steps (default: every prefill in one forward)",
    )
    parser.add_argument(
        "--state",
        choices=("clean", "reused", "prefix"),
        default=None,
        help="a one-prompt golden's prompt in a serving state, for pytest --parity-state DIR: alone on a fresh "
        "engine (clean), after another request in the KV blocks it held (reused), on a prefix-cache hit another "
        "request wrote (prefix); every state on the same engine settings (KV blocks of 32, one sequence at a time)",
    )


def _run(args: argparse.Namespace) -> int:
    from ..backends.vllm.engine import report_lines, run_engine

    if args.state is not None:
        from ..backends.vllm.engine_state import run_engine_state, state_report_lines

        run, said = run_engine_state(args.model, args.golden, args.out, args.state, args.dtype)
        print("\n".join(state_report_lines(run, said, args.state, args.out, args.golden)))
        return EXIT_OK

    run = run_engine(args.model, args.golden, args.out, args.dtype, args.max_batched_tokens)
    for line in report_lines(run, args.out, args.golden):
        print(line)
    return EXIT_OK


VLLM_DUMP = Command("vllm-dump", _arguments, _run)
