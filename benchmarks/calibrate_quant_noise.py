"""Calibrate the quantization noise floor (`moe-parity golden --noise-quant SPEC`, judged by `noise_factor`):
the noise ratio R of clean quantized candidates against the reference's own error under their scheme,
how many of their points fail without that floor, and R of scale bugs.

    python benchmarks/calibrate_quant_noise.py [--archs ...] [--seeds 0 1] [--seq-len 16] [--layers 2]

Per architecture and seed: a float32 golden (prefill and one decode step) with its bf16 floor and the
floor of each scheme of SCHEMES. Clean candidates, each judged isolated and chained (`both`):
- `bf16`: the reference's own checkpoint in bf16 under the scheme (`--hw-option quant=SPEC`): another
  compute dtype, so each fp8 rounding sees other inputs (the floor ran in float32, its bf16 floor added);
- `hub`: the scheme's hub checkpoint (`tiny-model --quant`, its unquantized tensors in bf16) in bf16 under
  the scheme's activations: the weights as an FP8 release ships them.
For each: points failing with the quantization floor, with the bf16 floor alone (`--noise-quant none`),
and under the dtype's fixed limits alone (the golden's floors removed, isolated); the worst R per mode.
Bugs (on `bf16`): one expert's down projection 1.5x (a scale read from another expert), activations
per tensor instead of per token (`dynamic-tensor`), a KV cache whose scales were calibrated on 8 random
tokens (the hub's `--kv-scales`); R at the point that must fail and the first failing point.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ARCHS = ["qwen3_moe", "deepseek_v3", "minimax_m2", "gpt_oss"]
SCHEMES = {
    "gpt_oss": ["mxfp4", "fp8-channel+dynamic-token+kv-fp8"],
    "*": ["fp8-block:32+dynamic-token", "fp8-channel+dynamic-token+kv-fp8"],
}
HUB = ("fp8-block", "fp8-channel", "mxfp4")  # the weight schemes `tiny-model --quant` writes


def run(golden: Path, model: Path, mode: str, quant: str | None, floor: str | None) -> dict:
    """Every point judged: {"failed": {mode: n}, "points": n, "R": {mode: worst}, "first": {mode: id},
    "at": {point: {mode: R}}}."""
    from pytest_moe_parity.errors import BackendFailure, PointUnavailable
    from pytest_moe_parity.session import ParitySession, RunOptions

    options = RunOptions(
        golden_dir=golden, model=model, hw="cpu", dtype="bfloat16", mode=mode, noise_quant=floor,
        hw_options=[f"quant={quant}"] if quant else [],
    )  # fmt: skip
    session = ParitySession(options)
    out: dict = {"failed": defaultdict(int), "points": 0, "R": defaultdict(float), "first": {}, "at": {}, "which": []}
    try:
        for point in session.points:
            try:
                res = session.judge(session.prepare(point))
            except (PointUnavailable, BackendFailure):
                continue
            out["points"] += 1
            for r in (res, res.chained):  # each mode's own checks (a chain with no token left to judge has none)
                if r is not None and not all(c.passed for c in r.checks):
                    out["which"].append(f"{point.id} ({r.mode})")
                    out["failed"][r.mode] += 1
                    out["first"].setdefault(r.mode, point.id)
                if r is not None and r.noise_ratio is not None:
                    part = f"{r.mode} {'decode' if point.step else 'prefill'}"
                    out["R"][r.mode] = max(out["R"][r.mode], r.noise_ratio)
                    out["R"][part] = max(out["R"][part], r.noise_ratio)
                    out["at"].setdefault(point.id, {})[r.mode] = r.noise_ratio
    finally:
        session.close()
    return out


def without_floors(golden: Path, dst: Path) -> Path:
    """A copy of the golden without its noise floors: the dtype's fixed limits alone."""
    if not dst.exists():
        shutil.copytree(golden, dst)
        manifest = json.loads((dst / "manifest.json").read_text())
        manifest.pop("noise", None)
        (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def bugs(spec: str, model: Path, golden: Path, root: Path, seed: int, layers: int) -> dict[str, tuple[Path, str, str]]:
    """name -> (candidate checkpoint, --hw-option quant, the point that must fail)."""
    root = root / spec.replace(":", "_").replace("+", "_")
    import faults

    from pytest_moe_parity.record.tiny import write_tiny_model

    last = layers - 1

    from pytest_moe_parity.golden import GoldenStore

    store = GoldenStore(golden)
    ids = store.load(store.point(f"layer_{last}.router")).output[2]
    busiest = int(ids.flatten().bincount().argmax())  # the expert most of the golden's tokens go to

    def scale(t: dict) -> None:
        here = [k for k in t if f"layers.{last}." in k and f".experts.{busiest}." in k]
        key = next(k for k in here if "down" in k or ".w2." in k)
        t[key] = t[key] * 1.5

    out = {}
    if "gpt_oss" not in str(model):
        out["expert scale 1.5x"] = (
            faults.edit_checkpoint(model, root / "bug-scale", scale),
            spec,
            f"layer_{last}.experts",
        )
    if "dynamic-token" in spec:
        out["per-tensor activations"] = (model, spec.replace("dynamic-token", "dynamic-tensor"), "layer_0.attention")
    if "kv-fp8" in spec:
        weights = spec.split("+")[0]
        hub = root / "bug-kv"
        if not hub.exists():
            arch = json.loads((model / "config.json").read_text())["model_type"]
            write_tiny_model(arch, hub, layers=layers, seed=seed, quant=weights, kv_scales=True)
        out["kv scales from 8 tokens"] = (hub, spec, "layer_0.attention")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--archs", nargs="*", default=ARCHS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--no-bugs", action="store_true")
    args = ap.parse_args()

    from pytest_moe_parity.judge.tolerances import NOISE_FACTOR, QUANT_NOISE_FACTOR
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model
    from pytest_moe_parity.replay.noise import record_noise
    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # candidate -> points, quant, bf16, fixed
    factors = f"noise_factor {QUANT_NOISE_FACTOR} (quantization floors; {NOISE_FACTOR}: a dtype's)"
    print(f"{factors}; candidates in bf16, judged isolated and chained\n")
    print(f"{'arch':<12}{'seed':>5}  {'scheme':<34}{'cand':<6}{'points':>7}{'fail quant':>12}{'fail bf16':>11}"
          f"{'fail fixed':>12}{'R iso':>8}{'R chain':>9}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for arch in args.archs:
            for seed in args.seeds:
                here = root / f"{arch}-{seed}"
                model = write_tiny_model(arch, here / "model", layers=args.layers, seed=seed)
                golden = here / "golden"
                record_golden(model, golden, seq_len=args.seq_len, decode_steps=1)
                record_noise(golden, "bfloat16", model_dir=model)
                for spec in SCHEMES.get(arch, SCHEMES["*"]):
                    record_noise(golden, None, quant=spec, model_dir=model)
                fixed = without_floors(golden, here / "fixed")
                for spec in SCHEMES.get(arch, SCHEMES["*"]):
                    weights = spec.split("+")[0]
                    candidates = {"bf16": model}
                    if weights.split(":")[0] in HUB:
                        hub = here / f"hub-{weights.replace(':', '_')}"
                        if not hub.exists():
                            write_tiny_model(arch, hub, layers=args.layers, seed=seed, quant=weights)
                        candidates["hub"] = hub
                    for name, cand in candidates.items():
                        floor = run(golden, cand, "both", spec, spec)
                        plain = run(golden, cand, "both", spec, "none")
                        alone = run(fixed, cand, "isolated", spec, None)
                        counts = [floor["points"], sum(floor["failed"].values()), sum(plain["failed"].values()),
                                  sum(alone["failed"].values())]  # fmt: skip
                        for i, n in enumerate(counts):
                            totals[name][i] += n
                        r_iso, r_chain = floor["R"].get("isolated", 0.0), floor["R"].get("chain", 0.0)
                        print(f"{arch:<12}{seed:>5}  {spec:<34}{name:<6}{counts[0]:>7}{counts[1]:>12}{counts[2]:>11}"
                              f"{counts[3]:>12}{r_iso:>8.3f}{r_chain:>9.3f}", flush=True)  # fmt: skip
                        if floor["which"]:
                            print(f"      failing with the floor: {', '.join(floor['which'])}")
                        for mode in (f"{m} {p}" for m in ("isolated", "chain") for p in ("prefill", "decode")):
                            r = floor["R"].get(mode, 0.0)
                            if r > worst.get((name, mode), (0.0, ""))[0]:
                                m, decode = mode.split()[0], mode.endswith("decode")
                                ids = [p for p in floor["at"] if p.startswith("step_") == decode]
                                at = max(ids, key=lambda p, m=m: floor["at"][p].get(m, 0.0))
                                worst[(name, mode)] = (r, f"{arch} seed {seed} {spec} at {at}")
                    if args.no_bugs or seed != args.seeds[0]:
                        continue
                    for bug, (cand, quant, point) in bugs(spec, model, golden, here, seed, args.layers).items():
                        got = run(golden, cand, "both", quant, spec)
                        ratios = got["at"].get(point, {})
                        print(f"    bug {bug:<26} R at {point}: isolated {ratios.get('isolated', float('nan')):.3g}, "
                              f"chain {ratios.get('chain', float('nan')):.3g}; first failing: "
                              f"{got['first'].get('isolated')} | {got['first'].get('chain')}", flush=True)  # fmt: skip
    print("\nclean candidates: verdicts failing with the quantization floor, the bf16 floor alone, fixed limits")
    for name, (points, quant, bf16, fixed) in totals.items():
        print(f"  {name:<6} {points} points ({2 * points} verdicts, isolated and chained): {quant} fail with the "
              f"quantization floor, {bf16} with the bf16 floor alone; {fixed} of the {points} isolated verdicts "
              "under the fixed bf16 limits alone")  # fmt: skip
    print("worst noise ratio of clean candidates (a decode step judges 1 token: its limit widens 2.83x):")
    for (name, mode), (r, where) in sorted(worst.items()):
        print(f"  {name:<6} {mode:<17} R {r:.3f}  ({where})")


if __name__ == "__main__":
    main()
