"""Item kinds beside the points: the seam a run composes them on. A point is replayed and judged
(`runner`); each other kind of item (the weight check of a unit, the drill's ops) is a `Checker` in
its own wing: it owns its options, its pytest marker and item family, its setup errors
(`from_options`), its entries in the run's schedule (before a point, or after it), the check of one
entry, and the rows of its items. A new kind is a new checker and its name in the session's
`CHECKERS`, whose order is the order of the kinds' items around a point (`place`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

from ..judge.result import PointResult
from ..points import Point
from ..report.drill import Drill
from ..report.rows import Row

if TYPE_CHECKING:
    from ..backends import Backend
    from ..golden import GoldenStore
    from .runner import ParityRunner


class Entry(Protocol):
    """What a checker schedules: an item's id, its place in forward order, and what pytest marks it
    with (the layer's xdist group; `kind` picks the item class)."""

    kind: str

    @property
    def id(self) -> str: ...

    @property
    def order(self) -> float: ...

    @property
    def layer(self) -> int | None: ...

    @property
    def group(self) -> str | None: ...


@dataclass(frozen=True)
class AtPoint:
    """An entry that belongs to a point (a drilled op, a MoE block's routing item): its layer, xdist
    group and component are the point's; its id is the point's, `::` and its own `name`."""

    point: Point

    @property
    def id(self) -> str:
        return f"{self.point.id}::{self.name}"

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def layer(self) -> int | None:
        return self.point.layer

    @property
    def group(self) -> str:
        return self.point.group

    @property
    def component(self) -> str:
        return self.point.component


@dataclass(frozen=True)
class RunAgain(AtPoint):
    """A differential's item: its point run again under a condition (`POINT::batch`, `::parallel`,
    `::routing`), after the point and its drill items, at `order` (its checker's `place`)."""

    order: float

    @property
    def name(self) -> str:
        return self.kind


def place(point: Point, rank: int, index: int = 0, *, before: bool = False) -> float:
    """Where an item beside `point` stands in the rows' order, as the float its row keeps
    (`Row.order`, which the reports sort by): the key (point, before or after it, the rank of its
    kind in `CHECKERS`, its index among that kind's items there) mapped monotonically into the
    half of the gap on its side of the point, so that no number of items of any kind (a drill of
    any size) reaches the next kind's, or the next point's, items. Before: [order - 1/2, order);
    after: [order + 1/4, order + 1/2)."""
    rank_then_index = rank + index / (index + 1)  # [rank, rank + 1): the rank first, then the index
    share = rank_then_index / (rank_then_index + 1)  # [0, 1), increasing
    return point.order - 0.5 + share / 2 if before else point.order + 0.25 + share / 4


def result_figures(result: PointResult) -> dict[str, Any]:
    """A judged output's figures as a differential's row keeps them (a routing level, a batch row, B
    against A): its verdict, its main tensor's relative L2, cosine and worst token, the checks that
    failed."""
    main = result.main
    return {
        "status": result.status,
        "rel_l2": main.rel_l2 if main else None,
        "cosine": main.cosine if main else None,
        "max_token_rel_l2": main.max_token_rel_l2 if main else None,
        "failed": [f"{c.target}.{c.name}" for c in result.checks if not c.passed],
    }


class Option(NamedTuple):
    """A command-line option of a kind: its flag, the pytest option's dest, argparse's other
    keywords, its help text."""

    flag: str
    dest: str
    extra: dict[str, Any]
    help: str


@dataclass(frozen=True)
class CheckerSetup:
    """What a checker is set up from (`Checker.from_options`): the run's golden, backend and runner,
    its `--hw`, how its front end spells each option (`flags`), the candidate's location, whether
    its own modeling code may run, and the points the run selected, in forward order."""

    golden: GoldenStore
    backend: Backend
    runner: ParityRunner
    hw: str
    flags: Mapping[str, str]
    candidate_dir: Path | None
    trust_remote_code: bool
    points: Sequence[Point]


class Checker:
    """One kind of item. Declared by its class: `kind` (its entries' and its value's name),
    `options` (its command-line options; `value` reads what they asked), `marker` (the help of the
    pytest marker `kind` its items carry; None: none), `family` (the pytest item class of its
    entries: `check`, `drill` or `differential`), and `from_options` (the run's checker, None where
    not asked; SetupError for what the user must fix). `before` and `after` a point: its entries
    there, in forward order, each at its `place`; `check`: an entry's row and its failure text
    (None: it passed), given the rows judged so far; `unjudged_row`: the row of an entry that was
    skipped or errored."""

    kind: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    marker: ClassVar[str | None] = None
    family: ClassVar[str] = "check"
    rank = 0  # its kind's place in CHECKERS (the session sets it): the order of the kinds' items at a point

    @classmethod
    def value(cls, get: Callable[[str], Any]) -> Any:
        """What the user asked of this kind, from its options' values (`get(dest)`)."""
        return get(cls.options[0].dest)

    @classmethod
    def recorded(cls, value: Any) -> Any:
        """The value as the report's `run_options` keeps it (shards of one run share it)."""
        return value

    @classmethod
    def flag(cls, setup: CheckerSetup) -> str:
        """The kind's option as the run's front end spells it, for its sentences."""
        return setup.flags.get(cls.kind, cls.options[0].flag)

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: Any) -> Checker | None:
        raise NotImplementedError

    def place(self, point: Point, index: int = 0, *, before: bool = False) -> float:
        """An entry's place in the rows' order (`place`), by this kind's rank."""
        return place(point, self.rank, index, before=before)

    def before(self, point: Point) -> Iterator[Any]:
        return iter(())

    def after(self, point: Point, selected: bool) -> Iterator[Any]:
        return iter(())

    def check(self, entry: Any, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        raise NotImplementedError

    def unjudged_row(self, entry: Any, status: str, message: str) -> Row:
        raise NotImplementedError

    def header_lines(self) -> list[str]:
        return []

    def failed(self, point: Point) -> tuple[Drill | None, str]:
        """At a point that failed: a drill's row and text for its failure (`--parity-drill auto`),
        else (None, "")."""
        return None, ""

    def close(self) -> None:
        pass


class Unchecked(Checker):
    """A kind with no items in this run that says why in the run's header (the weight items, where
    the candidate's weights cannot be compared)."""

    def __init__(self, lines: list[str]):
        self.lines = lines

    def header_lines(self) -> list[str]:
        return self.lines
