"""`pytest_moe_parity.dump.record` inside a hand-written plain-PyTorch Qwen3-MoE port (its own
modules, fused experts): the glue is the point map; a clean bf16 port passes, and each code-level
port bug first fails at the component that has it."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import cli, read_json, run_parity
from port_qwen3 import POINTS, Bugs, load_port
from safetensors import safe_open

from pytest_moe_parity.dump import record
from pytest_moe_parity.dump import writer as dump
from pytest_moe_parity.errors import BadInput
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def _ids(golden: Path) -> torch.Tensor:
    return torch.tensor(json.loads((golden / "manifest.json").read_text())["inputs"]["input_ids"])


def _record_port(golden: Path, model: Path, out: Path, bugs: Bugs | None = None) -> Path:
    """The port's prefill, and its own decode steps on its own cache where the golden has them."""
    port = load_port(model, bugs=bugs or Bugs())
    with torch.no_grad(), record(port, out, POINTS):
        port.generate(_ids(golden), GoldenStore(golden).decode_tokens)
    return out


def _names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as fh:
        return set(fh.keys())


def test_a_clean_bf16_port_passes_with_its_point_map_as_the_only_glue(
    pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    golden = golden_dir("qwen3_moe")
    out = _record_port(golden, tiny_model("qwen3_moe"), tmp_path / "dump")
    assert [p.name for p in out.iterdir()] == ["prefill.safetensors"]
    n = len(GoldenStore(golden).point_ids)
    code, stdout, err = cli(capsys, "compare", golden, out, "--dtype", "bfloat16")
    assert code == 0, stdout + err
    assert f"compared {n} of {n} points, candidate dtype bfloat16 (from --dtype)" in stdout
    run_parity(pytester, golden, "--hw", "dump", "--dtype", "bfloat16", model=out).assert_outcomes(passed=n)


@pytest.mark.parametrize(
    "bugs, first",
    [
        (Bugs(rope_interleaved=True), "layer_0.attention"),
        (Bugs(gqa_repeat=True), "layer_0.attention"),
        (Bugs(no_renormalise=True), "layer_0.router"),
        (Bugs(scale_by_hidden=True), "layer_0.attention"),
        (Bugs(mask_one_ahead=True), "layer_0.attention"),
        (None, "layer_1.experts"),  # one expert's weights zeroed: an expert the prompt routes to
    ],
    ids=[
        "rope-interleaved",
        "gqa-repeat",
        "topk-not-renormalised",
        "scaled-by-hidden",
        "mask-off-by-one",
        "zero-expert",
    ],
)
def test_each_port_bug_first_fails_where_it_is(bugs, first, tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("qwen3_moe")
    if bugs is None:
        bugs = Bugs(zero_expert=(1, faults._used_experts(golden, 1)[0]))
    out = _record_port(golden, tiny_model("qwen3_moe"), tmp_path / "dump", bugs)
    code, stdout, _ = cli(capsys, "compare", golden, out, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 1
    summary = read_json(tmp_path / "r" / SUMMARY_FILE)
    assert summary["first_divergence"] == first, stdout
    assert summary["error"] == 0


def test_each_call_of_the_model_is_the_next_step(tmp_path: Path, golden_dir, tiny_model) -> None:
    golden = golden_dir("qwen3_moe")
    port = load_port(tiny_model("qwen3_moe"))
    ids = _ids(golden)
    with torch.no_grad(), record(port, tmp_path / "d", POINTS) as rec:
        port(ids)
        port(ids[:, :1])
        rec.next_step()  # a runtime that does not call the root model says so itself
        port.layers[0](port.embed(ids[:, :1]), *port.rotary(port.embed(ids[:, :1]), torch.zeros(1, 1)))
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["prefill.safetensors", "step_1.safetensors", "step_2.safetensors"]
    assert "step_1.layer_3.output" in _names(tmp_path / "d" / "step_1.safetensors")
    assert {"step_1.layer_0.router.0", "step_1.layer_0.router.2"} <= _names(tmp_path / "d" / "step_1.safetensors")
    step_2 = _names(tmp_path / "d" / "step_2.safetensors")
    assert "step_2.layer_0.output" in step_2 and "step_2.layer_1.output" not in step_2


def test_ranks_write_their_own_directories(monkeypatch, tmp_path: Path, golden_dir, tiny_model) -> None:
    monkeypatch.setattr(dump, "_rank", lambda: (3, 8))
    out = _record_port(golden_dir("qwen3_moe"), tiny_model("qwen3_moe"), tmp_path / "d")
    assert [p.relative_to(out).as_posix() for p in out.rglob("*.safetensors")] == ["rank3/prefill.safetensors"]


@pytest.mark.parametrize(
    "points, message",
    [
        ({}, "must map point ids"),
        ({"layer_{layer}.atention": "layers.{layer}.attn"}, "'layer_{layer}.atention' is not a point id"),
        ({"layer_{layer}.attention": "layers.0.attn"}, "both or neither must hold {layer}"),
        ({"embedding": "embedding"}, "the model has no module 'embedding' (for embedding)"),
        (
            {"layer_{layer}.attention": "blocks.{layer}.attn"},
            "no module of the model is named like 'blocks.{layer}.attn'",
        ),
    ],
)
def test_a_bad_point_map_is_one_sentence(points, message, tmp_path: Path, tiny_model) -> None:
    port = load_port(tiny_model("qwen3_moe"))
    with pytest.raises(BadInput) as err, record(port, tmp_path / "d", points):
        pass
    assert message in str(err.value)


def test_nothing_is_written_when_the_block_fails_or_runs_nothing(tmp_path: Path, golden_dir, tiny_model) -> None:
    golden = golden_dir("qwen3_moe")
    port = load_port(tiny_model("qwen3_moe"))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), record(port, tmp_path / "d", POINTS):
        port(_ids(golden))
        raise RuntimeError("boom")
    assert not (tmp_path / "d").exists()
    assert not port._forward_pre_hooks and not port.layers[0]._forward_hooks  # the hooks are gone
    with pytest.raises(BadInput, match="no named module ran inside the block"), record(port, tmp_path / "d", POINTS):
        pass
    out = _record_port(golden, tiny_model("qwen3_moe"), tmp_path / "d")
    with pytest.raises(BadInput, match="already holds a dump"), record(port, out, POINTS):
        pass
    with torch.no_grad(), record(port, out, POINTS, overwrite=True):
        port(_ids(golden))


# -- the noise floor on the port's own chained run, prefill and decode -----------------------------


@pytest.fixture(scope="module")
def decode_goldens(golden_dir) -> dict[int, Path]:
    """Noise-floor goldens with 3 decode steps: 4 layers, and 16 layers of 24 tokens (where the port
    rounded otherwise routes a token unlike the golden early: the case that starved verdicts)."""
    return {
        4: golden_dir("qwen3_moe", noise="bfloat16", decode=3),
        16: golden_dir("qwen3_moe", layers=16, seq_len=24, noise="bfloat16", decode=3),
    }


def _compare(capsys, golden: Path, dump_dir: Path, report: Path, *args: str) -> tuple[int, str, dict]:
    code, out, err = cli(capsys, "compare", golden, dump_dir, "--report", report, *args)
    assert not err, err
    return code, out, read_json(report / SUMMARY_FILE)


@pytest.mark.parametrize("layers", [4, 16])
@pytest.mark.parametrize("rounding", ["as the reference", "otherwise"])
def test_a_clean_port_s_own_decode_passes_chained(
    layers: int, rounding: str, decode_goldens, tiny_model, tmp_path: Path, capsys
) -> None:
    """Prefill and 3 decode steps, dumped from the port's own run (its own cache), chained against the
    reference's free run: no false alarm, at 16 layers neither, where an early routing flip leaves
    few tokens to judge (judged on those, against the reference's error on the same tokens)."""
    golden = decode_goldens[layers]
    out = _record_port(
        golden, tiny_model("qwen3_moe", layers), tmp_path / "d", Bugs(other_rounding=rounding != "as the reference")
    )
    code, stdout, summary = _compare(capsys, golden, out, tmp_path / "r", "--mode", "chain")
    n = len(GoldenStore(golden).point_ids)
    assert code == 0 and summary["passed"] == n, stdout
    rows = read_json(tmp_path / "r" / "comparison_report.json")["points"]
    assert {r["mode"] for r in rows} == {"chain"}
    assert all(r["noise"] for r in rows if r["step"])  # the decode steps too: judged chained, on the noise floor
    if layers == 16 and rounding == "otherwise":  # a flip early leaves few tokens later: said, and judged on them
        few = [r for r in rows if any("noise ratio over the " in note for note in r["notes"])]
        assert few and any("judged: the noise limit widens to" in note for r in few for note in r["notes"])


@pytest.mark.parametrize(
    "bugs, first",
    [
        (Bugs(decode_position_stale=True), "step_1.rotary"),
        (Bugs(decode_drops_last_cached=True), "step_1.layer_0.attention"),
        (Bugs(router_softmax_bf16=True), "layer_0.router"),
        (Bugs(norm_eps_10x=True), "layer_0.input_norm"),
    ],
    ids=["decode-position-stale", "decode-drops-a-cached-position", "router-softmax-bf16", "norm-eps-10x"],
)
def test_a_port_bug_fails_at_its_point_in_the_chained_run(
    bugs: Bugs, first: str, decode_goldens, tiny_model, tmp_path: Path, capsys
) -> None:
    """The decode-only bugs fail at their first decode step's point and nowhere before; the sub-noise
    bugs (under the fixed bf16 limits) at their own point of the prefill; 16 layers deep."""
    golden = decode_goldens[16]
    out = _record_port(golden, tiny_model("qwen3_moe", 16), tmp_path / "d", bugs)
    code, stdout, summary = _compare(capsys, golden, out, tmp_path / "r", "--mode", "chain")
    assert code == 1 and summary["first_divergence"] == first, stdout
    rows = read_json(tmp_path / "r" / "comparison_report.json")["points"]
    assert all(r["status"] == "passed" for r in rows if r["order"] < GoldenStore(golden).point(first).order)
    if first.startswith("step_"):
        assert summary["first_decode_step_differing"] in (None, 1)


def test_a_dump_judged_isolated_is_told_the_chained_mode_fits(decode_goldens, tiny_model, tmp_path: Path, capsys):
    """A whole-model dump judged against the reference's isolated error fails where rounding
    accumulated: one line says most of those failures sit within the reference's chained error, and
    which mode fits; the chained verdict passes."""
    golden = decode_goldens[16]
    out = _record_port(golden, tiny_model("qwen3_moe", 16), tmp_path / "d", Bugs(other_rounding=True))
    code, stdout, _ = _compare(capsys, golden, out, tmp_path / "r")
    assert code == 1
    line = next(li for li in stdout.splitlines() if "within the reference's own chained error" in li)
    assert line.endswith("judge it chained: --mode chain"), line
    assert _compare(capsys, golden, out, tmp_path / "r2", "--mode", "chain")[0] == 0


def test_a_dumped_cache_write_is_compared(decode_goldens, tiny_model, tmp_path: Path, capsys) -> None:
    """`Recorder.keep_cache` after each decode step: the port's cache write is compared with the
    golden's (clean: passes, with cache.keys in the row; written one position early: fails there)."""
    golden = decode_goldens[4]
    for bugs, code in ((Bugs(), 0), (Bugs(decode_cache_overwrites_last=True), 1)):
        port = load_port(tiny_model("qwen3_moe"), bugs=bugs)
        with torch.no_grad(), record(port, tmp_path / "d", POINTS, overwrite=True) as rec:
            port.generate(_ids(golden), GoldenStore(golden).decode_tokens, recorder=rec)
        assert "step_1.layer_2.attention.cache.keys" in _names(tmp_path / "d" / "step_1.safetensors")
        got, stdout, summary = _compare(capsys, golden, tmp_path / "d", tmp_path / f"r{code}", "--mode", "chain")
        rows = {r["id"]: r for r in read_json(tmp_path / f"r{code}" / "comparison_report.json")["points"]}
        row = rows["step_1.layer_0.attention"]
        assert got == code, stdout
        assert {"cache.keys", "cache.values"} <= set(row["metrics"])
        if code:
            assert summary["first_divergence"] == "step_1.layer_0.attention"
            assert any(c["target"].startswith("cache.") and not c["passed"] for c in row["checks"]), row["checks"]
        else:
            assert not any("the cache write is not compared" in n for n in row["notes"])


def test_a_float32_port_s_bf16_cache_fails_at_the_first_decode_attention(
    decode_goldens, tiny_model, tmp_path: Path, capsys
) -> None:
    """A port computing in float32 that keeps its KV cache in bf16: the prefill passes (its attention
    reads its own keys before they are cached), the first decode step's attention fails, chained, by
    float32's limits (the dump's own dtype)."""
    golden = decode_goldens[4]
    for bugs, code in ((Bugs(), 0), (Bugs(cache_bf16=True), 1)):
        port = load_port(tiny_model("qwen3_moe"), dtype=torch.float32, bugs=bugs)
        with torch.no_grad(), record(port, tmp_path / "d", POINTS, overwrite=True):
            port.generate(_ids(golden), GoldenStore(golden).decode_tokens)
        got, stdout, summary = _compare(capsys, golden, tmp_path / "d", tmp_path / f"r{code}", "--mode", "chain")
        assert got == code and "candidate dtype float32 (from all " in stdout, stdout
        assert summary["first_divergence"] == ("step_1.layer_0.attention" if code else None)
