"""Calibrate the noise verdict (`noise_factor`): the noise ratio R = candidate error / the reference's
own bf16 error, for healthy candidates that compute differently from the reference, and for port bugs.

    python benchmarks/calibrate_noise.py [--archs ...] [--seeds 0 1] [--seq-lens 16 32] [--healthy trace compile]

Healthy: the reference's own weights through `--hw trace` (jit, dense static-shape experts) and
`--hw compile` (inductor kernels), isolated and chained. Faults: every case of tests/faults.py, an
RMSNorm eps 10x the config's, and a router that takes its softmax in bf16, on `--hw cpu`. For each
fault, R at the point that must fail (isolated and chained), and whether the noise verdict at the
current default fails it first there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TABLE_ARCHS = ["deepseek_v3", "gpt_oss", "minimax_m2", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


def ratios(session) -> dict[str, dict[str, float]]:
    """point id -> {"isolated": R, "isolated rel": rel_l2 ratio, "isolated token": worst-token ratio, and
    the same for "chain"} (missing where a mode has no figures)."""
    from pytest_moe_parity.errors import BackendFailure, PointUnavailable

    out: dict[str, dict[str, float]] = {}
    for point in session.points:
        try:
            res = session.judge(session.prepare(point))
        except (PointUnavailable, BackendFailure):
            continue
        row = {}
        for r in (res, res.chained):
            if r is not None and r.noise_ratio is not None:
                row[r.mode] = r.noise_ratio
                targets = r.noise["targets"].values()
                row[r.mode + " rel"] = max(t["rel_l2_ratio"] for t in targets)
                row[r.mode + " token"] = max(t.get("token_ratio", 0.0) for t in targets)
        out[point.id] = row
    return out


def first_failing(session) -> dict[str, str | None]:
    from pytest_moe_parity.errors import BackendFailure, PointUnavailable

    first: dict[str, str | None] = {"isolated": None, "chain": None}
    for point in session.points:
        try:
            res = session.judge(session.prepare(point))
        except (PointUnavailable, BackendFailure):
            continue
        for mode, verdict in res.verdicts.items():
            if verdict == "failed" and first[mode] is None:
                first[mode] = point.id
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--archs", nargs="*", default=TABLE_ARCHS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--healthy", nargs="*", default=["trace", "compile"])
    ap.add_argument("--no-faults", action="store_true")
    args = ap.parse_args()

    import faults

    from pytest_moe_parity.judge.tolerances import NOISE_FACTOR
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model
    from pytest_moe_parity.replay.noise import record_noise
    from pytest_moe_parity.session import ParitySession, RunOptions, quiet_transformers

    quiet_transformers()
    healthy: dict[tuple[str, str], float] = defaultdict(float)  # (mode, component) -> worst R
    worst_at: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        goldens: dict[tuple[str, int, int], tuple[Path, Path]] = {}
        for arch in args.archs:
            for seed in args.seeds:
                model = write_tiny_model(arch, root / f"m-{arch}-{seed}", seed=seed)
                for seq in args.seq_lens:
                    golden = root / f"g-{arch}-{seed}-{seq}"
                    record_golden(model, golden, seq_len=seq)
                    record_noise(golden, "bfloat16", model_dir=model)
                    goldens[(arch, seed, seq)] = (golden, model)
                    for hw in args.healthy:
                        options = RunOptions(
                            golden_dir=golden, model=model, hw=hw, dtype="bfloat16", mode="both",
                            hw_options=[f"cache_dir={root / 'cache'}"],
                        )  # fmt: skip
                        here: dict[str, float] = defaultdict(float)
                        for pid, row in ratios(ParitySession(options)).items():
                            comp = pid.rsplit(".", 1)[-1]
                            for mode, r in row.items():
                                here[mode] = max(here[mode], r)
                                if r > healthy[(mode, comp)]:
                                    healthy[(mode, comp)] = r
                                    worst_at[(mode, comp)] = f"{hw} {arch} seed={seed} seq={seq} ({pid})"
                        worst = ", ".join(f"{m} {r:.2f}" for m, r in sorted(here.items()) if " " not in m)
                        print(f"{hw:<8}{arch:<14}seed={seed} seq={seq:<4} worst R: {worst}", flush=True)
        print(f"\nhealthy candidates ({', '.join(args.healthy)}): worst noise ratio per component")
        print("(R, and its parts: the whole tensor's rel_l2 ratio and the worst token's ratio)")
        columns = ["isolated", "isolated rel", "isolated token", "chain", "chain rel", "chain token"]
        print(f"{'component':<16}" + "".join(f"{c:>16}" for c in columns) + "  worst R at (isolated | chain)")
        for comp in sorted({c for _, c in healthy}):
            print(
                f"{comp:<16}"
                + "".join(f"{healthy.get((c, comp), 0.0):>16.3f}" for c in columns)
                + f"  {worst_at.get(('isolated', comp), '-')} | {worst_at.get(('chain', comp), '-')}"
            )
        if args.no_faults:
            return

        cases = {name: (arch, expected, make, None) for name, (arch, expected, make) in faults.CASES.items()}
        cases["rms_norm_eps_10x"] = (
            "qwen3_moe", "layer_0.input_norm",
            lambda g: (None, lambda c: c.update(rms_norm_eps=c.get("rms_norm_eps", 1e-6) * 10)), None,
        )  # fmt: skip
        cases["router_softmax_bf16"] = ("qwen3_moe", "layer_0.router", lambda g: (None, None), "router_softmax_bf16")
        cases["router_softmax_bf16_mixtral"] = (
            "mixtral",
            "layer_0.router",
            lambda g: (None, None),
            "router_softmax_bf16",
        )
        print(f"\nfaults on --hw cpu bf16: noise ratio at the point that must fail (noise_factor {NOISE_FACTOR})")
        head = "".join(f"{c:>10}" for c in ("isolated", "iso rel", "iso token", "chain"))
        print(f"{'fault':<32}{'point':<24}{head}  first failing (isolated | chain)")
        import contextlib

        for name, (arch, expected, make, code) in sorted(cases.items()):
            for seed in args.seeds[:1]:
                seq = args.seq_lens[0]
                key = (arch, seed, seq)
                if key not in goldens:
                    continue
                golden, model = goldens[key]
                tensor_edit, config_edit = make(golden)
                cand = faults.edit_checkpoint(model, root / f"c-{name}-{seed}", tensor_edit or (lambda t: None))
                if config_edit:
                    faults.edit_config(cand, config_edit)
                options = RunOptions(golden_dir=golden, model=cand, hw="cpu", dtype="bfloat16", mode="both")
                with faults.code_fault(code) if code else contextlib.nullcontext():
                    row = ratios(ParitySession(options)).get(expected, {})
                    first = first_failing(ParitySession(options))
                figures = [row.get(m, float("nan")) for m in ("isolated", "isolated rel", "isolated token", "chain")]
                print(f"{name:<32}{expected:<24}" + "".join(f"{x:>10.3g}" for x in figures), end="")
                print(f"  {first['isolated']} | {first['chain']}", flush=True)


if __name__ == "__main__":
    main()
