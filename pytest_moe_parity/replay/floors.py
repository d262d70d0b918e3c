"""Which of a golden's noise floors a run is judged against. A golden may hold the reference's own
error in a lower dtype (`moe-parity golden --noise-dtype bfloat16`, the floor keyed by the dtype's name)
and under a quantization scheme (`--noise-quant fp8-block:128+dynamic-token`, keyed
`quant:fp8-block:128+dynamic-token`). A candidate is judged against its dtype's floor, unless:
- `--noise-quant SPEC` picks the floor of SPEC (`--noise-quant none`: the dtype's, whatever else);
- the candidate runs under `--hw-option quant=SPEC` and the golden holds SPEC's floor;
- the candidate checkpoint is quantized and the golden holds exactly one quantization floor.

A quantization floor is the reference's error under the scheme in the dtype it ran in (the golden's):
a candidate that computes in a coarser dtype (an FP8 port's bf16 activations) also rounds as that
dtype does, so where the golden holds that dtype's floor too, the two are added in quadrature (each
point's squared errors summed: two independent sources of error); where it does not, a floor asked
for by name is a usage error that says how to record it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import dtype_name, parse_dtype
from ..errors import CheckpointError, SetupError
from ..model.checkpoint import read_config
from ..model.emulate import KEY_PREFIX, QuantSpec, parse_spec, spec_of_key
from ..model.quant import layout

if TYPE_CHECKING:
    from ..golden import GoldenStore

NONE = "none"  # --noise-quant none: the candidate dtype's floor


@dataclass(frozen=True)
class NoiseFloor:
    """The floor a run's noise ratios divide by: the golden's noise entry `key`, and `combine`, a dtype's
    floor added in quadrature (None: `key`'s alone); `source`: why it was picked."""

    key: str
    combine: str | None = None
    spec: QuantSpec | None = None
    source: str = ""

    @property
    def scheme(self) -> str | None:
        """The quantization scheme the floor assumed (None: a dtype's own rounding)."""
        return self.spec.name if self.spec is not None else None

    def describe(self) -> str:
        if self.spec is None:
            return f"the reference's own {self.key} rounding"
        extra = f", with its own {self.combine} rounding added" if self.combine else ""
        return f"the reference's own error under {self.spec.name} ({self.spec.describe()}){extra}"

    def lines(self) -> list[str]:
        """The header's and the closing summary's line (none for a dtype's floor, as before)."""
        if self.spec is None:
            return [f"moe-parity: noise floor: {self.key} rounding ({self.source})"] if self.source else []
        return [f"moe-parity: noise floor: {self.describe()} ({self.source})"]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "scheme": self.scheme, "combined_with": self.combine, "source": self.source}


def quant_floors(golden: GoldenStore) -> list[str]:
    """The golden's quantization floors' keys (`quant:SPEC`)."""
    return sorted(k for k in golden.manifest.get("noise", {}) if k.startswith(KEY_PREFIX))


def floor_dtype(golden: GoldenStore, key: str) -> str:
    """The dtype a quantization floor ran in (the golden's, unless its entry says otherwise)."""
    return golden.manifest.get("noise", {}).get(key, {}).get("quant", {}).get("dtype") or golden.dtype


def pick_floor(
    golden: GoldenStore,
    dtype: torch.dtype,
    asked: str | None,
    backend: Any,
    candidate: Path | None,
    flag: str = "--noise-quant",
) -> NoiseFloor:
    """The floor of a run (`backend`: the candidate's, whose `emulation` is the scheme it runs under, if
    any): see the module's docstring. SetupError, one sentence, for a floor asked for that the golden
    lacks or cannot give the candidate's dtype."""
    emulation = getattr(backend, "emulation", None)  # --hw-option quant
    emulated: QuantSpec | None = emulation.spec if emulation is not None else None
    plain = NoiseFloor(dtype_name(dtype))
    if asked is not None and asked.strip() == NONE:
        return NoiseFloor(plain.key, source=f"{flag} {NONE}")
    if asked:
        try:
            spec = parse_spec(asked, flag)
        except ValueError as exc:
            raise SetupError(str(exc)) from None
        if spec.key not in golden.manifest.get("noise", {}):
            held = ", ".join(k[len(KEY_PREFIX) :] for k in quant_floors(golden)) or "none"
            raise SetupError(
                f"{flag} {spec.name}: {golden.root} holds no noise floor under {spec.name} (its quantization floors: "
                f"{held}); record it with `moe-parity golden ... --noise-quant {spec.name}`"
            )
        return _quant_floor(golden, dtype, spec, f"{flag} {spec.name}", flag)
    floors = quant_floors(golden)
    if emulated is not None and emulated.key in floors:
        source = f"--hw-option quant={emulated.name}: the golden's floor of the same scheme"
        return _quant_floor(golden, dtype, emulated, source, None) or plain
    quantized = _layout(candidate)
    if quantized is not None and len(floors) == 1:
        spec = spec_of_key(floors[0])
        assert spec is not None
        source = f"the candidate checkpoint is quantized ({quantized}) and the golden holds this one quantization floor"
        return _quant_floor(golden, dtype, spec, source, None) or plain
    return plain


def _quant_floor(
    golden: GoldenStore, dtype: torch.dtype, spec: QuantSpec, source: str, flag: str | None
) -> NoiseFloor | None:
    """The floor of `spec` for a candidate in `dtype`, with that dtype's floor added where the candidate
    rounds coarser than the floor ran; where the golden lacks it: SetupError when asked for by `flag`,
    else None."""
    ran = floor_dtype(golden, spec.key)
    try:
        coarser = torch.finfo(dtype).eps > torch.finfo(parse_dtype(ran)).eps
    except (ValueError, TypeError):
        coarser = False
    if not coarser:
        return NoiseFloor(spec.key, spec=spec, source=source)
    own = dtype_name(dtype)
    if golden.has_noise(own, "isolated"):
        return NoiseFloor(spec.key, combine=own, spec=spec, source=source)
    if flag is None:
        return None
    raise SetupError(
        f"{flag} {spec.name}: the floor ran in {ran} and the candidate runs in {own}, whose own rounding it lacks: "
        f"record the golden with `moe-parity golden ... --noise-dtype {own}` too (the two floors are then added), "
        f"or run the candidate in {ran}"
    )


def _layout(candidate: Path | None) -> str | None:
    """How the candidate checkpoint is quantized, in words (None: not, or not a checkpoint)."""
    if candidate is None or not (Path(candidate) / "config.json").is_file():
        return None
    try:
        found = layout(read_config(candidate), str(candidate))
    except (CheckpointError, ValueError, OSError):
        return None
    return found.describe() if found is not None else None


# -- two floors added: each point's errors in quadrature ----------------------------------------------


def combined(a: dict[str, dict[str, float]] | None, b: dict[str, dict[str, float]] | None) -> dict | None:
    """The quantization floor's figures at one point (`a`: per tensor, rel_l2 and max_token_rel_l2; flip
    shares) with a dtype's (`b`) added as two independent errors are: relative errors in quadrature, flip
    shares summed (at most 1). Only what `a` has: a tensor whose every token the quantized reference left
    out (its routing flipped) has no figure of it, and the dtype's alone would be no floor of the scheme."""
    if a is None or b is None:
        return a
    out: dict[str, dict[str, float]] = {}
    for target, x in a.items():
        y = b.get(target)
        if y is None:
            out[target] = x
            continue
        out[target] = {
            name: min(1.0, u + y.get(name, 0.0)) if name == "flip_share" else math.hypot(u, y.get(name, 0.0))
            for name, u in x.items()
        }
    return out


def combined_tokens(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> dict | None:
    """The quantization floor's squared errors per token (`a`) with a dtype's (`b`) added where both have
    a tensor's (NaN, a token either left out, stays NaN); where `b`'s differs in shape, `a`'s alone."""
    if a is None or b is None:
        return a
    out = {}
    for target, x in a.items():
        y = b.get(target)
        out[target] = x.to(torch.float32) + y.to(torch.float32) if y is not None and y.shape == x.shape else x
    return out
