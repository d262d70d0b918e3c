"""The drill's items (`--parity-drill`, `--parity-repro`): after each drilled point, one item per op
of its reference (`POINT::OP`) and the drill's own summary (`POINT::drill`); the drill of a point
runs once, at its first item, judged with the point's noise factor; `auto` drills the run's first
failing component into that point's failure text. Its setup errors are said here, in one sentence
each."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import compat
from ..dtypes import dtype_name
from ..errors import SetupError
from ..points import Point
from ..replay.checks import AtPoint, Checker, CheckerSetup, Option
from ..report.rows import Row, drill_row, unjudged_row
from . import store
from .driller import AUTO, Driller, drill_ops_command, drill_patterns, selects

if TYPE_CHECKING:
    from ..backends import Backend
    from ..golden import GoldenStore
    from ..replay.runner import ParityRunner
    from ..report.drill import Drill


@dataclass(frozen=True)
class DrillEntry(AtPoint):
    """One op of a drilled point (`layer_17.attention::q_norm.add`), or the drill's own summary
    (`::drill`: the op table, the culprit, the candidate's unmatched ops), right after the point."""

    op: str
    order: float
    kind = "drill"

    @property
    def name(self) -> str:
        return self.op


class DrillItems(Checker):
    """The drill's items of a run. `flags`: the run's option names (`drill`, `repro`, as the plugin or
    `moe-parity compare` spells them), for its sentences."""

    kind = "drill"
    family = "drill"
    marker = "moe-parity items of a drill (POINT::OP, --parity-drill)"
    options = (
        Option("--parity-drill", "parity_drill", {"action": "append", "default": [], "metavar": "auto|POINTS"},
               "drill below these points (ids or globs, comma-separated, repeatable, e.g. 'layer_17.attention,"
               "layer_*.router'): an item per op of each, in forward order (POINT::OP), and POINT::drill with the op "
               "table and the culprit; auto: the op table of the run's first failing component in its failure text"),
        Option("--parity-repro", "parity_repro", {"metavar": "DIR"},
               "with --parity-drill: write each culprit op's standalone repro (test_*.py + .safetensors) to DIR"),
    )  # fmt: skip

    @classmethod
    def value(cls, get: Callable[[str], Any]) -> tuple[Sequence[str], Path | None]:
        """(the points to drill, as given; where the culprits' repro files go)."""
        repro = get("parity_repro")
        return get("parity_drill"), Path(repro).expanduser().resolve() if repro else None

    @classmethod
    def recorded(cls, value: tuple[Sequence[str], Path | None]) -> list[str]:
        return list(value[0])

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: tuple[Sequence[str], Path | None]) -> DrillItems | None:
        points, repro_dir = value
        patterns = drill_patterns(list(points))
        if not patterns and repro_dir is None:
            return None
        return cls(
            setup.golden, setup.backend, setup.runner, patterns, hw=setup.hw,
            flags={"drill": cls.options[0].flag, "repro": cls.options[1].flag, **setup.flags},
            repro_dir=repro_dir, trust_remote_code=setup.trust_remote_code,
        )  # fmt: skip

    def __init__(
        self,
        golden: GoldenStore,
        backend: Backend,
        runner: ParityRunner,
        patterns: list[str],
        *,
        hw: str,
        flags: Mapping[str, str],
        repro_dir: Path | None = None,
        trust_remote_code: bool = False,
    ):
        self.golden, self.backend, self.runner, self.patterns = golden, backend, runner, patterns
        self.hw, self.flags = hw, flags
        self.repro_dir = repro_dir
        self.auto_drilled = False  # --parity-drill auto drills the first failing component only
        found = golden.local_model()
        self._check_setup(hw, flags, found)
        self.driller = Driller(golden, found[0] if found else None, backend, trust_remote_code=trust_remote_code)

    def _check_setup(self, hw: str, flags: Mapping[str, str], found: tuple[Path, str] | None) -> None:
        from ..backends import Backend

        if self.golden.captured_tokens is not None:
            raise SetupError(
                f"{flags['drill']} runs a point on its recorded inputs, which {self.golden.root} does not keep "
                "(moe-parity golden --capture-tokens): drill with a golden that keeps every token"
            )
        if not self.patterns:
            raise SetupError(f"{flags['repro']} writes the repro file of a drill's culprit: add {flags['drill']} ...")
        if type(self.backend).drill_call is Backend.drill_call:
            raise SetupError(
                f"{flags['drill']}: the {hw} backend gives no torch modules to drill into; drill with --hw cpu, "
                f"trace or compile (or a backend that implements drill_call)"
            )
        if (found is None or compat.MAJOR < 5) and not store.stored_points(self.golden.root):
            why = (
                f"the golden's model is not on this machine ({self.golden.manifest['model'].get('path')}): copy the "
                "checkpoint here, or"
                if found is None
                else f"this environment's transformers {compat.VERSION} cannot run the golden's modules (transformers 5"
                "'s layout):"
            )
            points = ",".join(p for p in self.patterns if p != AUTO) or "*"  # auto drills whichever fails first
            raise SetupError(
                f"{flags['drill']} runs the reference op by op; {why} record the reference's ops with the golden where "
                f"it was recorded: {drill_ops_command(self.golden.root, points, self.backend.dtype)}"
            )
        for pattern in self.patterns:
            if pattern != AUTO and not any(selects([pattern], p.id) for p in self.golden.points):
                raise SetupError(
                    f"{flags['drill']} {pattern!r} matches no point of this golden "
                    f"(e.g. layer_0.attention, 'layer_*.router', step_1.layer_0.attention, or auto)"
                )

    def after(self, point: Point, selected: bool) -> Iterator[DrillEntry]:
        """After a drilled point: its ops (named at collection from the reference's), then `::drill`."""
        if not selects(self.patterns, point.id):
            return
        try:
            names = self.driller.op_names(point) if selected else []
        except Exception:  # said by the summary item, which runs the drill
            names = []
        for i, name in enumerate(names):
            yield DrillEntry(point, name, self.place(point, i))
        yield DrillEntry(point, "drill", self.place(point, len(names)))

    def _drill(self, point: Point, point_passed: bool | None) -> Drill:
        drill = self.driller.drill(point, self.runner.tolerance(point)[0].noise_factor, point_passed)
        self._repro(drill)
        return drill

    def check(self, entry: DrillEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        """The row of a drill item and its failure text (None: it passed). The drill of a point
        runs once, at its first item."""
        from ..report.text import drill_op_text, drill_text

        row = rows.get(entry.point.id)
        drill = self._drill(entry.point, None if row is None else row.status == "passed")
        if entry.op == "drill":  # the point's last item: its values are no longer needed
            self.driller.release(entry.point)
            failed = drill.failed
            return drill_row(entry, "failed" if failed else "passed", None, drill), (
                drill_text(drill) if failed else None
            )
        op = drill.row(entry.op)
        if op is None:
            row = drill_row(entry, "failed", None, None)
            return row, f"{entry.id}: the reference ran no op {entry.op!r} this time (its ops: see ::drill)"
        row = drill_row(entry, "failed" if op.failed else "passed", asdict(op), None)
        return row, drill_op_text(entry.point.id, op, drill) if op.failed else None

    def unjudged_row(self, entry: Any, status: str, message: str) -> Row:
        return unjudged_row(drill_row(entry, status, None, None), status, message)

    def _repro(self, drill: Drill) -> None:
        """--parity-repro: the culprit's repro file, written once; why not, where it cannot be."""
        if self.repro_dir is None or not drill.culprit or drill.repro is not None:
            return
        try:
            written = self.driller.write_repro(drill, self.repro_dir)
        except Exception as exc:  # the drill's verdicts stand without it
            drill.repro = f"not written ({type(exc).__name__}: {exc})"
            return
        if written is None:
            drill.repro = f"not written: {drill.culprit} cannot be run alone on the reference's inputs"

    def failed(self, point: Point) -> tuple[Drill | None, str]:
        """`--parity-drill auto`: the first failing component drilled, its op table for the failure
        text and its row; else (None, "")."""
        from ..report.text import drill_text

        if AUTO not in self.patterns or self.auto_drilled:
            return None, ""
        self.auto_drilled = True
        try:
            drill = self._drill(point, False)  # auto drills the point that failed
        except Exception as exc:  # the point's own verdict stands; say why there is no table
            return None, f"--parity-drill auto: {point.id} could not be drilled ({type(exc).__name__}: {exc})"
        self.driller.release(point)
        collect = f"collect these ops as items: {self._rerun(point.id)}"
        return drill, f"{drill_text(drill)}\n{collect}"

    def _rerun(self, point_id: str) -> str:
        """This run's command, drilling `point_id` into items: as it is pasted."""
        setup, flags = self.backend.setup, self.flags
        words = ["pytest", flags["golden"], str(self.golden.root), flags["hw"], self.hw]
        if setup.model_dir is not None:
            words += [flags["model"], str(setup.model_dir)]
        words += [flags["dtype"], dtype_name(self.backend.dtype)]
        for key, value in setup.options.items():
            words += ["--hw-option", f"{key}={value}"]
        words += [flags["drill"], point_id, "-k", point_id]
        return shlex.join(words)

    def close(self) -> None:
        self.driller.close()
