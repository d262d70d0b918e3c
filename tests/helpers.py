"""Helpers shared by the test modules (imported as `helpers`, like `faults`)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_moe_parity.cli import main
from pytest_moe_parity.model.calls import CACHE_KWARGS
from pytest_moe_parity.record.reference import load_model
from pytest_moe_parity.session import ParitySession, RunOptions

# the architectures of the arch table the bf16 defaults are calibrated on (docs/limits.md)
TABLE_ARCHS = ["deepseek_v3", "gpt_oss", "minimax_m2", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """Run `moe-parity ARGV` in-process: (exit code, stdout, stderr). It must leave the process as
    it found it: nothing kept frozen from the garbage collector (`compare` freezes while it runs)."""
    with pytest.raises(SystemExit) as exc:
        sys.exit(main([str(a) for a in argv]))
    out, err = capsys.readouterr()
    assert gc.get_freeze_count() == 0, f"moe-parity {argv[0]} left objects frozen"
    return exc.value.code, out, err


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def load_fp32(path: Path):
    """The whole reference model in float32 on the CPU, loaded as `moe-parity golden` loads it."""
    return load_model(path, dtype=torch.float32, device="cpu", device_map=None, max_memory=None)


# Fault tests that follow a fault to its activation point: the weight items (on wherever the
# candidate is another checkpoint) would stop them at layer_N.weights first; tests/test_weights.py has those.
NO_WEIGHTS = "--no-parity-weights"
NO_CONFIG = "--no-parity-config"  # activation points only: a candidate's config edits tested where they bite
# A batch of three prompts of unequal length, the first the longest (its row holds no padding), as ids.
PADDED_PROMPTS = [[5, 17, 23, 42, 8, 99, 64, 7], [11, 12, 13], [30, 31, 32, 33, 34, 35]]
# Inner runs whose conftest patches a transformers forward: its deprecation notes are not the test's.
IGNORE_FUTURE = ("-W", "ignore::FutureWarning")


def session(golden: Path, model: Path | None = None, **options: Any) -> ParitySession:
    """A pytest-free parity session (what the plugin and `moe-parity compare` drive)."""
    return ParitySession(RunOptions(golden_dir=golden, model=model, **options))


def run_parity(
    pytester: pytest.Pytester, golden: Path, *args: str, model: Path | None = None, subprocess: bool = False
) -> pytest.RunResult:
    """An inner pytest session over a golden (in a fresh process with `subprocess`: needed where
    xdist workers must import what only PYTHONPATH provides, since xdist hands its workers the
    sys.path it saw when first imported)."""
    argv = ["--golden-dir", str(golden), "-p", "no:cacheprovider", *args]
    if model is not None:
        argv += ["--model", str(model)]
    return pytester.runpytest_subprocess(*argv) if subprocess else pytester.runpytest(*argv)


def assert_stops_at(result: pytest.RunResult, golden: Path, expected: str) -> None:
    """A `-x` run that stopped at `expected`, the one failure, every point before it passed, or skipped by
    layer-first (its layer passed on one run of it: `plugin.layer_first`)."""
    from pytest_moe_parity.golden import GoldenStore

    outcomes = result.parseoutcomes()
    before = GoldenStore(golden).point_ids.index(expected)
    assert outcomes.get("failed") == 1 and not outcomes.get("errors"), outcomes
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == before, (outcomes, before)
    result.stdout.fnmatch_lines([f"first divergence: {expected}*"])


def usage_error(result: pytest.RunResult, message: str) -> None:
    """Exit 4 with `message` on stderr, and no traceback anywhere."""
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    err = result.stderr.str()
    assert message in err, err
    assert "INTERNALERROR" not in err + result.stdout.str() and "Traceback" not in err


def assert_bitwise(actual, expected, where: str) -> None:
    """Equal dtype, shape and bits, through tuples; None in `expected` is an omitted output."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: max diff {(actual - expected).abs().max()}"
    elif isinstance(expected, tuple | list):
        assert isinstance(actual, tuple | list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if e is not None:
                assert_bitwise(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


# ------------------------------------------------------------------------------ float rounding
# Two computations of the same value that sum in another order (another kernel, block of rows,
# thread count or tensor-parallel split) differ by float rounding, which depends on the CPU (AVX2,
# AVX-512, AMX, Arm) and its threads. Tests that compare such values use these bounds, never a bare
# rtol/atol: rounding per accumulation step, at the scale of the reference. Where the code promises
# the same bits (offload vs in memory, the same kernels on the same inputs) tests stay bitwise
# (`assert_bitwise`).

ULPS_PER_STEP = 2  # each step of a sum rounds once (half an ulp) and may carry one rounding of its inputs


def rounding_bound(dtype: torch.dtype, scale: float, steps: int, ulps: float = ULPS_PER_STEP) -> float:
    """The most that float rounding alone moves a value of magnitude up to `scale` computed through
    `steps` rounded accumulations: `ulps` units of the last place (the dtype's epsilon times `scale`)
    per step. Worst-case error of an n-term sum grows as n·eps; `steps` names that n (or the sum of the
    sums' lengths along a path of layers)."""
    return ulps * torch.finfo(dtype).eps * steps * scale


def assert_within_rounding(actual, expected, *, steps: int, where: str = "", ulps: float = ULPS_PER_STEP) -> None:
    """`actual` is `expected` up to float rounding (`rounding_bound` at max |expected|): same dtype and
    shape, the same non-finite entries, and every finite difference within the bound. Integer and
    bool tensors compare bitwise."""
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor), where
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), where
        return
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual)) and torch.equal(actual[~finite], expected[~finite]), where
    ref, got = expected.detach()[finite].double(), actual.detach()[finite].double()
    if not ref.numel():
        return
    scale = float(ref.abs().max())
    bound = rounding_bound(expected.dtype, scale, steps, ulps)
    diff = float((got - ref).abs().max())
    eps = torch.finfo(expected.dtype).eps
    assert diff <= bound, (
        f"{where}: max |difference| {diff:.3g} is {diff / (eps * max(scale, 1e-300)):.1f} ulps of max |reference| "
        f"{scale:.3g}, beyond rounding ({ulps} ulps x {steps} steps = {bound:.3g})"
    )


def model_steps(config: dict) -> int:
    """The longest sum one layer of a model takes (a linear's input width, the attention over a head),
    read from a config dict: the accumulation steps a value's rounding is stated in."""
    width = [config.get(k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size")]
    heads = (config.get("num_attention_heads") or 0) * (config.get("head_dim") or 0)
    return max([w for w in width if isinstance(w, int)] + [heads])


def assert_replays_bitwise(golden: Path, model) -> None:
    """Every point of a golden, called on `model` with its recorded inputs, gives its recorded output."""
    from pytest_moe_parity.golden import GoldenStore
    from pytest_moe_parity.golden.spec import resolve_params
    from pytest_moe_parity.model.calls import cache_state, with_live_caches

    store = GoldenStore(golden)
    for point in store.points:
        rec = store.load(point)
        module = model.get_submodule(point.module)
        args, kwargs = resolve_params(rec.args, model), resolve_params(rec.kwargs, model)
        args, kwargs, caches = with_live_caches(args, kwargs, model.config)  # decode steps
        with torch.no_grad():
            out = module(*args, **kwargs)
        assert_bitwise(out, rec.output, point.id)
        if "cache_after.keys" in rec.extras:  # what a decode step's attention wrote
            state, cache = caches[0]
            after = cache_state(cache, state.layer)
            assert_bitwise(
                (after.keys, after.values),
                (rec.extras["cache_after.keys"], rec.extras["cache_after.values"]),
                f"{point.id} cache",
            )


def cache_kwarg(kwargs: dict[str, Any]) -> str:
    """The name a recorded call holds its KV cache by: `cache` from transformers 5.24 on,
    `past_key_values` before (exactly one of them)."""
    (name,) = [k for k in CACHE_KWARGS if k in kwargs]
    return name


def with_word_tokenizer(model: Path, dst: Path) -> Path:
    """A copy of a tiny checkpoint with a word-level tokenizer of its own (ids below its vocabulary;
    `[PAD]` is id 1), saved as transformers saves a fast tokenizer."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model, dst)
    words = ["the", "of", "capital", "france", "is", "paris", "1", "2", "3", "+", "="]
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(dst)
    return dst
