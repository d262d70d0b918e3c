"""The errors of pytest-moe-parity. Every message is one sentence that says what is wrong and what
to do; the pytest plugin turns a `ParityError` raised while setting up into a usage error (exit 4)
and `moe-parity` into one line on stderr (exit 2)."""

from __future__ import annotations


class ParityError(Exception):
    """Base class: something the user must fix, said in one sentence."""


class GoldenError(ParityError):
    """A golden directory is missing, incomplete, corrupted or from a newer version."""


class RecordError(ParityError):
    """A module call cannot be recorded faithfully (an argument type we cannot store)."""


class ArchError(ParityError):
    """The model's structure cannot be mapped onto capture points."""


class BadInput(ParityError):
    """Input the user must fix (a command-line value, a model directory)."""


class CheckpointError(ParityError):
    """The candidate checkpoint cannot be read (missing, not safetensors, lacks a layer)."""


class SetupError(ParityError):
    """A setting of the run is unusable (pytest: usage error, exit 4; `moe-parity`: exit 2)."""


class BackendError(ParityError):
    """A backend cannot be set up: a missing package or device, an unusable candidate, a bad option."""


class PointUnavailable(ParityError):
    """The backend has nothing for this point (e.g. a dump that lacks it): the point is skipped."""


class BackendFailure(ParityError):
    """The backend raised while running one point: an error of the backend, not a divergence."""

    def __init__(self, point_id: str, exc: BaseException):
        if isinstance(exc, ParityError):  # a sentence of ours: say it as it is
            message = str(exc) if str(exc).startswith(point_id) else f"{point_id}: {exc}"
        else:
            message = f"{point_id}: the backend raised {type(exc).__name__}: {exc}"
        super().__init__(message)
        self.point_id = point_id
        self.original = exc

    def report(self) -> str:
        """The message, then the traceback of what the backend raised, without this package's frames."""
        import traceback
        from pathlib import Path

        tb = traceback.TracebackException.from_exception(self.original)
        ours = str(Path(__file__).resolve().parent)
        tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if not f.filename.startswith(ours)])
        return f"{self}\n\n" + "".join(tb.format()).rstrip()


class BackendStartFailure(BackendFailure):
    """The backend raised in `start()`, before its first point: no point can run, so the run reports
    it once, as the backend's failure, and stops."""

    def __init__(self, point_id: str, exc: BaseException):
        super().__init__(point_id, exc)
        what = str(exc) if isinstance(exc, ParityError) else f"{type(exc).__name__}: {exc}"
        self.args = (f"the backend failed to start (before {point_id}, its first point): {what}",)


class UnusableOutput(ParityError):
    """A candidate output the verdict cannot use (a shape or structure unlike the golden's)."""


def upstream_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """(file name, line, function) of the innermost frame of `exc`'s traceback outside this package:
    the code that raised (a model's modeling file, an upstream library), not ours that called it;
    None where the innermost frame is ours (an error of this package, whose traceback is the report).
    torch's own Python frames are passed over for their caller's."""
    import traceback
    from pathlib import Path

    import torch

    stack = traceback.extract_tb(exc.__traceback__)
    if not stack or stack[-1].filename.startswith(str(Path(__file__).resolve().parent)):
        return None
    # torch's own Python frames (a functional's argument check) are named by the caller that passed them
    torch_dir = str(Path(torch.__file__).resolve().parent)
    frame = next((f for f in reversed(stack) if not f.filename.startswith(torch_dir)), stack[-1])
    return Path(frame.filename).name, frame.lineno or 0, frame.name
