"""`moe-parity audit`: a checkpoint's dtypes and memory from its safetensors headers alone (no tensor
data is read): a census per tensor class, every tensor in an unexpected dtype with its name and
bytes, the bytes of each decoder layer, and the memory of fusing each layer's experts into the
`[E, H, 2I]` / `[E, I, H]` layout Neuron and NxDI ports use.

Fusing a layer holds its expert tensors as stored and the fused pair (the same number of elements,
in the dtype the fusion writes): peak per layer = stored expert bytes + fused bytes. A conversion
that keeps every converted layer (NxDI's `convert_hf_to_neuron_state_dict` returns the whole state
dict) peaks at the checkpoint's bytes + every layer's fused bytes. Both are given in the
checkpoint's dtype and as if the fusion were promoted to float32 (the 1 TB surprise of a 400 GB
checkpoint)."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
         "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip
NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
         "F8_E5M2": "float8_e5m2"}  # fmt: skip
FLOATS = set(NAMES)
CLASSES = ("embedding", "attention", "router", "experts", "shared_experts", "mlp", "norms", "lm_head", "other")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.")
# Kept in float32 by the reference implementation itself (transformers' _keep_in_fp32_modules).
_FLOAT32_BY_DESIGN = re.compile(r"e_score_correction_bias")


def tensor_class(name: str) -> str:
    """Which part of an MoE model a checkpoint tensor belongs to."""
    n = name.lower()
    if re.search(r"embed_tokens|(^|\.)wte\.|word_embeddings", n):
        return "embedding"
    if re.search(r"(^|\.)lm_head\.|(^|\.)output\.weight$", n):
        return "lm_head"
    if re.search(r"norm", n):
        return "norms"
    if "shared_expert" in n:
        return "shared_experts"
    if _EXPERT.search(n):
        return "experts"
    if re.search(r"\.(gate|router)(\.|$)|e_score_correction_bias|\.router\.", n):
        return "router"
    if re.search(r"self_attn|attention|\.attn\.", n):
        return "attention"
    if re.search(r"\.mlp\.|feed_forward", n):
        return "mlp"
    return "other"


@dataclass
class Tensor:
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


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (its first 8 + N bytes only), checked against the file's size."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise BadInput(f"{path} is not a safetensors file (shorter than its header)")
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length > size - 8:
                raise BadInput(f"{path} is not a safetensors file (its header runs past the end)")
            header = json.loads(fh.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path} cannot be read as safetensors ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise BadInput(f"{path} is truncated: its header describes {8 + length + end} bytes, the file has {size}")
    return header


def read_tensors(model_dir: Path) -> list[Tensor]:
    """Every tensor of a checkpoint directory (single file or sharded with an index), from headers."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInput(f"--model {model_dir} is not a directory")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BadInput(f"{index} is not a safetensors index ({exc})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise BadInput(f"{index} names {missing[0]}, which is not in {model_dir}")
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise BadInput(f"{model_dir} holds no .safetensors files; the audit reads safetensors checkpoints")
    tensors = []
    for file in files:
        for name, entry in read_header(model_dir / file).items():
            if name != "__metadata__":
                tensors.append(Tensor(name, entry["dtype"], list(entry["shape"]), file))
    return tensors


@dataclass
class Audit:
    expected: str  # the expected dtype (safetensors spelling)
    expected_from: str
    census: dict[str, dict[str, dict[str, int]]]  # class -> dtype -> {"tensors", "bytes"}
    findings: list[dict[str, Any]]  # tensors in an unexpected dtype
    by_design: list[dict[str, Any]]  # float32 where the reference keeps it so
    layers: dict[int, dict[str, int]]  # layer -> bytes, expert bytes, expert elements
    total_bytes: int
    fusion: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "expected_dtype": NAMES.get(self.expected, self.expected),
            "expected_from": self.expected_from,
            "census": {c: {NAMES.get(d, d): v for d, v in ds.items()} for c, ds in self.census.items()},
            "findings": self.findings,
            "float32_by_design": self.by_design,
            "layers": {str(k): v for k, v in self.layers.items()},
            "total_bytes": self.total_bytes,
            "fusion": self.fusion,
        }


def _spelling(dtype: str) -> str:
    """`bfloat16`, `torch.bfloat16` or `BF16` -> `BF16`."""
    bare = dtype.removeprefix("torch.")
    for code, name in NAMES.items():
        if bare in (code, name):
            return code
    raise BadInput(f"--expect-dtype {dtype!r} is not a floating-point dtype (e.g. bfloat16)")


def audit(model_dir: Path | str, expect_dtype: str | None = None) -> Audit:
    model_dir = Path(model_dir)
    tensors = read_tensors(model_dir)
    floats = [t for t in tensors if t.dtype in FLOATS]
    if expect_dtype is not None:
        expected, source = _spelling(expect_dtype), "--expect-dtype"
    else:
        config = model_dir / "config.json"
        declared = None
        if config.is_file():
            try:
                data = json.loads(config.read_text())
                declared = data.get("torch_dtype") or data.get("dtype")
            except json.JSONDecodeError:
                declared = None
        if isinstance(declared, str) and declared.removeprefix("torch.") in NAMES.values():
            expected, source = _spelling(declared), "config.json"
        else:
            by_bytes: dict[str, int] = {}
            for t in floats:
                by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.bytes
            expected, source = max(by_bytes, key=by_bytes.get, default="BF16"), "the most bytes"
    census: dict[str, dict[str, dict[str, int]]] = {c: {} for c in CLASSES}
    findings, by_design = [], []
    layers: dict[int, dict[str, int]] = {}
    for t in tensors:
        cls = tensor_class(t.name)
        slot = census[cls].setdefault(t.dtype, {"tensors": 0, "bytes": 0})
        slot["tensors"] += 1
        slot["bytes"] += t.bytes
        m = _LAYER.search(t.name)
        if m:
            layer = layers.setdefault(int(m.group(1)), {"bytes": 0, "expert_bytes": 0, "expert_elements": 0})
            layer["bytes"] += t.bytes
            if cls == "experts":
                layer["expert_bytes"] += t.bytes
                layer["expert_elements"] += t.numel
        if t.dtype in FLOATS and t.dtype != expected:
            row = {"name": t.name, "dtype": NAMES[t.dtype], "bytes": t.bytes, "class": cls, "file": t.file}
            (by_design if t.dtype == "F32" and _FLOAT32_BY_DESIGN.search(t.name) else findings).append(row)
    census = {c: v for c, v in census.items() if v}
    total = sum(t.bytes for t in tensors)
    result = Audit(expected, source, census, findings, by_design, dict(sorted(layers.items())), total)
    result.fusion = fusion_memory(result.layers, expected, total)
    return result


def fusion_memory(layers: dict[int, dict[str, int]], dtype: str, total: int) -> dict[str, Any]:
    """Peak memory of fusing the experts, in the checkpoint's dtype and promoted to float32."""
    out: dict[str, Any] = {}
    for name, size in ((NAMES.get(dtype, dtype), SIZES.get(dtype, 2)), ("float32", 4)):
        per_layer = {str(k): v["expert_bytes"] + v["expert_elements"] * size for k, v in layers.items()}
        fused = sum(v["expert_elements"] * size for v in layers.values())
        out[name] = {
            "per_layer_peak_bytes": per_layer,
            "largest_layer_peak_bytes": max(per_layer.values(), default=0),
            "model_peak_bytes": total + fused,  # every converted layer kept, as NxDI's conversion does
        }
    return out


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def text_lines(result: Audit, model_dir: Path) -> list[str]:
    lines = [
        f"moe-parity audit: {model_dir}: {gib(result.total_bytes)} in {len(result.layers)} decoder layers; "
        f"expected dtype {NAMES.get(result.expected, result.expected)} (from {result.expected_from})"
    ]
    lines.append(f"{'class':<16}{'dtype':<12}{'tensors':>9}{'bytes':>14}")
    for cls, dtypes in result.census.items():
        for dtype, v in sorted(dtypes.items()):
            lines.append(f"{cls:<16}{NAMES.get(dtype, dtype.lower()):<12}{v['tensors']:>9}{gib(v['bytes']):>14}")
    if result.layers:
        sizes = [v["bytes"] for v in result.layers.values()]
        lines.append(f"per layer: {gib(min(sizes))} to {gib(max(sizes))}")
    for dtype, f in result.fusion.items():
        if result.layers and any(v["expert_elements"] for v in result.layers.values()):
            lines.append(
                f"fusing the experts into [E, H, 2I] / [E, I, H] in {dtype}: peak {gib(f['largest_layer_peak_bytes'])} "
                f"per layer; {gib(f['model_peak_bytes'])} for the model if every converted layer is kept"
            )
    for row in result.by_design:
        lines.append(f"float32 by design: {row['name']} ({gib(row['bytes'])})")
    if result.findings:
        total = sum(r["bytes"] for r in result.findings)
        lines.append(f"{len(result.findings)} tensors are not {NAMES.get(result.expected)} ({gib(total)}):")
        lines += [f"  {r['name']}: {r['dtype']}, {gib(r['bytes'])} ({r['class']})" for r in result.findings]
    else:
        lines.append("every tensor is in the expected dtype")
    return lines
