"""Reading a dump: a directory of safetensors files (or `.pt` files, read with `weights_only=True`)
written by another framework (Megatron, NxDI, Ascend, a custom runtime, or `dump.record`), or an NxDI
tensor-capture directory (see `nxdi_capture`), whose tensors are matched to point ids by name.

A point's output is found under, in order: the name the map file gives it, the name the NxDI table
of the golden's architecture gives it (capture directories), its point id (`layer_3.attention`), or
its transformers module path (`model.layers.3.self_attn`). Decode step k's tensors carry the prefix
`step_k.` (`step_2.layer_3.attention`). A point with several outputs (a router's logits, weights and
top-k ids) is `NAME.0`, `NAME.1`, ...

The map file is JSON, point id templates -> a name, or a list of names tried in turn, or an object
that says how the tensor was sharded across ranks:

    {"layer_{layer}.attention": "decoder.{layer}.attn_out",
     "layer_{layer}.moe": {"name": "decoder.{layer}.moe_out", "concat_dim": -1, "ranks": 8},
     "logits": {"name": "lm_out", "concat_dim": null, "ranks": 8}}

Rank r's piece of NAME is `NAME.rank{r}`, or NAME in a `rank{r}` (`rank_{r}`, `tp_rank_{r}`)
directory; the pieces are concatenated along `concat_dim` (null: every rank holds the whole tensor,
rank 0's is compared and the others are checked equal to it)."""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import SAFETENSORS_FLOATS, dtype_name
from ..errors import BackendError, PointUnavailable
from ..points import TEMPLATE_EXAMPLES, Point, is_point_template, step_prefix
from ..tree import leaves
from .neuron_plugin import Layout, PluginCapture, is_plugin_capture, module_of
from .nxdi_capture import PLACEHOLDER, Capture, available_tables, is_capture_dir, load_table, read_capture

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth")
_SAFETENSORS_FLOATS = {code: SAFETENSORS_FLOATS[code] for code in ("F64", "F32", "F16", "BF16")}
_RANK_DIR = re.compile(r"^(?:tp_)?rank_?(\d+)$")
_RANK_SUFFIX = re.compile(r"^(.+)\.rank(\d+)$")
_MAP_KEYS = {"name", "concat_dim", "ranks"}


class DumpError(BackendError):
    """The dump directory or the map file is unusable."""


class PointNotDumped(PointUnavailable):
    """The dump holds nothing for this point."""


@dataclass(frozen=True)
class Source:
    """Where a point's tensor is looked for: a name, and how it was sharded (None: not sharded)."""

    name: str
    concat_dim: int | None = None
    ranks: int | None = None
    note: str | None = None


Rule = tuple[re.Pattern[str], list[Source]]


def _template(point: str) -> re.Pattern[str]:
    return re.compile(re.escape(point).replace(re.escape("{layer}"), r"(?P<layer>\d+)"))


def _sources(path: Path, point: str, value: Any) -> list[Source]:
    where = f"map file {path}, entry {point!r}"
    if isinstance(value, str):
        return [Source(value)]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [Source(v) for v in value]
    if not isinstance(value, dict):
        raise DumpError(f'{where}: a name, a list of names or {{"name", "concat_dim", "ranks"}}, not {value!r}')
    unknown = set(value) - _MAP_KEYS
    if unknown:
        raise DumpError(f"{where}: unknown key {sorted(unknown)[0]!r} (keys: name, concat_dim, ranks)")
    name, dim, ranks = value.get("name"), value.get("concat_dim"), value.get("ranks")
    if not isinstance(name, str):
        raise DumpError(f'{where}: "name" must be the dumped tensor\'s name')
    if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        raise DumpError(f'{where}: "ranks" must be a whole number of ranks, at least 1')
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
        raise DumpError(f'{where}: "concat_dim" must be a dimension (e.g. -1), or null for a replicated tensor')
    if ranks is None and dim is not None:
        raise DumpError(f'{where}: "concat_dim" needs "ranks", the number of pieces to gather')
    return [Source(name, dim, ranks)]


def load_map(path: Path | str | None) -> list[Rule]:
    """The map file's rules, in its order."""
    if path is None:
        return []
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DumpError(f"map file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DumpError(f"map file {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise DumpError(f"map file {path} must be a JSON object of point id -> dumped tensor name")
    rules = []
    for point, value in data.items():
        if not is_point_template(point):
            raise DumpError(f"map file {path}: {point!r} is not a point id ({TEMPLATE_EXAMPLES})")
        rules.append((_template(point), _sources(path, point, value)))
    return rules


def _base(point: Point) -> tuple[str, str]:
    """The point id without its decode step, and the prefix of the step's tensors."""
    prefix = step_prefix(point.step)
    return point.id.removeprefix(prefix), prefix


class DumpDir:
    """Name -> tensor index over a dump directory (or an NxDI capture); tensors are read on demand."""

    def __init__(
        self,
        root: Path | str,
        map_file: Path | str | None = None,
        model_type: str | None = None,
        layout: Layout | None = None,
    ):
        self.root = Path(root)
        if not self.root.is_dir():
            raise DumpError(f"dump directory {self.root} does not exist")
        self.rules = load_map(map_file)
        self.capture: Capture | None = None
        self.unavailable: dict[str, str] = {}  # point template -> why the capture cannot give it
        # name -> rank (None: not sharded) -> (file, safetensors key or None for a .pt file)
        self._index: dict[str, dict[int | None, tuple[Path, str | None]]] = {}
        self.dtypes: dict[str, str] = {}  # name -> dtype, where headers or metadata say it
        self._pt_last: tuple[Path, Any] | None = None  # the last .pt file read (one held at a time)
        self.plugin: PluginCapture | None = None  # a vLLM Neuron plugin capture (`neuron_plugin`)
        if is_capture_dir(self.root):
            self._index_capture(model_type)
        elif layout is not None and is_plugin_capture(self.root):
            self.plugin = PluginCapture(self.root, layout)
            self._index = {name: {None: (self.root, name)} for name in self.plugin.names}
            held = self.plugin.dtypes
            self.dtypes = {n: held[m] for n in self.plugin.names if (m := module_of(n)) in held}
        else:
            self._index_files()
        if not self._index:
            raise DumpError(f"{self.root} holds no .safetensors or .pt files")
        self._pt_dtypes: dict[Path, str | None] = {}  # .pt file -> its first tensor's floating dtype
        for pieces in self._index.values():  # every .pt file opens as tensors, or the run does not start
            for path, key in pieces.values():
                if key is None and self.plugin is None:
                    first = next((t for t in leaves(load_pt(path, mmap=True)) if isinstance(t, torch.Tensor)), None)
                    floating = first is not None and first.is_floating_point()
                    self._pt_dtypes[path] = dtype_name(first.dtype) if floating else None

    def _index_capture(self, model_type: str | None) -> None:
        self.capture = read_capture(self.root)
        for name, path in self.capture.files.items():
            self._index[name] = {None: (path, None)}
        self.dtypes = {k: v.removeprefix("torch.") for k, v in self.capture.dtypes.items()}
        table = load_table(model_type or "")
        if table is None and not self.rules:
            raise DumpError(
                f"{self.root} is an NxDI tensor capture, and there is no NxDI module table for {model_type} "
                f"(tables: {', '.join(available_tables())}); pass a map file of point ids to module names"
            )
        if table is not None:
            notes = {k: table.notes.get(k) for k in table.modules}
            self.rules += [(_template(k), [Source(n, note=notes[k]) for n in v]) for k, v in table.modules.items()]
            self.unavailable = dict(table.unavailable)
        names = [_template(s.name) for _, sources in self.rules for s in sources]
        unknown = sorted(m for m in self.capture.modules if not any(n.fullmatch(m) for n in names))
        if unknown:
            what = f"the {model_type} table" if table is not None else "no NxDI table"
            raise DumpError(
                f"the NxDI capture {self.root} holds modules that neither {what} nor the map file names: "
                f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}; map each to its point in a map "
                '(e.g. {"layer_{layer}.attention": "layers.{layer}.self_attn.o_proj"}) '
                "or leave it out of modules_to_capture"
            )

    def _index_files(self) -> None:
        from safetensors import SafetensorError, safe_open

        files = sorted(p for p in self.root.rglob("*") if p.suffix in TENSOR_SUFFIXES and p.is_file())
        for f in files:
            parts = f.relative_to(self.root).parts
            rank = next((int(m.group(1)) for p in parts[:-1] if (m := _RANK_DIR.match(p))), None)
            if f.suffix == ".safetensors":
                try:
                    with safe_open(str(f), framework="pt") as fh:
                        for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                            self._add(key, rank, f, key)
                            dtype = _SAFETENSORS_FLOATS.get(fh.get_slice(key).get_dtype())
                            if dtype is not None:
                                self.dtypes[key] = dtype
                except (SafetensorError, OSError) as exc:
                    raise DumpError(f"{f} cannot be read as safetensors ({exc})") from None
            else:
                kept = [p for p in parts[:-1] if not _RANK_DIR.match(p)]
                self._add(".".join([*kept, f.stem]), rank, f, None)

    def _add(self, name: str, rank: int | None, path: Path, key: str | None) -> None:
        m = _RANK_SUFFIX.match(name)
        if m and rank is None:
            name, rank = m.group(1), int(m.group(2))
        self._index.setdefault(name, {})[rank] = (path, key)

    @property
    def names(self) -> list[str]:
        return sorted(self._index)

    # -- reading ------------------------------------------------------------------------------
    def _read(self, name: str, rank: int | None = None) -> Any:
        if self.plugin is not None:
            return self.plugin.tensor(name)
        f, key = self._index[name][rank]
        if key is not None:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as fh:
                return fh.get_tensor(key)
        if self._pt_last is None or self._pt_last[0] != f:
            self._pt_last = (f, load_pt(f))
        return self._pt_last[1]

    def has(self, name: str) -> bool:
        return name in self._index

    def read(self, name: str) -> Any:
        """The tensor under `name` (not sharded)."""
        return self._read(name)

    def _whole(self, name: str, source: Source, point: Point) -> tuple[Any, list[str]]:
        """The tensor under `name`, gathered from its ranks when the source says it is sharded."""
        pieces = self._index[name]
        if source.ranks is None:
            if None in pieces:
                return self._read(name), []
            ranks = sorted(r for r in pieces if r is not None)
            raise DumpError(
                f"{point.id}: the dump holds {name} per rank (ranks {ranks[0]}-{ranks[-1]}): say how to gather it in "
                f'the map file, e.g. {{"{point.id}": {{"name": "{name}", "concat_dim": -1, "ranks": {len(ranks)}}}}}'
            )
        missing = [r for r in range(source.ranks) if r not in pieces]
        if missing:
            raise DumpError(
                f"{point.id}: rank {missing[0]} of {source.ranks} of {name} is missing from {self.root} "
                f"(looked for {name}.rank{missing[0]}, or {name} in a rank{missing[0]} directory)"
            )
        values = [self._read(name, r) for r in range(source.ranks)]
        if source.concat_dim is None:  # replicated: every rank must hold the same tensor
            notes = [
                f"rank {r} holds a tensor other than rank 0's under {name}"
                for r, v in enumerate(values[1:], 1)
                if not _same(v, values[0])
            ]
            return values[0], notes
        if isinstance(values[0], torch.Tensor):
            return torch.cat(values, dim=source.concat_dim), []
        return tuple(torch.cat(parts, dim=source.concat_dim) for parts in zip(*values, strict=True)), []

    # -- points ---------------------------------------------------------------------------------
    def sources(self, point: Point) -> list[Source]:
        """Where `point` is looked for, in order."""
        base, prefix = _base(point)
        found: list[Source] = []
        for pattern, sources in self.rules:
            m = pattern.fullmatch(base)
            if m:
                found += [
                    Source(prefix + s.name.format(**m.groupdict()), s.concat_dim, s.ranks, s.note) for s in sources
                ]
        if self.capture is None:
            found += [Source(point.id), Source(prefix + point.module)]
        return found

    def candidates(self, point: Point) -> list[str]:
        return [s.name for s in self.sources(point)]

    def locate(self, point: Point) -> tuple[str, Source] | None:
        """The name the point's output is under (`NAME`, or its parts `NAME.0`, ...), without reading."""
        for source in self.sources(point):
            if source.name in self._index or f"{source.name}.0" in self._index:
                return source.name, source
        return None

    def find(self, point: Point) -> tuple[str, Any, list[str]] | None:
        """The dumped output of `point`, the name it was found under and notes on it, or None."""
        located = self.locate(point)
        if located is None:
            return None
        name, source = located
        notes = [source.note] if source.note else []
        if name in self._index:
            value, more = self._whole(name, source, point)
            return name, value, notes + more
        parts = []
        while f"{name}.{len(parts)}" in self._index:
            value, more = self._whole(f"{name}.{len(parts)}", source, point)
            parts.append(value)
            notes += more
        return name, tuple(parts), notes

    def why_missing(self, point: Point) -> str | None:
        """Why the capture cannot give `point`: NxDI has no module for it (the table says so), or it
        wrote its placeholder for the module (it captured nothing there)."""
        base, _ = _base(point)
        why = next((why for k, why in self.unavailable.items() if _template(k).fullmatch(base)), None)
        if why is None and self.capture is not None:
            held = [self.capture.placeholders[n] for n in self.candidates(point) if n in self.capture.placeholders]
            why = PLACEHOLDER.format(module=held[0]) if held else None
        return why

    def nearest(self, names: list[str], n: int = 3) -> list[str]:
        """The dump's names closest to `names` (for a message)."""
        found: list[str] = []
        for name in names:
            found += [c for c in difflib.get_close_matches(name, self.names, n=n, cutoff=0.4) if c not in found]
        return found[:n]

    def dtype_census(self) -> dict[str, int]:
        """How many dumped tensors are in each floating dtype (from headers and capture metadata)."""
        census: dict[str, int] = {}
        for dtype in self.dtypes.values():
            if dtype in _SAFETENSORS_FLOATS.values():
                census[dtype] = census.get(dtype, 0) + 1
        return census

    def dtype_of(self, name: str) -> str | None:
        """The floating dtype of the tensor under `name` (a `.pt` file's first tensor), from its header,
        the capture's metadata, or what opening the `.pt` file at start showed; None for an integer
        tensor."""
        if name not in self._index:
            name = f"{name}.0"  # the first of a point's several outputs
        if name in self.dtypes:
            return self.dtypes[name]
        path, key = next(iter(self._index[name].values()))
        return self.dtypes.get(key) if key is not None else self._pt_dtypes.get(path)


def load_pt(path: Path, *, mmap: bool = False) -> Any:
    """A `.pt` file's tensor, or tuple or list of tensors, read with `weights_only=True` (memory-mapped
    with `mmap`: nothing but its structure is read). Anything else, or a file torch cannot read that
    way, is one line naming the file: never torch's advice to turn the safety off."""
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on legacy files: the line below says it all
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        if mmap and "mmap" in str(exc):  # a legacy (not zip) file: torch maps zip files only
            return load_pt(path)
        raise DumpError(
            f"{path} cannot be read as tensors: torch.load(weights_only=True) refuses it (a file torch.save did not "
            "write, or one that holds objects other than tensors); save each output with torch.save(tensor or tuple "
            "of tensors, path), or as safetensors"
        ) from None
    if not isinstance(value, torch.Tensor | tuple | list) or not all(
        isinstance(t, torch.Tensor) for t in leaves(value)
    ):
        raise DumpError(
            f"{path} holds a {type(value).__name__}, not a tensor or a tuple of tensors: save each "
            "output as a tensor (torch.save(tensor, path))"
        )
    return value


def _same(a: Any, b: Any) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(la, lb, strict=True)
    )


def fit(
    candidate: torch.Tensor, golden: torch.Size, batch: int, seq: int, left: bool = False
) -> tuple[torch.Tensor, str | None]:
    """The candidate tensor in the golden's shape where only the layout differs: the same elements
    in other dimensions (a flattened batch), or more positions than the golden's `seq` along the
    positions, more rows than its `batch`, or both ([batch, positions, ...] or flattened
    [batch * positions, ...]: NxDI pads the context to its bucket at the end, so the first positions
    are the tokens, and the batch to its compiled size, so the first rows are the prompts'). With
    `left` (a golden whose batch is left-padded, as NxDI's `padding_side="left"` takes prompts
    left-padded to the bucket) the bucket's padding is at the start: the last positions are kept.
    Anything else is left for the verdict's shape check."""
    keep = slice(-seq, None) if left else slice(None, seq)
    if candidate.shape == golden or candidate.dim() == 0 or len(golden) == 0:
        return candidate, None
    shape = list(candidate.shape)
    if candidate.numel() == golden.numel():
        return candidate.reshape(golden), f"reshaped from {shape} to the golden's {list(golden)}"
    if candidate.dim() != len(golden):
        return candidate, None
    if len(golden) > 2 and golden[:2] == (batch, seq) and candidate.shape[2:] == golden[2:]:
        rows, positions = candidate.shape[0], candidate.shape[1]
        if rows >= batch and positions >= seq:  # [batch, positions, ...]
            return candidate[:batch, keep], _padding_left_out(rows, positions, batch, seq, left)
    elif golden[0] == batch * seq and candidate.shape[1:] == golden[1:]:  # [batch * positions, ...] tokens
        n = candidate.shape[0]
        if n % batch == 0 and n // batch >= seq:  # each sequence padded to a bucket
            per = candidate.reshape(batch, n // batch, *candidate.shape[1:])
            return per[:, keep].reshape(golden), _padding_left_out(batch, n // batch, batch, seq, left)
        if n % seq == 0 and n // seq >= batch:  # the batch padded to its compiled size
            return candidate[: batch * seq], _padding_left_out(n // seq, seq, batch, seq)
    return candidate, None


def _padding_left_out(rows: int, positions: int, batch: int, seq: int, left: bool = False) -> str:
    parts = []
    if positions > seq:
        which, padding = ("last", "bucket padding at the start") if left else ("first", "bucket padding")
        parts.append(f"the {which} {seq} of {positions} positions ({padding} left out)")
    if rows > batch:
        parts.append(f"the first {batch} of {rows} rows (the batch's padding rows left out)")
    return "; ".join(parts)
