"""The `moe-parity` command: tiny models, golden recordings, a look inside a golden, offline
comparison of dumps, and reports redrawn and compared run to run.
Exit codes: 0 success, 1 a comparison failed, 2 bad input.

A package by family of commands: `record` (tiny-model, golden), `runs` (compare, demo, sweep),
`reports` (report, diff), `checkpoint` (audit, estimate, dequantize), `inspect` (show, drill-ops, routes, scan),
`engine` (vllm-dump), `prompts` (prompts --from-lm-eval); `common` what they share. Each command raises a
`ParityError` for what the user must fix, and `main` says it once: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import compat
from ..errors import ParityError
from . import checkpoint, engine, inspect, prompts, record, reports, runs
from .common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, Command

__all__ = ["COMMANDS", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "Command", "build_parser", "main"]

# every command, in the help's order
COMMANDS: dict[str, Command] = {
    command.name: command
    for command in (
        record.TINY_MODEL,
        record.GOLDEN,
        prompts.PROMPTS,
        inspect.SCAN,
        runs.COMPARE,
        runs.DEMO,
        inspect.SHOW,
        inspect.DRILL_OPS,
        inspect.ROUTES,
        engine.VLLM_DUMP,
        runs.SWEEP,
        reports.REPORT,
        reports.DIFF,
        checkpoint.AUDIT,
        checkpoint.ESTIMATE,
        checkpoint.DEQUANTIZE,
    )
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-parity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS.values():  # each command's options beside the command
        command.arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..host import bound_onednn_caches

    args = build_parser().parse_args(argv)
    bound_onednn_caches()  # before any bf16 forward: the noise floor's, a scan's, a compare's
    command = COMMANDS[args.command]
    if command.needs_transformers_5 and compat.MAJOR < 5:
        print(f"moe-parity {args.command}: {compat.needs_transformers_5()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return command.run(args)
    except ParityError as exc:  # what the user must fix: one line, as pip's Command.main says its errors
        print(f"moe-parity: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("moe-parity: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `moe-parity show G | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
