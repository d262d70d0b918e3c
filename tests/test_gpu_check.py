"""benchmarks/gpu_check.py's stand-in for the `kernels` package (`--local-kernels`), without a GPU: the
device machine that runs the GPU checks cannot reach the hub, so transformers' fp8 and MXFP4 kernels are
imported from a kernels-community checkout instead. CI has no GPU; the checks themselves ran on an H200
(docs/quantization.md)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_kernels_stand_in_for_the_hub(tmp_path: Path, monkeypatch) -> None:
    """transformers takes the stand-in as a `kernels` package at the version it names, and `get_kernel`
    imports a kernel's sources with the `_ops` module its builder would generate; a kernel with no sources
    is the FileNotFoundError transformers expects of a missing one."""
    sources = tmp_path / "src"
    package = sources / "finegrained-fp8" / "torch-ext" / "finegrained_fp8"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from ._ops import add_op_namespace_prefix as name\nNAME = name('mm')\n")
    site = tmp_path / "site"
    monkeypatch.setenv("MOE_PARITY_LOCAL_KERNELS", "")  # local_kernels sets it: put back as it was after
    _gpu_check().local_kernels(site, sources)
    assert os.environ["MOE_PARITY_LOCAL_KERNELS"] == str(sources.resolve())
    probe = textwrap.dedent(
        """
        from transformers.utils.import_utils import is_kernels_available
        import transformers.integrations.hub_kernels as hub
        kernel = hub.get_kernel("kernels-community/finegrained-fp8", version=4)
        print(is_kernels_available(), kernel.NAME)
        try:
            hub.get_kernel("kernels-community/gpt-oss-triton-kernels", version=1)
        except FileNotFoundError as exc:
            print("missing:", exc)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    assert out.splitlines()[0] == "True _finegrained_fp8_local::mm", out
    assert out.splitlines()[1].startswith("missing: kernels-community/gpt-oss-triton-kernels: no local sources"), out
