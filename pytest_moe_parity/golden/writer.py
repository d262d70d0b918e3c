"""Writing a golden directory: one safetensors file per group, hashed and renamed into place, and
the manifest last and atomically, so an interrupted recording never reads as complete."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..dtypes import dtype_name
from ..errors import GoldenError
from ..files import atomic_write_text, file_mode
from ..points import Point
from .spec import Spec
from .store import FORMAT, MANIFEST, SCHEMA_VERSION, sha256_file


@dataclass
class Recorded:
    """One point's call as recorded: the structure specs plus the tensors they reference."""

    point: Point
    args: list[Spec]
    kwargs: dict[str, Spec]
    output: Spec
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Reference values kept for diagnosis only, never fed to the candidate (e.g. the golden
    # score-correction bias, to tell a routing tie from a real flip): name -> tensor key.
    extras: dict[str, str] = field(default_factory=dict)
    calls: int = 1
    seconds: float = 0.0


def _looks_like_golden(path: Path) -> bool:
    """True when every entry is something this tool writes, so --overwrite may clear it."""
    for entry in path.iterdir():
        name = entry.name
        if entry.is_dir() or not (
            name == MANIFEST or name.endswith(".safetensors") or (name.startswith(".") and ".tmp-" in name)
        ):
            return False
    return True


class GoldenWriter:
    """Writes a golden directory group by group; `finish` writes the manifest that makes it valid."""

    def __init__(self, root: Path | str, *, overwrite: bool = False):
        self.root = Path(root)
        self.overwrite = overwrite
        self.files: dict[str, dict[str, Any]] = {}
        self.points: list[dict[str, Any]] = []
        self._created = False

    @property
    def bytes_written(self) -> int:
        return sum(f["bytes"] for f in self.files.values())

    def prepare(self) -> None:
        root = self.root
        if root.exists() and not root.is_dir():
            raise GoldenError(f"{root} exists and is not a directory; choose another --out")
        if root.is_dir() and any(root.iterdir()):
            if not self.overwrite:
                raise GoldenError(f"{root} exists and is not empty; pass --overwrite or choose another --out")
            if not _looks_like_golden(root):
                raise GoldenError(
                    f"{root} holds files that are not part of a golden recording; "
                    "refusing to clear it even with --overwrite"
                )
            # The manifest goes first, so an interrupted overwrite never reads as the old golden.
            (root / MANIFEST).unlink(missing_ok=True)
            for entry in root.iterdir():
                entry.unlink()
        self._created = not root.exists()
        root.mkdir(parents=True, exist_ok=True)

    def write_group(self, group: str, records: list[Recorded]) -> int:
        """Write one group's tensors to `<group>.safetensors`; returns the bytes written."""
        file = f"{group}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for rec in records:
            tensors.update(rec.tensors)
        path = self.root / file
        tmp = self.root / f".{file}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"format": "pt", "producer": FORMAT, "group": group})
        os.chmod(tmp, file_mode())
        digest = sha256_file(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
        self.files[file] = {"sha256": digest, "bytes": size, "content": content_digest(tensors)}
        for rec in records:
            self.points.append(
                {
                    **rec.point.to_dict(),
                    "file": file,
                    "sha256": digest,
                    "calls": rec.calls,
                    "seconds": round(rec.seconds, 6),
                    "inputs": {"args": rec.args, "kwargs": rec.kwargs},
                    "output": rec.output,
                    "extras": rec.extras,
                    "tensors": {
                        k: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for k, t in rec.tensors.items()
                    },
                }
            )
        return size

    def abort(self) -> None:
        """Remove what this writer wrote (a failed recording), and the directory if it made it."""
        for file in self.files:
            (self.root / file).unlink(missing_ok=True)
        for tmp in self.root.glob(f".*.tmp-{os.getpid()}"):
            tmp.unlink(missing_ok=True)
        self.files.clear()
        self.points.clear()
        if self._created and self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()

    def finish(self, manifest: dict[str, Any]) -> Path:
        body = {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "complete": True,
            **manifest,
            "files": self.files,
            "points": sorted(self.points, key=lambda p: p["order"]),
        }
        path = self.root / MANIFEST
        atomic_write_text(path, json.dumps(body, indent=1, sort_keys=False) + "\n")
        return path


def update_manifest(root: Path | str, key: str, value: Any) -> None:
    """Set one top-level entry of a complete golden's manifest (e.g. the noise figures), atomically:
    a reader sees the manifest before or after, never half of it."""
    path = Path(root) / MANIFEST
    body = json.loads(path.read_text(encoding="utf-8"))
    body[key] = value
    atomic_write_text(path, json.dumps(body, indent=1, sort_keys=False) + "\n")


def content_digest(tensors: dict[str, torch.Tensor]) -> str:
    """What a file's tensors hold, whatever bytes the file's header is written in (safetensors writes
    its metadata in no fixed order): the sha256 of each tensor's name, dtype, shape and data, by name."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{dtype_name(t.dtype)}|{list(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # hashed in place, not copied
    return h.hexdigest()
