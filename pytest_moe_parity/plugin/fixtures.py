"""The fixtures a user's own tests get with `--golden-dir`: the golden store, the candidate, and a
comparison of two tensors under the tolerance a point of the test's name would get."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .items import _session

if TYPE_CHECKING:
    from ..golden import GoldenStore
    from ..replay.custom import Candidate
    from ..session import ParitySession


def _require_session(request: pytest.FixtureRequest) -> ParitySession:
    session = _session(request.config)
    if session is None:
        pytest.skip("needs a golden recording: pass --golden-dir (or set golden_dir in the ini file)")
    return session


@pytest.fixture(scope="session")
def golden(request: pytest.FixtureRequest) -> GoldenStore:
    """The golden store: `golden.load("layer_3.attention")` gives its args, kwargs and output."""
    return _require_session(request).golden


@pytest.fixture(scope="session")
def candidate(request: pytest.FixtureRequest) -> Candidate:
    """The candidate: `candidate.call(record)` runs a golden record's inputs through the backend;
    `candidate.module("layer_3.attention")` is its torch module (cpu, cuda); `candidate.dtype`."""
    from ..replay.custom import Candidate
    from ..replay.vacuous import AGAINST_ITSELF

    session = _require_session(request)
    if session.vacuous == AGAINST_ITSELF:  # its own model, dtype and backend (`replay.vacuous`)
        import warnings

        warnings.warn(
            f"the candidate is the golden's own model in the golden's dtype ({session.golden.dtype}): custom tests "
            "compare the reference with itself; pass --model DIR (the port) or --dtype (e.g. bfloat16)",
            pytest.PytestWarning,
            stacklevel=2,
        )
    return Candidate(session.golden, session.backend, session.runner)


@pytest.fixture
def parity(request: pytest.FixtureRequest):
    """parity(golden_tensor, candidate_tensor, component="custom") compares under the resolved
    tolerance (the test's parity marker, --parity-tol / ini patterns over the test name, dtype
    defaults) and fails with the metrics table; returns the PointResult."""

    def check(golden_tensor, candidate_tensor, *, component: str = "custom", point_id: str | None = None):
        __tracebackhide__ = True
        from ..replay.custom import judge_custom
        from ..report.text import failure_text

        marker = request.node.get_closest_marker("parity")
        run = _session(request.config)  # the run's dtype and tolerance patterns, where there is one
        result = judge_custom(
            point_id or request.node.name,
            golden_tensor,
            candidate_tensor,
            component=component,
            marker=dict(marker.kwargs) if marker else None,
            dtype=run.dtype if run is not None else None,
            cli=run.runner.cli_tolerances if run is not None else (),
            ini=run.runner.ini_tolerances if run is not None else (),
        )
        if not result.passed:
            pytest.fail(failure_text(result), pytrace=False)
        return result

    return check
