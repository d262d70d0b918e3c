"""A length sweep: the same prompt family recorded at several lengths (`moe-parity golden
--sweep-lengths 256,1024,4096`: one golden per length under OUT/len_N, the shorter prompts prefixes of
the longest), and a candidate run over every length (`moe-parity sweep OUT`): each point's error at
each length beside the reference's own error in the candidate's dtype at that point and length (the
noise floor, `--noise-dtype`), per-layer curves over length in a picture, and a verdict.

The verdict reads the grid length by length, shortest first: **accumulation** where no point leaves
its limits at any length (and what the candidate's error does over length, grows, falls or stays flat,
beside what the reference's own does: `trend`), or a
**defect** at the first point, in forward order, of the shortest length where one does (its own verdict
fails, or its error exceeds `noise_factor` times the reference's own there): the port is right up to
the length before and wrong from that one on, at that point (a rotary cache too short, a position
table, a bucket or tile edge). No pytest here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dtypes import dtype_name, json_safe
from .errors import BadInput
from .points import LOGITS, OUTPUT, parse_point_id
from .report.rows import PointRow, number
from .report.text import brief
from .words import counted

SWEEP_FILE = "sweep.json"
DIR = "len_{length}"
# What errors do over a sweep (`trend`): "grows" (or "falls") where the figures go up (down) consistently,
# pair by pair within each curve (Kendall's tau pooled over the curves, at least CONSISTENT), by at least
# TREND_FACTOR in the change fitted from the shortest length to the longest; else "flat".
CONSISTENT = 0.5
TREND_FACTOR = 1.05


class SweepError(BadInput, ValueError):
    """A sweep that cannot be recorded or read: one sentence saying what to do."""


def parse_lengths(text: str) -> list[int]:
    """`256,1024,4096` -> [256, 1024, 4096]; SweepError unless at least two increasing whole numbers."""
    try:
        lengths = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise SweepError(f"--sweep-lengths {text}: expected increasing token counts, e.g. 256,1024,4096") from None
    if len(lengths) < 2 or any(n < 1 for n in lengths) or lengths != sorted(set(lengths)):
        raise SweepError(f"--sweep-lengths {text}: expected two or more increasing token counts, e.g. 256,1024,4096")
    return lengths


def family(ids: list[int], lengths: list[int]) -> dict[int, list[int]]:
    """The prompt family: the ids of each length, each a prefix of the longest (`ids` repeated to reach
    it where shorter)."""
    longest = max(lengths)
    whole = (ids * (-(-longest // len(ids))))[:longest]
    return {n: whole[:n] for n in lengths}


def write_manifest(out: Path, lengths: list[int]) -> None:
    manifest = {"lengths": lengths, "goldens": {str(n): DIR.format(length=n) for n in lengths}}
    (out / SWEEP_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


@dataclass(frozen=True)
class Sweep:
    root: Path
    lengths: list[int]
    dirs: dict[int, Path]

    @classmethod
    def read(cls, root: Path) -> Sweep:
        path = Path(root) / SWEEP_FILE
        if not path.is_file():
            raise SweepError(f"{root} is not a length sweep (no {SWEEP_FILE}): record one with moe-parity golden "
                             "... --sweep-lengths 256,1024,4096")  # fmt: skip
        try:
            data = json.loads(path.read_text())
            lengths = [int(n) for n in data["lengths"]]
            dirs = {n: Path(root) / data["goldens"][str(n)] for n in lengths}
        except (ValueError, KeyError, TypeError) as exc:
            raise SweepError(f"{path} is not a sweep manifest ({exc}); record the sweep again") from None
        missing = [str(d) for d in dirs.values() if not d.is_dir()]
        if missing:
            raise SweepError(f"the sweep's golden {missing[0]} is missing; record the sweep again")
        return cls(Path(root), lengths, dirs)


@dataclass
class Cell:
    """One point at one length: the candidate's error, the reference's own there, their ratio."""

    status: str
    rel_l2: float | None
    reference: float | None = None
    ratio: float | None = None
    limit: float | None = None  # the ratio allowed (noise_factor)

    @property
    def defect(self) -> bool:
        over = self.ratio is not None and self.limit is not None and self.ratio > self.limit
        return self.status in ("failed", "error") or over


@dataclass
class SweepResult:
    lengths: list[int]
    dtype: str
    mode: str
    points: list[str] = field(default_factory=list)  # forward order
    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)

    @property
    def noise(self) -> bool:
        """Whether the sweep holds the reference's own error in the candidate's dtype (a cell read it)."""
        return any(c.reference is not None for c in self.cells.values())

    @property
    def defect(self) -> tuple[str, int] | None:
        """The first point, in forward order, of the shortest length where one leaves its limits."""
        for length in self.lengths:
            for pid in self.points:
                cell = self.cells.get((pid, length))
                if cell is not None and cell.defect:
                    return pid, length
        return None

    def curves(self) -> dict[str, list[Cell | None]]:
        """Each layer's output (and the logits) over length: the per-layer curves; and the defect's
        point, where it is another."""
        defect = self.defect
        shown = [p for p in self.points if _curve_point(p) or (defect is not None and p == defect[0])]
        return {p: [self.cells.get((p, n)) for n in self.lengths] for p in shown}

    def trends(self) -> tuple[Trend | None, Trend | None]:
        """What the candidate's error, and the reference's own, do over length on the curves (`trend`)."""
        curves = self.curves().values()
        candidate = trend(self.lengths, [[c.rel_l2 if c else None for c in cells] for cells in curves])
        reference = trend(self.lengths, [[c.reference if c else None for c in cells] for cells in curves])
        return candidate, reference

    def to_json(self) -> dict[str, Any]:
        defect = self.defect
        trends = dict(zip(("candidate", "reference"), self.trends(), strict=True))
        return json_safe({
            "lengths": self.lengths, "dtype": self.dtype, "mode": self.mode, "noise": self.noise,
            "verdict": "defect" if defect else "accumulation",
            "defect": {"point": defect[0], "length": defect[1]} if defect else None,
            "trend": {side: vars(t) if t else None for side, t in trends.items()},
            "points": {
                pid: {str(n): vars(c) for n in self.lengths if (c := self.cells.get((pid, n))) is not None}
                for pid in self.points
            },
        })  # fmt: skip


@dataclass(frozen=True)
class Trend:
    """What errors do over a sweep's lengths: `word` grows, falls or flat, `factor` the change fitted
    from the shortest length to the longest, over `curves` curves."""

    word: str
    factor: float
    curves: int

    def said(self, lengths: list[int]) -> str:
        how = {"grows": "grows with length", "falls": "falls with length", "flat": "stays flat over length"}
        fitted = f"x{self.factor:.2g} from {lengths[0]} to {lengths[-1]} tokens"
        return f"{how[self.word]} ({fitted}, fitted over {counted(self.curves, 'curve')})"


def trend(lengths: list[int], curves: list[list[float | None]]) -> Trend | None:
    """What errors do over length, by two tests on the figures: their direction, Kendall's tau over the
    pairs of lengths within each curve, pooled (+1: every pair up; -1: every pair down); and their size,
    one slope of log(error) on log(length) fitted over every curve at once, each at its own level
    (least squares within each curve, pooled), read as the change it fits from the shortest length to
    the longest. Grows or falls where both agree (module constants); else flat. Figures of 0 or None
    are left out (no logarithm); curves of every figure 0 are flat; None where no curve has two figures."""
    xs = [math.log(n) for n in lengths]
    sxy = sxx = 0.0
    up = down = pairs = fitted = zeros = 0
    for curve in curves:
        points = [(x, math.log(v)) for x, v in zip(xs, curve, strict=True) if v is not None and v > 0]
        if len(points) < 2:
            zeros += bool(curve) and all(v == 0 for v in curve)
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        sxy += sum((x - mx) * (y - my) for x, y in points)
        sxx += sum((x - mx) ** 2 for x, _ in points)
        for i, (_, a) in enumerate(points):
            for _, b in points[i + 1 :]:
                up, down, pairs = up + (b > a), down + (b < a), pairs + 1
        fitted += 1
    if not fitted:
        return Trend("flat", 1.0, zeros) if zeros else None
    factor = math.exp(sxy / sxx * (xs[-1] - xs[0]))
    tau = (up - down) / pairs
    word = "flat"
    if tau >= CONSISTENT and factor >= TREND_FACTOR:
        word = "grows"
    elif tau <= -CONSISTENT and factor <= 1 / TREND_FACTOR:
        word = "falls"
    return Trend(word, factor, fitted)


def _curve_point(pid: str) -> bool:
    step, _, component = parse_point_id(pid)
    return step is None and component in (OUTPUT, LOGITS)


def run_sweep(sweep: Sweep, *, hw: str, model: Path | None, dtype: str | None, hw_options: list[str], mode: str | None,
              say: Any = print) -> SweepResult:  # fmt: skip
    """The candidate over every length of `sweep` (each a parity run of its golden, activations only:
    no weight or config items), with the reference's own error where the goldens hold it."""
    from .session import ParitySession, RunOptions

    result: SweepResult | None = None
    for length in sweep.lengths:
        options = RunOptions(
            golden_dir=sweep.dirs[length], hw=hw, model=model, dtype=dtype, hw_options=hw_options, mode=mode,
            weights=False, config=False, plots=False, freeze_gc=True,
        )  # fmt: skip
        session = ParitySession(options)
        try:
            if result is None:
                result = SweepResult(sweep.lengths, dtype_name(session.dtype), session.mode)
                result.points = [p.id for p in session.points]
            for row in session.run_all():
                result.cells[row.id, length] = _cell(row)
            failed = sum(1 for (_, n), c in result.cells.items() if n == length and c.defect)
            points = sum(1 for (_, n) in result.cells if n == length)
            say(f"  length {length}: {counted(points, 'point')}, {failed} over limits")
        finally:
            session.close()
    assert result is not None
    return result


def _cell(row: Any) -> Cell:
    """A point's row at one length: its error, and the reference's own and their ratio as its verdict
    read them (over the same tokens: `PointRow.noise`)."""
    main = row.main_metrics
    rel = float(main.rel_l2) if main is not None and main.rel_l2 is not None else None
    cell = Cell(row.status, rel)
    if not isinstance(row, PointRow) or rel is None or not row.noise:
        return cell
    targets = row.noise.get("targets", {})
    target = row.shown if row.shown in targets else next(iter(targets), None)
    if target is not None and targets[target].get("reference_rel_l2") is not None:
        cell.reference = float(targets[target]["reference_rel_l2"])
        cell.ratio = float(targets[target]["rel_l2_ratio"])
        cell.limit = number(row.limits.get("noise_factor"))
    return cell


def sweep_lines(result: SweepResult, picture: str | None) -> list[str]:
    """The per-layer table (the candidate's relative L2 at each length, the reference's own beside it)
    and the verdict."""
    width = max((len(p) for p in result.curves()), default=10) + 2
    head = "".join(f"{n:>22}" for n in result.lengths)
    lines = [
        f"length sweep: {len(result.lengths)} lengths, candidate in {result.dtype}, {result.mode}; rel_l2 of each "
        f"layer's output" + (f" (the reference's own in {result.dtype} in brackets)" if result.noise else ""),
        f"  {'point':<{width}}{head}",
    ]
    for pid, cells in result.curves().items():
        row = "".join(f"{_figure(c):>22}" for c in cells)
        lines.append(f"  {pid:<{width}}{row}")
    defect = result.defect
    if defect is None:
        worst = max(
            ((c.ratio, pid, n) for (pid, n), c in result.cells.items() if c.ratio is not None), default=None
        )  # fmt: skip
        said = f"; the largest ratio to the reference's own, {worst[0]:.2f}, at {worst[1]} (length {worst[2]})" if (
            worst) else ""  # fmt: skip
        lines.append(f"verdict: accumulation: no point leaves its limits at any length{_trend_said(result)}{said}")
    else:
        pid, length = defect
        cell = result.cells[pid, length]
        before = result.lengths[result.lengths.index(length) - 1] if length != result.lengths[0] else None
        where = f"right up to length {before}, wrong from length {length}" if before else f"wrong at length {length}"
        reference = (
            f", the reference's own {cell.reference:.3g}, ratio {cell.ratio:.1f} > {cell.limit:g}"
            if cell.ratio is not None
            else ""
        )
        lines.append(f"verdict: a defect at {pid}: {where} (rel_l2 {brief(cell.rel_l2)}{reference}; {cell.status})")
    if picture:
        lines.append(f"picture: {picture}")
    return lines


def _trend_said(result: SweepResult) -> str:
    """What the candidate's error does over length, beside what the reference's own does, in words."""
    candidate, reference = result.trends()
    said = f"; the candidate's error {candidate.said(result.lengths)}" if candidate else ""
    if not result.noise:
        floor = "record it with --noise-dtype to read the candidate against the reference's own error"
        return f"{said} (the sweep holds no noise floor: {floor})"
    if candidate and reference:
        if reference.word == candidate.word:
            said += f", as the reference's own does (x{reference.factor:.2g})"
        else:
            said += f", while the reference's own {reference.said(result.lengths)}"
    return said


def _figure(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    mark = " !" if cell.defect else ""
    reference = f" ({brief(cell.reference)})" if cell.reference is not None else ""
    return f"{brief(cell.rel_l2)}{reference}{mark}"


def draw_sweep(result: SweepResult, path: Path) -> Path | None:
    """Each layer's curve over length, the candidate's solid and the reference's own dashed; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("viridis")
    curves = result.curves()
    for i, (pid, cells) in enumerate(curves.items()):
        colour = colours(i / max(len(curves) - 1, 1))
        xs = [n for n, c in zip(result.lengths, cells, strict=True) if c is not None and c.rel_l2 is not None]
        ys = [c.rel_l2 for c in cells if c is not None and c.rel_l2 is not None]
        ax.plot(xs, ys, "-o", color=colour, label=pid, markersize=3)
        refs = [(n, c.reference) for n, c in zip(result.lengths, cells, strict=True) if c and c.reference]
        if refs:
            ax.plot([n for n, _ in refs], [r for _, r in refs], "--", color=colour, linewidth=1)
    defect = result.defect
    if defect is not None:
        ax.axvline(defect[1], color="red", linestyle=":", label=f"defect: {defect[0]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"rel_l2 ({result.dtype}; dashed: the reference's own)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
