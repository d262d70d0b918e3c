"""Reading the reference model: its config and tokenizer as the `--model` directory gives them,
the model by `from_pretrained`, and the ways recording reads it (`reader`; `run.load_reference` follows
it) with the model as it then holds it (`LoadedReference`). `moe-parity golden` (`run`) and
`moe-parity scan` read it through these."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput, CheckpointError
from ..host import gib
from ..model.lazy_model import LazyModel, own_memory
from ..model.quant import Layout, layout
from .dispatch import does_not_fit
from .memory import placement, placement_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def first_line(exc: BaseException) -> str:
    """transformers' messages run to paragraphs: the first line says what is wrong."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_checked_config(model_dir: Path, *, trust_remote_code: bool = False):
    """The `--model` directory's config as this process's transformers reads it (recording and scanning
    run under transformers 5: no `compat.load_config` overrides); BadInput, in one sentence, where the
    directory is not a loadable checkpoint."""
    from transformers import AutoConfig

    if not model_dir.is_dir():
        raise BadInput(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise BadInput(f"{model_dir} is not a transformers checkpoint (no config.json)")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for unknown configs
        raise BadInput(f"{model_dir} is not a loadable transformers checkpoint: {first_line(exc)}") from None
    try:
        layout(config, str(model_dir))  # a quantization this cannot read, said before anything is loaded
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None
    return config


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_of(model_dir: Path, *, trust_remote_code: bool = False) -> tuple[Callable | None, int | None]:
    """The model's tokenizer as a function of a text to its token ids, and its pad id; (None, None)
    where the model directory has no tokenizer."""
    if not has_tokenizer(model_dir):
        return None, None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return (lambda text: list(tok(text)["input_ids"])), tok.pad_token_id


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: str | None,
    device_map: str | None,
    max_memory: dict | None,
    offload_folder: Path | None = None,
    trust_remote_code: bool = False,
):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        attn_implementation="eager",
        # grouped_mm (the CPU default) and eager differ by ~1e-7: pin it on both sides.
        experts_implementation="eager",
        trust_remote_code=trust_remote_code,
    )
    if device_map:
        kwargs["device_map"] = device_map
        if max_memory:
            kwargs["max_memory"] = max_memory
        if offload_folder is not None:
            kwargs["offload_folder"] = str(offload_folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        if "offload_folder" in str(exc) and offload_folder is None:  # placed partly on disk, and nowhere to put it
            raise does_not_fit(model_dir) from None
        raise BadInput(f"cannot load {model_dir} as a causal LM: {first_line(exc)}") from None
    if not device_map and device:
        model = model.to(device)
    # What stays on the host no longer holds the shards mapped (and sits where the unit-by-unit
    # reading puts it: aligned, so that both give the same bits).
    own_memory(model)
    return model.eval()


@dataclass
class LoadedReference:
    """The reference model as recording holds it, read as `reader` said (`how`): with `lazy`, its
    weights read from the checkpoint one unit at a time as the forward reaches them (every unit
    kept, or streamed a few decoder layers at a time)."""

    model: Any
    how: str
    lazy: LazyModel | None = None

    @property
    def loading(self) -> str:
        if self.how == "stream":
            assert self.lazy is not None
            return f"streamed, {self.lazy.max_layers} decoder layers at a time"
        return {"from_pretrained": "from_pretrained", "placed": "by unit, placed by accelerate"}.get(
            self.how, "by unit"
        )

    @property
    def input_device(self) -> torch.device:
        return self.lazy.device if self.lazy is not None else input_device(self.model)

    def running(self) -> contextlib.AbstractContextManager:
        return self.lazy.streaming() if self.lazy is not None else contextlib.nullcontext()

    def placement(self) -> dict[str, dict[str, int]]:
        return placement(self.model, self.lazy.device if self.lazy is not None else None)

    def _layer_bytes(self) -> list[int]:
        """Each decoder layer's weight bytes, largest first."""
        assert self.lazy is not None
        return sorted((self.lazy.unit_bytes(i) for i in range(self.lazy.num_layers)), reverse=True)

    def placement_line(self, placed: dict[str, dict[str, int]]) -> str:
        if self.how != "stream":
            return placement_line(placed)
        assert self.lazy is not None
        return (
            f"placement: streamed from the checkpoint onto {self.lazy.device}, {self.lazy.max_layers} decoder "
            f"layers at a time ({gib(self._layer_bytes()[0])} each; "
            f"{gib(sum(e['bytes'] for e in placed.values()))} in all)"
        )

    def host_weight_bytes(self, placed: dict[str, dict[str, int]]) -> int:
        """The weights this recording kept in host memory at most."""
        if self.how != "stream":
            return sum(entry["bytes"] for device, entry in placed.items() if device == "cpu")
        assert self.lazy is not None
        if self.lazy.device.type != "cpu":
            return 0
        model_level = sum(self.lazy.unit_bytes(u) for u in self.lazy.model_level_paths())
        return model_level + sum(self._layer_bytes()[: self.lazy.max_layers])


def reader(model_dir: Path, config: Any, device_map: str | None, stream: bool, native: bool = False) -> str:
    """How the reference is read: `from_pretrained` for a checkpoint without safetensors, or a
    quantized one whose maker's kernels run (`native`: transformers' quantizer builds its modules);
    else one unit at a time (a quantized checkpoint's weights dequantized as each is read), `placed`
    by an accelerate device map, `stream`ed, or every unit kept on one device (`units`)."""
    if not any(model_dir.glob("*.safetensors")) or native:
        return "from_pretrained"
    if device_map:
        return "placed"
    return "stream" if stream else "units"


REFERENCE_QUANT = ("dequant", "native")
# the finegrained-fp8 kernel's dot over a block of the input dimension: Triton's fp8 `tl.dot` needs K >= 32
# (seen on an H200: "Input shapes should have M >= 1, N >= 1 and K >= 32" for blocks of 8)
NATIVE_FP8_MIN_BLOCK = 32


def reference_quant(
    model_dir: Path, config: Any, choice: str | None, device: str | None, dtype: torch.dtype | None = None
) -> dict[str, Any] | None:
    """How a quantized reference's matmuls run, for its manifest and header (None: not quantized):
    `dequant` (the default: weights dequantized into the recording's dtype as each unit is read, what
    transformers does on a CPU), or `native`, the maker's path where transformers runs one here
    (compressed-tensors FP8: activations quantized per token, then a scaled matmul; fp8 and mxfp4: on
    a GPU with their kernels). BadInput, one sentence, where the choice cannot be had."""
    quant = layout(config, str(model_dir))
    if quant is None:
        if choice is not None:
            raise BadInput(f"--reference-quant applies to a quantized checkpoint, and {model_dir} is not quantized")
        return None
    choice = choice or "dequant"
    if choice not in REFERENCE_QUANT:
        raise BadInput(f"--reference-quant {choice!r} is not one of {', '.join(REFERENCE_QUANT)}")
    if choice == "native":
        why = native_unavailable(quant, device, dtype)
        if why:
            raise BadInput(f"--reference-quant native: {why}; record with --reference-quant dequant (the default)")
    return {
        **quant.to_dict(),
        "reference": choice,
        "matmuls": (
            "the maker's quantized kernels, through transformers' quantizer"
            if choice == "native"
            else "weights dequantized into the recording's dtype, activations unquantized"
        ),
    }


def native_unavailable(quant: Layout, device: str | None, dtype: torch.dtype | None = None) -> str | None:
    """Why transformers runs no quantized kernel of `quant` on `device` in `dtype` (None: it runs one)."""
    on_gpu = (device or "cpu").startswith("cuda") and torch.cuda.is_available()
    if quant.method == "compressed-tensors":
        return None if quant.bits == "fp8" else f"transformers runs no {quant.bits} kernel of compressed-tensors"
    if not on_gpu:
        return f"transformers dequantizes {quant.method} weights on a CPU (its kernels need a GPU)"
    if quant.method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        return "transformers' fp8 kernels need a GPU of compute capability 8.9 or more"
    if quant.method == "fp8" and quant.block and min(quant.block) < NATIVE_FP8_MIN_BLOCK:
        return (
            f"transformers' fp8 kernels (Triton) take blocks of at least {NATIVE_FP8_MIN_BLOCK}, and this "
            f"checkpoint's are {quant.block[0]}x{quant.block[1]}"
        )
    if quant.method == "mxfp4" and dtype not in (None, torch.bfloat16):
        return (
            f"transformers' mxfp4 kernels (Triton's matmul_ogs) take bfloat16 activations, not {dtype}: "
            "add --dtype bfloat16"
        )
    if not hub_kernels_installed():
        return (
            f"transformers' {quant.method} kernels come from the Hugging Face hub through the `kernels` package "
            "(pip install kernels, at the version transformers names), which is not installed here"
        )
    return None


def hub_kernels_installed() -> bool:
    """Whether transformers can fetch its hub kernels (the `kernels` package, at a version it takes)."""
    from transformers.utils import import_utils

    available = getattr(import_utils, "is_kernels_available", None)
    return bool(available and available())


def native_ran(model: Any) -> None:
    """BadInput where transformers' quantizer fell back to dequantizing the weights (its kernels did not
    load): a golden labelled `native` must have run the maker's kernels."""
    qconfig = getattr(model.config, "quantization_config", None)
    if isinstance(qconfig, dict):
        dequantized, method = qconfig.get("dequantize"), qconfig.get("quant_method")
    else:
        dequantized, method = getattr(qconfig, "dequantize", None), getattr(qconfig, "quant_method", None)
    if dequantized:
        method = getattr(method, "value", method)
        raise BadInput(
            f"--reference-quant native: transformers dequantized the {method} weights instead of running "
            "its kernels (see its warning above); record with --reference-quant dequant (the default)"
        )


def input_device(model) -> torch.device:
    emb = model.get_input_embeddings()
    p = next(emb.parameters(), None)
    if p is not None and p.device.type != "meta":
        return p.device
    return torch.device("cpu")
