"""NxDI's imports and its config: one sentence for each failure a user meets, NxD's and NxDI's own
deprecation notices kept out of the run, the checkpoint's config as NxDI reads it."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from pathlib import Path
from typing import Any

from ... import compat
from ...compat import legacy_rope, load_config
from ...errors import BackendError

INSTALL = (
    'pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "pytest-moe-parity[nxdi]" '
    "(neuronx-distributed-inference with torch-neuronx, Neuron SDK 2.28 or later, on a trn1/trn2/inf2 instance)"
)


def import_nxdi() -> None:
    """Imports NxDI (the stand-ins for the Neuron-only packages already in place where wanted),
    turning the failures a user meets into one sentence each."""
    try:
        importlib.import_module("neuronx_distributed_inference.utils.testing")
    except ImportError as exc:
        if compat.MAJOR >= 5:
            raise BackendError(
                f"--hw nxdi: NxDI and NxD do not import under transformers {compat.VERSION} ({exc}); "
                "run it in the Neuron SDK's Python stack (torch 2.9, torch-xla 2.9, transformers 4.57), where NxDI "
                "pins transformers==4.57.*"
            ) from None
        raise BackendError(f"--hw nxdi: NxDI cannot be imported here ({exc}): {INSTALL}") from None


@contextlib.contextmanager
def upstream_warnings():
    """NxD's and NxDI's own deprecation notices (every NeuronConfig warns about `get_platform_lnc`)
    are about their code, not the port under test: kept out of a run that errors on warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def nxdi_hf_config(model_dir: Path) -> Any:
    """The checkpoint's transformers config as NxDI reads it: the rotary settings under the names
    NxDI's configs require (`rope_theta`, `rope_scaling`, None for the default rotary), whichever
    transformers wrote config.json (`compat.load_config` reads one written by transformers 5 on a
    4.57 host)."""
    hf_config = load_config(model_dir)
    rope = legacy_rope(hf_config.to_dict())
    for name, value in rope.items():
        setattr(hf_config, name, value)
    if not hasattr(hf_config, "rope_scaling"):
        hf_config.rope_scaling = None
    scaling = hf_config.rope_scaling or {}
    if getattr(hf_config, "initial_context_length", None) is None and "original_max_position_embeddings" in scaling:
        # GPT-OSS's release names its YaRN's pre-extension length twice (`initial_context_length`, which
        # NxDI's GPT-OSS rotary reads, and rope_scaling's `original_max_position_embeddings`, which
        # transformers reads); transformers 5 writes only the latter
        hf_config.initial_context_length = scaling["original_max_position_embeddings"]
    return hf_config
