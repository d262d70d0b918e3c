"""Layer-first under `-x`: a decoder layer is run once, on the golden's inputs, and its output and every
component as that one call made them are judged; only where one fails do the component items run.

`pytest -x` asks for the first divergence and nothing after it. Each component item replays its module
on the golden's inputs (the attention again inside the layer, the experts three times) and is judged on
its own; the probe runs the layer once and judges the same components on the outputs the layer's own
forward gave them, each against its own golden record and limits, so a broken component fails the
probe however little it moves the residual stream around it (a gate/up swap whose layer output stays
within the output's limits). Where every verdict passes, the layer's component items are skipped with
that reason; where one fails, they run in forward order as without it, on the golden's inputs, and `-x`
stops at the first that fails, which the drill then opens. A component judged on the layer's own way
through it carries the error of the components before it too: that can only make the probe fail (the
components then run and say which), not pass. The output item takes the probe's run.

On by default under `-x` (`--maxfail 1`) in an isolated run on a backend that shows a module's parts
(`cpu`, `cuda`: `Backend.captures_parts`); `--parity-layer-first` asks for it without `-x`,
`--no-parity-layer-first` turns it off. Chained runs (`--parity-mode chain`, `both`) judge each component
on the candidate's own whole-model run, and a decode step's attention is judged with the cache it wrote:
both run every item (the prefill's layers alone are probed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ..points import OUTPUT, point_id

if TYPE_CHECKING:
    from ..points import Point
    from ..replay.runner import ParityRunner, Prepared
    from ..session import ParitySession

LAYER_FIRST_KEY = pytest.StashKey["LayerFirst"]()
OFF = "--no-parity-layer-first"


def wanted(config: pytest.Config, session: ParitySession) -> bool:
    """Whether the run goes layer-first: as asked, else under `-x` (`--maxfail 1`); where it can (an
    isolated run on a backend that shows a module's parts)."""
    asked = config.getoption("parity_layer_first")
    on = asked if asked is not None else config.getoption("maxfail") == 1
    return on and session.runner.mode == "isolated" and type(session.runner.backend).captures_parts


class LayerFirst:
    """The probes of one run: per (decode step, layer), the output's candidate run and whether it passed."""

    def __init__(self, session: ParitySession):
        self.session = session
        self.items: dict[str, pytest.Item] = {}  # the point items, by point id (their markers)
        self.probed: dict[tuple[int | None, int], tuple[Prepared | None, bool]] = {}

    def collected(self, items: list[pytest.Item]) -> None:
        """The run's point items (after selection): a layer is probed where its output is selected, and its
        components' verdicts take their items' `parity` markers."""
        self.items = {i.point.id: i for i in items if getattr(i, "point", None) is not None}

    def skip_reason(self, point: Point) -> str | None:
        """Why `point`'s item does not run (its layer's probe passed), or None: it runs."""
        if point.layer is None or point.component == OUTPUT or point.step is not None:  # decode: every item
            return None
        key, output = (point.step, point.layer), point_id(OUTPUT, point.layer, point.step)
        if key not in self.probed:
            self.probed[key] = self._probe(output)
        if not self.probed[key][1]:
            return None
        return f"layer-first: {output} and its components pass on one run of the layer ({OFF} runs each)"

    def _probe(self, output: str) -> tuple[Prepared | None, bool]:
        from ..errors import BackendFailure, GoldenError, PointUnavailable

        item = self.items.get(output)
        if item is None:  # not selected (-k, --parity-layers): every component runs
            return None, False
        point = item.point
        parts = [i.point for i in self.items.values() if i.point.layer == point.layer and i.point.step == point.step]
        parts = [p for p in parts if p.component != OUTPUT]
        try:
            return probe_layer(
                self.session.runner, point, parts, {p.id: _marker(self.items[p.id]) for p in [point, *parts]}
            )
        except (BackendFailure, GoldenError, PointUnavailable):  # the items say it, each at its own turn
            return None, False

    def prepared(self, point: Point) -> Prepared | None:
        """The output's candidate run, where a probe made it (handed over once, then let go)."""
        if point.component != OUTPUT or point.layer is None:
            return None
        key = (point.step, point.layer)
        prepared, passed = self.probed.get(key, (None, False))
        if prepared is not None:
            self.probed[key] = (None, passed)
        return prepared

    def header(self) -> str:
        return (
            "moe-parity: layer-first (-x): each decoder layer is run once and judged with its components as that "
            f"run made them; its component items run where one fails ({OFF}: every item)"
        )

    def closing(self) -> str | None:
        """How many layers were judged on one run of theirs, from the run's rows (an xdist controller's
        come from its workers' reports)."""
        layers = {
            (row.step, row.layer)
            for row in self.session.rows.values()
            if row.status == "skipped" and (row.reason or "").startswith("layer-first:")
        }
        if not layers:
            return None
        n = len(layers)
        return (
            f"layer-first: the components of {n} layer{'s' if n != 1 else ''} that passed on one run of the layer "
            f"were not run again ({OFF} runs them)"
        )


def active(config: pytest.Config) -> LayerFirst | None:
    return config.stash.get(LAYER_FIRST_KEY, None)


def _marker(item: pytest.Item) -> dict | None:
    marker = item.get_closest_marker("parity")
    return dict(marker.kwargs) if marker else None


def probe_layer(
    runner: ParityRunner, point: Point, parts: list[Point], markers: dict[str, dict | None]
) -> tuple[Prepared, bool]:
    """The decoder layer `point` run once on the golden's inputs (`Backend.run_parts`): its output judged,
    then each of `parts` on what that call gave it, against its own golden record (the experts and the MoE
    block with the routing the layer's router gave them, as a chained verdict takes it). (The output's
    run, for its item; whether every verdict passed.) Stops at the first that fails."""
    from ..backends import CandidateOutput
    from ..replay.runner import Prepared

    record = runner.golden.load(point, row_masks=runner.backend.row_masks)
    seen: dict[str, Any] = {}
    prepared = Prepared(point, record, runner.call(point, record, parts=(parts, seen)), None)
    if not runner.judge(prepared, markers.get(point.id)).passed:
        return prepared, False
    for part in parts:
        if part.id not in seen:  # not called by the layer as recorded: its item runs it
            return prepared, False
        router = runner.golden.router_of(part)
        routing = seen.get(router.id) if router is not None and part.follows_router else None
        routing = tuple(routing) if isinstance(routing, tuple | list) else None
        golden = runner.golden.load(part, row_masks=runner.backend.row_masks)
        result = runner.judge_output(
            part, golden, CandidateOutput(seen[part.id], routing), "isolated", markers.get(part.id)
        )
        if not result.passed:
            return prepared, False
    return prepared, True
