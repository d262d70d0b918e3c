"""What the vLLM leg's tests share: an inner `--hw vllm` session over a recorded directory, its report's
rows, and a fault put into one of vLLM's modules for one inner session."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_json, run_parity

from pytest_moe_parity.report.files import REPORT_FILE


def vllm_parity(
    pytester: pytest.Pytester,
    root: Path,
    report: Path,
    *args: str,
    model: Path | None = None,
    golden: Path | None = None,
) -> pytest.RunResult:
    """An inner `--hw vllm` session (warnings as errors, its report in `report`) over `root/golden` with the
    candidate `root/model`, or the `golden` and `model` given."""
    argv = ("--hw", "vllm", "--parity-report", str(report), "-W", "error", *args)
    return run_parity(pytester, golden or root / "golden", *argv, model=model or root / "model")


def busiest_expert(golden: Path, layer: int) -> int:
    """The expert the golden's router at `layer` chose most often (a fault there is seen by many tokens)."""
    from pytest_moe_parity.golden import GoldenStore

    return int(GoldenStore(golden).load(f"layer_{layer}.router").output[2].flatten().bincount().argmax())


def rows_of(report: Path) -> dict[str, dict]:
    """The report's rows by point id."""
    return {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}


def patched(pytester: pytest.Pytester, module: str, name: str, value: str, prelude: str = "") -> None:
    """The inner session's conftest: `module`'s attribute `name` (dotted: a class's method) set to the
    expression `value` for the session, and put back at its end (vLLM's modules stay imported across the
    inner sessions of this process: conftest's `keep_vllm_imported`). `prelude` defines what `value` uses;
    `original` is the attribute as it was."""
    attr = name.rpartition(".")[2]
    pytester.makeconftest(
        f"""
import importlib
import operator
import warnings

import torch

with warnings.catch_warnings():  # vLLM's own notices as it imports
    warnings.simplefilter("ignore")
    target = importlib.import_module({module!r})
for part in {name!r}.split(".")[:-1]:
    target = getattr(target, part)
original = getattr(target, {attr!r})

{prelude}


def pytest_configure(config):
    setattr(target, {attr!r}, {value})


def pytest_unconfigure(config):
    setattr(target, {attr!r}, original)
"""
    )


def loading_through(pytester: pytest.Pytester, module: str, cls: str, change: str) -> None:
    """The inner session's conftest: vLLM's model class `cls` of `module` loads the checkpoint through
    `change`, a function of (name, tensor) giving the pair loaded (a loader bug)."""
    value = "lambda self, weights: original(self, (change(k, t) for k, t in weights))"
    patched(pytester, module, f"{cls}.load_weights", value, change)
