"""The parity run's pytest items, in forward order: a point (`ParityItem`: setup runs the candidate,
the call judges it), and an item of each kind its checkers add, of its checker's family (`CheckItem`,
`DrillItem`, `DifferentialItem`), which the session checks in one call; the collector that makes them
from the session's schedule. The run's session is on the config's stash (`SESSION_KEY`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ..drill.items import DrillEntry
    from ..judge.result import PointResult
    from ..points import Point
    from ..replay.checks import AtPoint, Entry
    from ..replay.runner import Prepared
    from ..report.rows import Row
    from ..session import ParitySession

SESSION_KEY = pytest.StashKey["ParitySession"]()


def _session(config: pytest.Config) -> ParitySession | None:
    return config.stash.get(SESSION_KEY, None)


def _message(excinfo: pytest.ExceptionInfo[BaseException] | None) -> str:
    from ..errors import ParityError

    if excinfo is None:
        return ""
    exc = excinfo.value
    plain = isinstance(exc, ParityError | pytest.fail.Exception | pytest.skip.Exception)
    return str(exc).partition("\n")[0] if plain else f"{type(exc).__name__}: {exc}"


def _marked(config: pytest.Config, text: str) -> str:
    """A failure text with its failing verdicts in red where the terminal shows colour."""
    if not config.get_terminal_writer().hasmarkup:
        return text
    red, reset = "\x1b[31;1m", "\x1b[0m"
    return "\n".join(f"{line[:-4]}{red}FAIL{reset}" if line.endswith("  FAIL") else line for line in text.split("\n"))


class ParityFailure(AssertionError):
    def __init__(self, result: PointResult):
        super().__init__(result.id)
        self.result = result


class ParityCollector(pytest.Collector):
    def collect(self):
        from ..points import Point

        session = _session(self.config)
        assert session is not None
        xdist = self.config.pluginmanager.hasplugin("xdist")
        for entry in session.schedule():
            if not isinstance(entry, Point):
                checker = session.checkers[entry.kind]
                item = FAMILIES[checker.family].from_parent(self, name=entry.id, entry=entry)
                if checker.marker is not None:
                    item.add_marker(getattr(pytest.mark, entry.kind))
            else:
                item = ParityItem.from_parent(self, name=entry.id, entry=entry)
                item.add_marker(getattr(pytest.mark, entry.component))
            if xdist and entry.layer is not None:
                item.add_marker(pytest.mark.xdist_group(name=entry.group))
            yield item


class _CheckItem(pytest.Item):
    """An item the session checks in one call: its row, and its failure text (None: it passed)."""

    def __init__(self, *, entry: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self.entry = entry
        self.row: Row | None = None

    # what the check may raise that fails the item with a sentence (`cannot_run`), where it is not
    # the candidate's fault; a point the candidate lacks (`PointUnavailable`) skips it
    failures: tuple[type[BaseException], ...] = ()

    def cannot_run(self, exc: BaseException) -> str:
        return str(exc)

    def check(self, session: ParitySession) -> tuple[Row, str | None]:
        from ..errors import PointUnavailable

        try:
            return session.check(self.entry)
        except PointUnavailable as exc:
            raise pytest.skip.Exception(str(exc), _use_item_location=True) from None
        except self.failures as exc:
            message = self.cannot_run(exc)
        pytest.fail(message, pytrace=False)  # outside the handler: no chained exceptions shown

    def runtest(self) -> None:
        session = _session(self.config)
        assert session is not None
        self.row, failure = self.check(session)
        if failure:
            pytest.fail(failure, pytrace=False)

    def reportinfo(self):
        return self.path, 0, f"parity {self.name}"


class CheckItem(_CheckItem):
    """A check before the points it concerns: the candidate checkpoint's config against the
    reference's (`config`: a failure names each field the forward reads that differs), the weights
    of one unit (`layer_N.weights`: a failure lists what is wrong, tensor by tensor, in words)."""

    entry: Entry


class DrillItem(_CheckItem):
    """One op of a drilled point (`POINT::OP`): failed where it introduced or inherited the
    divergence, or has no counterpart; `POINT::drill` fails with the whole op table."""

    entry: DrillEntry

    @property
    def failures(self) -> tuple[type[BaseException], ...]:
        from ..errors import ParityError

        return (ParityError,)  # a drill that cannot run here: one sentence, no traceback

    def cannot_run(self, exc: BaseException) -> str:
        return f"{self.entry.id}: the drill cannot run: {exc}"


class DifferentialItem(_CheckItem):
    """A point run again under a condition: a MoE block with the golden's routing, level by level
    (`POINT::routing`), a point on each row of the batch alone (`POINT::batch`); failed where the
    condition alone changes the candidate."""

    entry: AtPoint

    @property
    def failures(self) -> tuple[type[BaseException], ...]:
        from ..errors import BackendFailure

        return (BackendFailure,)  # the backend's error at the block: its message and traceback

    def cannot_run(self, exc: BaseException) -> str:
        return exc.report()  # type: ignore[attr-defined]


# the item class of each family of checkers (`Checker.family`)
FAMILIES: dict[str, type[_CheckItem]] = {"check": CheckItem, "drill": DrillItem, "differential": DifferentialItem}


class ParityItem(pytest.Item):
    """One point: setup runs the candidate (its failures are errors of the backend, a point it
    lacks is skipped), the call judges it (a divergence fails)."""

    def __init__(self, *, entry: Point, **kwargs: Any):
        super().__init__(**kwargs)
        self.point = self.entry = entry
        self.prepared: Prepared | None = None
        self.result: PointResult | None = None
        self.row: Row | None = None
        self.drill_text = ""  # --parity-drill auto: the op table of the run's first failing component

    def setup(self) -> None:
        from ..errors import BackendFailure, BackendStartFailure, GoldenError, PointUnavailable
        from .layer_first import active

        session = _session(self.config)
        assert session is not None
        lf = active(self.config)
        if lf is not None and (reason := lf.skip_reason(self.point)):
            raise pytest.skip.Exception(reason, _use_item_location=True)
        try:
            self.prepared = (lf.prepared(self.point) if lf else None) or session.prepare(self.point)
            return
        except PointUnavailable as exc:
            raise pytest.skip.Exception(str(exc), _use_item_location=True) from None
        except GoldenError as exc:
            message = str(exc)
        except BackendStartFailure as exc:  # no point can run: said once, at this one, and the run stops
            self.session.shouldfail = f"moe-parity: --hw {session.hw}: {exc}"
            message = exc.report()
        except BackendFailure as exc:
            message = exc.report()
        pytest.fail(message, pytrace=False)  # outside the handler: no chained exceptions shown

    def runtest(self) -> None:
        from ..errors import BackendFailure

        session = _session(self.config)
        assert session is not None and self.prepared is not None
        marker, message = self.get_closest_marker("parity"), ""
        try:
            self.result = session.judge(self.prepared, dict(marker.kwargs) if marker else None)
        except BackendFailure as exc:  # an output the verdict cannot use: an error of this point
            message = str(exc)
        if self.result is None:
            pytest.fail(message, pytrace=False)  # outside the handler: no chained exceptions shown
        from ..report.rows import point_row

        self.row = point_row(self.result)
        self.user_properties.extend(self.result.junit_properties())
        if not self.result.passed:
            self.row.drill, self.drill_text = session.auto_drill(self.point)
            raise ParityFailure(self.result)

    def teardown(self) -> None:
        self.prepared = None  # tensors go with it: items live until the end of the session

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        from ..report.text import failure_text

        if isinstance(excinfo.value, ParityFailure):
            text = failure_text(excinfo.value.result)
            text = f"{text}\n{self.drill_text}" if self.drill_text else text
            return _marked(self.config, text)
        return f"{self.name}: {excinfo.exconly()}\n" + str(super().repr_failure(excinfo, style=style or "short"))

    def reportinfo(self):
        return self.path, 0, f"parity {self.name}"
