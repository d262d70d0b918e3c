"""The weight items of a quantized candidate: each quantized tensor of a unit read as its checkpoint
stores it (the format's values, the scales, the block they cover) beside the reference's tensor of
the same name (dequantized where the reference is quantized too), and judged within the format's own
rounding at its block's scale (`judge.quant_weights`), in the hub's names: a finding names the tensor
and the block, the expert or the channel. Per-expert tensors of one projection that all hold one
expert's scales are said once, for the projection."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..judge.quant_weights import SHOWN, QuantVerdict, Stored, judge_quantized, shared_finding, shared_scale
from ..model.checkpoint import Shards, read_config, weight_map
from ..model.quant import Dequantizer, Layout, expand_scale, layout, mxfp4_dequantize

# A per-expert tensor of the hub's layout: `...experts.3.gate_proj.weight`.
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")
FORMATS = {"fp8": "e4m3", "int8": "int8", "mxfp4": "e2m1"}
# The relative L2 error a quantized tensor may show where the reference names it otherwise (it is then
# compared as the model holds it, not as stored): a few times one quantization's, per format.
LOOSE = {"fp8": 2.0**-4, "int8": 2.0**-5, "mxfp4": 2.0**-2}


def quantized_checkpoint(path: Path) -> bool:
    """Whether the checkpoint's config declares a quantization this reads (CheckpointError: one it cannot)."""
    return layout(read_config(path), str(path)) is not None


def same_layout(a: Layout | None, b: Layout | None) -> bool:
    """Two checkpoints quantized alike: method, scheme and block (activations and KV scales aside)."""
    return a is not None and b is not None and (a.method, a.name, a.block) == (b.method, b.name, b.block)


@dataclass
class Read:
    """One weight of a checkpoint as the run computes with it (`value`, plain name and orientation) and,
    where quantized, as stored (`stored`, in its stored orientation; `flipped`: MXFP4's [out, in] for
    an [in, out] parameter)."""

    value: torch.Tensor
    stored: Stored | None = None
    flipped: bool = False

    def oriented(self) -> torch.Tensor:
        return self.value.transpose(-1, -2) if self.flipped else self.value


class Side:
    """A checkpoint's tensors by plain name (the names an unquantized checkpoint of the model has),
    read one at a time from its shards."""

    def __init__(self, path: Path):
        self.path = path
        self.layout = layout(read_config(path), str(path))
        self.dequantizer = Dequantizer(self.layout, str(path)) if self.layout is not None else None
        self.files = weight_map(path)
        self.parts: dict[str, list[str]] = {}  # plain name -> its raw keys
        for key in self.files:
            if self.dequantizer is not None and self.dequantizer.aside(key):
                continue
            plain = (self.dequantizer.companion(key) if self.dequantizer else None) or key
            self.parts.setdefault(plain, []).append(key)
        self._shards: Shards | None = None

    def quantized(self, plain: str) -> bool:
        """Whether the checkpoint stores `plain` quantized (with a scale, or MXFP4's blocks and scales)."""
        return any(k != plain for k in self.parts.get(plain, []))

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """Shards open for the reads inside (each opened once, none left open)."""
        with Shards(self.path) as shards:
            self._shards = shards
            try:
                yield
            finally:
                self._shards = None

    def _handle(self, key: str) -> Any:
        assert self._shards is not None, "read inside open()"
        return self._shards.handle(self.files[key])

    def _raw(self, key: str, index: int | None = None) -> torch.Tensor:
        """A tensor of the checkpoint, or (`index`) its slice along dim 0 where it has three dims or more
        (a scale of one element, or of a 2-D weight, whole)."""
        handle = self._handle(key)
        if index is None:
            return handle.get_tensor(key)
        sl = handle.get_slice(key)
        return sl[index : index + 1].squeeze(0) if len(sl.get_shape()) >= 3 else handle.get_tensor(key)

    def experts(self, plain: str) -> int | None:
        """How many weights `plain` stacks along dim 0 (stacked experts, as GPT-OSS stores them), where
        its stored value has more than two dims; None for a 2-D weight."""
        main = plain + "_blocks" if plain + "_blocks" in self.parts.get(plain, []) else plain
        shape = self._handle(main).get_slice(main).get_shape()
        flat = len(shape) - (1 if main.endswith("_blocks") else 0)
        return int(shape[0]) if flat > 2 else None

    def read(self, plain: str, index: int | None = None) -> Read:
        """The weight `plain` (with `index`, its weight `index` along dim 0), in float32 (dequantized as
        transformers does), and as stored."""
        raw = {k: self._raw(k, index) for k in self.parts[plain]}
        if self.dequantizer is None:
            return Read(raw[plain].float())
        value = self.dequantizer.dequantize(raw, torch.float32)[plain].float()  # a weight without its scale: raises
        if not self.quantized(plain):
            return Read(value)
        if self.layout.bits == "mxfp4":
            return Read(value, self._mxfp4(plain, raw), flipped=True)
        return Read(value, self._scaled(plain, raw))

    def _scaled(self, plain: str, raw: dict[str, torch.Tensor]) -> Stored:
        lay = self.layout
        q = raw[plain]
        scale = raw[plain[: -len("weight")] + lay.scale_suffix].float()
        zero = raw.get(plain[: -len("weight")] + "weight_zero_point")
        shape = tuple(q.shape)
        values = q.float()
        if zero is not None:
            values = values - expand_scale(zero.float(), shape, lay.block, name=plain, where=str(self.path), layout=lay)
        rows, cols = shape[-2:]
        lead = shape[:-2]
        if scale.numel() == 1:
            grid, block = scale.reshape(1, 1).expand(*lead, 1, 1).contiguous(), (rows, cols)
        elif tuple(scale.shape[-2:]) == (rows, 1) and not lay.scheme.endswith("-block"):
            grid, block = scale, (1, cols)
        else:
            grid, block = scale, lay.block or (rows, cols)
        return Stored(values, grid, block, FORMATS[lay.bits], lay.scale_suffix, lay.name)

    def _mxfp4(self, plain: str, raw: dict[str, torch.Tensor]) -> Stored:
        blocks, scales = raw[plain + "_blocks"], raw[plain + "_scales"]
        ones = torch.full_like(scales, 127)  # each group's exponent 0: the e2m1 values themselves
        values = mxfp4_dequantize(blocks, ones, torch.float32, name=plain, where=str(self.path)).transpose(-1, -2)
        grid = torch.exp2(scales.float() - 127)
        name = plain.rsplit(".", 1)[-1] + "_scales"
        return Stored(values.contiguous(), grid, (1, values.shape[-1] // grid.shape[-1]), "e2m1", name, "mxfp4")


class QuantizedWeights:
    """The quantized tensors of a candidate checkpoint against the reference's, a unit at a time.
    `layer_of(key)`: the decoder layer of a checkpoint key (None: model-level)."""

    def __init__(self, reference: Path, candidate: Path, layer_of: Callable[[str], int | None]):
        self.candidate, self.reference = Side(candidate), Side(reference)
        self.same = same_layout(self.candidate.layout, self.reference.layout)
        self.layer_of = layer_of
        lay = self.candidate.layout or self.reference.layout
        self.loose = LOOSE.get(lay.bits if lay else "fp8", LOOSE["fp8"])

    @staticmethod
    def stored_keys(path: Path) -> set[str]:
        """The raw keys of a checkpoint's quantized tensors (values and scales): none where unquantized."""
        if not quantized_checkpoint(path):
            return set()
        side = Side(path)
        return {k for plain, keys in side.parts.items() if side.quantized(plain) for k in keys}

    def unit(self, layer: int | None) -> list[str]:
        """The plain names of the unit's tensors stored quantized by either side."""
        cand, ref = self.candidate, self.reference
        names = [p for p in cand.parts if self.layer_of(p) == layer]
        return [p for p in names if cand.quantized(p) or ref.quantized(p)]

    def findings(self, layer: int | None) -> tuple[list[str], set[str], set[str]]:
        """What is wrong with the unit's quantized tensors, in words; the plain names judged here; the
        plain names quantized (those the reference has no tensor of are left to a looser comparison)."""
        names = self.unit(layer)
        judged: set[str] = set()
        verdicts: dict[str, QuantVerdict] = {}
        with self.candidate.open(), self.reference.open():
            for name in names:
                if name not in self.reference.parts:
                    continue
                verdicts[name] = self._judge(name)
                judged.add(name)
        return self._words(verdicts), judged, set(names)

    def _judge(self, name: str) -> QuantVerdict:
        """One tensor judged; stacked experts one at a time (a layer of GPT-OSS-120B's experts is 2.1G
        values: one expert's are 17M), said for the tensor."""
        experts = self.candidate.experts(name)
        if experts is None or self.reference.experts(name) != experts:
            return self._judge_one(name)
        slices = {e: self._judge_one(name, e) for e in range(experts)}
        failing = [e for e, v in slices.items() if v.findings]
        if not failing:
            return QuantVerdict(name)
        found = shared_scale(slices)
        if found is not None:
            scale_name = next(v.scale_name for v in slices.values())
            return QuantVerdict(name, [shared_finding(name, *found, experts, scale_name)], cause="shared")
        lines = [f for e in failing[:SHOWN] for f in slices[e].findings]
        if len(failing) > SHOWN:
            more = ", ".join(map(str, failing[SHOWN : SHOWN + 8])) + (" ..." if len(failing) > SHOWN + 8 else "")
            lines.append(f"{name}: and {len(failing) - SHOWN} more of its {experts} experts beyond it ({more})")
        return QuantVerdict(name, lines, cause=slices[failing[0]].cause)

    def _judge_one(self, name: str, index: int | None = None) -> QuantVerdict:
        cand, ref = self.candidate.read(name, index), self.reference.read(name, index)
        name = name if index is None else f"{name} (expert {index})"
        if cand.stored is None:  # the reference's alone quantized: its rounding of the candidate's values
            assert ref.stored is not None
            value = cand.value.transpose(-1, -2) if ref.flipped else cand.value
            verdict = judge_quantized(name, value, ref.oriented(), ref.stored, reason=False)
            said = f"(the reference's quantized {name} against the candidate's)"
            verdict.findings = [f"{f} {said}" for f in verdict.findings]
            return verdict
        ref_stored = ref.stored
        if ref_stored is not None and ref.flipped != cand.flipped:
            ref_stored = ref_stored.transposed()
        reference = ref.value.transpose(-1, -2) if cand.flipped else ref.value
        return judge_quantized(name, reference, cand.oriented(), cand.stored, ref_stored, same_layout=self.same)

    def _words(self, verdicts: dict[str, QuantVerdict]) -> list[str]:
        """The verdicts' findings in the unit's order; the experts of one projection that all hold one
        expert's scales in one line."""
        groups: dict[str, dict[int, QuantVerdict]] = {}
        pattern_of: dict[str, str] = {}
        for name, verdict in verdicts.items():
            m = EXPERT_KEY.search(name)
            if m:
                pattern_of[name] = EXPERT_KEY.sub(".experts.*.", name, count=1)
                groups.setdefault(pattern_of[name], {})[int(m.group(1))] = verdict
        lines: dict[str, str] = {}  # a projection's pattern -> its one line
        for pattern, members in groups.items():
            found = shared_scale(members)
            if found is not None:
                scale_name = self.candidate.layout.scale_suffix if self.candidate.layout else "scale"
                lines[pattern] = shared_finding(pattern, *found, len(members), scale_name)
        said = {name: lines[p] for name, p in pattern_of.items() if p in lines}
        out: list[str] = []
        for name, verdict in verdicts.items():
            if name in said:
                if said[name] not in out:
                    out.append(said[name])
                continue
            out += verdict.findings
        return out
