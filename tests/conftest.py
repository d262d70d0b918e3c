"""Shared fixtures: tiny checkpoints and golden recordings, built once per session (per worker)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers() -> None:
    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(arch, layers=None, seed=0, **config_overrides) -> checkpoint directory, written
    once per session."""
    from pytest_moe_parity.record.tiny import write_tiny_model

    cache: dict[tuple, Path] = {}

    def make(arch: str, layers: int | None = None, seed: int = 0, **overrides) -> Path:
        key = (arch, layers, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{layers}-{seed}")
            cache[key] = write_tiny_model(arch, out, layers=layers, seed=seed, overrides=overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> Callable[..., Path]:
    """golden_dir(arch, layers=None, seq_len=16, noise=None, decode=0) -> golden directory recorded once
    per session (with `noise="bfloat16"`, with the reference's own error in that dtype; with `decode`,
    that many decode steps after the prefill)."""
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.replay.noise import record_noise

    cache: dict[tuple, Path] = {}

    def make(
        arch: str, layers: int | None = None, seq_len: int = 16, noise: str | None = None, decode: int = 0
    ) -> Path:
        key = (arch, layers, seq_len, noise, decode)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"golden-{arch}-{layers}-{seq_len}-{noise}-{decode}") / "golden"
            record_golden(tiny_model(arch, layers), out, seq_len=seq_len, decode_steps=decode)
            if noise is not None:
                record_noise(out, noise, model_dir=tiny_model(arch, layers))
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture
def nxdi_double(monkeypatch):
    """NxDI's test double (tests/doubles: its modules' code, with the device calls left out) on the path,
    and its modules forgotten after the test."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "doubles"))
    yield
    for name in [m for m in sys.modules if m.startswith(("neuronx_distributed_inference", "neuronx_distributed."))]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trace cache per test worker, away from ~/.cache."""
    return tmp_path_factory.mktemp("trace-cache")


@pytest.fixture(scope="session")
def _import_everything_once(golden_dir, tiny_model) -> None:
    """pytester's in-process runs drop the modules first imported inside them, and some torch
    modules register C++ operator libraries that cannot be imported twice. The modules that run
    inner sessions use this fixture (see their `pytestmark`) to run the whole replay path once up
    front, so that every such module is imported by the outer session; pure unit tests do not."""
    from helpers import session

    from pytest_moe_parity.record.tiny import available_archs, build_tiny_model

    runner = session(golden_dir("minimax_m2"), tiny_model("minimax_m2"), dtype="bfloat16").runner
    for pid in ("embedding", "rotary", "layer_0.attention", "layer_0.router", "layer_0.moe", "logits"):
        runner.run(pid)
    # every architecture's modeling module, through transformers' auto classes (which keep the
    # module they first import): a module first imported inside a run would be dropped after it,
    # and a code fault patched into a fresh import would not reach the model the next run builds
    for arch in available_archs():
        build_tiny_model(arch, layers=1)
    # the report's pictures
    import matplotlib.backends.backend_agg
    import matplotlib.colors
    import matplotlib.figure
    import matplotlib.image  # noqa: F401


@pytest.fixture(scope="session")
def _import_inductor_once() -> None:
    """As `_import_everything_once`, for torch.compile: inductor registers its cache artifacts at
    import, and a second import inside a later inner session would register them twice."""
    import importlib
    import warnings

    import torch

    with warnings.catch_warnings():  # inductor's imports touch deprecated torch.jit helpers
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(3))
        # the modules that register cache artifacts, which a small compile does not import
        for name in (
            "torch._inductor.runtime.autotune_cache",
            "torch._inductor.codecache",
            "torch._functorch._aot_autograd.autograd_cache",
            "torch._dynamo.package",
            "torch._dynamo.pgo",
        ):
            importlib.import_module(name)
