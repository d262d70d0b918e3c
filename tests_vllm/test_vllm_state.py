"""`moe-parity vllm-dump --state clean|reused|prefix` and `pytest --parity-state DIR`: vLLM's engine serving a
40-token prompt alone, after another request in the KV blocks it held, and on a prefix-cache hit of its
first 32 tokens another request wrote; each state's dump judged against the clean one's, point by point
(three engine runs, about 10 s each on 2 cores); and a fault put into vLLM's own KV-cache write for one engine
run (a reused block left holding the earlier request's keys and values), found at its first point by the
`reused` state's dump alone (one more engine run)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import read_json, run_parity

from pytest_moe_parity.cli import main
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE

PROMPT = ",".join(str((7 * i + 3) % 250 + 3) for i in range(40))  # longer than a KV block of 32: a prefix hit


@pytest.fixture(scope="module")
def dumps(recorded, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, str]]]:
    """The 40-token golden, and each state's dump with what the command said."""
    root = recorded("qwen3_moe", head_dim=32, golden_args=("--input-ids", PROMPT))
    made = {}
    for state in ("clean", "reused", "prefix"):
        out = tmp_path_factory.mktemp("state") / state
        made[state] = out, vllm_dump(root, root / "golden", out, state)
    return root / "golden", made


def said_of(dump: Path) -> str:
    return json.loads((dump / "engine.json").read_text())["state"]["said"][0]


def vllm_dump(root: Path, golden: Path, out: Path, state: str) -> str:
    """`moe-parity vllm-dump --state STATE` of the recorded `root/model` on `golden`, in this process; what it said."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = main(["vllm-dump", "--model", str(root / "model"), "--golden", str(golden), "--out", str(out),
                     "--state", state])  # fmt: skip
    assert code == 0, said.getvalue()
    return said.getvalue()


@pytest.mark.parametrize("state", ["reused", "prefix"])
def test_the_engine_in_another_state_gives_the_clean_run_s_output(dumps, pytester: pytest.Pytester, state: str):
    golden, made = dumps
    (clean, _), (dump, said) = made["clean"], made[state]
    if state == "reused":  # the prompt in the batch row and the KV blocks the other request held
        assert "state: after another request (40 tokens) in batch row 0: the prompt in batch row 0, KV blocks " in said
        assert "2 KV blocks the other request held" in said
    else:
        assert "state: on a prefix-cache hit of 32 tokens (blocks of 32) that another request wrote" in said
        assert json.loads((dump / "engine.json").read_text())["state"]["prompt"]["prefix_hit_tokens"] == 32
    report = pytester.path / "r"
    result = run_parity(pytester, golden, "--hw", "dump", "--parity-state", str(dump), "--parity-report", str(report),
                        model=clean)  # fmt: skip
    points = len(GoldenStore(golden).point_ids)
    result.assert_outcomes(passed=2 * points)
    rows = [r for r in read_json(report / REPORT_FILE)["points"] if r["id"].endswith("::state")]
    assert len(rows) == points and all(r["said"] == f"in the dump {dump} ({said_of(dump)})" for r in rows)
    # vLLM's CPU kernels in float32 give the state's run the clean run's bits, the prefix hit's rows included
    assert max(r["figures"]["state_vs_clean"] for r in rows) == 0.0


@contextlib.contextmanager
def unrewritten_reused_block() -> Iterator[None]:
    """vLLM's CPU attention writing keys and values into its KV cache, but skipping the first block of a new
    request's allocation when an earlier request had written that block (a block's "written" mark not cleared
    when the block is freed): requests on a fresh engine are served right; a request in reused blocks reads
    the earlier request's keys and values in that block. vLLM's method is put back on exit."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.do_kv_cache_update
    written: dict[int, set[int]] = {}  # per layer's cache: the blocks ever written

    def update(self, layer, key, value, kv_cache, slot_mapping):
        engine = getattr(layer, "kv_cache", None)  # the engine's own cache, not a scratch block written through it
        if not isinstance(engine, torch.Tensor) or engine.data_ptr() != kv_cache.data_ptr():
            return original(self, layer, key, value, kv_cache, slot_mapping)
        size = kv_cache.shape[2]  # [blocks, kv heads, block size, 2 x head size]
        slots = slot_mapping[: key.shape[0]]
        blocks = torch.div(slots, size, rounding_mode="floor")
        seen = written.setdefault(kv_cache.data_ptr(), set())
        refilled = [b for b in blocks[(slots >= 0) & (slots % size == 0)].tolist() if b in seen]
        seen.update(blocks[slots >= 0].tolist())
        if refilled:
            keep = blocks != refilled[0]
            key, value, slots = key[: slots.shape[0]][keep], value[: slots.shape[0]][keep], slots[keep]
        return original(self, layer, key, value, kv_cache, slots)

    CPUAttentionBackendImpl.do_kv_cache_update = update
    try:
        yield
    finally:
        CPUAttentionBackendImpl.do_kv_cache_update = original


def test_a_reused_block_left_unwritten_fails_first_at_the_attention_s_state(
    dumps, recorded, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's KV-cache write skipping a reused block for one engine run (`reused`): the prompt's first 32 keys
    and values are the earlier request's. The clean dump's points all pass; the state's items fail first at
    layer 0's attention (every token row: each reads the stale block), a decode step's cache read back naming
    the stale block's rows and not the prompt's own after it."""
    golden, made = dumps
    clean, faulty = made["clean"][0], tmp_path / "reused"
    root = recorded("qwen3_moe", head_dim=32, golden_args=("--input-ids", PROMPT))
    with unrewritten_reused_block():
        said = vllm_dump(root, golden, faulty, "reused")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    assert CPUAttentionBackendImpl.do_kv_cache_update.__module__ == CPUAttentionBackendImpl.__module__  # put back
    assert "2 KV blocks the other request held" in said, said
    report = pytester.path / "r"
    result = run_parity(pytester, golden, "--hw", "dump", "--parity-state", str(faulty), "--parity-report", str(report),
                        model=clean)  # fmt: skip
    rows = sorted(read_json(report / REPORT_FILE)["points"], key=lambda r: r["order"])
    points = [r for r in rows if not r["id"].endswith("::state")]
    assert points and all(r["status"] == "passed" for r in points), [r["id"] for r in points if r["status"] != "passed"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and failed[0]["id"] == "layer_0.attention::state", [r["id"] for r in failed]
    assert all(r["status"] == "passed" for r in rows[: rows.index(failed[0])])
    figures = failed[0]["figures"]
    assert figures["rows"] == list(range(40)) and figures["clean_vs_golden"] < 1e-5 < figures["state_vs_golden"]
    # a decode step's cache read back: the block the write skipped (rows 0-31) holds the earlier request's keys
    # and values, the prompt's own rows in its second block (32-39) are right; 40: the token the state chose
    cache = next(r for r in rows if r["id"] == "step_1.layer_0.attention::state")["figures"]
    for read in (cache["key_rows"], cache["value_rows"]):
        assert read[:32] == list(range(32)) and not set(range(32, 40)) & set(read), cache
    result.assert_outcomes(passed=len(rows) - len(failed), failed=len(failed))
    result.stdout.fnmatch_lines(["layer_0.attention::state: the state alone changes it: in the dump *",
                                 "first divergence: layer_0.attention::state*"])  # fmt: skip


def test_a_prompt_no_prefix_hit_can_cover_is_one_line(head32: Path, capsys: pytest.CaptureFixture, tmp_path) -> None:
    """A 16-token prompt: a hit takes whole blocks of 32 and leaves the last token to compute (exit 2, before vLLM
    builds an engine, nothing written)."""
    code = main(["vllm-dump", "--model", str(head32 / "model"), "--golden", str(head32 / "golden"),
                 "--out", str(tmp_path / "out"), "--state", "prefix"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "the golden's prompt has 16 tokens: a prefix-cache hit takes whole blocks of 32" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
