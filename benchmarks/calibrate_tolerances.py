"""Measure healthy bf16 (or fp16) error levels per component, to calibrate the default tolerances.

    python benchmarks/calibrate_tolerances.py [--dtype bfloat16] [--seeds 0 1 2 3] [--seq-lens 16 64]
        [--archs lfm2_moe ...] [--as-built]

For every tiny architecture, model seed and sequence length: record a float32 golden, replay every
point on a candidate of the same weights in `--dtype`, and report per component the worst rel_l2
and cosine and the worst token's rel_l2, plus routing and top-1 flips and ties, and every point that
fails the current defaults. `--as-built`: the models as their config classes initialise them (norms
at 1, biases and score-correction biases at 0), where the fixtures randomise those: routers whose
scores then sit closer together (LFM2-MoE's, 8 experts' sigmoids around 0.5 with no bias).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--archs", nargs="*", default=None)
    ap.add_argument("--as-built", action="store_true", help="norms and biases as the config class leaves them")
    args = ap.parse_args()

    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import available_archs, write_tiny_model
    from pytest_moe_parity.session import ParitySession, RunOptions, quiet_transformers

    quiet_transformers()
    worst: dict[str, dict[str, float]] = defaultdict(lambda: {"rel_l2": 0.0, "cosine": 1.0, "token": 0.0, "n": 0})
    flips = ties = tokens = top1_flips = top1_ties = 0
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs or available_archs():
            for seed in args.seeds:
                model = write_tiny_model(arch, Path(tmp) / f"{arch}-{seed}", seed=seed, perturb=not args.as_built)
                for seq in args.seq_lens:
                    gdir = Path(tmp) / f"g-{arch}-{seed}-{seq}"
                    record_golden(model, gdir, seq_len=seq)
                    session = ParitySession(RunOptions(golden_dir=gdir, model=model, dtype=args.dtype))
                    for point in session.points:
                        pid = point.id
                        res = session.judge(session.prepare(point))
                        comp = res.component
                        for target, m in res.metrics.items():
                            key = f"{comp}:{target}"
                            worst[key]["rel_l2"] = max(worst[key]["rel_l2"], m.rel_l2)
                            worst[key]["cosine"] = min(worst[key]["cosine"], m.cosine)
                            worst[key]["token"] = max(worst[key]["token"], m.max_token_rel_l2 or 0.0)
                            worst[key]["n"] += 1
                        if comp == "router" and res.routing is not None:
                            flips += len(res.routing.flips)
                            ties += len(res.routing.ties)
                            tokens += res.routing.num_tokens
                        if res.logits is not None:
                            top1_flips += len(res.logits.top1.flips)
                            top1_ties += len(res.logits.top1.ties)
                        if not res.passed:
                            failed = ", ".join(f"{c.target}.{c.name}={c.value:.3g}" for c in res.failed_checks)
                            failures.append(f"{arch} seed={seed} seq={seq} {pid}: {failed}")
    print(f"{'component:tensor':<28}{'points':>8}{'worst rel_l2':>14}{'worst cosine':>14}{'worst token':>14}")
    for key in sorted(worst):
        w = worst[key]
        print(f"{key:<28}{w['n']:>8}{w['rel_l2']:>14.3e}{w['cosine']:>14.6f}{w['token']:>14.3e}")
    print(f"router tokens {tokens}: real flips {flips}, ties {ties}")
    print(f"logits top-1: real flips {top1_flips}, ties {top1_ties}")
    print(f"{len(failures)} failing points at the default tolerances")
    for line in failures:
        print("  " + line)


if __name__ == "__main__":
    main()
