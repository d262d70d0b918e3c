"""The golden store: one safetensors file per layer (and per model-level point) plus a manifest
written last and atomically. The reader opens only the file of the point it is asked for."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..record.capture import Recorded, build, dtype_name

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FORMAT = "pytest-moe-parity golden"


class GoldenError(Exception):
    """A golden directory is missing, incomplete, corrupted or from a newer version."""


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
        self.bytes_written = 0

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
        os.chmod(tmp, 0o644 & ~_umask())
        digest = sha256_file(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
        self.files[file] = {"sha256": digest, "bytes": size}
        for rec in records:
            p = rec.point
            self.points.append(
                {
                    "id": p.id,
                    "component": p.component,
                    "layer": p.layer,
                    "module": p.module,
                    "order": p.order,
                    "router_kind": p.router_kind,
                    "score_bias": p.score_bias,
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
        self.bytes_written += size
        return size

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


@dataclass
class GoldenRecord:
    """One point read back: args/kwargs/output with tensors, and ParamRef for parameters."""

    point: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    output: Any
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.point["id"]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """safetensors hands out tensors at any byte offset; CPU GEMM kernels take other code paths
    (other summation orders) for unaligned data, so replaying a misaligned golden input is not
    bitwise. A copy from torch's allocator is 64-byte aligned."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


class GoldenStore:
    """Read access to a golden directory, one point (one file) at a time."""

    def __init__(self, root: Path | str, *, verify: bool = True):
        self.root = Path(root)
        self.verify = verify
        self.opened_files: list[str] = []
        self._verified: set[str] = set()
        self.manifest = self._read_manifest()
        self._points = {p["id"]: p for p in self.manifest["points"]}

    # -- manifest -------------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any]:
        root = self.root
        if not root.is_dir():
            raise GoldenError(f"golden directory {root} does not exist")
        path = root / MANIFEST
        if not path.is_file():
            raise GoldenError(
                f"{path} is missing: {root} is not a golden directory, or its recording did not finish; "
                "record one with `moe-parity golden`"
            )
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GoldenError(f"{path} is corrupted or truncated (not valid JSON: {exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise GoldenError(f"{path} is not a pytest-moe-parity golden manifest")
        version = manifest.get("schema_version")
        if not isinstance(version, int):
            raise GoldenError(f"{path} has no integer schema_version")
        if version > SCHEMA_VERSION:
            raise GoldenError(
                f"{path} has schema version {version}, newer than the supported {SCHEMA_VERSION}; "
                "upgrade pytest-moe-parity"
            )
        if manifest.get("complete") is not True:
            raise GoldenError(f"{path} does not mark the recording as complete")
        files = manifest.get("files")
        points = manifest.get("points")
        if not isinstance(files, dict) or not isinstance(points, list):
            raise GoldenError(f"{path} lacks its 'files' or 'points' table")
        for name in files:
            self._safe_path(name)
        for p in points:
            if not isinstance(p, dict) or not {"id", "file", "inputs", "output", "tensors"} <= p.keys():
                raise GoldenError(f"{path}: a point entry is malformed: {str(p)[:80]}")
            if p["file"] not in files:
                raise GoldenError(f"{path}: point {p['id']} names file {p['file']!r} absent from 'files'")
        return manifest

    def _safe_path(self, name: str) -> Path:
        root = self.root.resolve()
        candidate = (root / name).resolve()
        if os.path.isabs(name) or candidate.parent != root:
            raise GoldenError(
                f"{self.root / MANIFEST} names file {name!r} outside the golden directory; refusing to read it"
            )
        return candidate

    # -- queries --------------------------------------------------------------------------------
    @property
    def point_ids(self) -> list[str]:
        return [p["id"] for p in self.manifest["points"]]

    @property
    def points(self) -> list[dict[str, Any]]:
        return list(self.manifest["points"])

    @property
    def model_type(self) -> str:
        return self.manifest["model"]["model_type"]

    def point(self, pid: str) -> dict[str, Any]:
        try:
            return self._points[pid]
        except KeyError:
            raise GoldenError(f"no point {pid!r} in {self.root / MANIFEST}") from None

    def router_point(self, layer: int | None) -> dict[str, Any] | None:
        """The router point of a decoder layer (None for dense layers and model-level points)."""
        return self._points.get(f"layer_{layer}.router") if layer is not None else None

    def _check_file(self, name: str) -> Path:
        path = self._safe_path(name)
        if not path.is_file():
            raise GoldenError(f"{path} is missing from the golden directory")
        if self.verify and name not in self._verified:
            expected = self.manifest["files"][name].get("sha256")
            actual = sha256_file(path)
            if actual != expected:
                raise GoldenError(
                    f"{path} does not match its sha256 in the manifest (corrupted, truncated or replaced); "
                    "record the golden again"
                )
            self._verified.add(name)
        return path

    def tensors(self, pid: str) -> dict[str, torch.Tensor]:
        """The tensors of one point, read from its own file only."""
        point = self.point(pid)
        path = self._check_file(point["file"])
        self.opened_files.append(point["file"])
        out: dict[str, torch.Tensor] = {}
        try:
            with safe_open(str(path), framework="pt") as fh:
                available = set(fh.keys())
                for key in point["tensors"]:
                    if key not in available:
                        raise GoldenError(f"{path} lacks tensor {key!r} listed in the manifest")
                    out[key] = _aligned(fh.get_tensor(key))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise GoldenError(f"{path} cannot be read as safetensors ({exc})") from None
        return out

    def load(self, pid: str) -> GoldenRecord:
        point = self.point(pid)
        tensors = self.tensors(pid)
        args = [build(s, tensors) for s in point["inputs"]["args"]]
        kwargs = {k: build(s, tensors) for k, s in point["inputs"]["kwargs"].items()}
        extras = {name: tensors[key] for name, key in point.get("extras", {}).items()}
        return GoldenRecord(point, args, kwargs, build(point["output"], tensors), extras)
