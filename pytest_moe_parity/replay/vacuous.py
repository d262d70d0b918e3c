"""No vacuous green (issue 53): a run that can pass without checking anything about a port says so in
its header, its closing lines and its report, and where a candidate is required (`CI=true`,
`--parity-require-candidate`) it is refused. Two such runs: the golden against itself (the golden's
own model, in the golden's own dtype, on the reference's own backend: every row `1 0 0`), and a run
or shard whose selection holds no point; and, once run, one whose every point was skipped."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..dtypes import dtype_name

AGAINST_ITSELF = "the golden against itself"
NO_POINT = "no point selected"
# The backends that run the reference's own modules (transformers' code, eager): on the golden's model in
# its dtype they replay the recording. The others (trace, compile, neuron, nxdi, dump, a registered one)
# run another stack, which is what a port is.
REFERENCE_BACKENDS = ("cpu", "cuda")
# The settings of those backends that change the candidate (the others place or pace it).
CHANGING_OPTIONS = ("quant",)
REQUIRE_FLAG = "--parity-require-candidate"
_TRUE = ("1", "true", "yes", "on")


def against_itself(session: Any) -> str | None:
    """AGAINST_ITSELF where a session's candidate is the golden's own model (by default, or `--model`
    naming its directory), in the golden's recorded dtype, on a backend of the reference's own kind with
    no setting that changes the candidate; else None."""
    golden, candidate, options = session.golden, session.candidate_dir, session.backend.setup.options
    if session.hw not in REFERENCE_BACKENDS or dtype_name(session.dtype) != golden.dtype:
        return None
    if any(options.get(key) for key in CHANGING_OPTIONS):
        return None
    own = golden.local_model()
    if candidate is None or own is None or Path(candidate).resolve() != Path(own[0]).resolve():
        return None
    return AGAINST_ITSELF


def header_line(reason: str | None) -> list[str]:
    """The header's line of a vacuous run (none for another)."""
    if reason == AGAINST_ITSELF:
        return [
            f"moe-parity: {AGAINST_ITSELF}: this checks nothing about a port (pass --model CANDIDATE, --dtype or --hw)"
        ]
    if reason == NO_POINT:
        return [f"moe-parity: {NO_POINT}: this checks nothing (-k, -m or --parity-layers deselected every point)"]
    return []


def required(option: bool, environ: Mapping[str, str] = os.environ) -> str | None:
    """What requires a candidate: the option, or CI=true (a nightly); None where nothing does."""
    if option:
        return REQUIRE_FLAG
    if environ.get("CI", "").strip().lower() in _TRUE:
        return "CI=true"
    return None


def refusal(reason: str, by: str, dtype: str = "", hw: str = "") -> str:
    """The one sentence of the usage error of a vacuous run where `by` requires a candidate."""
    if reason == AGAINST_ITSELF:
        return (
            f"the candidate is the golden's own model in the golden's own dtype ({dtype}) on --hw {hw}, "
            f"{AGAINST_ITSELF}, which checks nothing about a port, and {by} requires a candidate: "
            f"pass the port with --model CANDIDATE (and its --dtype, --hw)"
        )
    return (
        f"{NO_POINT}: -k, -m or --parity-layers deselected every point of the golden, which checks nothing, "
        f"and {by} requires a candidate's points: select at least one point"
    )


def golden_itself(golden_dir: Path, candidate: Path | None) -> bool:
    """Whether a dump directory given as the candidate (`moe-parity compare`, `--hw dump --model`) is
    the golden itself: the golden's own directory, or a copy of it (a golden of the same fingerprint).
    False where either cannot be read as a golden (the run then says why)."""
    from ..golden import MANIFEST, GoldenError, GoldenStore

    if candidate is None or not (Path(candidate) / MANIFEST).is_file():
        return False
    if Path(candidate).resolve() == Path(golden_dir).resolve():
        return True
    try:
        return GoldenStore(candidate).fingerprint == GoldenStore(golden_dir).fingerprint
    except GoldenError:
        return False


def dump_refusal(candidate: Path, by: str | None, flag: str) -> str:
    """The one sentence of a run whose dump is the golden itself: a usage error always (it compares the
    golden with itself, and its layout is no dump's), naming what requires a candidate where one does."""
    said = f"{flag} {candidate} is the golden itself, {AGAINST_ITSELF}, which checks nothing about a port"
    if by is not None:
        said += f", and {by} requires a candidate"
    return f"{said}: pass the port's dump as {flag}"


def nothing_compared(rows: Sequence[Any], hw: str) -> str | None:
    """A run whose every point was skipped compared nothing: a mistake (a dump of other names,
    a selection of points the candidate lacks), never a success. Why, or None."""
    if not rows or any(r.status != "skipped" for r in rows):
        return None
    return (
        f"no point was compared: the {hw} backend gave none of the {len(rows)} selected points "
        f"(first: {rows[0].reason or ''})"
    )
