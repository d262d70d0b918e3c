"""The time to the culprit at depth: what a user waits for between typing `pytest -x --parity-drill auto`
and reading the culprit's line, against the least any tool must do to know where the port goes wrong.

    python benchmarks/bench_time_to_culprit.py [--tokens 256] [--hidden 256] [--layers 48] [--fault-layer 40]
                                               [--repeat 1] [--keep DIR]

A tiny qwen3_moe checkpoint of `--layers` decoder layers at `--hidden` width (experts at half of it,
8 experts, top 2) is written, its golden recorded in float32 on `--tokens` tokens, and a candidate made
from it with one weight fault: layer `--fault-layer`'s input norm scaled by 1.25 (`tests/faults.py`'s
`scale`). Then, each in a fresh process (OMP_NUM_THREADS=1 unless set, as on the shared 2-core host),
`--repeat` rounds interleaved, the least kept:

- **pytest**: `pytest --golden-dir G --model C --hw cpu --dtype bfloat16 --no-parity-weights -x
  --parity-drill auto -p no:cacheprovider`, its stdout streamed: the wall from the process's start to
  the line `culprit: ... introduced the divergence`, and to its exit. A timing plugin (`-p ttc_timing`,
  which imports torch and transformers first, to tell their imports apart) stamps where the time goes:
  python and pytest, those imports, the plugins', the session (golden manifest, backend set up),
  collection, the items before the failing layer (and their seconds by kind), the failing layer's items
  before the failing point, the failing point's replay and verdict, the drill (`DrillItems.failed`), and
  what follows up to the culprit's line;
- **the floor**: import torch and transformers, then `from_pretrained` of the checkpoint cut to layers 0
  to `--fault-layer` (`num_hidden_layers`: the other layers are not read; transformers' own reading and
  conversion into bf16) and one forward of the golden's tokens through them: the least any tool must do
  to know that layer `--fault-layer` is where the numbers leave the reference.

Both run as a user's install does, with their modules' bytecode cached (PYTHONDONTWRITEBYTECODE is
dropped from their environment). The ratio is pytest's time to the culprit's line over the floor's wall
(goal: at most 1.5), and the same after torch's and transformers' imports on both sides. A closing line
estimates the same at Qwen3-30B-A3B's shapes from `bench_real_shapes.py`'s figures at 2 and 4 layers.

The CPU seconds of both (every thread, pytest's to the failing point's end, the drill included) are
printed beside the walls: on a shared host the walls move with the others' load, the CPU seconds far
less. `--pytest-arg=--no-parity-layer-first` times the run of every item. Measured on this project's
2-core host, quiet (OMP_NUM_THREADS=1, hidden 256, 48 layers, fault at 40, fp32 golden, bf16 candidate;
best of 3 at 256 tokens, of 2 at 2048; the floor measured beside each):

                          pytest to the culprit  the floor  wall ratio (after imports)  CPU ratio
    256 tokens, layer-first     7.10 s           4.95 s     x1.43 (x1.67)               x1.49
    256 tokens, every item      8.20 s           4.87 s     x1.68 (x2.06)               x1.73
    2048 tokens, layer-first   19.13 s          16.58 s     x1.15 (x1.22)               x1.23
    2048 tokens, every item    30.05 s          17.39 s     x1.73 (x1.88)               x1.78

Layer-first (the default under -x: `plugin/layer_first.py`) runs each layer before the fault once and
judges its output and components as that run made them, where every item replays its own module (the
attention twice, the experts three times) and is judged: at 256 tokens ~50 ms a layer against ~140, at
2048 ~0.34 s against ~0.7. Where the rest goes at 256 tokens: ~0.2 s python and pytest, ~2 s torch's
and transformers' imports, 0.3 s the session, ~2 s the first item (`embedding`: the backend's start,
transformers' modeling code imported and the skeleton built, which the floor pays in its read too), the
drill 0.1 s. (Earlier figures, every item, at a load of ~2.5: 10.4 s against 5.2 s, x1.99.) Each golden
file's sha256 is computed ahead in a background thread (`GoldenStore.plan`), and a decoder layer's read
does not walk the whole model's skeleton (`lazy_model._UnitView`).

At Qwen3-30B-A3B's real shapes the reads dominate and the run overlaps them with the forwards: from
`bench_real_shapes.py`'s figures for every item (2 and 4 layers: replay 8.7 s + 1.05 s a layer, read +
forward 3.7 s + 1.85 s a layer) pytest reaches the culprit at layer 40 in ~52 s against a floor of ~80 s
(x0.65); layer-first does less.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CULPRIT = re.compile(r"^\s+culprit: (\S+) introduced the divergence")
GOAL = 1.5

# The timing plugin of the pytest process (-p ttc_timing): stamps (perf_counter, since the process
# started: START_NS is the parent's time.time_ns() at launch) at the hooks where the run's parts meet,
# written as JSON at unconfigure.
TIMING_PLUGIN = r"""
import json, os, time
import pytest

START = int(os.environ["TTC_START_NS"]) / 1e9
OUT = os.environ["TTC_OUT"]
FAULT = os.environ["TTC_FAILING"]
stamps = {"plugin loaded": time.time() - START}
import torch, transformers  # here, to tell their imports from the rest (the session would import them)

stamps["torch imported"] = time.time() - START
items = []  # (nodeid, start, end)
drill = [0.0, 0.0]


def now():
    return time.time() - START


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    stamps["configure start"] = now()


def pytest_sessionstart(session):  # after every plugin's configure: the parity session is made
    stamps["configure end"] = now()
    from pytest_moe_parity.drill.items import DrillItems

    failed = DrillItems.failed

    def timed(self, point):
        drill[0] = now()
        try:
            return failed(self, point)
        finally:
            drill[1] = now()

    DrillItems.failed = timed


def pytest_collection(session):
    stamps["collection start"] = now()


def pytest_collection_finish(session):
    stamps["collection end"] = now()


def pytest_runtest_logstart(nodeid, location):
    items.append([nodeid, now(), None])


def pytest_runtest_logfinish(nodeid, location):
    items[-1][2] = now()
    if nodeid.endswith(FAULT):  # its failure text, the culprit's line, follows at once
        stamps["cpu at the failing point"] = time.process_time()


def pytest_sessionfinish(session, exitstatus):
    stamps["session finish"] = now()


def pytest_unconfigure(config):
    stamps["unconfigure"] = now()
    with open(OUT, "w") as fh:
        json.dump({"stamps": stamps, "items": items, "drill": drill}, fh)
"""

FLOOR_CHILD = r"""
import json, os, sys, time
START = int(os.environ["TTC_START_NS"]) / 1e9
import torch, transformers
imported = time.time() - START  # as pytest's: torch and transformers, then what the reading needs
from transformers import AutoConfig, AutoModelForCausalLM
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
model_dir, last, ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
config = AutoConfig.from_pretrained(model_dir)
config.num_hidden_layers = last + 1  # layers 0 to `last`: the others are not read
model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.bfloat16,
                                             attn_implementation="eager")
read = time.time() - START
with torch.no_grad():
    model.model(input_ids=torch.tensor(ids), use_cache=False)
wall = time.time() - START
print(json.dumps({"imports_s": imported, "read_s": read - imported, "forward_s": wall - read, "wall_s": wall,
                  "cpu_done_s": time.process_time()}))
"""


def _env(work: Path) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TTC_START_NS": str(time.time_ns())}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's install runs: its modules' bytecode cached
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _children_cpu() -> float:
    """User and system seconds of this process's finished children (one child runs at a time)."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def build(work: Path, hidden: int, layers: int, tokens: int, fault_layer: int) -> tuple[Path, Path, Path]:
    """The checkpoint, its float32 golden and the candidate with the weight fault (reused under --keep)."""
    from faults import edit_checkpoint, scale

    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model

    model, golden, candidate = work / "model", work / f"golden-{tokens}", work / f"candidate-{fault_layer}"
    overrides = {
        "hidden_size": hidden,
        "moe_intermediate_size": hidden // 2,
        "intermediate_size": hidden * 2,
        "max_position_embeddings": max(512, 2 * tokens),
    }
    if not (model / "config.json").is_file():
        write_tiny_model("qwen3_moe", model, layers=layers, overrides=overrides, max_shard_size="20MB")
    if not (golden / "manifest.json").is_file():
        record_golden(model, golden, seq_len=tokens, overwrite=True)
    if not (candidate / "config.json").is_file():
        edit_checkpoint(model, candidate, scale("input_layernorm", fault_layer, 1.25))
    return model, golden, candidate


def pytest_run(work: Path, golden: Path, candidate: Path, failing: str, extra: list[str]) -> dict:
    """`pytest -x --parity-drill auto` (and `extra`) in a fresh process: when the culprit line came, when it
    exited, and the timing plugin's stamps."""
    (work / "ttc_timing.py").write_text(TIMING_PLUGIN)
    out = work / "ttc_timing.json"
    argv = [sys.executable, "-m", "pytest", "--golden-dir", str(golden), "--model", str(candidate), "--hw", "cpu",
            "--dtype", "bfloat16", "--no-parity-weights", "-x", "--parity-drill", "auto", "-p", "no:cacheprovider",
            "-p", "ttc_timing", "--rootdir", str(work), *extra]  # fmt: skip
    env = {**_env(work), "TTC_OUT": str(out), "TTC_FAILING": failing}
    start = int(env["TTC_START_NS"]) / 1e9
    cpu = _children_cpu()
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    culprit, lines = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        match = CULPRIT.match(line)
        if match and culprit is None:
            culprit = (time.time() - start, match.group(1))
    proc.wait()
    wall, cpu = time.time() - start, _children_cpu() - cpu
    if culprit is None:
        raise SystemExit("no culprit line in pytest's output:\n" + "".join(lines[-60:]))
    return {"culprit_s": culprit[0], "culprit": culprit[1], "wall_s": wall, "cpu_s": cpu, **json.loads(out.read_text())}


def floor_run(work: Path, model: Path, golden: Path, fault_layer: int) -> dict:
    ids = json.loads((golden / "manifest.json").read_text())["inputs"]["input_ids"]
    argv = [sys.executable, "-c", FLOOR_CHILD, str(model), str(fault_layer), json.dumps(ids)]
    cpu = _children_cpu()
    proc = subprocess.run(argv, cwd=work, env=_env(work), capture_output=True, text=True, check=False)
    try:
        return {**json.loads(proc.stdout.strip().splitlines()[-1]), "cpu_s": _children_cpu() - cpu}
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:]) from None


def breakdown(run: dict, failing: str, fault_layer: int) -> list[tuple[str, float]]:
    """Where pytest's time to the culprit line went, part by part, in seconds."""
    s, items = run["stamps"], run["items"]
    layer = f"layer_{fault_layer}."
    first = next(i for i, (nodeid, _, _) in enumerate(items) if layer in nodeid)
    point = next(i for i, (nodeid, _, _) in enumerate(items) if nodeid.endswith(failing))
    drill = run["drill"][1] - run["drill"][0]
    before = items[first][1] - s["collection end"]
    layer_items = items[point][1] - items[first][1]
    failing_s = items[point][2] - items[point][1] - drill
    return [
        ("python and pytest", s["plugin loaded"]),
        ("torch and transformers' imports", s["torch imported"] - s["plugin loaded"]),
        ("the other plugins' imports", s["configure start"] - s["torch imported"]),
        ("the session (the golden, the backend, its modeling)", s["configure end"] - s["configure start"]),
        ("collection", s["collection end"] - s["collection start"]),
        (f"{first} items before layer {fault_layer}", before),
        (f"layer {fault_layer}'s {point - first} items before {failing}", layer_items),
        (f"{failing}: its replay and verdict", failing_s),
        ("the drill (--parity-drill auto)", drill),
        ("after: the report, the failure text", run["culprit_s"] - items[point][2]),
    ]


# bench_real_shapes.py's Qwen3-30B-A3B figures (its docstring's table, after imports, 256 tokens, bf16):
# layers built -> the replay's wall, and one read + one forward of the model (LazyModel, one layer held)
REAL_REPLAY = {2: 10.8, 4: 12.9}
REAL_READ_FORWARD = {2: 3.8 + 3.6, 4: 6.9 + 4.2}


def _fit(figures: dict[int, float]) -> tuple[float, float]:
    """(fixed, per layer) of a straight line through two (layers, seconds) figures."""
    (a, ta), (b, tb) = sorted(figures.items())
    per = (tb - ta) / (b - a)
    return ta - a * per, per


def real_estimate(fault_layer: int, drill_share: float) -> str:
    """pytest's time to the culprit at Qwen3-30B-A3B's shapes against the floor's, from bench_real_shapes.py's
    figures at 2 and 4 layers (each a fixed part and a per-layer part), to layer `fault_layer`; the drill
    taken at the share of a layer's items it took here."""
    (fixed, per), (floor_fixed, floor_per) = _fit(REAL_REPLAY), _fit(REAL_READ_FORWARD)
    layers = fault_layer + 1
    pytest_s = fixed + layers * per + drill_share * per
    floor = floor_fixed + layers * floor_per
    return (
        f"at Qwen3-30B-A3B's shapes (bench_real_shapes.py, after imports: replay {fixed:.1f} s + {per:.2f} s a "
        f"layer, read + forward {floor_fixed:.1f} s + {floor_per:.2f} s a layer; the drill {drill_share:.2f} of a "
        f"layer's items, as here), fault at layer {fault_layer}: pytest ~{pytest_s:.0f} s against ~{floor:.0f} s, "
        f"x{pytest_s / floor:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--fault-layer", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="build (or reuse) the checkpoint and goldens here")
    ap.add_argument("--pytest-arg", action="append", default=[], help="added to pytest's line (repeatable), "
                    "e.g. --pytest-arg=--no-parity-layer-first")  # fmt: skip
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-ttc-"))
    work.mkdir(parents=True, exist_ok=True)
    failing = f"layer_{args.fault_layer}.input_norm"
    try:
        model, golden, candidate = build(work, args.hidden, args.layers, args.tokens, args.fault_layer)
        runs, floors = [], []
        for _ in range(args.repeat):
            runs.append(pytest_run(work, golden, candidate, failing, args.pytest_arg))
            floors.append(floor_run(work, model, golden, args.fault_layer))
        run = min(runs, key=lambda r: r["culprit_s"])
        floor = min(floors, key=lambda r: r["wall_s"])
        print(f"qwen3_moe, {args.layers} layers, hidden {args.hidden}, {args.tokens} tokens, fp32 golden, bf16 "
              f"candidate, a weight fault at {failing} (best of {args.repeat})")  # fmt: skip
        ratio = run["culprit_s"] / floor["wall_s"]
        # the same without torch's and transformers' imports on either side
        after = (run["culprit_s"] - run["stamps"]["torch imported"]) / (floor["wall_s"] - floor["imports_s"])
        line = " ".join(["pytest -x --parity-drill auto", *args.pytest_arg])
        print(f"  {line}: culprit {run['culprit']} at {run['culprit_s']:.2f} s (exit at {run['wall_s']:.2f} s)")
        print(f"  floor: {floor['wall_s']:.2f} s (imports {floor['imports_s']:.2f} s, read of layers "
              f"0-{args.fault_layer} {floor['read_s']:.2f} s, forward {floor['forward_s']:.2f} s)")  # fmt: skip
        cpu = run["stamps"]["cpu at the failing point"]
        print(f"  CPU seconds (every thread): pytest {cpu:.2f} s to the failing point ({run['cpu_s']:.2f} s to exit), "
              f"the floor {floor['cpu_done_s']:.2f} s: x{cpu / floor['cpu_done_s']:.2f}")  # fmt: skip
        print(f"  ratio x{ratio:.2f} (goal <= {GOAL}: {'ok' if ratio <= GOAL else 'MISS'}); after the imports of "
              f"torch and transformers x{after:.2f}")  # fmt: skip
        parts = breakdown(run, failing, args.fault_layer)
        for name, seconds in parts:
            print(f"    {seconds:7.2f} s  {name}")
        items = run["items"]
        by_kind: dict[str, float] = {}
        for nodeid, began, ended in items:
            if f"layer_{args.fault_layer}." not in nodeid:
                kind = nodeid.rsplit(".", 1)[-1] if "layer_" in nodeid else nodeid.split("::")[-1]
                by_kind[kind] = by_kind.get(kind, 0.0) + ended - began
        print("    the items by kind: " + ", ".join(f"{k} {v:.2f} s" for k, v in by_kind.items()))
        per_layer = (items[-1][2] - items[0][1]) / (args.fault_layer + 1)
        print(real_estimate(args.fault_layer, dict(parts)["the drill (--parity-drill auto)"] / per_layer))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
