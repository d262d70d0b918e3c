"""Tolerances: what a point must meet to pass, resolved most specific first from a `parity` marker,
the command line (`--parity-tol`), ini/pyproject glob patterns over point ids, and the defaults
for the candidate's dtype.

The verdict uses `cosine` (minimum) and `rel_l2` (maximum) on every compared tensor, `max_flip_share`
on routers, and the share of elements within `atol`/`rtol` only when `within` is set (setting
`atol` or `rtol` alone implies `within=1.0`, i.e. allclose)."""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from ..dtypes import dtype_name


@dataclass(frozen=True)
class Tolerance:
    cosine: float  # minimum cosine similarity
    rel_l2: float  # maximum ||c - g|| / ||g||
    atol: float  # for the within-tolerance share: |c - g| <= atol + rtol * |g|
    rtol: float
    within: float | None = None  # minimum share of elements within atol/rtol; None: report only
    max_flip_share: float = 0.0  # share of tokens whose router top-k set really flipped (ties excluded)
    tie_factor: float = 8.0  # a flip is a tie when the golden score gap is within tie_factor * eps(dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KEYS = tuple(f.name for f in fields(Tolerance))

# Calibrated on tiny models of all seven architectures, bf16 candidate against a float32 golden,
# isolated inputs (see benchmarks/calibrate_tolerances.py): healthy components reach rel_l2 up to
# ~1.5e-2 and cosine >= 0.9998; the limits leave a 2-3x margin, and port bugs land at rel_l2 >= 0.1.
_DEFAULTS: dict[str, Tolerance] = {
    "float64": Tolerance(cosine=0.999999, rel_l2=1e-6, atol=1e-8, rtol=1e-7),
    "float32": Tolerance(cosine=0.99999, rel_l2=1e-4, atol=1e-5, rtol=1e-4),
    "bfloat16": Tolerance(cosine=0.999, rel_l2=4e-2, atol=1e-2, rtol=1.6e-2, max_flip_share=0.05),
    "float16": Tolerance(cosine=0.9995, rel_l2=1e-2, atol=1e-3, rtol=1e-3, max_flip_share=0.02),
}
# Per component, where the kind of computation needs it.
_COMPONENT_DEFAULTS: dict[tuple[str, str], dict[str, float]] = {
    # logits: a long dot product over the hidden size, in the candidate dtype
    ("bfloat16", "logits"): {"rel_l2": 5e-2},
}


def default_tolerance(dtype: torch.dtype | str, component: str) -> Tolerance:
    name = dtype_name(dtype)
    base = _DEFAULTS.get(name, _DEFAULTS["bfloat16"])
    return replace(base, **_COMPONENT_DEFAULTS.get((name, component), {}))


def _coerce(key: str, value: Any) -> float | None:
    if key not in KEYS:
        raise ValueError(f"unknown tolerance key {key!r}; known keys: {', '.join(KEYS)}")
    if key == "within" and value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"tolerance {key}={value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"tolerance {key}={value!r} is not a number") from None
    if number != number or number < 0:
        raise ValueError(f"tolerance {key}={value!r} must be a non-negative number")
    if key in ("cosine", "within", "max_flip_share") and number > 1:
        raise ValueError(f"tolerance {key}={value!r} must be between 0 and 1")
    return number


def validate(values: dict[str, Any]) -> dict[str, float | None]:
    return {k: _coerce(k, v) for k, v in values.items()}


def parse_override(text: str) -> tuple[str, dict[str, float | None]]:
    """`PATTERN:key=value,...` (or just `key=value,...` for every point) -> (pattern, values)."""
    text = text.strip()
    pattern, sep, body = text.rpartition(":")
    if not sep:
        pattern, body = "*", text
    pattern = pattern.strip() or "*"
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"malformed tolerance {part!r} in {text!r}; expected PATTERN:key=value,...")
        values[key.strip()] = value.strip()
    if not values:
        raise ValueError(f"no tolerance given in {text!r}; expected PATTERN:key=value,...")
    return pattern, validate(values)


def parse_ini_lines(lines: list[str]) -> list[tuple[str, dict[str, float | None]]]:
    return [parse_override(line) for line in lines if line.strip() and not line.strip().startswith("#")]


def _apply(tol: Tolerance, values: dict[str, float | None]) -> Tolerance:
    changed = dict(values)
    if ("atol" in changed or "rtol" in changed) and "within" not in changed and tol.within is None:
        changed["within"] = 1.0
    return replace(tol, **changed)


def resolve(
    point_id: str,
    component: str,
    dtype: torch.dtype | str,
    *,
    marker: dict[str, Any] | None = None,
    cli: list[tuple[str, dict[str, float | None]]] = (),
    ini: list[tuple[str, dict[str, float | None]]] = (),
) -> tuple[Tolerance, list[str]]:
    """The tolerance of one point and where each layer of it came from (least specific first)."""
    tol = default_tolerance(dtype, component)
    sources = [f"default for {dtype_name(dtype)}"]
    for origin, overrides in (("ini", ini), ("command line", cli)):
        for pattern, values in overrides:
            if fnmatch.fnmatchcase(point_id, pattern):
                tol = _apply(tol, values)
                sources.append(f"{origin} {pattern}")
    if marker:
        tol = _apply(tol, validate(marker))
        sources.append("parity marker")
    return tol, sources
