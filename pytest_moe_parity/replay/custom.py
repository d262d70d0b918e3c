"""What a user's own tests get from a run (the plugin's `candidate` and `parity` fixtures): the
candidate's modules and calls, and two tensors compared under the tolerance a point of that name
would get."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import dtype_name
from ..judge.result import Custom, PointResult
from ..judge.tolerances import Override, resolve
from ..judge.verdict import Case, judge_point

if TYPE_CHECKING:
    from ..backends import Backend
    from ..golden import GoldenStore
    from .runner import ParityRunner


class Candidate:
    """The candidate of a run, for custom tests (the `candidate` fixture)."""

    def __init__(self, golden: GoldenStore, backend: Backend, runner: ParityRunner):
        self._golden, self._backend, self._runner = golden, backend, runner

    @property
    def dtype(self) -> torch.dtype:
        return self._backend.dtype

    def module(self, point_or_path: str) -> Any:
        """The backend's torch module for a point id or module path (backends with modules)."""
        golden = self._golden
        path = golden.point(point_or_path).module if point_or_path in golden.point_ids else point_or_path
        return self._backend.module(path)

    def call(self, record: Any) -> Any:
        """The candidate's output on a golden record's inputs (cast as for the parity items)."""
        return self._runner.call(record.point, record).output


def judge_custom(
    name: str,
    golden: torch.Tensor,
    candidate: torch.Tensor,
    *,
    component: str = "custom",
    marker: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    cli: Sequence[Override] = (),
    ini: Sequence[Override] = (),
) -> PointResult:
    """A comparison of two tensors under the tolerance a point called `name` would get (the `parity`
    fixture): the marker, then the run's --parity-tol (`cli`) and ini patterns (`ini`), then the
    defaults of `dtype` (the run's; without a run, the candidate tensor's)."""
    dtype = dtype if dtype is not None else candidate.dtype
    tol, sources = resolve(name, component, dtype, marker=marker, cli=list(cli), ini=list(ini))
    result = judge_point(Case(Custom(name, component), golden, candidate, tol, dtype))
    result.tolerance_sources = sources
    result.golden_dtype = dtype_name(golden.dtype)
    return result
