"""`moe-parity estimate --shards N | --budget T`: a nightly's wall per shard, and how many shards fit.

A replay's work per unit (a decoder layer; the model-level points: embedding, rotary, final norm and
logits) comes from what can be known without running it:

- FLOPs at the golden's tokens, from the checkpoint's headers and config: every linear is 2 x tokens x
  its weight's elements; attention adds its scores (2 x T^2 x heads x (qk dim + v dim): eager
  attention computes the whole T x T, masked); the routed experts run top-k of E per token on the eager
  path (`cpu`, `cuda`: transformers' experts loop over the experts tokens were sent to) and all E on
  the static-shape one (`trace`, `compile`, `neuron`: `backends.experts`). Each point replays its
  module on the golden's inputs, so a layer's wholes run their parts again: the MoE block its router,
  experts and shared experts, the layer's output its attention and MoE block too.
- bytes read: the unit's weights in the run's dtype and its golden captures (the estimate's own
  figures). A run reads a layer ahead in a background thread, so a unit takes the longer of its
  compute and its reads.

Its seconds need a throughput, from one of two sources, named in the output:

- a previous report (`--from-report DIR`): its points' measured seconds (each row's `seconds`: the
  module's forward alone) against their FLOPs give the FLOP rate and a per-call cost (a least-squares
  line); the run's wall (`wall_seconds` x workers) less those seconds, per point, is what each point
  costs beside its forward (the judge, pytest, the golden's reads);
- a quick calibration here: a GEMM of the model's shape ([tokens, hidden] x [hidden, hidden]) in the
  run's dtype, the judge's metric pass on one output of that shape, and a cold read of the checkpoint.

`--cores C` scales a CPU's FLOP rate linearly from the cores it was measured on (the calibration's
threads, or the report's host): an upper bound on the speed-up. A report of a device backend (neuron,
cuda, nxdi) is not scaled: its points ran on the device.

Shards are contiguous in forward order (the model-level unit first: `model,0-14`), chosen to make
the longest shard as short as it can be (an exact partition over the units' seconds)."""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..host import gib
from ..model.checkpoint import Tensor, read_config
from ..words import counted
from .audit import _LAYER, FLOATS, checkpoint_tensors, tensor_class

MODEL = "model"  # --parity-layers' word for the model-level points (replay.setup.MODEL_POINTS)
CPU_BACKENDS = ("cpu", "trace", "compile")  # their points run on the host's cores: --cores scales them
ALL_EXPERTS = ("trace", "compile", "neuron")  # static-shape experts: every expert for every token
NORM_FLOPS = 8  # per element of an RMSNorm: square, mean, rsqrt, scale (and the dtype casts)
READ_SAMPLE = 256 * 2**20  # bytes the calibration reads of the checkpoint
_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$")


def parse_duration(text: str, flag: str = "--budget") -> float:
    """`60m`, `1h30m`, `5400s` -> seconds; BadInput for a bare number (minutes or seconds?) or nonsense."""
    m = _DURATION.match(text or "")
    if m is None or not any(m.groups()):
        raise BadInput(f"{flag} {text!r} is not a duration: give its unit, e.g. 60m, 1h30m or 3600s")
    h, mins, s = (float(g) if g else 0.0 for g in m.groups())
    seconds = h * 3600 + mins * 60 + s
    if seconds <= 0:
        raise BadInput(f"{flag} {text!r} is no time at all")
    return seconds


def duration(seconds: float) -> str:
    """12345 -> "3h25m45s"; under a minute to three figures ("0.25s", "42.5s")."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


def flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} FLOP"


# -- the work of each unit ---------------------------------------------------------------------------
@dataclass
class Unit:
    """One unit of a shard: a decoder layer, or the model-level points (`layer` None). `points`: each of
    its points' FLOPs as the replay runs it, by component."""

    name: str
    layer: int | None
    points: dict[str, float]
    read_bytes: int
    compute_s: float = 0.0  # its points' forwards and what each costs beside them
    read_s: float = 0.0  # its weights and golden captures, read

    @property
    def flops(self) -> float:
        return sum(self.points.values())

    @property
    def seconds(self) -> float:
        """Alone: the longer of its compute and its reads (a read overlaps the compute of the layer before)."""
        return max(self.compute_s, self.read_s)


def _config(model_dir: Path) -> dict[str, Any]:
    config = read_config(model_dir, BadInput, f"{model_dir} has no config.json: the estimate needs the model's shape")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _int(config: dict[str, Any], *names: str, default: int | None = None) -> int | None:
    return next((config[n] for n in names if isinstance(config.get(n), int)), default)


def attention_scores(config: dict[str, Any], tokens: int) -> float:
    """FLOPs of eager attention's scores and their weighted sum over T x T (MLA's head dims where the
    config has them: DeepSeek-V3's qk_nope + qk_rope and v_head_dim)."""
    heads = _int(config, "num_attention_heads") or 0
    hidden = _int(config, "hidden_size") or 0
    head = _int(config, "head_dim", default=hidden // heads if heads else 0) or 0
    qk = (_int(config, "qk_nope_head_dim", default=0) or 0) + (_int(config, "qk_rope_head_dim", default=0) or 0)
    v = _int(config, "v_head_dim", default=head) or head
    return 2.0 * tokens * tokens * heads * ((qk or head) + v)


def replay_units(model_dir: Path, tokens: int, read_bytes: dict[str, int], hw: str) -> list[Unit]:
    """The units in forward order (the model-level one first), each point's FLOPs at `tokens` as the
    replay runs it on `hw`, and the bytes it reads (`read_bytes`: weights and golden captures by unit:
    `embed`, `layer_N`, `lm_head`)."""
    config = _config(model_dir)
    tensors = checkpoint_tensors(model_dir)
    experts = _int(config, "num_local_experts", "num_experts", "n_routed_experts", default=1) or 1
    top_k = _int(config, "num_experts_per_tok", "moe_topk", default=1) or 1
    share = 1.0 if hw in ALL_EXPERTS else min(1.0, top_k / experts)
    hidden = _int(config, "hidden_size") or 0
    per: dict[Any, dict[str, int]] = {}  # layer (None: model level) -> class -> matrix elements
    for t in tensors:
        if t.dtype not in FLOATS and not t.name.endswith("weight"):
            continue  # quantisation scales and the like: no multiply of their own
        m = _LAYER.search(t.name)
        slot = per.setdefault(int(m.group(1)) if m else None, {})
        cls = tensor_class(t.name)
        slot[cls] = slot.get(cls, 0) + (_matrix(t) if cls != "embedding" else t.numel)
    T = float(tokens)
    norm = NORM_FLOPS * T * hidden
    scores = attention_scores(config, tokens)
    units = []
    model = per.get(None, {})
    head = model.get("lm_head") or model.get("embedding", 0)  # tied embeddings: the logits read the embedding
    units.append(
        Unit(
            MODEL,
            None,
            {"embedding": T * hidden, "rotary": 4 * T * hidden, "final_norm": norm, "logits": 2 * T * head},
            read_bytes.get("embed", 0) + read_bytes.get("lm_head", 0),
        )
    )
    for layer in sorted(k for k in per if k is not None):
        w = per[layer]
        attention = 2 * T * w.get("attention", 0) + scores
        points = {"input_norm": norm, "attention": attention, "post_attn_norm": norm}
        if w.get("experts"):
            router = 2 * T * w.get("router", 0)
            routed = 2 * T * w["experts"] * share
            shared = 2 * T * w.get("shared_experts", 0)
            block = router + routed + shared
            points.update(router=router, experts=routed, moe=block)
            if shared:
                points["shared_experts"] = shared
        else:
            block = 2 * T * w.get("mlp", 0)
            points["mlp"] = block
        points["output"] = 2 * norm + attention + block
        units.append(Unit(f"layer_{layer}", layer, points, read_bytes.get(f"layer_{layer}", 0)))
    return units


def _matrix(t: Tensor) -> int:
    """Elements a matrix multiply reads of a weight (a vector, a norm's or a bias, none)."""
    return t.numel if len(t.shape) >= 2 else 0


# -- throughput --------------------------------------------------------------------------------------
@dataclass
class Throughput:
    """Seconds of a point: its FLOPs at `flops_per_s`, plus `per_call_s` for each forward, plus
    `per_point_s` beside it (the judge, pytest); a unit's reads at `read_bps`, while the layer before
    computes. `source` and `notes`: where the figures come from, in words."""

    flops_per_s: float
    per_call_s: float
    per_point_s: float
    read_bps: float
    source: str
    notes: list[str] = field(default_factory=list)
    compile_s: float = 0.0  # a compiled backend's graphs, per shard without a trace cache (a report's figure)

    def to_json(self) -> dict[str, Any]:
        return {
            "flops_per_s": self.flops_per_s,
            "per_call_s": self.per_call_s,
            "per_point_s": self.per_point_s,
            "read_bytes_per_s": self.read_bps,
            "compile_s": self.compile_s,
            "source": self.source,
            "notes": self.notes,
        }


def scale_cores(flops_per_s: float, measured_on: int | None, cores: int | None) -> tuple[float, str | None]:
    """A CPU's FLOP rate from `measured_on` cores to `cores` (linear: an upper bound); the note saying so."""
    if not cores or not measured_on or cores == measured_on:
        return flops_per_s, None
    return flops_per_s * cores / measured_on, f"scaled linearly from {measured_on} cores to --cores {cores}"


def calibrate(model_dir: Path, tokens: int, dtype: str | None, cores: int | None) -> Throughput:
    """This host's figures at the model's shape: a [tokens, hidden] x [hidden, hidden] GEMM in the run's
    dtype (the FLOP rate, and the cost of a call from a tiny one), the judge's metric pass on one output
    of that shape, and a cold read of the checkpoint's largest file."""
    import torch

    from ..dtypes import parse_dtype
    from ..judge.tensors import compare_tensors

    config = _config(model_dir)
    hidden = _int(config, "hidden_size") or 64
    run = parse_dtype(dtype) if dtype else torch.float32
    width = min(hidden, 8192)
    rows = min(tokens, 4096)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, width, generator=gen).to(run)
    b = torch.randn(width, width, generator=gen).to(run)
    rate = 2.0 * rows * width * width / _timed(lambda: a @ b)
    tiny = torch.randn(1, 8, generator=gen).to(run)
    per_call = _timed(lambda: tiny @ tiny.T)
    x = torch.randn(rows, hidden, generator=gen)
    per_point = _timed(lambda: compare_tensors(x, x + 1e-3))
    threads = torch.get_num_threads()
    rate, scaled = scale_cores(rate, threads, cores)
    read_bps, read_note = cold_read(model_dir)
    notes = [
        f"a {rows}x{width}x{width} GEMM in {str(run).removeprefix('torch.')} on {threads} threads; not counted: the "
        "process start and pytest's own cost per item (--from-report measures them)"
    ]
    notes += [n for n in (scaled, read_note) if n]
    return Throughput(rate, per_call, per_point, read_bps, "a calibration on this host", notes)


def _timed(fn: Any, at_least: float = 0.05, batches: int = 5) -> float:
    """Seconds of one call of `fn`: the fastest of `batches` batches of calls, each taking `at_least`
    seconds (after a warm-up), so that a neighbour's burst on a shared host does not count."""
    fn()
    best = math.inf
    for _ in range(batches):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= at_least or n >= 10_000:
                break
        best = min(best, elapsed / n)
    return best


def cold_read(model_dir: Path) -> tuple[float, str]:
    """Bytes per second reading up to READ_SAMPLE of the checkpoint's largest file, its pages dropped
    from the page cache first where the OS allows it (else a warm read: said)."""
    files = sorted(Path(model_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    if not files:
        return math.inf, "no file to read"
    path = files[-1]
    size = min(path.stat().st_size, READ_SAMPLE)
    with path.open("rb", buffering=0) as fh:
        dropped = hasattr(os, "posix_fadvise")
        if dropped:
            os.posix_fadvise(fh.fileno(), 0, size, os.POSIX_FADV_DONTNEED)
        start, read = time.perf_counter(), 0
        while read < size:
            chunk = fh.read(min(16 * 2**20, size - read))
            if not chunk:
                break
            read += len(chunk)
        seconds = max(time.perf_counter() - start, 1e-9)
    how = "cold" if dropped else "possibly cached"
    return read / seconds, f"reads: {gib(read)} of {path.name} at {read / seconds / 1e9:.2g} GB/s ({how})"


def from_report(path: Path, model_dir: Path, model_type: str | None, cores: int | None) -> Throughput:
    """The FLOP rate and costs a previous run of this model measured (see the module docstring), its
    points' FLOPs taken at its own tokens and on its own backend; BadInput where the report is not one of
    this model or holds no measured point."""
    from ..report.files import read_report, report_rows
    from ..report.rows import PointRow

    try:
        report = read_report(path)
    except ValueError as exc:
        raise BadInput(f"--from-report: {exc}") from None
    if model_type and report.get("model_type") not in (None, model_type):
        raise BadInput(
            f"--from-report {path} is a report of a {report.get('model_type')} model, and --model is a {model_type}"
        )
    tokens = report.get("tokens")
    if not isinstance(tokens, int):
        raise BadInput(f"--from-report {path}: its report does not say its tokens (written by an older moe-parity)")
    hw = str(report.get("hw", "cpu"))
    by_layer = {u.layer: u for u in replay_units(model_dir, tokens, {}, hw)}
    x, y = [], []
    rows = [r for r in report_rows(report) if r.kind != "op"]
    forwards = sum(r.seconds for r in rows if isinstance(r, PointRow))  # decode steps' too: the wall holds them
    for row in rows:
        unit = by_layer.get(row.layer)
        measured = isinstance(row, PointRow) and row.step is None and row.seconds > 0
        if measured and unit is not None and row.component in unit.points:
            x.append(unit.points[row.component])
            y.append(row.seconds)
    if len(x) < 2:
        raise BadInput(f"--from-report {path}: it holds no measured point of this model to take a throughput from")
    rate, per_call, flat = _line(x, y)
    workers = int(report.get("workers") or 1)
    wall = report.get("wall_seconds")
    beside = max(0.0, (wall * workers - forwards) / len(rows)) if isinstance(wall, int | float) else 0.0
    notes = [f"{len(y)} points' measured seconds at {tokens} tokens on --hw {hw}", *([flat] if flat else [])]
    if isinstance(wall, int | float):
        notes.append(f"{duration(beside)} beside each point's forward (the run's wall less its forwards)")
    if hw in CPU_BACKENDS:
        rate, scaled = scale_cores(rate, (report.get("host") or {}).get("threads"), cores)
        notes += [scaled] if scaled else []
    elif cores:
        notes.append(f"not scaled to --cores {cores}: --hw {hw} runs its points on its device")
    compiled = sum(float(r.backend.get("compile_s", 0.0)) for r in report_rows(report) if isinstance(r, PointRow))
    if compiled:
        notes.append(f"its graphs compiled in {duration(compiled)}: counted once per shard (no trace cache)")
    read_bps, read_note = cold_read(model_dir)
    return Throughput(rate, per_call, beside, read_bps, f"the report {path}", [*notes, read_note], compiled)


def _line(x: list[float], y: list[float]) -> tuple[float, float, str | None]:
    """Least squares y = x / rate + c, c >= 0: (rate, c, a note where the points do not make such a line)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx if sxx else 0.0
    c = my - slope * mx
    if slope > 0 and c >= 0:
        return 1.0 / slope, c, None
    if slope > 0:  # a line through the origin
        return sum(a * a for a in x) / sum(a * b for a, b in zip(x, y, strict=True)), 0.0, None
    return (
        sum(x) / sum(y),
        0.0,
        (
            "the points' seconds do not grow with their FLOPs (each call's own cost dominates): the rate is their "
            "FLOPs over their seconds, which overstates the time of bigger points"
        ),
    )


# -- shards ------------------------------------------------------------------------------------------
def time_units(units: list[Unit], speed: Throughput) -> None:
    """Each unit's compute seconds (its points' forwards and what each costs beside) and read seconds."""
    for u in units:
        u.compute_s = sum(f / speed.flops_per_s + speed.per_call_s + speed.per_point_s for f in u.points.values())
        u.read_s = u.read_bytes / speed.read_bps if speed.read_bps else 0.0


def wall(units: list[Unit], speed: Throughput, setup_s: float, workers: int) -> float:
    """A shard's wall: its setup and compile, then its compute shared among its workers (xdist's
    loadgroup gives each a layer at a time) or its reads, which the workers share, where longer."""
    compute = sum(u.compute_s for u in units) / max(1, min(workers, len(units)))
    return setup_s + speed.compile_s + max(compute, sum(u.read_s for u in units))


def partitions(costs: list[float]) -> list[list[tuple[int, int]]]:
    """For every number of shards n (index n - 1), the contiguous split of `costs` whose largest sum is
    the smallest, as [start, end) pairs: an exact dynamic programme, O(units^3)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(n + 1)]  # best[j][i]: first i units in j shards
    cut = [[0] * (n + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                worst = max(best[j - 1][k], prefix[i] - prefix[k])
                if worst < best[j][i]:
                    best[j][i], cut[j][i] = worst, k
    out = []
    for j in range(1, n + 1):
        bounds, i = [], n
        for jj in range(j, 0, -1):
            k = cut[jj][i]
            bounds.append((k, i))
            i = k
        out.append(bounds[::-1])
    return out


def selection(units: list[Unit]) -> str:
    """A shard's --parity-layers: `model` for the model-level unit, then its layers as one range."""
    words = [MODEL] if any(u.layer is None for u in units) else []
    layers = [u.layer for u in units if u.layer is not None]
    if layers:
        words.append(f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0]))
    return ",".join(words)


@dataclass
class ShardPlan:
    """The shards of a nightly and their walls: `shards[i]` = (its --parity-layers, its seconds)."""

    units: list[Unit]
    speed: Throughput
    shards: list[tuple[str, float]]
    setup_s: float
    workers: int
    budget_s: float | None = None
    to_fit: int | None = None  # the fewest shards whose longest fits the budget (None: none does)

    @property
    def longest(self) -> float:
        return max(s for _, s in self.shards)

    @property
    def one_runner(self) -> float:
        return wall(self.units, self.speed, self.setup_s, self.workers)

    @property
    def fits(self) -> bool | None:
        return None if self.budget_s is None else self.longest <= self.budget_s

    def to_json(self) -> dict[str, Any]:
        return {
            "throughput": self.speed.to_json(),
            "units": [
                {
                    "unit": u.name,
                    "flops": u.flops,
                    "read_bytes": u.read_bytes,
                    "compute_s": round(u.compute_s, 3),
                    "read_s": round(u.read_s, 3),
                }
                for u in self.units
            ],
            "shards": [{"parity_layers": sel, "seconds": round(sec, 3)} for sel, sec in self.shards],
            "setup_s": self.setup_s,
            "workers": self.workers,
            "longest_s": round(self.longest, 3),
            "one_runner_s": round(self.one_runner, 3),
            "budget_s": self.budget_s,
            "shards_to_fit": self.to_fit,
            "fits": self.fits,
        }


def plan_shards(
    units: list[Unit],
    speed: Throughput,
    *,
    shards: int | None,
    budget_s: float | None,
    setup_s: float = 0.0,
    workers: int = 1,
) -> ShardPlan:
    """`shards` balanced shards (or, with a budget alone, the fewest that fit it); each shard's wall is
    its setup, its compile, and its units' seconds shared among its workers."""
    time_units(units, speed)
    splits = partitions([u.seconds for u in units])

    def walls(bounds: list[tuple[int, int]]) -> list[tuple[str, float]]:
        return [(selection(units[a:b]), wall(units[a:b], speed, setup_s, workers)) for a, b in bounds]

    to_fit = None
    if budget_s is not None:
        to_fit = next((n + 1 for n, b in enumerate(splits) if max(s for _, s in walls(b)) <= budget_s), None)
    count = shards or to_fit or len(units)
    if count > len(units):
        raise BadInput(f"--shards {count}: the model has {len(units)} units to share (its layers and the model-level "
                       "points); ask for at most that many")  # fmt: skip
    return ShardPlan(units, speed, walls(splits[count - 1]), setup_s, workers, budget_s, to_fit)


def shard_lines(plan: dict[str, Any], hw: str, tokens: int) -> list[str]:
    """The plan (:meth:`ShardPlan.to_json`) in words: the cost model, the throughput and its source, each
    shard, the budget."""
    layers = [u for u in plan["units"] if u["unit"] != MODEL]
    heavy = max(layers, key=lambda u: u["flops"], default=None)
    experts = "top-k experts per token"
    if hw in ALL_EXPERTS:
        experts = "every expert for every token, as static-shape graphs run them"
    speed = plan["throughput"]
    model = next(u for u in plan["units"] if u["unit"] == MODEL)
    lines = [
        f"replay at {tokens} tokens on --hw {hw} ({experts}): "
        + (f"up to {flops(heavy['flops'])} and {gib(heavy['read_bytes'])} read per layer ({heavy['unit']}); "
           if heavy else "")
        + f"the model-level points {flops(model['flops'])}",
        f"throughput from {speed['source']}: {flops(speed['flops_per_s'])}/s, {duration(speed['per_call_s'])} a call, "
        f"{duration(speed['per_point_s'])} beside each point; reads {speed['read_bytes_per_s'] / 1e9:.3g} GB/s",
        *(f"  {note}" for note in speed["notes"]),
    ]  # fmt: skip
    extra = []
    if plan["setup_s"]:
        extra.append(f"{duration(plan['setup_s'])} setup")
    if speed["compile_s"]:
        extra.append(f"{duration(speed['compile_s'])} compile")
    if plan["workers"] > 1:
        extra.append(f"{plan['workers']} workers each")
    shards = plan["shards"]
    lines.append(
        f"{counted(len(shards), 'shard')}, balanced by each unit's cost"
        + (f" ({', '.join(extra)})" if extra else "")
        + ":"
    )
    width = max(len(s["parity_layers"]) for s in shards)
    lines += [f"  --parity-layers {s['parity_layers']:<{width}}  about {duration(s['seconds'])}" for s in shards]
    longest, one = duration(plan["longest_s"]), duration(plan["one_runner_s"])
    lines.append(f"longest shard: about {longest}; one runner for all: about {one}")
    if plan["budget_s"] is not None:
        budget, fit = duration(plan["budget_s"]), plan["shards_to_fit"]
        if fit is None:
            lines.append(f"--budget {budget}: no number of shards fits (one unit per shard is still longer)")
        else:
            fewest = f"{fit} shard fits" if fit == 1 else f"{fit} shards fit"
            lines.append(f"--budget {budget}: {fewest} (the fewest whose longest is within it)")
        if not plan["fits"]:
            lines.append(f"these {len(shards)} shards do not fit --budget {budget}")
    return lines
