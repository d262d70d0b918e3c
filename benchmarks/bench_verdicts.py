"""False alarms and caught bugs of the noise verdict, route by route (issue 22's targets).

    python benchmarks/bench_verdicts.py [--layers 4 16 48] [--tokens 24] [--steps 3]

For each depth: a tiny qwen3_moe checkpoint, a golden of `--tokens` tokens and `--steps` decode steps
with the bf16 noise floor, then bf16 candidates through every route:

- `dump` / recorder: the hand-written port of tests/port_qwen3.py (its own modules, fused experts, its
  own KV cache), rounding as the reference does and otherwise (`other_rounding`), recorded with
  `pytest_moe_parity.dump.record` and compared chained (and isolated, where a one-line hint must say
  that chained fits);
- `cpu`: transformers' own modules in bf16, isolated, chained and both;
- `trace`: the same modules traced to graphs, isolated, chained and both (decode steps: not built);
- the port's bugs, chained: where each first fails.

Prints one line per run: points, failures (false alarms on clean candidates), the first divergence,
and for the bugs whether it is the expected point.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

BUGS = {
    "decode_position_stale": "step_1.rotary",
    "decode_drops_last_cached": "step_1.layer_0.attention",
    "router_softmax_bf16": "layer_0.router",
    "norm_eps_10x": "layer_0.input_norm",
    # a bf16 softmax changes a token's bf16 weights only now and then: the first decode router where it does
    "decode_router_softmax_bf16": "step_*.layer_*.router",
}


def run(golden: Path, **options) -> tuple[list[dict], list[str]]:
    from pytest_moe_parity.session import ParitySession, RunOptions

    session = ParitySession(RunOptions(golden_dir=golden, dtype="bfloat16", **options))
    try:
        rows = list(session.run_all())
        hint = session.mode_hint(rows)
    finally:
        session.close()
    return rows, [hint] if hint else []


def line(label: str, rows: list[dict], expected: str | None = None, extra: list[str] = ()) -> str:
    failed = [r for r in rows if r["status"] in ("failed", "error")]
    first = failed[0]["id"] if failed else None
    judged = [r for r in rows if r["status"] in ("passed", "failed")]
    text = f"  {label:<58} {len(judged):>4} judged, {len(failed):>3} failed, first: {first}"
    if expected is not None:
        text += "  [expected here]" if first and fnmatch.fnmatchcase(first, expected) else f"  [EXPECTED {expected}]"
    return text + "".join(f"\n      {e}" for e in extra)


def port_dump(model: Path, golden: Path, out: Path, **bugs) -> Path:
    from port_qwen3 import POINTS, Bugs, load_port

    from pytest_moe_parity.dump import record
    from pytest_moe_parity.golden import GoldenStore

    store = GoldenStore(golden)
    port = load_port(model, bugs=Bugs(**bugs))
    with torch.no_grad(), record(port, out, POINTS, overwrite=True):
        port.generate(torch.tensor(store.manifest["inputs"]["input_ids"]), store.decode_tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 48])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from noise_goldens import noise_golden

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for layers in args.layers:
            started = time.perf_counter()
            model, golden = noise_golden(root, layers, args.tokens, args.steps)
            print(f"{layers} layers, {args.tokens} tokens, {args.steps} decode steps "
                  f"(golden and noise floor {time.perf_counter() - started:.1f} s)")  # fmt: skip
            for rounding in (False, True):
                dump = port_dump(model, golden, root / "dump", other_rounding=rounding)
                name = "port rounding otherwise" if rounding else "port rounding as the reference"
                for mode in ("chain", "isolated"):
                    rows, hint = run(golden, hw="dump", model=dump, mode=mode)
                    print(line(f"clean {name}, dump/recorder, {mode}", rows, extra=hint))
            for hw in ("cpu", "trace"):
                for mode in ("isolated", "chain", "both"):
                    options = {"hw_options": [f"cache_dir={root / 'cache'}"]} if hw == "trace" else {}
                    rows, _ = run(golden, hw=hw, model=model, mode=mode, **options)
                    print(line(f"clean transformers bf16, --hw {hw}, {mode}", rows))
            for bug, expected in BUGS.items():
                for rounding in (False, True):
                    dump = port_dump(model, golden, root / "dump", other_rounding=rounding, **{bug: True})
                    rows, _ = run(golden, hw="dump", model=dump, mode="chain")
                    label = f"bug {bug}{' (rounding otherwise)' if rounding else ''}, chained"
                    print(line(label, rows, expected))


if __name__ == "__main__":
    main()
