"""`--hw vllm` on a padded batch and under `--parity-drill`: a tiny Qwen3-MoE of head_dim 32 (vLLM's CPU
attention takes it) recorded in the leg, once as one sequence and once as the padded batch of
fixtures/prompts/padded.jsonl (left padding). The batch's attention and decoder layer run as vLLM's
requests (each row's real tokens), prefill and decode; the drill descends into vLLM's own ops (its GEMMs,
norms, rotary, paged-cache update and attention kernels, its fused MoE); faults put into vLLM's code for
one inner session are named at their op, and a KV write one slot early at its point."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_json, run_parity
from vllm_helpers import patched, rows_of

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

ROOT = Path(__file__).resolve().parent.parent
PADDED = ("--prompts", str(ROOT / "fixtures" / "prompts" / "padded.jsonl"), "--padding-side", "left")


@pytest.fixture(scope="session")
def batch32(recorded) -> Path:
    """The head_dim-32 Qwen3-MoE's golden of a left-padded batch of 3 rows (prefill and 2 decode steps)."""
    return recorded("qwen3_moe", golden_args=PADDED, head_dim=32)


def vllm(pytester: pytest.Pytester, where: Path, report: Path, *args: str) -> pytest.RunResult:
    """An inner `--hw vllm` run on `where`'s golden and model, its reports in `report`."""
    more = ("--hw", "vllm", "--parity-report", str(report), "-W", "error", *args)
    return run_parity(pytester, where / "golden", *more, model=where / "model")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_padded_batch_passes_every_point(dtype: str, batch32: Path, pytester: pytest.Pytester, tmp_path) -> None:
    """Three rows, two of them left-padded: vLLM's attention and decoder layer run them as three requests of
    their real tokens (3, 6 and 8), prefill and both decode steps, the decode steps' caches read back per
    request; every point passes."""
    store = GoldenStore(batch32 / "golden")
    assert store.padded and store.sequences == 3
    result = vllm(pytester, batch32, tmp_path / "r", "--dtype", dtype)
    result.assert_outcomes(passed=len(store.point_ids))
    rows = rows_of(tmp_path / "r")
    assert {"cache.keys", "cache.values"} <= set(rows["step_2.layer_3.attention"]["metrics"])
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] is None


def drill(pytester: pytest.Pytester, where: Path, points: str, select: str, report: Path) -> tuple:
    """An inner run of the points `select` picks, drilled at `points`: its result, rows and drill records."""
    result = vllm(pytester, where, report, "--parity-drill", points, "-k", select)
    rows = rows_of(report)
    return result, rows, {i.removesuffix("::drill"): r["drill"] for i, r in rows.items() if i.endswith("::drill")}


def test_a_clean_vllm_drills_clean(head32: Path, pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Every layer-1 component, prefill and a decode step: vLLM's ops (its packed GEMMs, norms, rotary, the
    paged cache update and attention kernel, its fused MoE) matched by value to the reference's, none
    failed, no culprit."""
    points = "layer_1.*,step_1.layer_1.*"
    result, _, drills = drill(pytester, head32, points, "layer_1 and not step_2", tmp_path / "r")
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert len(drills) == 14
    for point, record in drills.items():
        assert record["culprit"] is None and not record["structure"] and not record["same_code"], (point, record)
        assert not [r for r in record["rows"] if r["verdict"] != "ok"], point
    for point in ("layer_1.attention", "step_1.layer_1.attention"):
        ops = {c for r in drills[point]["rows"] for c in r["candidate"]}
        assert {"attn.do_kv_cache_update", "attn.attention_forward", "qkv_proj.onednn_mm.onednn_mm"} <= ops, ops
    experts = {c for r in drills["layer_1.experts"]["rows"] for c in r["candidate"]}
    assert any("cpu_fused_moe" in c for c in experts), experts


SCALE_TWICE = """def twice(*args, scale, **kwargs):
    return original(*args, scale=2 * scale, **kwargs)"""


def test_a_fault_in_vllm_s_attention_kernel_is_named_at_its_op(
    head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's paged attention kernel (`vllm._custom_ops.cpu_attention_with_kv_cache`) called with twice the
    softmax scale, for one inner session: the attention fails, and its drill names the reference's attention
    product that vLLM's kernel computes in its place as the culprit, the kernel's op beside it in the closing
    line; the projections, norms and rotary before it agree."""
    patched(pytester, "vllm._custom_ops", "cpu_attention_with_kv_cache", "twice", SCALE_TWICE)
    point = "layer_1.attention"
    result, rows, drills = drill(pytester, head32, point, f"{point} and not step", tmp_path / "r")
    assert rows[point]["status"] == "failed"
    record = drills[point]
    ops = {r["name"]: r for r in record["rows"]}
    assert record["culprit"] == "eager_attention_forward.bmm#2", (record["culprit"], record["structure"])
    assert ops["eager_attention_forward.bmm#2"]["verdict"] == "introduced"
    assert ops["eager_attention_forward.bmm#2"]["candidate"] == ["attn.attention_forward"]
    for name in ("q_proj", "v_proj", "q_norm.mul", "apply_rotary_pos_emb.add", "apply_rotary_pos_emb.add#2"):
        assert ops[name]["verdict"] == "ok", ops[name]
    said = "*culprit eager_attention_forward.bmm#2, substituting * the candidate's op: attn.attention_forward"
    result.stdout.fnmatch_lines([f"drill {point}: {said}"])


EARLY = """def early(layer_name, every=False):
    metadata, layer, kv_cache, slots = original(layer_name)
    if slots is not None and metadata is not None:
        new = metadata.query_start_loc.diff()
        cached = (metadata.seq_lens - new > 0) | every  # a request that holds cached tokens (a decode step)
        slots = slots - torch.repeat_interleave(cached.long(), new)
    return metadata, layer, kv_cache, slots"""


@pytest.mark.parametrize(
    "which, first",
    [("lambda name: early(name)", "step_1.layer_0.attention"), ("lambda name: early(name, True)", "layer_0.attention")],
    ids=["decode-steps", "every-token"],
)
def test_a_kv_write_one_slot_early_fails_first_at_its_attention(
    which: str, first: str, head32: Path, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """vLLM's cache update handed each new token's slot one before its own (the slot mapping of the forward
    context, as vLLM's attention reads it, shifted by one). Where a decode step's tokens are shifted, the
    prefill passes and the first decode step's attention is the first divergence, its cache's keys and values
    failing; where every token is (prefill too), vLLM's prefill attention, which reads its keys and values back
    from the paged cache, fails first."""
    patched(pytester, "vllm.model_executor.layers.attention.attention", "get_attention_context", which, EARLY)
    vllm(pytester, head32, tmp_path / "r")
    assert read_json(tmp_path / "r" / SUMMARY_FILE)["first_divergence"] == first
    rows = rows_of(tmp_path / "r")
    failed = {c.get("target") for c in rows["step_1.layer_0.attention"]["checks"] if not c.get("passed", True)}
    assert {"cache.keys", "cache.values"} <= failed, rows["step_1.layer_0.attention"]["checks"]
    assert rows["layer_0.router"]["status"] == "passed"
