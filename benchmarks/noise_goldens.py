"""A tiny qwen3_moe checkpoint and its golden with the bf16 noise floor, for the benchmarks that judge
candidates against it (bench_chain.py, bench_verdicts.py)."""

from __future__ import annotations

from pathlib import Path


def noise_golden(root: Path, layers: int, seq_len: int, decode_steps: int = 0) -> tuple[Path, Path]:
    """(checkpoint, golden) under `root`, the golden recorded with `--noise-dtype bfloat16`."""
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model
    from pytest_moe_parity.replay.noise import record_noise
    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()
    model = write_tiny_model("qwen3_moe", root / f"model-{layers}", layers=layers)
    golden = root / f"golden-{layers}"
    record_golden(model, golden, seq_len=seq_len, decode_steps=decode_steps)
    record_noise(golden, "bfloat16", model_dir=model)
    return model, golden
