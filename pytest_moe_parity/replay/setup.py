"""A run's settings checked against its golden and backend, each in one sentence the user can act on
(`SetupError`: a pytest usage error, exit 4; `moe-parity` exit 2): the candidate's config, the layer
selection, the backend, candidate and dtype asked, the judging mode, noise figures for a noise
factor; and what a run's outcome says of them afterwards (a dump judged isolated that reads as a
whole-model run, decode steps a `-k` asks for that the golden lacks). `flag`: how the front end
spells the option."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..backends import CHAIN_KINDS, backend_class, registry
from ..dtypes import dtype_name, parse_dtype
from ..errors import BackendError, CheckpointError, SetupError
from ..judge.tolerances import NOISE_FACTOR, Override
from ..model.checkpoint import read_config, read_tensors
from ..model.quant import layout
from ..model.quant_check import check_tensors
from ..points import describe_layers, parse_layers
from ..report.rows import Row
from ..words import counted
from .runner import MODES

if TYPE_CHECKING:
    from ..backends import Backend
    from ..golden import GoldenStore

# Config entries a candidate must share with the golden (label, then the names models use for it).
CONFIG_KEYS_THAT_MUST_MATCH = (
    ("model_type", ("model_type",)),
    ("hidden_size", ("hidden_size",)),
    ("num_hidden_layers", ("num_hidden_layers",)),
    ("experts", ("num_local_experts", "num_experts", "n_routed_experts")),
    ("top_k", ("num_experts_per_tok", "moe_topk", "top_k")),
    ("vocab_size", ("vocab_size",)),
)


def model_mismatches(golden_cfg: dict[str, Any], candidate_cfg: dict[str, Any]) -> list[str]:
    """The entries of CONFIG_KEYS_THAT_MUST_MATCH the two configs give other values, "label: golden G,
    candidate C" (a candidate that is another model; `config.config_differences` compares every field)."""

    def value(cfg: dict[str, Any], names: tuple[str, ...]) -> Any:
        return next((cfg[n] for n in names if cfg.get(n) is not None), None)

    diffs = []
    for label, names in CONFIG_KEYS_THAT_MUST_MATCH:
        g, c = value(golden_cfg, names), value(candidate_cfg, names)
        if g != c:
            diffs.append(f"{label}: golden {g!r}, candidate {c!r}")
    return diffs


def backend_named(hw: str, flag: str) -> type[Backend]:
    """The class of the backend `hw` (`--hw`), or SetupError naming the known ones."""
    backends = registry()
    if hw not in backends:
        known = ", ".join(sorted(backends)) or "none (is pytest-moe-parity installed?)"
        raise SetupError(f"{flag} {hw!r} is not a known backend; available: {known}")
    try:
        return backend_class(hw)
    except BackendError as exc:
        raise SetupError(f"{flag} {hw}: {exc}") from None


def candidate_dtype(text: str | None, flag: str) -> torch.dtype | None:
    """The candidate's dtype as asked (`--dtype`; None: the backend's), or SetupError."""
    try:
        return None if text is None else parse_dtype(text, floating=True)
    except ValueError:
        raise SetupError(f"{flag} {text!r} is not a floating-point torch dtype (e.g. bfloat16)") from None


def find_candidate(
    golden: GoldenStore, option: Path | None, cls: type[Backend], hw: str, flags: Mapping[str, str]
) -> tuple[Path | None, str]:
    """The candidate's location (`--model`, else the golden's model for a backend that needs a
    checkpoint) and why it was taken; a checkpoint's config checked against the golden's."""
    found = None
    if option:
        path = Path(option).expanduser().resolve()
        if not path.exists():
            raise SetupError(f"{flags['model']} {option} does not exist; pass the candidate's directory")
        found = path, flags["model"]
    elif not cls.needs_checkpoint:
        raise SetupError(f"{flags['hw']} {hw} needs the candidate's location: pass {flags['model']} DIR")
    found = found or golden.local_model()
    if found is None:
        raise SetupError(
            f"the golden's model {golden.manifest['model'].get('path')} does not exist on this machine; "
            f"pass the candidate checkpoint with {flags['model']} DIR"
        )
    if cls.needs_checkpoint:
        check_config(golden, found[0])
    return found


def check_config(golden: GoldenStore, candidate: Path) -> None:
    """The candidate checkpoint is the golden's model in every entry the points depend on."""
    missing = f"candidate {candidate} is not a transformers checkpoint (no config.json)"
    config = read_config(candidate, SetupError, missing)
    diffs = model_mismatches({**golden.config, "model_type": golden.model_type}, config)
    if diffs:
        raise SetupError(f"candidate {candidate} does not match the golden's model: " + "; ".join(diffs))
    check_quantized(candidate, config)


def check_quantized(candidate: Path, config: dict[str, Any]) -> None:
    """A quantized candidate checkpoint: a layout this reads, every quantized weight with a scale of its
    shape (from the headers alone), before any point runs."""
    try:
        quant = layout(config, f"candidate {candidate}")
        if quant is not None and any(candidate.glob("*.safetensors")):
            check_tensors(read_tensors(candidate), quant, f"candidate {candidate}")
    except CheckpointError as exc:
        raise SetupError(str(exc)) from None


MODEL_POINTS = "model"  # the word of --parity-layers for the items that are not a layer's


def select_units(text: str | None, golden: GoldenStore, flag: str) -> tuple[list[int] | None, bool]:
    """`--parity-layers` -> (its decoder layers, each a layer of the golden, None for every one;
    whether the model-level items run: embedding, rotary, final norm, logits, the config and
    model-level weight items). They run with no selection, or where the word `model` is in it
    (`model,0-15`; `model` alone: those only): a shard of a sharded run must be able to take them, or
    no shard would (`moe-parity report --merge`)."""
    if text is None or not str(text).strip():
        return None, True
    parts = [p.strip() for p in str(text).split(",")]
    model = MODEL_POINTS in parts
    rest = ",".join(p for p in parts if p and p != MODEL_POINTS)
    if model and not rest:
        return [], True
    try:
        layers = parse_layers(rest)
    except ValueError as exc:
        raise SetupError(f"{flag} {text}: {exc}") from None
    unknown = sorted(set(layers) - set(golden.layers))
    if unknown:
        raise SetupError(
            f"{flag} {text}: the golden has no layer {describe_layers(unknown)}; "
            f"its layers are {describe_layers(golden.layers)}"
        )
    return layers, model


def _chain_of(name: str) -> str | None:
    """How a registered backend chains (None when it cannot, or cannot be loaded)."""
    try:
        return backend_class(name).chain_kind
    except BackendError:
        return None


def run_mode(
    golden: GoldenStore, cls: type, asked: str | None, flag: str, hw: str, dtype: torch.dtype, floor: str | None = None
) -> str:
    """The judging mode (`asked`, else isolated, or chain for a golden that keeps some tokens only),
    one the golden and the backend (`cls`, named `hw`) can judge in `dtype` (against the noise floor
    `floor`, a key of the golden's noise floors: by default the dtype's)."""
    captured = golden.describe_captured()  # --capture-tokens: judged chained only
    mode = asked or ("chain" if captured else "isolated")
    if mode not in MODES:
        raise SetupError(f"{flag} {mode!r} is not a mode; use one of {', '.join(MODES)}")
    if captured and mode != "chain":
        raise SetupError(
            f"{flag} {mode}: {golden.root} keeps only the {captured} in its points' outputs, and none "
            f"of their inputs (moe-parity golden --capture-tokens): it is judged with {flag} chain"
        )
    if mode == "isolated":
        return mode
    if cls.chain_kind is None:
        able = ", ".join(name for name in sorted(registry()) if _chain_of(name) in CHAIN_KINDS)
        raise SetupError(
            f"{flag} {mode}: the {hw} backend cannot run the candidate on its own inputs; "
            f"backends that can: {able} (a backend chains by declaring `chain_kind`: see the backend contract)"
        )
    if cls.chain_kind not in CHAIN_KINDS:
        raise SetupError(
            f"{flag} {mode}: the {hw} backend declares chain = {cls.chain_kind!r}; "
            f"a backend's chain is one of {', '.join(CHAIN_KINDS)} (or None)"
        )
    if mode == "both" and cls.chain_kind == "recorded":
        raise SetupError(
            f"{flag} both: a {hw} candidate holds one run of its own; use {flag} chain if it is "
            "a whole-model run, isolated if it was fed the golden inputs"
        )
    if dtype.itemsize < 4 and not golden.has_noise(floor or dtype, "chain"):
        raise SetupError(
            f"{flag} {mode} in {dtype_name(dtype)} judges each point against the reference's own "
            f"{dtype_name(dtype)} error, and {golden.root} has none: record the golden with "
            f"`moe-parity golden ... --noise-dtype {dtype_name(dtype)}`"
        )
    return mode


def check_noise(
    golden: GoldenStore, dtype: torch.dtype, overrides: Sequence[Override], floor: str | None = None
) -> None:
    """`noise_factor` set by the user needs noise figures in the candidate's dtype (or the run's `floor`)."""
    asked = [p for p, values in overrides if "noise_factor" in values]
    if asked and not golden.has_noise(floor or dtype, "isolated"):
        recorded = ", ".join(golden.noise_dtypes) or "none"
        raise SetupError(
            f"noise_factor ({asked[0]}) needs the reference's own error in {dtype_name(dtype)}, which "
            f"{golden.root} does not hold (noise dtypes recorded: {recorded}): record the golden with "
            f"`moe-parity golden ... --noise-dtype {dtype_name(dtype)}`"
        )


def chained_hint(rows: list[Row], golden: GoldenStore, dtype: torch.dtype, flag: str) -> str | None:
    """A candidate that holds its own run (a dump) judged isolated, against the reference's
    isolated error, where most failures are within the reference's own chained error: one line
    saying the chained verdict is the one that fits a whole-model run."""
    failed = [r for r in rows if r.status == "failed" and r.noise_ratio]
    figures = golden.unsteered_noise(dtype)
    if not failed or not golden.has_noise(dtype, figures):
        return None
    within = 0
    for row in failed:
        reference = golden.noise(dtype, figures, row.id) or {}
        ratios = [m.rel_l2 / max(reference[t]["rel_l2"], 1e-12) for t, m in row.metrics.items() if t in reference]
        within += bool(ratios) and max(ratios) <= NOISE_FACTOR
    if within * 2 < len(failed):
        return None
    return (
        f"{within} of the {counted(len(failed), 'failed point')} {'is' if within == 1 else 'are'} within the "
        f"reference's own chained error: if the "
        f"dump is the candidate's own whole-model run (not fed the golden's inputs point by point), judge it "
        f"chained: {flag} chain"
    )


def missing_steps(golden: GoldenStore, keyword: str) -> str | None:
    """Why a -k naming a decode step the golden lacks selects nothing, in one line (or None)."""
    asked = [int(n) for n in re.findall(r"step_(\d+)", keyword or "")]
    steps = golden.recorded_steps
    lacking = [n for n in asked if n not in steps]
    if not lacking:
        return None
    if not steps:
        have = "no decode steps"
    elif steps == list(range(1, steps[-1] + 1)):
        have = f"decode steps 1..{steps[-1]}"
    else:
        have = f"decode steps {', '.join(map(str, steps))}"
    return (
        f"-k {keyword!r} asks for step_{max(lacking)}; this golden has {have} "
        f"(record them with `moe-parity golden ... --decode-steps N` or `--decode-at POSITIONS`)"
    )
