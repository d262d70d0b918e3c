"""`moe-parity scan` batches its prompts: a scan of 32 prompts against 32 separate whole-model runs
(the same scan one prompt at a time). The issue's target: the batched scan at most 0.5x their time.

    python benchmarks/bench_scan.py [--layers 4] [--prompts 32] [--new-tokens 8] [--batch-size 8] [--keep DIR]

The Mixtral-style checkpoint of bench_replay.py (hidden 512, 16 experts, vocabulary 1024) is the
reference; the candidate is the same checkpoint (in bfloat16). Prompts are 32 random id sequences of
12 to 100 tokens (a fixed seed). Three timings, each in this process with the models loaded by the
scan itself:

- `batched`: one scan, `--batch-size` prompts per forward;
- `one at a time`: the same scan with `--batch-size 1` (32 separate runs of each model's forward,
  and of the continuation);
- `separate scans`: 32 scans of one prompt each (each loads the three models again), the way a
  script that loops over prompts runs them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import write_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoint here (default: a temp dir)")
    args = ap.parse_args()

    import torch

    from pytest_moe_parity.scan import ScanRequest
    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-scan-"))
    model = write_checkpoint(root, args.layers)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 1024, (int(n),), generator=gen).tolist() for n in torch.randint(12, 101, (args.prompts,))]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))

    loading = [0.0]  # the three models' loading, timed apart (the same in every way of running)
    real_load = ScanRequest._load

    def timed_load(self, path, dtype):
        started = time.perf_counter()
        try:
            return real_load(self, path, dtype)
        finally:
            loading[0] += time.perf_counter() - started

    ScanRequest._load = timed_load

    def scan(path: Path, batch: int) -> tuple[float, float]:
        """(seconds in all, seconds of the forwards: without loading the models)"""
        loading[0] = 0.0
        started = time.perf_counter()
        ScanRequest(model, model, prompts=path, new_tokens=args.new_tokens, batch_size=batch).run()
        seconds = time.perf_counter() - started
        return seconds, seconds - loading[0]

    scan(prompts, args.batch_size)  # warm-up: the first run pays for imports and page cache
    batched = scan(prompts, args.batch_size)
    single = scan(prompts, 1)
    separate = [0.0, 0.0]
    for i, r in enumerate(rows):
        one = root / f"prompt_{i}.jsonl"
        one.write_text(json.dumps({"ids": r}) + "\n")
        separate = [a + b for a, b in zip(separate, scan(one, 1), strict=True)]
    print(f"{args.prompts} prompts of 12-100 tokens, {args.new_tokens} new tokens, mixtral hidden 512, "
          f"{args.layers} layers, {torch.get_num_threads()} threads; seconds in all (forwards alone)")  # fmt: skip
    print(f"  batched (batch {args.batch_size}):       {batched[0]:7.2f} ({batched[1]:6.2f})")
    for name, (total, forwards) in (("one at a time (batch 1)", single), (f"{args.prompts} separate scans", separate)):
        print(f"  {name:<24} {total:7.2f} ({forwards:6.2f})   batched / this = {batched[0] / total:.2f} "
              f"({batched[1] / forwards:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
