"""The precision search on `--hw nxdi` (its CPU build): the units are the precision settings NxDI's
config exposes for the point's module (`backends.nxdi.precision`: the router's
`router_config.dtype`, `attention_dtype`, `rpl_reduce_dtype` at TP > 1), those it reads and the
candidate does not already run in float32; a trial rebuilds the module with the chosen settings at
float32 in its neuron config (the backend's `raised`, keyed into its configs and built modules as a
parallel plan is) and judges it as the point's own item does. The search itself is
`replay.precision`'s: nothing raised, every setting raised, then the bisection."""

from __future__ import annotations

from typing import Any

import torch

from ..backends import Backend
from ..errors import BackendFailure, PointUnavailable
from ..golden import GoldenRecord, GoldenStore
from ..judge.result import PointResult
from ..model.raised import Unit
from ..points import Point
from .runner import ParityRunner, candidate_inputs


def nxdi_search_usable(backend: Backend) -> str | None:
    """Why `--hw nxdi` as configured cannot be searched (None: it can)."""
    if backend.hw_options.get("build") != "cpu":
        return (
            "--hw nxdi searches NxDI's precision settings on its CPU build, where a module is rebuilt per trial: "
            "add --hw-option build=cpu"
        )
    return None


class NxdiSearcher:
    """Runs one point's NxDI module rebuilt with chosen precision settings at float32, and judges it."""

    def __init__(self, golden: GoldenStore, runner: ParityRunner):
        from ..backends.nxdi import precision

        self.golden, self.runner, self.settings = golden, runner, precision
        self.backend: Any = runner.backend
        self.already: list[str] = []  # the point's settings the candidate runs in float32 already

    def units(self, point: Point) -> list[Unit]:
        """The settings of the point's module, in the order NxDI's docs list them, that are not float32
        in the candidate's own config; a module that reads none is not searched (PointUnavailable)."""
        backend, settings = self.backend, self.settings
        spec = backend.table.components.get(point.component)
        if spec is None:
            raise PointUnavailable(f"{point.id}: --hw nxdi builds no NxDI module for it: nothing to search")
        reads = settings.applicable(point.component, spec.factory, backend.tp)
        if not reads:
            module = spec.factory.rpartition(":")[2].removesuffix("()")
            raise PointUnavailable(
                f"{point.id}: NxDI exposes no precision setting for its module ({module}; the settings: "
                f"{', '.join(s.said for s in settings.SETTINGS)}, none of which it reads here): nothing to search"
            )
        backend.start()
        config = backend._config(backend.tp, backend.ep)
        self.already = [s.said for s in reads if s.current(config) == torch.float32]
        return [("", s.said) for s in reads if s.current(config) != torch.float32]

    def run(self, point: Point, record: GoldenRecord, raised: set[Unit]) -> tuple[PointResult, list[Unit]]:
        """The point judged with the `raised` settings at float32, and the point's units."""
        runner, backend = self.runner, self.backend
        runner.start(point)
        units = self.units(point)
        by_said = {s.said: s.option for s in self.settings.SETTINGS}
        natural = candidate_inputs(record, runner.dtype, backend.device)
        backend.raised = {by_said[name]: "float32" for _, name in raised}
        try:
            output = backend.run(point, natural)
        except PointUnavailable:
            raise
        except Exception as exc:
            raise BackendFailure(point.id, exc) from exc
        finally:
            backend.raised = {}
        return runner.judge_output(point, record, output, "isolated", None), units

    def describe(self, point_id: str, units: list[Unit], others: int) -> str:
        said = " and ".join(f"{name}=float32" for _, name in units)
        rest = "nothing else needs it" + ("" if others else " (the only setting it reads that is not float32 already)")
        return f"{point_id} passes with NxDI's {said}; {rest}"

    def defect_words(self, point_id: str, order: list[Unit]) -> str:
        raised = [name for _, name in order]
        parts = [f"{', '.join(raised)} raised" if raised else "", f"{', '.join(self.already)} float32 already"
                 if self.already else ""]  # fmt: skip
        said = "; ".join(p for p in parts if p)
        return (
            f"{point_id} still fails with every precision setting NxDI exposes for its module in float32 ({said}): "
            "a defect, not precision"
        )

    def not_precision_words(self, point_id: str) -> str:
        return (
            f"{point_id} passes with its NxDI module rebuilt as the candidate is: its failure is not a precision "
            "setting of NxDI's (another run's, or another tolerance) - a defect, not precision"
        )

    def close(self) -> None:
        self.backend.raised = {}
