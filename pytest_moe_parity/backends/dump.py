"""Candidates dumped by another framework (Megatron, Ascend, a custom runtime): a directory of
safetensors files (or `.pt` files, read with `weights_only=True`) whose tensors are matched to
point ids by name, and compared without running anything.

A point's output is found under, in order: the name the map file gives it, its point id
(`layer_3.attention`), or its transformers module path (`model.layers.3.self_attn`). A point with
several outputs (a router's logits, weights and top-k ids) is `NAME.0`, `NAME.1`, ... The map file is
JSON: `{"layer_{layer}.attention": "decoder.{layer}.attn_out", "logits": "lm_head_out"}`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import BackendError
from ..golden import GoldenRecord
from ..points import Point
from . import Backend, BackendSetup, CandidateOutput, HwOption, PointUnavailable

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth")
_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class DumpError(BackendError):
    """The dump directory or the map file is unusable."""


class PointNotDumped(PointUnavailable):
    """The dump holds nothing for this point."""


def load_map(path: Path | str | None) -> list[tuple[re.Pattern[str], str]]:
    if path is None:
        return []
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DumpError(f"map file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DumpError(f"map file {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise DumpError(f"map file {path} must be a JSON object of point id -> dumped tensor name")
    rules = []
    for point, name in data.items():
        pattern = re.escape(point).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
        rules.append((re.compile(pattern), name))
    return rules


class DumpDir:
    """Name -> tensor index over a dump directory; tensors are read on demand."""

    def __init__(self, root: Path | str, map_file: Path | str | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DumpError(f"dump directory {self.root} does not exist")
        self.rules = load_map(map_file)
        self._index: dict[str, tuple[Path, str | None]] = {}
        self._header_dtypes: dict[str, str] = {}  # safetensors entries: name -> dtype from the header
        self._pt_last: tuple[Path, Any] | None = None  # the last .pt file read (one held at a time)
        from safetensors import SafetensorError, safe_open

        files = sorted(p for p in self.root.rglob("*") if p.suffix in TENSOR_SUFFIXES and p.is_file())
        for f in files:
            if f.suffix == ".safetensors":
                try:
                    with safe_open(str(f), framework="pt") as fh:
                        for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                            self._index[key] = (f, key)
                            self._header_dtypes[key] = fh.get_slice(key).get_dtype()
                except (SafetensorError, OSError) as exc:
                    raise DumpError(f"{f} cannot be read as safetensors ({exc})") from None
            else:
                self._index[".".join(f.relative_to(self.root).with_suffix("").parts)] = (f, None)
        if not self._index:
            raise DumpError(f"{self.root} holds no .safetensors or .pt files")

    @property
    def names(self) -> list[str]:
        return sorted(self._index)

    def _read(self, name: str) -> Any:
        f, key = self._index[name]
        if key is not None:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as fh:
                return fh.get_tensor(key)
        if self._pt_last is None or self._pt_last[0] != f:
            try:
                self._pt_last = (f, torch.load(f, map_location="cpu", weights_only=True))
            except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
                raise DumpError(f"{f} cannot be loaded with weights_only=True ({type(exc).__name__}: {exc})") from None
        return self._pt_last[1]

    def float_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor of the dump (the candidate's precision);
        safetensors dumps answer from their headers, without reading tensor data."""
        for name in self.names:
            header = _SAFETENSORS_FLOATS.get(self._header_dtypes.get(name, ""))
            if header is not None:
                return header
            if name in self._header_dtypes:
                continue
            value = self._read(name)
            for t in value if isinstance(value, tuple | list) else [value]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    return t.dtype
        return None

    def candidates(self, point: Point) -> list[str]:
        names = []
        for pattern, template in self.rules:
            m = pattern.fullmatch(point.id)
            if m:
                names.append(template.format(**m.groupdict()))
        names += [point.id, point.module]
        return names

    def find(self, point: Point) -> tuple[str, Any] | None:
        """The dumped output of `point` and the name it was found under, or None."""
        for name in self.candidates(point):
            if name in self._index:
                return name, self._read(name)
            parts = []
            while f"{name}.{len(parts)}" in self._index:
                parts.append(self._read(f"{name}.{len(parts)}"))
            if parts:
                return name, tuple(parts)
        return None


class DumpBackend(Backend):
    """`--hw dump --model DUMP_DIR [--hw-option map=FILE]`: outputs come from the dump."""

    name = "dump"
    needs_checkpoint = False
    captures_routing = True  # when the router's (logits, weights, top-k ids) were dumped
    chain = "recorded"  # a dump of the candidate's own forward is a chained run already
    options = (HwOption("map", "JSON map of point ids to dumped tensor names (same as --parity-map)"),)

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        if setup.model_dir is None:
            raise BackendError("--hw dump needs the dump directory: pass --model DIR")
        # indexes the dump (names and headers only) and reads the map file
        self.dump = DumpDir(setup.model_dir, self.hw_options["map"])
        self.native_dtype = self.dump.float_dtype()

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        found = self.dump.find(point)
        if found is None:
            tried = ", ".join(self.dump.candidates(point))
            raise PointNotDumped(f"{point.id} is not in the dump {self.dump.root} (looked for {tried})")
        routing = None
        router = self.golden.router_of(point)
        if router is not None:
            dumped = self.dump.find(router)
            if dumped is not None and isinstance(dumped[1], tuple | list) and len(dumped[1]) >= 3:
                routing = tuple(dumped[1])
        return CandidateOutput(found[1], routing)
