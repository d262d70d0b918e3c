"""Replay one point on the candidate and judge it: the engine shared by the pytest plugin and the
command line. The backend is created on first use, so collecting items costs nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend
from ..golden import GoldenRecord, GoldenStore
from ..judge.tolerances import Tolerance, resolve
from ..judge.verdict import PointResult, judge_point

Overrides = list[tuple[str, dict[str, float | None]]]


class ParityRunner:
    def __init__(
        self,
        golden: GoldenStore,
        backend_factory: Callable[[], Backend],
        dtype: torch.dtype,
        *,
        cli_tolerances: Overrides = (),
        ini_tolerances: Overrides = (),
    ):
        self.golden = golden
        self._factory = backend_factory
        self._backend: Backend | None = None
        self.dtype = dtype
        self.cli_tolerances = list(cli_tolerances)
        self.ini_tolerances = list(ini_tolerances)
        self.config = golden.manifest["model"].get("config", {})
        self._router_cache: dict[int, GoldenRecord] = {}

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = self._factory()
        return self._backend

    @property
    def backend_started(self) -> bool:
        return self._backend is not None

    def tolerance(self, pid: str, marker: dict[str, Any] | None = None) -> tuple[Tolerance, list[str]]:
        point = self.golden.point(pid)
        return resolve(
            pid, point["component"], self.dtype, marker=marker, cli=self.cli_tolerances, ini=self.ini_tolerances
        )

    def _router_record(self, layer: int | None) -> GoldenRecord | None:
        point = self.golden.router_point(layer)
        if point is None:
            return None
        if layer not in self._router_cache:
            self._router_cache.clear()  # one layer at a time
            self._router_cache[layer] = self.golden.load(point["id"])
        return self._router_cache[layer]

    def run(self, pid: str, marker: dict[str, Any] | None = None) -> PointResult:
        point = self.golden.point(pid)
        tol, sources = self.tolerance(pid, marker)
        record = self.golden.load(pid)
        cand = self.backend.run(point, record)
        golden_router = bias = None
        comp = point["component"]
        if comp == "router":
            bias = record.extras.get("score_bias")
        elif comp in ("moe", "output"):
            router = self._router_record(point["layer"])
            if router is not None:
                golden_router = router.output
                bias = router.extras.get("score_bias")
        result = judge_point(
            point,
            record.output,
            cand.output,
            tol,
            self.dtype,
            config=self.config,
            golden_router=golden_router,
            candidate_router=cand.routing,
            score_bias=bias,
        )
        result.tolerance_sources = sources
        result.seconds = cand.seconds
        result.golden_dtype = self.golden.manifest["record"]["dtype"]
        return result

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
