"""Weight items: a candidate checkpoint's weights against the reference's, one unit (a decoder
layer, or the model-level modules) at a time, both loaded as transformers loads them (so fused
expert layouts are compared as the model holds them), in float32; what differs is said in words
(`judge.weights.diagnose`). A quantized tensor (of either side) is judged as its checkpoint stores
it, within its format's rounding at its block's scale (`replay.quant_weights`). `weight_items` sets
up their checker (`WeightItems`), or says why a run has none."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import compat
from ..dtypes import SAFETENSORS_FLOATS
from ..errors import CheckpointError, ParityError
from ..judge.quant_weights import Stored, judge_quantized
from ..judge.weights import diagnose, rounded
from ..model.checkpoint import read_tensors
from ..model.lazy_model import LazyModel
from ..points import Point, layer_group, weights_id
from ..report.rows import Row, unjudged_row, weights_row
from .checks import Checker, CheckerSetup, Option, Unchecked
from .quant_weights import QuantizedWeights, quantized_checkpoint

if TYPE_CHECKING:
    from ..backends import Backend
    from ..golden import GoldenStore


@dataclass(frozen=True)
class WeightUnit:
    """The weight check of one unit: a decoder layer (`layer_N.weights`) or the model-level modules
    (`weights`, layer None), ordered just before the unit's first point."""

    layer: int | None
    order: float
    kind = "weights"

    @property
    def id(self) -> str:
        return weights_id(self.layer)

    @property
    def group(self) -> str | None:
        return None if self.layer is None else layer_group(self.layer)


def _stored_as(converted: dict[tuple[str, str], int]) -> str:
    """`WeightCheck.conversion`'s counts in words."""
    return ", ".join(f"{n} tensor(s) stored as {c}, the reference's as {r}" for (r, c), n in converted.items())


def weight_items(
    golden: GoldenStore,
    candidate: Path | None,
    backend: Backend,
    hw: str,
    *,
    asked: bool | None,
    trust_remote_code: bool,
) -> tuple[WeightItems | None, list[str]]:
    """The weight items' checker, where the candidate is a checkpoint other than the reference's and
    the reference's is here to compare with, and its header line; else None and why not, said where
    the items were asked for (`asked`: --parity-weights) or where the weights go unchecked whatever
    was asked."""
    if asked is False:
        return None, []
    loud, why = bool(asked), ""
    found = golden.local_model()
    if not type(backend).needs_checkpoint or candidate is None:
        why = f"the {hw} backend's candidate is not a checkpoint"
    elif found is None:  # said whatever was asked: the candidate's weights go unchecked
        where = golden.manifest["model"].get("path")
        loud, why = True, f"the golden's model is not on this machine ({where}): copy it here to check the weights"
    elif compat.MAJOR < 5:  # said whatever the options: the candidate's weights go unchecked
        loud, why = (
            True,
            (
                f"they read the golden's model as transformers 5 lays it out, and this environment has transformers "
                f"{compat.VERSION}: check the weights where transformers>=5 is installed (moe-parity audit)"
            ),
        )
    elif found[0].resolve() == Path(candidate).resolve():
        why = "the candidate is the golden's own model"
    else:
        try:
            check = WeightCheck(
                found[0].resolve(), candidate, trust_remote_code=trust_remote_code, held=backend.held_weights,
                held_stored=backend.held_quantized,
            )  # fmt: skip
        except ParityError as exc:  # its activations are compared all the same
            why = f"a checkpoint cannot be read ({exc})"
        else:
            return WeightItems(check, backend, hw, golden.points), []
    return None, [f"moe-parity: no weight items: {why}"] if loud else []


class WeightCheck:
    """`findings(layer)` (None: the model-level modules) -> what is wrong, [] when nothing is."""

    def __init__(
        self,
        reference: Path,
        candidate: Path,
        *,
        trust_remote_code: bool = False,
        held: Callable[[int | None], dict[str, torch.Tensor] | None] | None = None,
        held_stored: Callable[[int | None], dict[str, Stored] | None] | None = None,
    ):
        """`held(layer)`: the weights a backend holds for the unit, mapped back to the reference's
        names and layout (a backend that converts them); else the candidate checkpoint is read.
        `held_stored(layer)`: those it quantizes itself (NxDI's quantized state dict), as stored."""
        self.reference, self.candidate = Path(reference), Path(candidate)
        self.held, self.held_stored = held, held_stored
        self._models: dict[str, LazyModel] = {}
        self._stored = {
            "reference": {t.name: t.dtype for t in read_tensors(self.reference)},
            "candidate": {t.name: t.dtype for t in read_tensors(self.candidate)},
        }
        self.trust_remote_code = trust_remote_code
        self._quantized: QuantizedWeights | None = None
        self.quantized = quantized_checkpoint(self.reference) or quantized_checkpoint(self.candidate)
        if self.quantized:  # tensors stored quantized are judged at their format's rounding, not as conversions
            for which, path in (("reference", self.reference), ("candidate", self.candidate)):
                for key in QuantizedWeights.stored_keys(path):
                    self._stored[which].pop(key, None)

    def _quantized_weights(self) -> QuantizedWeights:
        if self._quantized is None:
            self._quantized = QuantizedWeights(self.reference, self.candidate, self._model("candidate").layer_of)
        return self._quantized

    def _model(self, which: str) -> LazyModel:
        if which not in self._models:
            path = self.reference if which == "reference" else self.candidate
            self._models[which] = LazyModel(
                path, dtype=torch.float32, max_layers=1, trust_remote_code=self.trust_remote_code
            )
        return self._models[which]

    def _unit_params(self, model: LazyModel, layer: int | None) -> dict[str, torch.Tensor | None]:
        """The unit's parameters by name, loaded (None: the checkpoint lacks it)."""
        paths = [model.unit_path(layer)] if layer is not None else model.model_level_paths()
        params: dict[str, torch.Tensor | None] = {}
        for path in paths:
            try:
                module = model.module(path)
            except CheckpointError:
                module = model.model.get_submodule(path)
            for name, p in module.named_parameters(recurse=layer is not None):
                params[f"{path}.{name}"] = None if p.device.type == "meta" else p
        return params

    def conversion(self, layer: int | None = None, every: bool = False) -> dict[tuple[str, str], int]:
        """The unit's checkpoint tensors (with `every`, the whole checkpoint's) stored in another
        dtype than the reference's: {(reference dtype, candidate dtype): how many}."""
        stored_cand = self._stored["candidate"]
        layer_of = self._model("reference").layer_of if not every else None
        out: dict[tuple[str, str], int] = {}
        for key, dtype in self._stored["reference"].items():
            other = stored_cand.get(key)
            if other and other != dtype and (layer_of is None or layer_of(key) == layer):
                out[(dtype, other)] = out.get((dtype, other), 0) + 1
        return out

    def findings(self, layer: int | None) -> tuple[list[str], list[str]]:
        """What is wrong with the unit's weights, in words, and notes on what is not wrong: tensors
        stored in another dtype whose values are the reference's rounded to it are a conversion
        (judged against that rounding), not a finding."""
        ref = self._unit_params(self._model("reference"), layer)
        held = self.held(layer) if self.held is not None else None
        cand = held if held is not None else self._unit_params(self._model("candidate"), layer)
        converted = self.conversion(layer)
        narrower = {SAFETENSORS_FLOATS.get(c) for (_, c) in converted} - {None}
        rounding = getattr(torch, next(iter(narrower))) if len(narrower) == 1 else None
        out, judged, loose, count = self._quantized_findings(layer) if self.quantized else ([], set(), {}, 0)
        if held is not None and judged:
            out += self._conversion_of_quantized(layer, held, judged)
        stored = self.held_stored(layer) if self.held_stored is not None else None
        for name, weight in (stored or {}).items():  # the backend's own quantization, judged as it stores it
            if ref.get(name) is not None:
                out += judge_quantized(name, ref[name], weight.dequantized(), weight).findings
                judged, count = judged | {name}, count + 1
        for name, r in ref.items():
            if r is None or name in judged:
                continue
            c = cand.get(name)
            if rounding is not None and c is not None and rounded(r, c, rounding):
                continue
            found = diagnose(name, r, c, **({"tol": loose[name]} if name in loose else {}))
            if found and converted:
                stored = ", ".join(
                    f"{n} tensor(s) stored as {c}, the reference's as {r}" for (r, c), n in converted.items()
                )
                found = [*found[:-1], f"{found[-1]} ({stored})"]
            out += found
        notes = []
        if converted and not out:
            stored = ", ".join(
                f"{n} tensor(s) stored as {c}, the reference's as {r}" for (r, c), n in converted.items()
            )
            how = "each the reference's values rounded to it" if rounding is not None else "within its rounding"
            notes.append(f"a conversion: {stored}; judged against that rounding, {how}")
        if count and not out:
            notes.append(f"{count} quantized tensor(s) within their format's rounding at their block's scale")
        return out, notes

    def _conversion_of_quantized(self, layer: int | None, held: dict[str, torch.Tensor], judged: set[str]) -> list[str]:
        """A backend's conversion of the quantized tensors (NxDI's dequantizes them as it converts)
        against transformers' dequantization of the same checkpoint: the checkpoint itself is judged
        as stored; what the conversion made of it must be what transformers makes of it."""
        own = self._unit_params(self._model("candidate"), layer)
        out: list[str] = []
        for name in sorted(judged):
            if own.get(name) is not None:
                found = diagnose(name, own[name], held.get(name))
                out += [f"{f} (the backend's conversion, against the checkpoint dequantized as transformers does)"
                        for f in found]  # fmt: skip
        return out

    def quantized_line(self) -> str | None:
        """The header's line on quantized checkpoints: how their quantized tensors are judged."""
        if not self.quantized:
            return None
        weights = self._quantized_weights()
        sides = [
            f"{which} {side.layout.describe()}"
            for which, side in (("candidate", weights.candidate), ("reference", weights.reference))
            if side.layout is not None
        ]
        return (
            f"moe-parity: quantized weights ({'; '.join(sides)}) are judged as stored, each value within its "
            "format's rounding at its block's scale"
        )

    def _quantized_findings(self, layer: int | None) -> tuple[list[str], set[str], dict[str, float], int]:
        """The unit's quantized tensors judged as stored; the model's names of the parameters they make
        (not compared again); those the reference names otherwise, by the relative error their format
        allows (`quant_weights.LOOSE`); how many checkpoint tensors were judged as stored."""
        weights = self._quantized_weights()
        found, judged, quantized = weights.findings(layer)
        model = self._model("candidate")
        names = {model.model_name(k) for k in judged}
        loose = {model.model_name(k): weights.loose for k in quantized - judged}
        return found, names - set(loose), loose, len(judged)

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()


class WeightItems(Checker):
    """The weight items of a run: each unit's check before its first point (of the prefill: decode
    steps reuse the same weights)."""

    kind = "weights"
    options = (
        Option("--parity-weights", "parity_weights", {"action": "store_true", "default": None},
               "check the candidate's weights against the golden's model before its activations: an item per "
               "layer (layer_N.weights) and one for the model-level weights (default: wherever the candidate is a "
               "checkpoint other than the golden's model and that model is on this machine; with this flag, say why "
               "not otherwise)"),
        Option("--no-parity-weights", "parity_weights", {"action": "store_false", "default": None}, "no weight items"),
    )  # fmt: skip

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: bool | None) -> Checker | None:
        """The weight items, or where the run has none and says why, that sentence."""
        checker, why = weight_items(
            setup.golden, setup.candidate_dir, setup.backend, setup.hw, asked=value,
            trust_remote_code=setup.trust_remote_code,
        )  # fmt: skip
        return checker if checker is not None else Unchecked(why) if why else None

    def __init__(self, check: WeightCheck, backend: Backend, hw: str, points: list[Point]):
        self.weights, self.backend, self.hw = check, backend, hw
        self._first: dict[int | None, str] = {}  # per unit (layer; None: model-level), its first prefill point
        for point in points:
            if point.step is None:
                self._first.setdefault(point.layer, point.id)

    def before(self, point: Point) -> Iterator[WeightUnit]:
        if point.step is None and self._first.get(point.layer) == point.id:
            yield WeightUnit(point.layer, self.place(point, before=True))

    def check(self, entry: WeightUnit, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        """The report row of a unit's weight check, and its failure text (None: the weights agree)."""
        findings, notes = self.weights.findings(entry.layer)
        row = weights_row(entry.id, entry.layer, entry.order, findings)
        row.notes = notes
        if not findings:
            return row, None
        return row, "\n".join([f"{entry.id}: the candidate's weights differ from the reference's:", *grouped(findings)])

    def unjudged_row(self, entry: Any, status: str, message: str) -> Row:
        return unjudged_row(weights_row(entry.id, entry.layer, entry.order, []), status, message)

    def header_lines(self) -> list[str]:
        from ..backends import Backend

        converted = type(self.backend).held_weights is not Backend.held_weights
        held = f" (the {self.hw} backend's converted weights, mapped back)" if converted else ""
        lines = [f"moe-parity: weights{held} checked against the golden's model {self.weights.reference}"]
        converted = self.weights.conversion(every=True)
        if converted and not held:
            lines.append(f"moe-parity: the candidate checkpoint is a conversion ({_stored_as(converted)}): its weights "
                         "are judged against the reference's rounded to its dtype")  # fmt: skip
        quantized = self.weights.quantized_line()
        if quantized and held:
            quantized += f"; the {self.hw} backend's conversion of them against transformers' dequantization"
        own = self.backend.quantized_words()
        if own:
            lines.append(f"moe-parity: the {self.hw} backend's weights are {own}: each quantized weight is judged "
                         "as stored, within its format's rounding at its output channel's scale")  # fmt: skip
        return [*lines, quantized] if quantized else lines

    def close(self) -> None:
        self.weights.close()


GROUPED = 4  # findings that end in the same words, from this many on, are said once


def grouped(findings: list[str]) -> list[str]:
    """The findings, those that end in the same words (a block size off in every tensor of a layer) said
    once: how many, which (the first few), and the first in full."""
    tails: dict[str, list[str]] = {}
    for line in findings:
        tails.setdefault(line.rsplit(": ", 1)[-1], []).append(line)
    out: list[str] = []
    for tail, lines in tails.items():
        if len(lines) < GROUPED or tail == lines[0]:
            out += lines
            continue
        names = [line.split(": ", 1)[0] for line in lines]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        out.append(f"{len(lines)} tensors ({', '.join(names[:3])}{more}): {tail}; the first: {lines[0]}")
    return out
