"""What the `moe-parity` commands share: exit codes, a command and its facts (`Command`), argparse's
value types, and `--json FILE`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..files import atomic_write_text
from ..points import positive_int

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class Command:
    """A `moe-parity` command: its name, its options (`arguments(sub)` adds its parser) and its run
    (`run(args)` -> exit code; a `ParityError` it raises is one line and exit 2, said by `main`), with
    the facts about it beside it (as pip's `Command` class attributes)."""

    name: str
    arguments: Callable[[Any], None]
    run: Callable[[argparse.Namespace], int]
    # it runs transformers' own modules of the golden's architecture (their transformers 5 layout)
    needs_transformers_5: bool = False


def int_list_arg(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int_arg(text: str) -> int:
    """`points.positive_int` as argparse reports it ("argument --decode-steps: expected ...")."""
    try:
        return positive_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def factor_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 1.0:
        raise argparse.ArgumentTypeError(f"the factor must be above 1, got {text}")
    return value


def quiet_transformers() -> None:
    from ..session import quiet_transformers

    quiet_transformers()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def write_json(path: Path, data: Any) -> None:
    """`--json FILE`: `data` written there (its folder made); BadInput saying why where it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise BadInput(f"--json {path}: cannot write it ({exc})") from None
