"""`moe-parity dequantize`: an unquantized copy of a quantized checkpoint (fp8 block-scaled,
compressed-tensors, MXFP4), written one unit at a time.

Each decoder layer's raw tensors (and then the tensors outside the layers, as one unit) are read with
safetensors, dequantized by the layout's `model.quant.Dequantizer` (the arithmetic transformers' own
loading uses, and LazyModel's) into `--dtype`, and saved as a shard of their own, before the next
unit is read: the copy holds one unit's stored and dequantized tensors at a time, what `moe-parity
audit` gives as the conversion's peak. The copy has the key names of an unquantized checkpoint of
the model in the hub's layout as read (`<name>.weight` for `<name>.weight` + `weight_scale_inv`,
GPT-OSS's `gate_up_proj` for its `_blocks` + `_scales`); the unquantized tensors are copied as
stored (DeepSeek's own `fp8_cast_bf16.py` does the same), activation and KV-cache scales left out.
config.json loses its `quantization_config` and declares `--dtype`; the other files beside the
weights (generation config, tokenizer) are copied. Everything is written into a temporary directory
beside `--out`, renamed to `--out` once complete: a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..dtypes import parse_dtype
from ..errors import BadInput, CheckpointError
from ..host import gib, malloc_trim, map_large_allocations
from ..model.checkpoint import INDEX_FILE, Shards, read_config, weight_map
from .audit import MODEL_UNIT, QuantView, checkpoint_tensors, conversion_unit, quantized_view

DTYPES = ("bfloat16", "float16", "float32")
SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}
# files beside the weights that are weights too (other formats): not copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")


def dequantize_checkpoint(
    model_dir: Path | str, out: Path | str, dtype: str = "bfloat16", *, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Write the unquantized copy of `model_dir` to `out` (see the module); what was written, by unit.
    BadInput, one sentence, for an unquantized checkpoint, one its layout cannot read, an `out` that
    holds anything, a dtype that is not one of DTYPES, or too little room."""
    model_dir, out = Path(model_dir), Path(out)
    if dtype.removeprefix("torch.") not in DTYPES:
        raise BadInput(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dtype = dtype.removeprefix("torch.")
    tensors = checkpoint_tensors(model_dir)
    config = read_config(model_dir, BadInput)
    view = quantized_view(model_dir, tensors, config)  # BadInput where the layout cannot read it
    if view is None:
        raise BadInput(f"{model_dir} is already unquantized (its config.json has no quantization_config)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"--out {out} already exists and is not empty: name a new directory")
    need = sum(view.converted_bytes(t, SIZES[dtype]) for t in tensors)
    _check_room(out, need)
    units = _units(model_dir)
    map_large_allocations()  # a unit's temporaries handed back as they are freed: it holds what it keeps
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        written = _write_units(model_dir, partial, view, units, dtype, progress)
        _write_config(config, partial / "config.json", dtype)
        copied = _copy_beside(model_dir, partial)
        if out.exists():
            out.rmdir()  # empty: checked above
        partial.rename(out)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise BadInput(f"cannot write {out} ({exc}); nothing was left there") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return _summary(model_dir, out, view, dtype, written, copied)


def _check_room(out: Path, need: int) -> None:
    """BadInput where the filesystem of `out` has less room than the copy needs."""
    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise BadInput(f"the unquantized copy needs {gib(need)} and {where} has {gib(free)} free")


def _units(model_dir: Path) -> dict[str, dict[str, list[str]]]:
    """unit (`model`, `layer_N`, in that order) -> shard file -> keys, from the checkpoint's index."""
    try:
        mapping = weight_map(model_dir)
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None
    units: dict[str, dict[str, list[str]]] = {}
    for key, file in mapping.items():
        units.setdefault(conversion_unit(key), {}).setdefault(file, []).append(key)
    return dict(sorted(units.items(), key=lambda kv: -1 if kv[0] == MODEL_UNIT else int(kv[0].split("_")[1])))


def _write_units(
    model_dir: Path,
    out: Path,
    view: QuantView,
    units: dict[str, dict[str, list[str]]],
    dtype: str,
    progress: Callable[[str], None] | None,
) -> dict[str, dict[str, Any]]:
    """Each unit read, dequantized and saved as its shard, one after the other; the index last."""
    from safetensors.torch import save_file

    torch_dtype = parse_dtype(dtype)
    weights: dict[str, str] = {}
    written: dict[str, dict[str, Any]] = {}
    for n, (unit, files) in enumerate(units.items(), 1):
        shard = f"model-{n:05d}-of-{len(units):05d}.safetensors"
        state, read = _read_unit(model_dir, files, view, torch_dtype)
        save_file(state, str(out / shard), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in state.values())
        weights.update(dict.fromkeys(state, shard))
        written[unit] = {"file": shard, "tensors": len(state), "read_bytes": read, "written_bytes": size}
        state.clear()
        malloc_trim()
        if progress is not None:
            progress(f"{unit}: {gib(read)} read, {gib(size)} written to {shard}")
    total = sum(w["written_bytes"] for w in written.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weights.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return written


def _read_unit(model_dir: Path, files: dict[str, list[str]], view: QuantView, dtype: Any) -> tuple[dict, int]:
    """One unit's tensors, dequantized (the unquantized ones as stored); the bytes read."""
    raw: dict[str, Any] = {}
    handles: dict[str, Any] = {}
    read = 0
    with Shards(model_dir, BadInput) as shards:
        for file, keys in files.items():
            handle = shards.handle(file)
            for key in keys:
                raw[key] = handle.get_slice(key)
                handles[key] = handle
                read += view.by_name[key].bytes if key in view.by_name else 0
        try:
            plain = view.dequantizer.dequantize(raw, dtype)
        except CheckpointError as exc:
            raise BadInput(str(exc)) from None
        state = {}
        for name, value in plain.items():  # what is not quantized, read as it is stored
            tensor = value if not hasattr(value, "get_shape") else handles[name].get_tensor(name)
            state[name] = tensor.contiguous()
    return state, read


def _write_config(config: dict[str, Any], path: Path, dtype: str) -> None:
    config = dict(config)
    config.pop("quantization_config", None)
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    config.update(dict.fromkeys(keys, dtype))
    path.write_text(json.dumps(config, indent=2) + "\n")


def _copy_beside(model_dir: Path, out: Path) -> list[str]:
    """The files beside the weights (generation config, tokenizer, ...), subdirectories left out."""
    copied = []
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name in ("config.json", INDEX_FILE) or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, out / path.name)
        copied.append(path.name)
    return copied


def _summary(
    model_dir: Path, out: Path, view: QuantView, dtype: str, written: dict[str, dict[str, Any]], copied: list[str]
) -> dict[str, Any]:
    roles: dict[str, int] = {}
    for t in view.tensors:
        role = view.role(t)
        roles[role] = roles.get(role, 0) + 1
    peaks = {u: w["read_bytes"] + w["written_bytes"] for u, w in written.items()}
    largest = max(peaks, key=peaks.get, default=MODEL_UNIT)
    return {
        "model": str(model_dir),
        "out": str(out),
        "quantization": view.layout.to_dict(),
        "dtype": dtype,
        "dequantized": roles.get("quantized", 0),
        "unquantized": roles.get("plain", 0),
        "left_out": {
            "kv_cache_scales": roles.get("kv_scale", 0),
            "activation_scales": roles.get("activation_scale", 0),
        },
        "units": written,
        "written_bytes": sum(w["written_bytes"] for w in written.values()),
        "largest_unit": largest,
        "peak_bytes": peaks.get(largest, 0),
        "copied": copied,
    }


def dequantize_lines(result: dict[str, Any]) -> list[str]:
    q = result["quantization"]
    left = result["left_out"]
    aside = [f"{n} {what.replace('_', ' ')}" for what, n in left.items() if n]
    return [
        f"moe-parity dequantize: {result['model']} ({q['method']}, {q['scheme']}) -> {result['out']}: "
        f"{result['dequantized']} weights dequantized into {result['dtype']}, {result['unquantized']} tensors copied "
        f"as stored{'; left out: ' + ', '.join(aside) if aside else ''}",
        f"{len(result['units'])} shards, {gib(result['written_bytes'])}; one unit at a time: at most "
        f"{gib(result['peak_bytes'])} held ({result['largest_unit']}: its stored and its {result['dtype']} tensors)",
        f"copied beside the weights: {', '.join(result['copied']) or 'nothing'}",
    ]
