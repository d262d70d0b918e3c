"""`moe-parity prompts`: a prompts file made from a task's failures (`--from-lm-eval`: lm-eval's
per-document samples of a reference run and a candidate run), for `moe-parity golden --prompts` and
`moe-parity scan --prompts`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..files import atomic_write_text
from ..words import counted
from .common import EXIT_OK, Command, positive_int_arg


def _prompts_arguments(sub: Any) -> None:
    prompts = sub.add_parser(
        "prompts",
        help="write a prompts file of the documents a candidate scores worse than its reference in lm-eval",
    )
    prompts.add_argument(
        "--from-lm-eval",
        nargs="+",
        required=True,
        type=Path,
        metavar="SAMPLES",
        help="lm-eval's --log_samples output (a samples_<task>_<date>.jsonl file, or a run's folder) of the "
        "reference, then of the candidate: the documents the candidate scores worse, the reference right and the "
        "candidate wrong first, then by how far their log-likelihoods part. With one run alone: the documents it "
        "failed, the most confidently wrong first",
    )
    prompts.add_argument("--out", required=True, type=Path, metavar="FILE", help="the prompts file (JSONL) to write")
    prompts.add_argument(
        "--top", type=positive_int_arg, default=None, metavar="N", help="keep the first N documents (default: all)"
    )


def cmd_prompts(args: argparse.Namespace) -> int:
    from ..record.lm_eval import prompts_from_lm_eval

    runs = args.from_lm_eval
    if len(runs) > 2:
        raise BadInput(
            f"--from-lm-eval takes the reference's samples and the candidate's, not {len(runs)}; give one folder "
            "or file per run"
        )
    outcome = prompts_from_lm_eval(runs[0], runs[1] if len(runs) == 2 else None, args.top)
    if args.out.is_dir():
        raise BadInput(f"--out {args.out} is a folder; give the prompts file's path")
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in outcome.records))
    except OSError as exc:
        raise BadInput(f"--out {args.out}: cannot write it ({exc})") from None
    for line in outcome.lines:
        print(line)
    print(f"wrote {counted(len(outcome.records), 'prompt')} -> {args.out}")
    return EXIT_OK


PROMPTS = Command("prompts", _prompts_arguments, cmd_prompts)
