"""Whether a pytest session runs a test directory's own tests, for the conftests of CI's other legs
(tests_neuron/, tests_vllm/): they refuse a wrong environment only when they are what the session runs."""

from __future__ import annotations

from pathlib import Path

import pytest


def targeted(config: pytest.Config, here: Path) -> bool:
    """Whether the session runs the tests under `here` (not a run that only passes by it)."""
    for arg in config.args or [str(config.invocation_params.dir)]:
        path = Path(str(arg).split("::", 1)[0]).resolve()
        if path == here or here in path.parents:
            return True
    return False
