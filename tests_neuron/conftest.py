"""The Neuron-stack leg: `--hw nxdi --hw-option build=cpu` against NxDI's and NxD's real source
(the pinned snapshots of ../shared/upstream, or what NXDI_SRC and NXD_SRC name) under the Neuron
SDK's Python stack (torch 2.9, torch-xla 2.9, transformers 4.57), replaying goldens recorded under
transformers 5 by the first leg (MOE_PARITY_T5_GOLDENS: `{arch}-model/` and `{arch}-golden/` per
architecture). `bash .ci/neuron-leg` builds that environment and runs this directory; run
elsewhere, it is a usage error that says what is missing, never a skip."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the main suite's helpers (run_parity, read_json, ...)

from targeted import targeted  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "dbrx", "gpt_oss", "llama4_text")
GOLDENS = "MOE_PARITY_T5_GOLDENS"
BATCH = "qwen3_moe-batch"  # three prompts of unequal length padded on the left (fixtures/prompts/padded.jsonl)
BUCKET = "qwen3_moe-bucket"  # the same, left-padded to a bucket of 16 tokens (NxDI's application takes it so)


def pytest_configure(config: pytest.Config) -> None:
    if not targeted(config, Path(__file__).resolve().parent):
        return
    import transformers

    from pytest_moe_parity.backends.nxdi import import_nxdi, upstream_warnings
    from pytest_moe_parity.backends.nxdi.cpu import standins

    if int(transformers.__version__.split(".")[0]) != 4:
        raise pytest.UsageError(
            f"tests_neuron/ runs on the Neuron SDK's stack (transformers 4.57); this has transformers "
            f"{transformers.__version__}: run `bash .ci/neuron-leg`"
        )
    standins.install()
    try:
        with upstream_warnings():
            import_nxdi()
    except Exception as exc:
        raise pytest.UsageError(
            f"tests_neuron/ needs NxDI and NxD importable ({exc}): put their src/ on PYTHONPATH "
            "(`bash .ci/neuron-leg` unpacks the pinned snapshots)"
        ) from None
    root = os.environ.get(GOLDENS)
    wanted = [f"{a}-golden" for a in ARCHS] + [BATCH, BUCKET]
    missing = [g for g in wanted if not root or not (Path(root) / g / "manifest.json").is_file()]
    if missing:
        raise pytest.UsageError(
            f"{GOLDENS} must name a directory of goldens recorded under transformers 5 ({', '.join(missing)} "
            f"missing{'' if root else ': the variable is not set'}); `bash .ci/run` records them in its first leg"
        )


@pytest.fixture(scope="session")
def t5() -> Path:
    """The directory of transformers-5 checkpoints and goldens."""
    return Path(os.environ[GOLDENS])
