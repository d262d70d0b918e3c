"""Reading a golden directory: one safetensors file per layer (and per model-level point) plus a
manifest written last. The reader opens only the file of the point it is asked for, checks its
sha256 once, and hands out owned copies of the tensors (no file stays mapped)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..dtypes import SAFETENSORS_DTYPES, dtype_name
from ..errors import GoldenError
from ..points import EXPERTS, Point, describe_layers, describe_steps
from ..tree import map_structure
from .spec import Spec, build, select_tokens

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
FORMAT = "pytest-moe-parity golden"


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class GoldenRecord:
    """One point read back: the golden call's args, kwargs and output. Tensors are tensors;
    parameters and buffers passed as arguments are `ParamRef` placeholders, resolved from the
    candidate (`golden.spec.resolve_params`). `extras` hold reference values for diagnosis only
    (e.g. the golden score-correction bias), never fed to the candidate."""

    point: Point
    args: list[Any]
    kwargs: dict[str, Any]
    output: Any
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.point.id


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """safetensors hands out tensors at any byte offset; CPU GEMM kernels take other code paths
    (other summation orders) for unaligned data, so replaying a misaligned golden input is not
    bitwise. A copy from torch's allocator is 64-byte aligned."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


@dataclass(frozen=True)
class PointFacts:
    """What a point is judged with beside its own record, read from the store at once
    (`GoldenStore.facts`): its router point, the reference's own error in the candidate's dtype and
    its per-token figures, the batch's padding and sequences, the decode position, the prompts, the
    model's config and the golden's dtype."""

    router: Point | None
    noise: dict[str, dict[str, float]] | None
    noise_tokens: dict[str, torch.Tensor] | None
    padding: tuple[list[int], int] | None
    sequences: int
    position: int | None
    prompts: list[str]
    config: dict[str, Any]
    dtype: str


class GoldenStore:
    """Read access to a golden directory, one point (one file) at a time."""

    def __init__(self, root: Path | str, *, verify: bool = True):
        self.root = Path(root)
        self.verify = verify
        self.opened_files: dict[str, None] = {}  # file names in the order first read
        self._verified: set[str] = set()
        self._hashing: dict[str, Future[str]] = {}  # file name -> its sha256, computed ahead (`plan`)
        self._hasher: ThreadPoolExecutor | None = None
        self._safe_paths: dict[str, Path] = {}  # file name -> its checked path (resolved once)
        self._padding: tuple[list[int], int] | None = None  # the batch's padding tokens (see padding)
        self._noise_keys: dict[str, dict[tuple[str, str], list[str]]] = {}  # see noise_tokens
        self.manifest = self._read_manifest()
        self._entries = {p["id"]: p for p in self.manifest["points"]}
        self._points = {pid: self._point(entry) for pid, entry in self._entries.items()}

    def local_model(self) -> tuple[Path, str] | None:
        """The golden's own model on this machine and where it was found, or None. A golden that
        travelled with its model (a bundled demo, a copied directory) names it relative to itself:
        that copy beats whatever sits at the recording machine's path."""
        model = self.manifest["model"]
        relative, recorded = model.get("path_relative"), model.get("path")
        if relative:
            path = (self.root / relative).resolve()
            if path.is_dir():
                return path, "the golden's model, found relative to the golden"
        if recorded and Path(recorded).is_dir():
            return Path(recorded), "the golden's model, at the path it was recorded from"
        return None

    # -- manifest -------------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any]:
        root = self.root
        if root.exists() and not root.is_dir():
            raise GoldenError(
                f"{root} is a file, not a golden directory: pass the directory that holds {MANIFEST} "
                "(recorded by `moe-parity golden`)"
            )
        if not root.is_dir():
            raise GoldenError(f"golden directory {root} does not exist")
        path = root / MANIFEST
        if not path.is_file() and (root / "sweep.json").is_file():  # `moe-parity golden --sweep-lengths`
            lengths = sorted(d.name for d in root.glob("len_*") if d.is_dir())
            raise GoldenError(
                f"{root} is a length sweep, a golden per length ({', '.join(lengths)}): run `moe-parity sweep {root}`, "
                f"or name one length's golden ({root / (lengths[0] if lengths else 'len_N')})"
            )
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
        seen: set[str] = set()
        for p in points:
            if not isinstance(p, dict) or not {"id", "file", "inputs", "output", "tensors"} <= p.keys():
                raise GoldenError(f"{path}: a point entry is malformed: {str(p)[:80]}")
            if p["file"] not in files:
                raise GoldenError(f"{path}: point {p['id']} names file {p['file']!r} absent from 'files'")
            if p["id"] in seen:
                raise GoldenError(
                    f"{path} lists point {p['id']} twice: the manifest was edited or merged; record again"
                )
            seen.add(p["id"])
        return manifest

    def _point(self, entry: dict[str, Any]) -> Point:
        try:
            return Point.from_dict(entry)
        except (ValueError, KeyError, TypeError) as exc:
            raise GoldenError(f"{self.root / MANIFEST}: point {entry.get('id')!r} is malformed ({exc})") from None

    def _safe_path(self, name: str) -> Path:
        if name in self._safe_paths:
            return self._safe_paths[name]
        root = self.root.resolve()
        candidate = (root / name).resolve()
        if os.path.isabs(name) or candidate.parent != root:
            raise GoldenError(
                f"{self.root / MANIFEST} names file {name!r} outside the golden directory; refusing to read it"
            )
        self._safe_paths[name] = candidate
        return candidate

    # -- queries --------------------------------------------------------------------------------
    @property
    def points(self) -> list[Point]:
        """Every point, in forward order."""
        return list(self._points.values())

    @property
    def point_ids(self) -> list[str]:
        return list(self._points)

    @property
    def layers(self) -> list[int]:
        """The decoder layers this golden holds points of."""
        return sorted({p.layer for p in self._points.values() if p.layer is not None})

    @property
    def model_type(self) -> str:
        return self.manifest["model"]["model_type"]

    @property
    def dtype(self) -> str:
        """The dtype the reference ran in."""
        return self.manifest["record"]["dtype"]

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["model"].get("config", {})

    @property
    def decode_steps(self) -> int:
        """How many decode steps were recorded after the prefill (`--decode-steps`)."""
        return int(self.manifest.get("decode", {}).get("steps", 0))

    @property
    def decode_tokens(self) -> list[int] | list[list[int]]:
        """The token fed at each decode step (the reference's greedy choice); a batch's, a token per row."""
        return list(self.manifest.get("decode", {}).get("tokens", []))

    @property
    def recorded_steps(self) -> list[int]:
        """The decode steps whose points were recorded: every step run, or those `--decode-at` asked for
        (the steps between were run for their cache only)."""
        decode = self.manifest.get("decode", {})
        return list(decode.get("recorded", range(1, self.decode_steps + 1)))

    @property
    def prefill_tokens(self) -> int:
        """Tokens per row of the prefill."""
        return int(self.manifest["inputs"]["seq_len"])

    @property
    def sequences(self) -> int:
        """Rows of the golden's batch (1 for a single prompt)."""
        return len(self.manifest["inputs"]["input_ids"])

    @property
    def prompts(self) -> list[str]:
        """Each prompt row's preview (`--prompts`); empty for a golden of one prompt."""
        return list(self.manifest["inputs"].get("prompts", []))

    @property
    def padded(self) -> bool:
        """Whether the batch holds padding (`--prompts` rows of unequal length, `--pad-to`, `--batch-size`)."""
        mask = self.manifest["inputs"].get("attention_mask")
        return bool(mask) and any(0 in row for row in mask)

    def padding(self, point: Point | str) -> tuple[list[int], int] | None:
        """The padding tokens of a point's tensors (as token indices over the batch's rows, row-major)
        and how many tokens they have: (padding, tokens); None where the point has no padding. A decode
        step feeds a token per row: its padding is the rows of padding only, and the rows that finished
        before it (fed padding since their end of sequence)."""
        step = self.point(point).step
        if step is not None:  # a token per row
            masks = self.manifest["inputs"].get("attention_mask") or []
            empty = [i for i, row in enumerate(masks) if not any(row)]
            finished = self.manifest.get("decode", {}).get("finished", {})
            empty += [int(r) for r, at in finished.items() if at < step and int(r) not in empty]
            return (sorted(empty), self.sequences) if empty else None
        if not self.padded:
            return None
        if self._padding is None:  # the same for every prefill point: worked out once
            kept = self.captured_tokens  # (over the positions a --capture-tokens golden keeps)
            rows = self.manifest["inputs"]["attention_mask"]
            flat = [row[p] for row in rows for p in kept] if kept is not None else [m for row in rows for m in row]
            self._padding = ([i for i, m in enumerate(flat) if not m], len(flat))
        return self._padding

    @functools.cached_property
    def captured_tokens(self) -> list[int] | None:
        """`--capture-tokens`: the token positions whose outputs the golden keeps (none of the points'
        inputs: it is judged chained); None where it keeps every token and every input. Read once:
        every prefill point's verdict asks."""
        entry = self.manifest.get("capture_tokens")
        return list(entry["positions"]) if entry else None

    def describe_captured(self) -> str:
        """`tokens 0-3, 60-63 of 64`, or "" for a golden that keeps every token."""
        kept = self.captured_tokens
        return f"tokens {describe_layers(kept)} of {self.prefill_tokens}" if kept is not None else ""

    def keep_tokens(self, point: Point | str, output: Any) -> Any:
        """A candidate's output of a prefill point at the token positions the golden keeps (as it is
        for a golden that keeps every token, and for a decode step)."""
        kept = self.captured_tokens
        if kept is None or output is None or self.point(point).step is not None:
            return output
        return map_structure(output, lambda t: select_tokens(t, self.sequences, self.prefill_tokens, kept))

    def describe_steps(self) -> str:
        """The decode steps recorded, in words with their positions ("" for a golden without any)."""
        steps = self.recorded_steps
        return describe_steps(steps, self.decode_steps, self.prefill_tokens) if steps else ""

    def quantization_line(self) -> str | None:
        """A quantized reference: its layout and how its matmuls ran, in words (None: unquantized)."""
        q = self.manifest.get("quantization")
        if not q:
            return None
        parts = [q["scheme"], *([f"activations {q['activations']}"] if q.get("activations") else [])]
        parts += ["KV-cache scales"] if q.get("kv_cache") else []
        default = ", the default" if q["reference"] == "dequant" else ""
        return (
            f"golden quantized: {q['method']} ({', '.join(parts)}): the reference ran {q['matmuls']} "
            f"(--reference-quant {q['reference']}{default})"
        )

    def position(self, point: Point | str) -> int | None:
        """The absolute position of the token a decode step's point computes (None for the prefill's)."""
        step = self.point(point).step
        return None if step is None else self.prefill_tokens + step - 1

    @property
    def fingerprint(self) -> str:
        """What this golden recorded, in 16 hex digits: its points, its inputs and what its tensors hold
        (each file's content digest: names, dtypes, shapes and data, not the file's bytes), so a golden
        recorded again from the same model and inputs keeps it, and so does a copy. Two reports are
        comparable when their goldens share it. A golden written before content digests: its files'
        sha256s."""
        files = self.manifest["files"]
        if all("content" in f for f in files.values()):
            text = "\n".join(
                [
                    *(f"{name}:{files[name]['content']}" for name in sorted(files)),
                    ",".join(self._entries),
                    json.dumps(self.manifest.get("inputs", {}).get("input_ids")),
                    json.dumps(self.decode_tokens),
                ]
            )
        else:
            text = "\n".join(f"{name}:{files[name].get('sha256', '')}" for name in sorted(files))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def point(self, pid: str | Point) -> Point:
        if isinstance(pid, Point):
            return pid
        try:
            return self._points[pid]
        except KeyError:
            raise GoldenError(f"no point {pid!r} in {self.root / MANIFEST}") from None

    def entry(self, pid: str | Point) -> dict[str, Any]:
        """The manifest entry of a point: its recorded call structure, tensors, file."""
        return self._entries[self.point(pid).id]

    @property
    def noise_dtypes(self) -> list[str]:
        """The dtypes the reference's own error was recorded in (`--noise-dtype`)."""
        return sorted(self.manifest.get("noise", {}))

    def _noise(self, dtype: torch.dtype | str, figures: str) -> dict[str, Any]:
        """Point id -> the reference's own figures in `dtype` of the set `figures` ("isolated", "chain",
        "free", "batch"; {} if not recorded)."""
        return self.manifest.get("noise", {}).get(dtype_name(dtype), {}).get(figures) or {}

    def noise(self, dtype: torch.dtype | str, figures: str, pid: str) -> dict[str, dict[str, float]] | None:
        """The reference's own error at a point when run in `dtype`, in the set `figures` (isolated,
        chained, ...): per compared tensor, its figures (rel_l2, max_token_rel_l2); None where not recorded."""
        return self._noise(dtype, figures).get(pid)

    def noise_tokens(self, dtype: torch.dtype | str, figures: str, pid: str) -> dict[str, torch.Tensor]:
        """The reference's own squared error per token at a point in `dtype`, per compared tensor (NaN:
        a token its run left out); {} for a golden recorded before these were kept."""
        entry = self.manifest.get("noise", {}).get(dtype_name(dtype), {}).get("tokens")
        if not entry:
            return {}
        name = entry["file"]
        if name not in self._verified:
            path = self._safe_path(name)
            if not path.is_file():
                raise GoldenError(f"{path} is missing from the golden directory (the noise floor's per-token errors)")
            if self.verify and sha256_file(path) != entry.get("sha256"):
                raise GoldenError(f"{path} does not match its sha256 in the manifest; record the noise floor again")
            self._verified.add(name)
        try:
            with safe_open(str(self._safe_path(name)), framework="pt") as fh:
                if name not in self._noise_keys:  # (figures, point) -> its keys, indexed once
                    index: dict[tuple[str, str], list[str]] = {}
                    for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                        m, p, _ = key.split("/", 2)
                        index.setdefault((m, p), []).append(key)
                    self._noise_keys[name] = index
                keys = self._noise_keys[name].get((figures, pid), [])
                return {k.split("/", 2)[2]: fh.get_tensor(k) for k in keys}
        except (SafetensorError, OSError, ValueError) as exc:
            raise GoldenError(f"{self._safe_path(name)} cannot be read as safetensors ({exc})") from None

    def has_noise(self, dtype: torch.dtype | str, figures: str) -> bool:
        return bool(self._noise(dtype, figures))

    def unsteered_noise(self, dtype: torch.dtype | str) -> str:
        """Which of the reference's chained runs an unsteered chain (a dump) is read against: its free
        run where recorded (`"free"`), else the steered one (goldens recorded before the free run)."""
        return "free" if self.has_noise(dtype, "free") else "chain"

    def facts(self, point: Point, dtype: torch.dtype, figures: str) -> PointFacts:
        """Everything `point` is judged with beside its record, in one value (the noise figures of
        `figures`, "isolated", "chain" or "free", in `dtype`)."""
        noise = self.noise(dtype, figures, point.id)
        tokens = self.noise_tokens(dtype, figures, point.id) if noise is not None else None
        return PointFacts(
            self.router_of(point), noise, tokens, self.padding(point), self.sequences, self.position(point),
            self.prompts, self.config, self.dtype,
        )  # fmt: skip

    def router_of(self, point: Point) -> Point | None:
        """The router whose routing a point follows (`moe`, `output`, `experts`); None for dense
        layers and for points that follow no router."""
        rid = point.router_id
        return self._points.get(rid) if rid is not None else None

    def experts_of(self, router: Point) -> Point | None:
        """The experts point of a router's layer (None where the golden has none)."""
        return self._points.get(f"{router.id.rpartition('.')[0]}.{EXPERTS}")

    def call_values(self, pid: str | Point) -> dict[int | str, str]:
        """The strings a point's recorded call passed at its top level, by position or keyword: what
        tells apart the calls of a module called more than once per forward to do other things (a
        layer type: `model.calls.OutputCapture`). Flags such as `use_cache`, which a chained run may
        pass otherwise than the recording, are left out."""
        inputs = self.entry(pid)["inputs"]

        def text(spec: dict[str, Any]) -> bool:
            return spec.get("t") == "value" and isinstance(spec.get("value"), str)

        out: dict[int | str, str] = {i: s["value"] for i, s in enumerate(inputs["args"]) if text(s)}
        out.update({k: s["value"] for k, s in inputs["kwargs"].items() if text(s)})
        return out

    def verify_all(self) -> None:
        """Check every file against its sha256 (reading normally checks a file on first use), and every
        tensor the manifest lists against its file's header: there, in the dtype and shape it says."""
        for name in self.manifest["files"]:
            self._check_file(name, force=True)
        for pid, entry in self._entries.items():
            path = self._safe_path(entry["file"])
            try:
                with safe_open(str(path), framework="pt") as fh:
                    available = set(fh.keys())
                    for key, spec in entry["tensors"].items():
                        if key not in available:
                            raise GoldenError(f"{path} lacks tensor {key!r} listed in the manifest")
                        piece = fh.get_slice(key)
                        dtype = SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                        self._check_spec(pid, key, spec, dtype, list(piece.get_shape()))
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise GoldenError(f"{path} cannot be read as safetensors ({exc})") from None

    def _check_spec(self, pid: str, key: str, spec: dict[str, Any], dtype: str, shape: list[int]) -> None:
        """A tensor as its file holds it against what the manifest says of it."""
        said = (spec.get("dtype"), list(spec.get("shape", [])))
        if said != (dtype, shape):
            raise GoldenError(
                f"{self.root / MANIFEST}: {pid}'s tensor {key} is {dtype} {shape} in its file, "
                f"but the manifest says {said[0]} {said[1]}: the golden was edited after recording; record it again"
            )

    def _check_file(self, name: str, *, force: bool = False) -> Path:
        path = self._safe_path(name)
        if not path.is_file():
            raise GoldenError(f"{path} is missing from the golden directory")
        if (self.verify or force) and name not in self._verified:
            expected = self.manifest["files"][name].get("sha256")
            actual = self._sha256(name, path)
            if actual != expected:
                raise GoldenError(
                    f"{path} does not match its sha256 in the manifest (corrupted, truncated or replaced); "
                    "record the golden again"
                )
            self._verified.add(name)
        return path

    def _sha256(self, name: str, path: Path) -> str:
        """The file's sha256: computed ahead by `plan` where it was (waited for where it is under way),
        else here."""
        future = self._hashing.pop(name, None)
        if future is not None and not future.cancel():  # under way or done: its result
            try:
                return future.result()
            except OSError:
                pass  # said by the read here
        return sha256_file(path)

    def plan(self, points: Iterable[str | Point]) -> None:
        """The points a run will read, in order: their files' sha256s are computed ahead, one file after
        another in a background thread (reading and hashing release the GIL), so that a point's first
        read finds its file checked, and in the page cache. Nothing changes in what is checked or when
        a mismatch is said: at the first read of the file (`_check_file`)."""
        if not self.verify:
            return
        entries = (self._entries.get(p.id if isinstance(p, Point) else p) for p in points)
        for name in dict.fromkeys(e["file"] for e in entries if e is not None):
            if name in self._verified or name in self._hashing or name not in self.manifest["files"]:
                continue
            try:
                path = self._safe_path(name)
            except GoldenError:
                continue  # said at its first read
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="golden-sha256")
            self._hashing[name] = self._hasher.submit(sha256_file, path)

    def close(self) -> None:
        """Stop computing sha256s ahead (`plan`); a later read checks its file itself."""
        if self._hasher is not None:
            self._hasher.shutdown(wait=False, cancel_futures=True)
            self._hasher = None
        self._hashing.clear()

    def tensors(self, pid: str | Point) -> dict[str, torch.Tensor]:
        """The tensors of one point, read from its own file only."""
        entry = self.entry(pid)
        path = self._check_file(entry["file"])
        self.opened_files[entry["file"]] = None
        out: dict[str, torch.Tensor] = {}
        try:
            with safe_open(str(path), framework="pt") as fh:
                available = set(fh.keys())
                for key in entry["tensors"]:
                    if key not in available:
                        raise GoldenError(f"{path} lacks tensor {key!r} listed in the manifest")
                    out[key] = _aligned(fh.get_tensor(key))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise GoldenError(f"{path} cannot be read as safetensors ({exc})") from None
        for key, spec in entry["tensors"].items():
            t = out[key]
            self._check_spec(entry["id"], key, spec, dtype_name(t.dtype), list(t.shape))
        return out

    def load(
        self,
        pid: str | Point,
        *,
        chained: Callable[[Spec], torch.Tensor | None] | None = None,
        row_masks: bool = False,
    ) -> GoldenRecord:
        """A point's recorded call. With `chained`, an input recorded as an earlier point's output
        is `chained(origin)` where that gives a tensor (see `spec.build`). With `row_masks`, a causal
        mask comes as a `spec.CausalRows`, made a block of query rows at a time, not whole."""
        point = self.point(pid)
        entry = self._entries[point.id]
        tensors = self.tensors(point)
        padding = self.manifest.get("inputs", {}).get("attention_mask")  # a causal mask is made again over it
        args = [build(s, tensors, chained, padding, row_masks) for s in entry["inputs"]["args"]]
        kwargs = {k: build(s, tensors, chained, padding, row_masks) for k, s in entry["inputs"]["kwargs"].items()}
        extras = {name: tensors[key] for name, key in entry.get("extras", {}).items()}
        return GoldenRecord(point, args, kwargs, build(entry["output"], tensors), extras)
