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

from .spec import build

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FORMAT = "pytest-moe-parity golden"


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


class GoldenError(Exception):
    """A golden directory is missing, incomplete, corrupted or from a newer version."""


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
