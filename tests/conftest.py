"""Shared fixtures: tiny checkpoints and golden recordings, built once per session (per worker)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_moe_parity.record.tiny import available_archs

ARCHS = available_archs()


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(arch, layers=None, seed=0) -> checkpoint directory, written once per session."""
    from pytest_moe_parity.record.tiny import write_tiny_model

    cache: dict[tuple, Path] = {}

    def make(arch: str, layers: int | None = None, seed: int = 0) -> Path:
        key = (arch, layers, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{layers}-{seed}")
            cache[key] = write_tiny_model(arch, out, layers=layers, seed=seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> Callable[..., Path]:
    """golden_dir(arch, layers=None, seq_len=16) -> golden directory recorded once per session."""
    from pytest_moe_parity.record.run import record_golden

    cache: dict[tuple, Path] = {}

    def make(arch: str, layers: int | None = None, seq_len: int = 16) -> Path:
        key = (arch, layers, seq_len)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"golden-{arch}-{layers}-{seq_len}") / "golden"
            record_golden(tiny_model(arch, layers), out, seq_len=seq_len)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def _import_everything_once(golden_dir, tiny_model) -> None:
    """pytester's in-process runs drop the modules first imported inside them, and some torch
    modules register C++ operator libraries that cannot be imported twice. Run the whole replay
    path once up front so that every such module is imported by the outer session."""
    import torch

    from pytest_moe_parity.backends import BackendOptions
    from pytest_moe_parity.backends.hf import TorchBackend
    from pytest_moe_parity.golden import GoldenStore
    from pytest_moe_parity.replay.runner import ParityRunner

    store = GoldenStore(golden_dir("minimax_m2"))
    backend = TorchBackend(BackendOptions(store, tiny_model("minimax_m2"), torch.bfloat16))
    runner = ParityRunner(store, lambda: backend, torch.bfloat16)
    for pid in ("embedding", "rotary", "layer_0.attention", "layer_0.router", "layer_0.moe", "logits"):
        runner.run(pid)
