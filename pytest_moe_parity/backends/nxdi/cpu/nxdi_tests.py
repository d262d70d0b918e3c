"""A pytest plugin that runs NxDI's own module tests on the CPU: `pytest -p
pytest_moe_parity.backends.nxdi.cpu.nxdi_tests test/unit/models/...`. NxDI's `build_module` (trace,
compile, load on a Neuron device) is replaced by the CPU build of `--hw nxdi --hw-option build=cpu`
before the tests import it; everything else the tests call is NxDI's and NxD's own code."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from ..imports import upstream_warnings
    from . import ranks, standins

    standins.install()
    os.environ["NXD_CPU_MODE"] = "1"
    try:
        with upstream_warnings():
            from neuronx_distributed_inference.utils import testing
    except ImportError as exc:
        raise pytest.UsageError(f"NxDI cannot be imported here ({exc}): its module tests need NxDI and NxD") from None
    testing.build_module = ranks.build_module
    ranks.START["method"] = "spawn"  # the tests' references run first, on every core
    config.add_cleanup(ranks.close_pools)
