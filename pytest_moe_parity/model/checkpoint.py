"""A safetensors checkpoint directory, read without its tensor data: the shard index (checkpoint
key -> shard file), each shard's header (every tensor's dtype and shape), and the quantization its
config declares. What cannot be read raises CheckpointError, one sentence naming the file; a
command that was handed the directory says it as bad input."""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of each safetensors dtype code.
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
         "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip


@dataclass
class Tensor:
    """One tensor of a checkpoint, as its shard's header describes it."""

    name: str
    dtype: str  # safetensors' spelling, e.g. BF16
    shape: list[int]
    file: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        return self.numel * SIZES.get(self.dtype, 0)


def read_config(model_dir: Path | str, error: type[Exception] = CheckpointError, missing: str = "") -> dict[str, Any]:
    """A checkpoint's config.json as written (no transformers), or `error` with one sentence: `missing`
    where it has none (default: not a transformers checkpoint), or the file's JSON error."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise error(missing or f"{model_dir} is not a transformers checkpoint (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON ({exc})") from None


def read_index(model_dir: Path | str) -> dict[str, str] | None:
    """The shard index's weight map (checkpoint key -> shard file name), or None where the
    directory has no index (a single-file checkpoint)."""
    index = Path(model_dir) / INDEX_FILE
    if not index.is_file():
        return None
    try:
        mapping = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
    if not isinstance(mapping, dict):
        raise CheckpointError(f"{index} is not a valid safetensors index (its weight_map is not a mapping)")
    return dict(mapping)


def weight_map(model_dir: Path | str) -> dict[str, str]:
    """Checkpoint key -> shard file name, from the index or the single safetensors file."""
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    mapping = read_index(model_dir)
    if mapping is not None:
        return mapping
    single = model_dir / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as fh:
                return dict.fromkeys(fh.keys(), SINGLE_FILE)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{single} cannot be read as safetensors ({exc})") from None
    raise CheckpointError(
        f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; "
        "only safetensors checkpoints can be read one layer at a time"
    )


class Shards:
    """A checkpoint's safetensors shards, each opened on its first read and once, all closed on exit (none
    stays open, nor mapped once the tensors read from it are freed). A shard that is missing or not
    safetensors is `error`'s one sentence naming it."""

    def __init__(self, model_dir: Path | str, error: type[Exception] = CheckpointError):
        self.model_dir, self.error = Path(model_dir), error
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handles.clear()
        self._stack.close()

    @property
    def opened(self) -> set[str]:
        """The shard files opened so far."""
        return set(self._handles)

    def handle(self, file: str) -> Any:
        """`file`'s safetensors handle (get_slice, get_tensor)."""
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            path = self.model_dir / file
            if not path.is_file():
                raise self.error(f"{path} (named by the checkpoint index) is missing")
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as exc:
                raise self.error(f"{path} cannot be read as safetensors ({exc})") from None
        return self._handles[file]


def safetensors_files(model_dir: Path | str, need: str = "the audit reads safetensors checkpoints") -> list[str]:
    """The safetensors files of a checkpoint directory: every shard its index names (each checked
    present), else every `.safetensors` file. CheckpointError when there is none, saying why one is
    needed."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"--model {model_dir} is not a directory")
    mapping = read_index(model_dir)
    if mapping is not None:
        files = sorted(set(mapping.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir / INDEX_FILE} names {missing[0]}, which is not in {model_dir}")
        return files
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no .safetensors files; {need}")
    return files


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (its first 8 + N bytes only), checked against the file's size."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a safetensors file (shorter than its header)")
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length > size - 8:
                raise CheckpointError(f"{path} is not a safetensors file (its header runs past the end)")
            header = json.loads(fh.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read as safetensors ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise CheckpointError(
            f"{path} is truncated: its header describes {8 + length + end} bytes, the file has {size}"
        )
    return header


def read_tensors(model_dir: Path | str) -> list[Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded with an index), from headers."""
    model_dir = Path(model_dir)
    tensors = []
    for file in safetensors_files(model_dir):
        for name, entry in read_header(model_dir / file).items():
            if name != "__metadata__":
                tensors.append(Tensor(name, entry["dtype"], list(entry["shape"]), file))
    return tensors


def quantization(config: Any) -> str | None:
    """The quantization method a checkpoint's config declares (fp8, gptq, ...), or None. Its weights
    need transformers' quantizer, which only `from_pretrained` applies."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method) or "quantized")
