"""`moe-parity audit`: a checkpoint's dtypes and memory from its safetensors headers alone (no tensor
data is read): a census per tensor class, every tensor in an unexpected dtype with its name and
bytes, the bytes of each decoder layer, and the memory of fusing each layer's experts into the
`[E, H, 2I]` / `[E, I, H]` layout Neuron and NxDI ports use.

Fusing a layer holds its expert tensors as stored and the fused pair (the same number of elements,
in the dtype the fusion writes): peak per layer = stored expert bytes + fused bytes. A conversion
that keeps every converted layer (NxDI's `convert_hf_to_neuron_state_dict` returns the whole state
dict) peaks at the checkpoint's bytes + every layer's fused bytes. Both are given in the
checkpoint's dtype and as if the fusion were promoted to float32 (the 1 TB surprise of a 400 GB
checkpoint).

A quantized checkpoint (`model.quant.layout` of its config: fp8, compressed-tensors, mxfp4) is read
as its layout says: its quantized weights (e4m3 / int8 weights, MXFP4 `_blocks`) and their scales
are what the layout stores, not a dtype finding; the audit gives its layout, the quantized tensors by
class and the tensors that stay unquantized, names every projection left unquantized that the
config does not leave so (its `ignore` / `modules_to_not_convert`), and the memory of converting it
to bfloat16 one decoder layer at a time (`moe-parity dequantize`: a layer's stored bytes + its
bf16 bytes) and all at once (the checkpoint + every bf16 byte). A checkpoint the layout cannot read
(a quantized weight without its scale, a scale of the wrong shape, a `weight_block_size` the scales
do not fit) is bad input, one sentence naming the tensor: no command could read it."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dtypes import SAFETENSORS_FLOATS
from ..errors import BadInput, CheckpointError
from ..host import gib
from ..model.attention import DEFAULT_BUDGET_MIB, budget_bytes, score_bytes
from ..model.checkpoint import SIZES, Tensor, read_config, read_tensors
from ..model.quant import ACT_SCALE, KV_SCALE, MX_GROUP, QUANTIZED_CODES, Dequantizer, Layout, layout
from ..model.quant_check import tensor_problems
from ..points import layer_group
from ..words import counted

NAMES = SAFETENSORS_FLOATS
FLOATS = set(NAMES)
CLASSES = (
    "embedding",
    "attention",
    "router",
    "experts",
    "shared_experts",
    "mlp",
    "norms",
    "lm_head",
    "scales",
    "other",
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.")
# Kept in float32 by the reference implementation itself (transformers' _keep_in_fp32_modules).
_FLOAT32_BY_DESIGN = re.compile(r"e_score_correction_bias")


# The first pattern that matches a tensor's name gives its class (norms before attention: q_norm).
_CLASS_PATTERNS = [
    ("embedding", re.compile(r"embed_tokens|(^|\.)wte\.|word_embeddings")),
    ("lm_head", re.compile(r"(^|\.)lm_head\.|(^|\.)output\.weight$")),
    ("norms", re.compile(r"norm")),
    ("shared_experts", re.compile(r"shared_expert")),
    ("experts", _EXPERT),
    ("router", re.compile(r"\.(gate|router)(\.|$)|e_score_correction_bias")),
    ("attention", re.compile(r"self_attn|attention|\.attn\.")),
    ("mlp", re.compile(r"\.mlp\.|feed_forward")),
]


def tensor_class(name: str) -> str:
    """Which part of an MoE model a checkpoint tensor belongs to."""
    n = name.lower()
    return next((cls for cls, pattern in _CLASS_PATTERNS if pattern.search(n)), "other")


def checkpoint_tensors(model_dir: Path) -> list[Tensor]:
    """Every tensor of the checkpoint the user named, from its headers; BadInput when it cannot be read."""
    try:
        return read_tensors(model_dir)
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None


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
    quantization: dict[str, Any] | None = None  # a quantized checkpoint's layout, classes and conversion

    @property
    def failed(self) -> bool:
        """A tensor in an unexpected dtype, or a projection left unquantized that the config does not say."""
        return bool(self.findings or (self.quantization or {}).get("unexpected_unquantized"))

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
            "quantization": self.quantization,
        }


def _spelling(dtype: str) -> str:
    """`bfloat16`, `torch.bfloat16` or `BF16` -> `BF16`."""
    bare = dtype.removeprefix("torch.")
    for code, name in NAMES.items():
        if bare in (code, name):
            return code
    raise BadInput(f"--expect-dtype {dtype!r} is not a floating-point dtype (e.g. bfloat16)")


def _expected_dtype(model_dir: Path, tensors: list[Tensor], expect_dtype: str | None) -> tuple[str, str]:
    """The dtype every (unquantized) tensor should have and where that comes from."""
    if expect_dtype is not None:
        return _spelling(expect_dtype), "--expect-dtype"
    try:
        data = read_config(model_dir)
        declared = data.get("torch_dtype") or data.get("dtype")
    except CheckpointError:  # none, or not JSON: the dtype holding the most bytes
        declared = None
    if isinstance(declared, str) and declared.removeprefix("torch.") in NAMES.values():
        return _spelling(declared), "config.json"
    by_bytes: dict[str, int] = {}
    for t in tensors:
        if t.dtype in FLOATS:
            by_bytes[t.dtype] = by_bytes.get(t.dtype, 0) + t.bytes
    return max(by_bytes, key=by_bytes.get, default="BF16"), "the most bytes"


def audit(model_dir: Path | str, expect_dtype: str | None = None) -> Audit:
    model_dir = Path(model_dir)
    tensors = checkpoint_tensors(model_dir)
    expected, source = _expected_dtype(model_dir, tensors, expect_dtype)
    view = quantized_view(model_dir, tensors)
    census: dict[str, dict[str, dict[str, int]]] = {c: {} for c in CLASSES}
    findings, by_design = [], []
    layers: dict[int, dict[str, int]] = {}
    for t in tensors:
        role = view.role(t) if view else "plain"
        cls = "scales" if role in SCALE_ROLES else tensor_class(t.name)
        slot = census[cls].setdefault(t.dtype, {"tensors": 0, "bytes": 0})
        slot["tensors"] += 1
        slot["bytes"] += t.bytes
        m = _LAYER.search(t.name)
        if m:
            layer = layers.setdefault(int(m.group(1)), {"bytes": 0, "expert_bytes": 0, "expert_elements": 0})
            layer["bytes"] += t.bytes
            if cls == "experts":
                layer["expert_bytes"] += t.bytes
                layer["expert_elements"] += view.elements(t, role) if view else t.numel
        if role == "plain" and t.dtype in FLOATS and t.dtype != expected:
            row = {"name": t.name, "dtype": NAMES[t.dtype], "bytes": t.bytes, "class": cls, "file": t.file}
            (by_design if t.dtype == "F32" and _FLOAT32_BY_DESIGN.search(t.name) else findings).append(row)
    census = {c: v for c, v in census.items() if v}
    total = sum(t.bytes for t in tensors)
    result = Audit(expected, source, census, findings, by_design, dict(sorted(layers.items())), total)
    result.fusion = fusion_memory(result.layers, expected, total)
    if view is not None:
        result.quantization = view.section()
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


# -- quantized checkpoints ----------------------------------------------------------------------------
SCALE_ROLES = ("scale", "kv_scale", "activation_scale")  # the census's class `scales`
PROJECTIONS = ("attention", "experts", "shared_experts", "mlp")  # the classes a layout quantizes
IGNORE_KEYS = ("modules_to_not_convert", "ignore", "ignored_layers")  # a config's modules left unquantized
CONVERTED = "BF16"  # what a conversion writes the dequantized weights in (`moe-parity dequantize`'s default)
MODEL_UNIT = "model"  # the tensors outside the decoder layers, converted as one unit


def checkpoint_layout(model_dir: Path, config: dict[str, Any] | None = None) -> Layout | None:
    """The quantized layout a checkpoint's config.json declares (None: unquantized, or no config);
    BadInput, one sentence, for a method or format that cannot be read."""
    if config is None:
        try:
            config = read_config(model_dir)
        except CheckpointError:
            return None
    try:
        return layout(config, str(model_dir))
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None


def quantized_view(model_dir: Path, tensors: list[Tensor], config: dict[str, Any] | None = None) -> QuantView | None:
    """The checkpoint's tensors as its quantized layout reads them (None: unquantized), checked:
    BadInput naming the tensor where the layout cannot read them."""
    quant = checkpoint_layout(model_dir, config)
    if quant is None:
        return None
    if config is None:
        config = read_config(model_dir)
    view = QuantView(quant, tensors, str(model_dir), _ignored_patterns(config))
    problems = view.problems()
    if problems:
        more = f" ({len(problems) - 1} more such problems)" if len(problems) > 1 else ""
        raise BadInput(problems[0] + more)
    return view


def _ignored_patterns(config: dict[str, Any]) -> list[str]:
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return []
    return [str(p) for key in IGNORE_KEYS for p in (q.get(key) or [])]


def conversion_unit(name: str) -> str:
    """The unit a conversion reads a checkpoint key in: its decoder layer (`layer_N`), else `model`."""
    m = _LAYER.search(name)
    return layer_group(int(m.group(1))) if m else MODEL_UNIT


class QuantView:
    """A quantized checkpoint's tensors as its layout reads them, from the headers alone: each one's
    role (`quantized`: an e4m3 / int8 weight or MXFP4 `_blocks`; `scale`: a weight's scale or zero
    point; `kv_scale`, `activation_scale`: kept aside; `plain`: stored unquantized) and the
    elements it gives the model once dequantized."""

    def __init__(self, quant: Layout, tensors: list[Tensor], where: str, ignored: list[str] | None = None):
        self.layout, self.tensors, self.where = quant, tensors, where
        self.dequantizer = Dequantizer(quant, where)
        self.by_name = {t.name: t for t in tensors}
        self.ignored = ignored or []

    def role(self, t: Tensor) -> str:
        if KV_SCALE.search(t.name):
            return "kv_scale"
        if ACT_SCALE.search(t.name):
            return "activation_scale"
        if self.layout.bits == "mxfp4":
            return {"_blocks": "quantized", "_scales": "scale"}.get(t.name[-7:], "plain")
        if self.dequantizer.companion(t.name) is not None:
            return "scale"
        return "quantized" if t.dtype in QUANTIZED_CODES else "plain"

    def elements(self, t: Tensor, role: str | None = None) -> int:
        """The elements the tensor gives the model (scales none; MXFP4 `_blocks` two a byte)."""
        role = role or self.role(t)
        if role == "quantized":
            return t.numel * 2 if self.layout.bits == "mxfp4" else t.numel
        return t.numel if role == "plain" else 0

    def converted_bytes(self, t: Tensor, size: int = SIZES[CONVERTED]) -> int:
        """Its bytes in an unquantized copy: dequantized weights `size` bytes an element, unquantized
        tensors as stored, scales gone (`moe-parity dequantize` writes exactly these)."""
        role = self.role(t)
        return self.elements(t, role) * size if role == "quantized" else (t.bytes if role == "plain" else 0)

    def run_bytes(self, t: Tensor, size: int) -> int:
        """Its bytes as a run in a `size`-byte dtype holds it (LazyModel: dequantized, floats cast)."""
        role = self.role(t)
        if role == "plain" and t.dtype not in FLOATS:
            return t.bytes
        return self.elements(t, role) * size

    def problems(self) -> list[str]:
        """One sentence per tensor the layout cannot read, naming it (`model.quant_check`)."""
        return tensor_problems(self.tensors, self.layout, self.where)

    # -- the audit's section ------------------------------------------------------------------------
    def ignored_by_config(self, name: str) -> bool:
        """Whether the config leaves the tensor's module unquantized (`ignore`, `modules_to_not_convert`:
        names, globs, compressed-tensors' `re:` patterns, or parts of a name as transformers matches them)."""
        module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module) or re.match(pattern[3:], name):
                    return True
            elif f".{pattern}." in f".{module}." or any(
                fnmatch.fnmatchcase(module, p) for p in (pattern, pattern + ".*")
            ):
                return True
        return False

    def unexpected(self, t: Tensor, role: str, cls: str) -> bool:
        """A projection's weight of a decoder layer stored unquantized that the config does not leave so."""
        last = t.name.rsplit(".", 1)[-1]
        return (
            role == "plain"
            and cls in PROJECTIONS
            and _LAYER.search(t.name) is not None
            and t.dtype in FLOATS
            and len(t.shape) >= 2
            and "bias" not in last
            and not self.ignored_by_config(t.name)
        )

    def section(self) -> dict[str, Any]:
        """The audit's `quantization`: the layout, the quantized tensors and the unquantized ones by
        class, the scales, every projection left unquantized unexpectedly, and the conversion's memory."""
        quantized: dict[str, dict[str, int]] = {}
        unquantized: dict[str, dict[str, int]] = {}
        scales: dict[str, dict[str, int]] = {}
        unexpected = []
        for t in self.tensors:
            role, cls = self.role(t), tensor_class(t.name)
            if role in SCALE_ROLES:
                _add(scales, {"scale": "weight", "kv_scale": "kv_cache", "activation_scale": "activation"}[role], t)
            elif role == "quantized":
                _add(quantized, cls, t, "bfloat16_bytes")["bfloat16_bytes"] += self.converted_bytes(t)
            else:
                _add(unquantized, cls, t)
                if self.unexpected(t, role, cls):
                    unexpected.append({"name": t.name, "class": cls, "dtype": NAMES[t.dtype], "shape": t.shape,
                                       "bytes": t.bytes, "file": t.file})  # fmt: skip
        return {
            **self.layout.to_dict(),
            "describe": self.layout.describe(),
            "quantized": _ordered(quantized),
            "scales": scales,
            "unquantized": _ordered(unquantized),
            "ignored_by_config": self.ignored,
            "unexpected_unquantized": unexpected,
            "conversion": self.conversion(),
        }

    def conversion(self) -> dict[str, Any]:
        """The memory of converting to bfloat16: one unit (a decoder layer, or the model-level tensors)
        at a time holds its stored bytes and its bfloat16 bytes; all at once, the checkpoint and every
        bfloat16 byte. Dequantizing a tensor makes float32 temporaries of it on top (a few copies of
        `largest_tensor_float32_bytes`, transformers' arithmetic: both factors in float32)."""
        read: dict[str, int] = {}
        written: dict[str, int] = {}
        for t in self.tensors:
            unit = conversion_unit(t.name)
            read[unit] = read.get(unit, 0) + t.bytes
            written[unit] = written.get(unit, 0) + self.converted_bytes(t)
        peaks = {u: read[u] + written[u] for u in read}
        largest = max(peaks, key=peaks.get, default=MODEL_UNIT)
        biggest = max((self.elements(t) for t in self.tensors if self.role(t) == "quantized"), default=0)
        return {
            "largest_tensor_float32_bytes": biggest * 4,
            "dtype": NAMES[CONVERTED],
            "stored_bytes": sum(read.values()),
            "converted_bytes": sum(written.values()),
            "per_unit": {u: {"read_bytes": read[u], "written_bytes": written[u]} for u in read},
            "largest_unit": largest,
            "one_layer_at_a_time_peak_bytes": peaks.get(largest, 0),
            "all_at_once_peak_bytes": sum(read.values()) + sum(written.values()),
        }


def _add(table: dict[str, dict[str, int]], key: str, t: Tensor, *extra: str) -> dict[str, int]:
    slot = table.setdefault(key, dict.fromkeys(("tensors", "bytes", *extra), 0))
    slot["tensors"] += 1
    slot["bytes"] += t.bytes
    return slot


def _ordered(table: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {c: table[c] for c in CLASSES if c in table}


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
    if result.quantization is not None:
        lines += quantization_lines(result.quantization)
    for row in result.by_design:
        lines.append(f"float32 by design: {row['name']} ({gib(row['bytes'])})")
    if result.findings:
        total = sum(r["bytes"] for r in result.findings)
        n = len(result.findings)
        lines.append(
            f"{counted(n, 'tensor')} {'is' if n == 1 else 'are'} not {NAMES.get(result.expected)} ({gib(total)}):"
        )
        lines += [f"  {r['name']}: {r['dtype']}, {gib(r['bytes'])} ({r['class']})" for r in result.findings]
    else:
        lines.append(f"every {'unquantized ' if result.quantization else ''}tensor is in the expected dtype")
    return lines


def quantization_lines(q: dict[str, Any]) -> list[str]:
    """The audit's lines of a quantized checkpoint: its layout, its tensors quantized and not by class,
    its scales, the projections left unquantized unexpectedly, and the conversion's memory."""
    scheme = q["scheme"]
    if q["method"] == "mxfp4":
        block = f"an e8m0 exponent per {MX_GROUP} values"
    elif q["block"]:
        block = f"a scale per {q['block'][0]}x{q['block'][1]} block"
    else:
        block = "a scale per output channel" if scheme.endswith("-channel") else "one scale per tensor"
    kv = q["scales"].get("kv_cache", {}).get("tensors", 0)
    acts = q["activations"] or "unquantized (weight-only)"
    lines = [
        f"quantization: {q['method']}, {scheme}: {block}; activations {acts}; "
        f"KV-cache scales: {kv or 'none'}{' (declared by the config)' if q['kv_cache'] else ''}",
        f"{'quantized':<16}{'tensors':>9}{'bytes':>14}{'in ' + q['conversion']['dtype']:>16}",
    ]
    for cls, v in q["quantized"].items():
        lines.append(f"{cls:<16}{v['tensors']:>9}{gib(v['bytes']):>14}{gib(v['bfloat16_bytes']):>16}")
    kinds = {"weight": "weight scales", "kv_cache": "KV-cache scales", "activation": "activation scales"}
    lines.append(
        "scales: " + ", ".join(f"{v['tensors']} {kinds[k]} ({gib(v['bytes'])})" for k, v in q["scales"].items())
    )
    lines.append(
        "unquantized: " + ", ".join(f"{cls} {v['tensors']} ({gib(v['bytes'])})" for cls, v in q["unquantized"].items())
    )
    odd = q["unexpected_unquantized"]
    if odd:
        lines.append(f"{len(odd)} projections are stored unquantized, and the config does not leave them so:")
        lines += [f"  {r['name']}: {r['dtype']}, {gib(r['bytes'])} ({r['class']})" for r in odd]
    c = q["conversion"]
    unit = c["per_unit"][c["largest_unit"]]
    lines.append(
        f"converting to {c['dtype']} one layer at a time: peak {gib(c['one_layer_at_a_time_peak_bytes'])} "
        f"({c['largest_unit']}: {gib(unit['read_bytes'])} read, {gib(unit['written_bytes'])} written; "
        f"float32 temporaries of one tensor on top, {gib(c['largest_tensor_float32_bytes'])} a copy); "
        f"all at once: {gib(c['all_at_once_peak_bytes'])} ({gib(c['stored_bytes'])} read, "
        f"{gib(c['converted_bytes'])} written)"
    )
    return lines


# -- moe-parity estimate ----------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def parse_memory(spec: str, *, gpus: int | None = None) -> dict[str, int]:
    """`0:60GiB,1:60GiB,cpu:200GiB[,disk:1TB]` -> bytes per device, in that order. With `gpus` (a
    recording on this machine, which has that many visible): a bare SIZE caps every GPU, a GPU index
    must be visible, and disk takes no cap (accelerate offloads to --offload-folder)."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        device, sep, amount = part.rpartition(":")
        if not (device.isdigit() or device in ("cpu", "disk") or (not sep and gpus is not None)):
            raise BadInput(f"--max-memory {spec!r}: {part!r} is not DEVICE:SIZE (0:60GiB, cpu:200GiB, disk:1TB)")
        try:
            size = parse_size(amount)
        except ValueError:
            raise BadInput(f"--max-memory {spec!r}: {amount!r} is not a size (e.g. 60GiB, 512MB)") from None
        if gpus is None:
            out[device] = size
        elif not sep:
            if gpus == 0:
                raise BadInput(f"--max-memory {spec!r} caps every GPU and none is visible; use cpu:SIZE")
            out.update(dict.fromkeys(map(str, range(gpus)), size))
        elif device == "disk":
            raise BadInput(f"--max-memory {spec!r}: disk is not capped; pass --offload-folder DIR for disk offload")
        elif device.isdigit() and int(device) >= gpus:
            seen = f"GPUs 0-{gpus - 1} are visible" if gpus else "no GPU is visible"
            raise BadInput(f"--max-memory {spec!r} names GPU {device}, and {seen}")
        else:
            out[device] = size
    if not out:
        raise BadInput(f"--max-memory {spec!r} names no device")
    return out


@dataclass
class Shape:
    """What the estimate needs from config.json."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    expert_inter: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Shape:
        def first(*names: str, default: int | None = None) -> int:
            for n in names:
                if isinstance(config.get(n), int):
                    return config[n]
            if default is None:
                raise BadInput(f"config.json has none of {', '.join(names)}: the estimate needs it")
            return default

        hidden = first("hidden_size")
        heads = first("num_attention_heads")
        return cls(
            layers=first("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            head_dim=first("head_dim", default=hidden // heads),
            vocab=first("vocab_size"),
            experts=first("num_local_experts", "num_experts", "n_routed_experts", default=1),
            top_k=first("num_experts_per_tok", "moe_topk", default=1),
            expert_inter=first("moe_intermediate_size", "intermediate_size"),
        )

    def activations(self, tokens: int, size: int, attention_budget: int = budget_bytes(DEFAULT_BUDGET_MIB)) -> int:
        """Peak activations of one decoder layer's forward, batch 1: a few hidden-size tensors, the
        eager attention's score arrays (whole, or within `attention_budget` where recording runs them
        a block of query rows at a time: `model.attention`), the routed tokens' expert intermediates,
        the router logits in float32."""
        t = tokens
        scores = score_bytes(self.heads, t)
        if attention_budget:
            scores = min(scores, attention_budget)
        return (6 * t * self.hidden + 3 * t * self.top_k * self.expert_inter) * size + scores + t * self.experts * 4

    def capture(self, tokens: int) -> int:
        """What a golden stores per decoder layer, in float32: ten hidden-size tensors (the layer's
        input, the outputs of its input norm, attention, post-attention norm, experts, MoE block
        and layer, and the inputs of the post-attention norm and router; shared experts add one),
        the router's logits, weights and ids, and the inputs stored once per layer (the rotary tables,
        the positions). A causal attention mask is not stored but made again on replay (a mask of
        another shape, e.g. a sliding window's, adds T^2 * 4 bytes to its layer)."""
        t = tokens
        return (10 * t * self.hidden + t * self.experts + 2 * t * self.head_dim) * 4 + t * (self.top_k * 12 + 8)

    def model_level_capture(self, tokens: int) -> int:
        """Five hidden-size tensors (the embedding's output, the rotary's and the final norm's and the
        lm_head's inputs, the final norm's output), the rotary tables and the logits, in float32."""
        return (5 * tokens * self.hidden + 2 * tokens * self.head_dim + tokens * self.vocab) * 4 + tokens * 16


def check_context(context: Any, tokens: int, decode_steps: int = 0) -> None:
    """BadInput where the prompt and the decode steps reach past the model's context (its
    `max_position_embeddings`): such a run means nothing, and a mistyped count would run for hours."""
    if not isinstance(context, int) or context <= 0 or tokens + decode_steps <= context:
        return
    if decode_steps:
        raise BadInput(
            f"{tokens} prompt tokens and {decode_steps} decode steps reach position {tokens + decode_steps}, beyond "
            f"the model's context of {context} tokens (max_position_embeddings): ask for fewer"
        )
    raise BadInput(
        f"{tokens} tokens are beyond the model's context of {context} (max_position_embeddings): ask for fewer"
    )


def estimate(model_dir: Path | str, seq_len: int, dtype: str | None, max_memory: str | None) -> dict[str, Any]:
    """Weights per unit in the run's dtype, one layer's activations and captures, the golden's size, what
    a streamed recording holds and a placement. A quantized checkpoint's weights count as the run holds
    them, dequantized into its dtype (by default the config's), and reading a unit holds its stored
    tensors beside them: the largest unit's are `per_layer.dequantize_bytes`."""
    model_dir = Path(model_dir)
    tensors = checkpoint_tensors(model_dir)
    config = read_config(model_dir, BadInput, f"{model_dir} has no config.json: the estimate needs the model's shape")
    shape = Shape.from_config(config)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    check_context(text.get("max_position_embeddings"), seq_len)
    if dtype is not None and dtype not in DTYPE_SIZES:
        raise BadInput(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    view = quantized_view(model_dir, tensors, config)
    if view is not None and dtype is None:  # dequantized into the dtype the config declares
        declared = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
        dtype = declared if declared in DTYPE_SIZES else "bfloat16"
    size = DTYPE_SIZES[dtype] if dtype else None
    units: dict[str, int] = {}  # unit -> weight bytes in the run's dtype, in forward order
    stored: dict[str, int] = {}  # unit -> bytes as stored
    for t in tensors:
        m = _LAYER.search(t.name)
        model_level = "lm_head" if tensor_class(t.name) in ("lm_head", "norms") else "embed"
        unit = layer_group(int(m.group(1))) if m else model_level
        if view is not None:
            held = view.run_bytes(t, size or 2)
        else:
            held = t.numel * size if size and t.dtype in FLOATS else t.bytes
        units[unit] = units.get(unit, 0) + held
        stored[unit] = stored.get(unit, 0) + t.bytes
    order = sorted(
        units, key=lambda u: (u != "embed", u == "lm_head", int(u.split("_")[1]) if u[:6] == "layer_" else 0)
    )
    run_size = size or 2
    per_layer = {
        "activations_bytes": shape.activations(seq_len, run_size),
        "capture_bytes": shape.capture(seq_len),
    }
    if view is not None:  # a unit's stored tensors, read while its weights are dequantized
        per_layer["dequantize_bytes"] = max(stored.values(), default=0)
    weights = {u: units[u] for u in order}
    result: dict[str, Any] = {
        "model": str(model_dir),
        "seq_len": seq_len,
        "dtype": dtype or "as stored",
        "weights_bytes": weights,
        "total_weights_bytes": sum(weights.values()),
        "per_layer": per_layer,
        "golden_bytes": shape.layers * per_layer["capture_bytes"] + shape.model_level_capture(seq_len),
        "stream_bytes": stream_bytes(weights, per_layer),
    }
    if view is not None:
        result["quantization"] = {**view.layout.to_dict(), "stored_bytes": sum(stored.values())}
    if max_memory:
        result["placement"] = place(weights, parse_memory(max_memory), per_layer["activations_bytes"])
    return result


def stream_bytes(weights: dict[str, int], per_layer: dict[str, int]) -> int:
    """What `moe-parity golden --stream` holds on its device: the model-level modules, the two
    largest decoder layers, one layer's activations and two layers' captures (and, quantized, one
    unit's stored tensors while they are dequantized)."""
    layers = sorted((v for u, v in weights.items() if u.startswith("layer_")), reverse=True)
    model_level = sum(v for u, v in weights.items() if not u.startswith("layer_"))
    held = model_level + sum(layers[:2]) + per_layer["activations_bytes"] + 2 * per_layer["capture_bytes"]
    return held + per_layer.get("dequantize_bytes", 0)


def place(weights: dict[str, int], memory: dict[str, int], activations: int) -> dict[str, Any]:
    """Units in forward order onto the devices in order (GPUs, then cpu, then disk), as accelerate's
    sequential map does; each GPU keeps one layer's activations free."""
    devices = sorted((d for d in memory if d.isdigit()), key=int) + [d for d in ("cpu", "disk") if d in memory]
    free = {d: memory[d] - (activations if d.isdigit() else 0) for d in devices}
    placed: dict[str, list[str]] = {d: [] for d in devices}
    used = {d: 0 for d in devices}
    i = 0
    units = list(weights)
    for n, unit in enumerate(units):
        need = weights[unit]
        while i < len(devices) and free[devices[i]] - used[devices[i]] < need:
            i += 1
        if i == len(devices):
            short = sum(weights[u] for u in units[n:])
            return {"fits": False, "devices": used, "units": placed, "unplaced_from": unit, "short_bytes": short}
        placed[devices[i]].append(unit)
        used[devices[i]] += need
    return {"fits": True, "offloads_to_disk": bool(placed.get("disk")), "devices": used, "units": placed}


def estimate_lines(result: dict[str, Any]) -> list[str]:
    weights = result["weights_bytes"]
    layers = [v for u, v in weights.items() if u.startswith("layer_")]
    per = result["per_layer"]
    lines = [
        f"moe-parity estimate: {result['model']}: {len(layers)} decoder layers, {result['seq_len']} tokens, "
        f"weights {result['dtype']}",
        f"weights: {gib(result['total_weights_bytes'])}"
        + (f"; per layer {gib(min(layers))} to {gib(max(layers))}" if layers else ""),
        f"per layer: activations {gib(per['activations_bytes'])}, golden capture {gib(per['capture_bytes'])}",
        f"golden on disk: about {gib(result['golden_bytes'])} (float32, prefill)",
        f"`moe-parity golden --stream` on one device: about {gib(result['stream_bytes'])} (two decoder layers, "
        "the model-level modules, one layer's activations and two layers' captures"
        + (", one layer's quantized tensors)" if "dequantize_bytes" in per else ")"),
    ]
    q = result.get("quantization")
    if q:
        lines.insert(
            2,
            f"quantized ({q['method']}, {q['scheme']}): {gib(q['stored_bytes'])} stored, dequantized into "
            f"{result['dtype']} as each unit is read; reading one holds its quantized tensors too "
            f"(up to {gib(per['dequantize_bytes'])})",
        )
    placement = result.get("placement")
    if placement:
        for device, used in placement["devices"].items():
            units = placement["units"][device]
            where = f"{units[0]} .. {units[-1]}" if units else "nothing"
            lines.append(f"  {device}: {gib(used)} ({where})")
        if placement["fits"]:
            disk = " with offload to disk" if placement.get("offloads_to_disk") else ""
            lines.append(f"the placement fits{disk}")
        else:
            lines.append(
                f"the placement does not fit: from {placement['unplaced_from']} on, {gib(placement['short_bytes'])} "
                "find no device"
            )
    return lines
