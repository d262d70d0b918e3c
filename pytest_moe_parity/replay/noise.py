"""The noise floor: the reference model itself run in a lower precision (`moe-parity golden
--noise-dtype bfloat16`), isolated and chained, judged against its own golden like a candidate.
Its error at each point is what rounding alone costs there; a candidate's error is then read as a
ratio to it (`noise_factor`), which separates a port bug of 1e-2 from bf16 rounding where a fixed
limit cannot, and keeps deep chained runs from failing on accumulated rounding."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..backends import BackendSetup
from ..backends.hf import TorchBackend
from ..dtypes import dtype_name, parse_dtype
from ..errors import BackendError, BackendFailure, BadInput, PointUnavailable
from ..golden import GoldenStore
from ..golden.writer import update_manifest
from ..host import gib, malloc_trim
from ..judge.result import PointResult
from ..model.emulate import RESOLVES, QuantSpec, parse_spec, resolves
from ..points import ROUTER
from ..words import counted
from .batch import Rows
from .runner import ParityRunner

FIGURES = ("rel_l2", "max_token_rel_l2")


def noise_figures(result: PointResult) -> dict[str, dict[str, float]]:
    """Per compared tensor, the figures a noise ratio divides by; for routers and the logits, the
    share of real flips (routing top-k, next-token top-1). A tensor whose every token the run left
    out has no figure (one over no token would read as an error of 0)."""
    out: dict[str, dict[str, float]] = {}
    for target, m in result.metrics.items():
        values = {name: getattr(m, name) for name in FIGURES}
        record = result.token_d2.get(target)
        if record is not None and record.numel() and bool(torch.isnan(record).all()):
            continue
        if m.shape_match and all(v is None or math.isfinite(v) for v in values.values()):
            out[target] = {k: v for k, v in values.items() if v is not None}
    if result.component == ROUTER and result.routing:  # real routing flips of the reference itself
        out["top_k"] = {"flip_share": result.routing.flip_share}
    if result.logits is not None:
        out["top1"] = {"flip_share": result.logits.top1.flip_share}
    return out


def record_noise(
    golden_dir: Path | str,
    dtype: str | None,
    *,
    quant: str | QuantSpec | None = None,
    model_dir: Path | str | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the golden's own model in `dtype`, isolated (every point on its golden inputs) and
    chained (one whole-model forward, steered, and once more free), and add its error at every point
    to the golden's manifest (each token's, to a file beside it). With `quant` (a `--noise-quant` spec,
    `model.emulate`), the model runs under that quantization, in `dtype` (None: the golden's own), and
    its floor is keyed `quant:SPEC`."""
    say = progress or (lambda msg: None)
    # what the recording before it left for the collector (its model's modules hold cycles: with accelerate's
    # disk offload, ~150 MB of host weights of 16 Mixtral-style layers alive until collected) goes back first
    gc.collect()
    malloc_trim()
    golden = GoldenStore(golden_dir)
    spec = noise_spec(quant)
    torch_dtype = _noise_dtype(dtype if dtype is not None or spec is None else golden.dtype, golden, spec)
    name = dtype_name(torch_dtype)
    key = name if spec is None else spec.key
    label = name if spec is None else f"{name} under {spec.name}"
    golden.manifest.get("noise", {}).pop(key, None)  # recorded again: the old figures judge nothing here
    model = Path(model_dir) if model_dir is not None else Path(golden.manifest["model"]["path"])
    options = {"device": device, **({"quant": spec.name} if spec is not None else {})}
    setup = BackendSetup(golden, model, torch_dtype, options=options, trust_remote_code=trust_remote_code)
    try:
        backend = TorchBackend(setup)
    except BackendError as exc:
        raise BadInput(f"the reference under --noise-quant {spec.name if spec else ''}: {exc}") from None
    # a --capture-tokens golden keeps no inputs: its points are judged chained only, on a chain that
    # cannot be steered (the free run's figures are the chained ones)
    captured = golden.captured_tokens is not None
    isolated = ParityRunner(golden, backend, mode="isolated")
    steered = ParityRunner(golden, backend, mode="chain", steer=not captured)
    free = ParityRunner(golden, backend, mode="chain", steer=False)  # the same model, a chain nobody steers
    started = time.perf_counter()
    at = counted(len(golden.points), "point")
    say(f"noise floor: the reference in {label}, isolated and chained (steered, free), at {at}")
    try:
        isolated.start(golden.points[0])  # the model on the meta device: what it will hold, before any forward
    except BackendFailure as exc:
        raise BadInput(f"the reference in {label} cannot be built: {exc}") from None
    line, held = cost(golden, backend)
    say(line)
    sets = _passes(golden, isolated, steered, free, label, say, started, spec)
    tokens = sets.pop("tokens")
    entry = {
        **sets,
        "tokens": write_noise_tokens(golden.root, key.replace(":", "_").replace("+", "_"), tokens),
        "recorded": {
            "seconds": round(time.perf_counter() - started, 3),
            "device": device,
            "model": str(model),
            "host_weight_bytes": held,  # the most weight bytes it held on the host at once
        },
    }
    if backend.emulation is not None:
        entry["quant"] = {"dtype": name, **backend.emulation.to_dict()}
    noise = {**golden.manifest.get("noise", {}), key: entry}
    update_manifest(golden.root, "noise", noise)
    say(f"noise floor recorded in {time.perf_counter() - started:.1f}s")
    return entry


def noise_spec(quant: str | QuantSpec | None) -> QuantSpec | None:
    """A `--noise-quant` value, parsed (BadInput, one sentence, for a bad one)."""
    if quant is None or isinstance(quant, QuantSpec):
        return quant
    try:
        return parse_spec(quant)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def _noise_dtype(dtype: str, golden: GoldenStore | None, spec: QuantSpec | None) -> torch.dtype:
    """The dtype the noise floor runs in, checked: a dtype's floor below the golden's, a quantization's
    floor in a dtype fine enough to resolve the scheme's own step (`emulate.resolves`)."""
    flag = "--noise-dtype" if spec is None else "--noise-quant"
    try:
        torch_dtype = parse_dtype(dtype, floating=True)
    except ValueError:
        raise BadInput(f"{flag} {dtype!r} is not a floating-point torch dtype (e.g. bfloat16)") from None
    name = dtype_name(torch_dtype)
    if spec is None and golden is not None and name == golden.dtype:
        raise BadInput(f"--noise-dtype {name} is the golden's own dtype: its error would be zero; pick a lower one")
    if spec is not None and not resolves(torch_dtype, spec):
        raise BadInput(
            f"--noise-quant {spec.name}: the reference would run in {name}, whose own rounding (eps "
            f"{torch.finfo(torch_dtype).eps:.2g}) is not {RESOLVES:g}x finer than the scheme's step ({spec.eps:.2g}): "
            f"the floor would measure {name} as much as the scheme; record the golden in float32"
        )
    return torch_dtype


def _passes(golden, isolated, steered, free, label, say, started, spec) -> dict[str, Any]:
    """The three passes (`record_noise`): the figures of each set, and each token's under "tokens"."""
    captured = golden.captured_tokens is not None
    # the set of figures -> point id -> the point's figures
    sets: dict[str, dict[str, Any]] = {"isolated": {}, "chain": {}, "free": {}}
    rows = Rows.of(golden) if not captured else None
    # each prefill point's rows: the reference's own output in the batch against alone; not under a scale shared
    # over the batch (dynamic-tensor), whose batch dependence is the very thing the batch items look for
    if rows is not None and rows.count > 1 and (spec is None or spec.batch_invariant):
        sets["batch"] = {}
    tokens: dict[str, torch.Tensor] = {}  # figures/point/tensor -> each token's squared error (NaN: left out)
    try:
        # Three passes, each holding what recording holds: every point on its golden inputs (a point at
        # a time), then the two whole-model runs, each point judged as the forward produces it and
        # forgotten (a layer's outputs at a time; the model's would grow with its depth and length).
        # (a --capture-tokens golden's points have no inputs: only those the chain does not run are run so)
        chained_only = {p.id for p in steered.chain.points} if captured else set()
        _isolated_pass(isolated, sets, tokens, rows, label, chained_only, say, started)
        _chained_passes(isolated, steered, free, captured, sets, tokens, label, say, started)
    finally:
        for runner in (isolated, steered, free):
            if runner.chain is not None:
                runner.chain.close()
        isolated.close()  # the backend, once
    return {**sets, "tokens": tokens}


def cost(golden: GoldenStore, backend: TorchBackend) -> tuple[str, int]:
    """What the noise floor will cost, said before its first forward (as the captures' size is said
    before the recording's): about three forwards of the model, and the weights it holds at once, in
    its dtype, beside what the recording held on the host; and the weight bytes it holds on the host."""
    lazy = backend.lazy
    assert lazy is not None
    layers = sorted((lazy.unit_bytes(i) for i in range(lazy.num_layers)), reverse=True)[: lazy.max_layers]
    model_level = sum(lazy.unit_bytes(u) for u in lazy.model_level_paths())
    held = sum(layers) + model_level
    recorded = golden.manifest.get("stats", {}).get("host_weight_bytes")
    where = "on the host" if lazy.device.type == "cpu" else f"on {lazy.device} (the host: a unit in flight)"
    beside = f"; the recording held {gib(recorded)} of weights on the host" if recorded is not None else ""
    line = (
        f"noise floor: about 3 forwards of the model (every point on its golden inputs, then two whole-model runs, "
        f"each point judged as the forward produces it); {gib(held)} of {dtype_name(lazy.dtype)} weights at once "
        f"{where}: {len(layers)} decoder layers of {gib(layers[0] if layers else 0)} and the model-level modules "
        f"({gib(model_level)}){beside}"
    )
    return line, held if lazy.device.type == "cpu" else 0


def _chained_passes(
    isolated: ParityRunner,
    steered: ParityRunner,
    free: ParityRunner,
    captured: bool,
    sets: dict,
    tokens: dict,
    name: str,
    say: Callable[[str], None],
    started: float,
) -> None:
    """The two whole-model runs, steered and free (a --capture-tokens golden's one, which cannot be
    steered, gives both sets), each point judged as the forward produces it."""
    for runner in (steered, free) if not captured else (steered,):
        runner.started = isolated.started or steered.started  # one backend, started once
        kinds = ("chain", "free") if captured else ("free",) if runner is free else ("chain",)

        def judge(point: Any, record: Any, own: Any, runner: ParityRunner = runner, kinds=kinds) -> None:
            result = runner.judge_output(point, record, own, "chain", None)
            _keep(sets, tokens, kinds[0], point, result)
            for kind in kinds[1:]:  # the same figures, each kind's tokens a tensor of its own (a file keeps each)
                result.token_d2 = {t: d2.clone() for t, d2 in result.token_d2.items()}
                _keep(sets, tokens, kind, point, result)

        try:
            runner.chain.stream(judge)
        except BackendFailure as exc:
            raise BadInput(f"the reference in {name} failed in its whole-model run: {exc}") from None
        what = "free" if runner is free or captured else "steered"
        say(f"  noise floor chained ({what}): {time.perf_counter() - started:.1f}s")
        isolated.started = runner.started


def _isolated_pass(
    runner: ParityRunner,
    sets: dict,
    tokens: dict,
    rows: Rows | None,
    name: str,
    chained_only: set[str],
    say: Callable[[str], None],
    started: float,
) -> None:
    """Every point on its golden inputs but those in `chained_only`, one at a time, with each prefill
    point's rows alone where the golden is a batch."""
    golden = runner.golden
    layer_groups = list(dict.fromkeys(p.group for p in golden.points if p.layer is not None))
    ends = {p.group: p.id for p in golden.points}  # each group's last point
    for point in golden.points:
        if point.id not in chained_only:
            try:
                prepared = runner.prepare(point)
            except PointUnavailable:
                prepared = None
            except BackendFailure as exc:
                raise BadInput(f"the reference in {name} failed at {point.id}: {exc}") from None
            if prepared is not None and prepared.candidate is not None:
                _keep(
                    sets,
                    tokens,
                    "isolated",
                    point,
                    runner.judge_output(point, prepared.golden, prepared.candidate, "isolated", None),
                )
                if "batch" in sets and point.step is None:
                    sets["batch"][point.id] = batch_vs_alone(runner, rows, point, prepared.candidate)
        if point.layer is not None and ends[point.group] == point.id and not chained_only:  # its layer's last point
            done = layer_groups.index(point.group) + 1
            say(f"  noise floor {point.group} [{done}/{len(layer_groups)}, {time.perf_counter() - started:.1f}s]")


def batch_vs_alone(runner: ParityRunner, rows: Rows, point: Any, batch: Any) -> list[float | None]:
    """Each row's relative L2 between the reference's own output for it in the batch and alone (the
    golden's call cut to the row), in the noise floor's dtype: what batching alone costs the reference."""
    out: list[float | None] = [None] * rows.count  # None: a row of padding only
    for row, alone in rows.runs_alone(runner, point, runner.golden.load(point)):
        main = runner.judge_between(point, alone.output, rows.cut(batch.output, row)).main
        out[row] = float(main.rel_l2) if main is not None and math.isfinite(main.rel_l2) else None
    return out


def _keep(sets: dict, tokens: dict, figures: str, point: Any, result: PointResult) -> None:
    """A point's figures (and each token's error) kept in the set `figures`."""
    sets[figures][point.id] = noise_figures(result)
    tokens.update({f"{figures}/{point.id}/{t}": d2 for t, d2 in result.token_d2.items()})


def write_noise_tokens(root: Path, dtype: str, tokens: dict[str, torch.Tensor]) -> dict[str, str]:
    """The reference's own per-token errors, in `noise_tokens.<dtype>.safetensors` beside the points'
    files (not among them: the golden's fingerprint is what the reference recorded): the manifest's
    entry names the file and its sha256."""
    from safetensors.torch import save_file

    from ..files import atomic_replace
    from ..golden.store import sha256_file

    name = f"noise_tokens.{dtype}.safetensors"
    with atomic_replace(Path(root) / name) as tmp:
        save_file({k: v.contiguous() for k, v in tokens.items()}, str(tmp))
        digest = sha256_file(tmp)
    return {"file": name, "sha256": digest}


def check_quant(model_dir: Path | str, quant: str, golden_dtype: str, trust_remote_code: bool = False) -> QuantSpec:
    """A `--noise-quant` value checked before anything is recorded: parsed, fine enough for the dtype the
    reference records in, and one the model can take (its skeleton, on the meta device: mxfp4's groups of
    32, kv-fp8's K/V projections). BadInput, one sentence; a model that cannot be read is the recording's
    to report."""
    spec = noise_spec(quant)
    assert spec is not None
    try:
        dtype = parse_dtype(golden_dtype, floating=True)
    except ValueError:
        return spec  # the recording reports its --dtype
    if not resolves(dtype, spec):
        _noise_dtype(golden_dtype, None, spec)  # raises, saying why
    try:
        from ..model.emulate import find_targets
        from ..model.lazy_model import LazyModel

        model = LazyModel(model_dir, dtype=dtype, trust_remote_code=trust_remote_code).model
    except Exception:  # not a model this can read: the recording says why, in its own words
        return spec
    try:
        find_targets(model, spec, str(model_dir))
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return spec
