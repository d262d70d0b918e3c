"""Item kinds beside the points: the seam a run composes them on. A point is replayed and judged
(`runner`); each other kind of item (the weight check of a unit, the drill's ops) is a `Checker` in
its own wing: it owns its setup errors, its entries in the run's schedule (before a point, or after
it), the check of one entry, and the rows of its items. A new kind is a new checker and the line
that adds it to the session."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..judge.result import PointResult
from ..points import Point
from ..report.rows import Row


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
    `::routing`), after the point and its drill items, in the order of `offset`."""

    offset: ClassVar[float] = 0.999

    @property
    def name(self) -> str:
        return self.kind

    @property
    def order(self) -> float:
        return self.point.order + self.offset


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


class Checker:
    """One kind of item. `before` and `after` a point: its entries there, in forward order;
    `check`: an entry's row and its failure text (None: it passed), given the rows judged so far;
    `unjudged_row`: the row of an entry that was skipped or errored."""

    kind = ""

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

    def close(self) -> None:
        pass
