"""Replay gives memory back: a run over every layer must hold about what a run over one layer holds,
and cost about what loading the model and running it once costs.

    python benchmarks/bench_replay.py [--layers 48] [--repeat 1] [--keep DIR] [--breakdown]

A Mixtral-style checkpoint (hidden 512, 16 experts of intermediate 512, ~54 MB of float32 weights per
layer, hub layout sharded at 200 MB) and its golden (32 tokens, float32) are written once; then, each
in a fresh process, with a bf16 candidate:

1. `pytest --golden-dir G --dtype bfloat16 -k "layer_2."` (one layer),
2. `pytest --golden-dir G --dtype bfloat16` (every point of every layer),
3. `AutoModelForCausalLM.from_pretrained(dtype=bfloat16)` + one forward of the golden's tokens.

Peak RSS is the process's own high-water mark (VmHWM: ru_maxrss would carry the parent's peak
across fork and exec); wall time is the whole process, imports included, and after imports.
Targets: full run <= 1.3x the one-layer run's peak RSS, and <= 1.5x the wall time of (3).

`--breakdown` then times the parts of one more full run (backend start, candidate forwards, judging,
golden reads, the rest), exclusive of each other, with the main thread's and the process's CPU time:
where the process uses far less CPU than the cores give, its threads wait for the GIL, and only less
Python work (not more threads) makes the run faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK = """
def _peak_mb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
"""

PYTEST_CHILD = (
    PEAK
    + """
import json, sys, time
t0 = time.perf_counter()
import pytest, torch, transformers
t1 = time.perf_counter()
code = pytest.main(sys.argv[1:])
t2 = time.perf_counter()
print(json.dumps({"code": int(code), "after_imports_s": t2 - t1, "peak_rss_mb": _peak_mb()}))
"""
)

BASELINE_CHILD = (
    PEAK
    + """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from transformers import AutoModelForCausalLM
t1 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, attn_implementation="eager")
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    model(input_ids=ids, use_cache=False)
t2 = time.perf_counter()
print(json.dumps({"code": 0, "after_imports_s": t2 - t1, "peak_rss_mb": _peak_mb()}))
"""
)


# a replay's parts timed, each exclusive of the others (bench_real_shapes.py's breakdown too)
TIMED = """
import collections, json, sys, time
import pytest, torch, transformers
from pytest_moe_parity.backends.hf import TorchBackend
from pytest_moe_parity.golden.store import GoldenStore
from pytest_moe_parity.replay.runner import ParityRunner

spent, nested = collections.Counter(), []

def timed(cls, name, part):  # exclusive time: a timed call inside another counts once, as its own part
    inner = getattr(cls, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        nested.append(0.0)
        try:
            return inner(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            spent[part] += took - nested.pop()
            if nested:
                nested[-1] += took
    setattr(cls, name, wrapper)
"""

BREAKDOWN_CHILD = (
    TIMED
    + """
timed(TorchBackend, "start", "backend start: modeling import, meta skeleton")
timed(TorchBackend, "run", "candidate forwards, and waits for a layer read ahead")
timed(ParityRunner, "judge", "judging")
timed(GoldenStore, "load", "golden reads")
wall, main_cpu, cpu = time.perf_counter(), time.thread_time(), time.process_time()
code = pytest.main(sys.argv[1:])
wall, main_cpu, cpu = time.perf_counter() - wall, time.thread_time() - main_cpu, time.process_time() - cpu
spent["pytest, the plugin and the rest"] = wall - sum(spent.values())
print(json.dumps({"code": int(code), "after_imports_s": wall, "main_thread_cpu_s": main_cpu, "process_cpu_s": cpu,
                  "parts": spent}))
"""
)


def run_child(script: str, *args: str, cwd: Path | None = None) -> tuple[dict, str]:
    """Run `script` in a fresh interpreter (OMP_NUM_THREADS=2 unless set): its closing JSON line plus
    `wall_s`, and its stdout; what it printed, and exit, where it gave no such line or a code."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - start
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:]) from None
    if out["code"] != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return {**out, "wall_s": wall}, proc.stdout


def child(script: str, *args: str) -> dict:
    return run_child(script, *args)[0]


def write_checkpoint(root: Path, layers: int, quant: str | None = None) -> Path:
    """The Mixtral-style checkpoint of `layers` layers (written once under `root`); with `quant` (a
    `tiny-model --quant` scheme, e.g. fp8-block:128), in that scheme's hub layout."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    model_dir = root / (f"mixtral-{layers}" + (f"-{quant.replace(':', '_')}" if quant else ""))
    if not (model_dir / "config.json").is_file():
        config = MixtralConfig(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=512,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            num_local_experts=16,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if quant:
            from pytest_moe_parity.record.quantized import write_quantized

            write_quantized(model, model_dir, quant, kv=False, seed=0, max_shard_size="200MB")
        else:
            model.save_pretrained(model_dir, max_shard_size="200MB")
        del model
    return model_dir


def prepare(root: Path, layers: int) -> tuple[Path, Path]:
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()
    model_dir, golden = write_checkpoint(root, layers), root / f"golden-{layers}"
    if not (golden / "manifest.json").is_file():
        record_golden(model_dir, golden, seq_len=32, overwrite=True)
    return model_dir, golden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each measurement (the minimum is reported)")
    ap.add_argument("--keep", type=Path, default=None, help="write (and reuse) the checkpoint and golden here")
    ap.add_argument(
        "--breakdown", action="store_true", help="then time the parts of one more run over every layer (in-process)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        model_dir, golden = prepare(root, args.layers)
        shards = len(list(model_dir.glob("*.safetensors")))
        size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 1e9
        print(f"checkpoint: {args.layers} layers, {size:.2f} GB fp32 in {shards} shards; golden ready "
              f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        base = ["--golden-dir", str(golden), "--dtype", "bfloat16", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                "--rootdir", str(root)]  # fmt: skip
        ids = json.dumps(json.loads((golden / "manifest.json").read_text())["inputs"]["input_ids"])
        runs = {
            "one layer (-k layer_2.)": lambda: child(PYTEST_CHILD, *base, "-k", "layer_2."),
            "every layer": lambda: child(PYTEST_CHILD, *base),
            "from_pretrained + forward": lambda: child(BASELINE_CHILD, str(model_dir), ids),
        }
        # Interleaved (one of each, then again): this machine's speed drifts by tens of percent over
        # minutes, and a block of runs of one kind would carry the drift into the ratio.
        samples: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, run in runs.items():
                samples[name].append(run())
        results = {}
        for name in runs:
            results[name] = {k: min(s[k] for s in samples[name]) for k in ("wall_s", "after_imports_s", "peak_rss_mb")}
            r = results[name]
            print(f"{name:<28} wall {r['wall_s']:6.1f} s (after imports {r['after_imports_s']:6.1f} s), "
                  f"peak RSS {r['peak_rss_mb']:7.0f} MB")  # fmt: skip
            if args.repeat > 1:
                walls = " ".join(f"{s['wall_s']:.1f}" for s in samples[name])
                print(f"  {'':<26} walls round by round: {walls}")
        one, full, ref = (results[k] for k in runs)
        print(f"every layer / one layer: peak RSS x{full['peak_rss_mb'] / one['peak_rss_mb']:.2f} (target <= 1.3)")
        print(
            f"every layer / (from_pretrained + forward): wall x{full['wall_s'] / ref['wall_s']:.2f}, after imports "
            f"x{full['after_imports_s'] / ref['after_imports_s']:.2f} (target <= 1.5)"
        )
        names = list(runs)
        rounds = sorted(f["wall_s"] / b["wall_s"] for f, b in zip(samples[names[1]], samples[names[2]], strict=True))
        listed = ", ".join(f"x{r:.2f}" for r in rounds)
        print(f"  the same ratio round by round: {listed} (median x{rounds[len(rounds) // 2]:.2f})")
        if args.breakdown:
            parts = child(BREAKDOWN_CHILD, *base)
            print(f"every layer, by part (after imports {parts['after_imports_s']:.1f} s):")
            for part, seconds in sorted(parts["parts"].items(), key=lambda kv: -kv[1]):
                print(f"  {part:<54} {seconds:5.2f} s")
            cores = os.cpu_count() or 1
            print(
                f"  CPU: main thread {parts['main_thread_cpu_s']:.1f} s, whole process {parts['process_cpu_s']:.1f} s "
                f"of the {cores * parts['after_imports_s']:.1f} s that {cores} cores give"
            )


if __name__ == "__main__":
    main()
