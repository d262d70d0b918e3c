"""A decode step's KV cache is judged under every verdict: chained against the noise floor, by the
reference's own chained error of the cache (its steered and free runs keep it after each step), else
by the dtype's limits, so a wrong cache write fails the step that wrote it on the dump and recorder
routes, and a clean bf16 port passes every point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import port_own
import pytest
import torch
from helpers import read_json, run_parity
from port_qwen3 import POINTS, Bugs, load_port
from safetensors.torch import load_file, save_file

from pytest_moe_parity.dump import record
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.golden.store import sha256_file
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

STEPS = 3
FIRST = "step_1.layer_0.attention"
# the hand-written dump's point ids -> port_own's modules (it has no norm or rotary modules)
OWN_MODULES = {
    "embedding": "embed",
    "layer_{layer}.attention": "layers.{layer}.attn",
    "layer_{layer}.router": "layers.{layer}.moe.router",
    "layer_{layer}.moe": "layers.{layer}.moe",
    "layer_{layer}.output": "layers.{layer}",
    "logits": "head",
}


@pytest.fixture(scope="module")
def golden(golden_dir) -> Path:
    return golden_dir("qwen3_moe", noise="bfloat16", decode=STEPS)


def _ids(golden: Path) -> torch.Tensor:
    return torch.tensor(json.loads((golden / "manifest.json").read_text())["inputs"]["input_ids"])


def _recorded(golden: Path, model: Path, out: Path, bug: str | None) -> Path:
    """port_qwen3's own prefill and decode steps, each step's cache kept by `Recorder.keep_cache`."""
    port = load_port(model, bugs=Bugs(**({bug: True} if bug else {})))
    with torch.no_grad(), record(port, out, POINTS) as rec:
        port.generate(_ids(golden), GoldenStore(golden).decode_tokens, recorder=rec)
    return out


def _hand_dump(golden: Path, model: Path, out: Path, bug: str | None) -> Path:
    """port_own's run dumped by hand under the documented names: each point's output (a router's as
    NAME.0-2), decode step k's prefixed `step_k.`, and after each step every layer's whole static
    cache, preallocated past what the run needs, as `step_k.layer_L.attention.cache.keys`/`.values`."""
    port = port_own.load_port(model, bugs=port_own.Bugs(frozenset({bug} if bug else ())))
    files: dict[int, dict[str, torch.Tensor]] = {}
    step = [0]

    def keep(pid: str):
        def hook(module, args, output) -> None:
            name = f"step_{step[0]}.{pid}" if step[0] else pid
            kept = files.setdefault(step[0], {})
            outputs = output if isinstance(output, tuple) else (output,)
            for i, t in enumerate(outputs):
                kept[f"{name}.{i}" if isinstance(output, tuple) else name] = t.detach().clone()

        return hook

    for template, path in OWN_MODULES.items():
        for layer in range(len(port.layers)) if "{layer}" in template else (None,):
            port.get_submodule(path.format(layer=layer)).register_forward_hook(keep(template.format(layer=layer)))
    ids, tokens = _ids(golden), GoldenStore(golden).decode_tokens
    cache = port.new_cache(ids.shape[0], ids.shape[1] + len(tokens) + 8)
    with torch.no_grad():
        port(ids, cache)
        for step[0], token in enumerate(tokens, 1):
            port(torch.full((ids.shape[0], 1), token), cache)
            for layer, held in enumerate(cache):
                files[step[0]][f"step_{step[0]}.layer_{layer}.attention.cache.keys"] = held.keys.clone()
                files[step[0]][f"step_{step[0]}.layer_{layer}.attention.cache.values"] = held.values.clone()
    out.mkdir(parents=True)
    for k, kept in files.items():
        save_file(kept, str(out / (f"step_{k}.safetensors" if k else "prefill.safetensors")))
    return out


DUMPS = {"recorder": _recorded, "by hand": _hand_dump}


def _chained(pytester: pytest.Pytester, golden: Path, dump: Path) -> tuple[pytest.RunResult, list[dict], dict]:
    report = pytester.path / "report"
    result = run_parity(
        pytester, golden, "--hw", "dump", "--dtype", "bfloat16", "--parity-mode", "chain", "--parity-report",
        str(report), "-rf", model=dump,
    )  # fmt: skip
    return result, read_json(report / REPORT_FILE)["points"], read_json(report / SUMMARY_FILE)


def test_the_noise_floor_keeps_the_reference_s_cache_after_each_decode_step(golden: Path) -> None:
    """The reference's chained runs (steered and free) keep the cache each decode step's attention left,
    as its isolated run does: every set holds a figure of `cache.keys` and `cache.values` there."""
    noise = json.loads((golden / "manifest.json").read_text())["noise"]["bfloat16"]
    attention = [p.id for p in GoldenStore(golden).points if p.step is not None and p.component == "attention"]
    assert len(attention) == STEPS * 4
    for figures in ("isolated", "chain", "free"):
        for pid in attention:
            assert {"cache.keys", "cache.values"} <= set(noise[figures][pid]), (figures, pid)
            assert noise[figures][pid]["cache.keys"]["rel_l2"] < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("route", sorted(DUMPS))
def test_a_clean_port_s_cache_passes_chained_on_its_noise_ratio(
    route: str, golden: Path, tiny_model, tmp_path: Path, pytester: pytest.Pytester
) -> None:
    dump = DUMPS[route](golden, tiny_model("qwen3_moe"), tmp_path / "dump", None)
    result, rows, summary = _chained(pytester, golden, dump)
    assert result.ret == 0 and summary["failed"] == 0, result.stdout.str()
    steps = [r for r in rows if r["step"] is not None and r["component"] == "attention"]
    assert len(steps) == STEPS * 4
    for row in steps:  # every tensor of the row judged: the cache by its noise ratio, as the output is
        judged = {(c["target"], c["name"]) for c in row["checks"]}
        assert {("cache.keys", "noise_ratio"), ("cache.values", "noise_ratio")} <= judged, row["checks"]
        assert row["noise"]["targets"]["cache.keys"]["ratio"] < 1.5


@pytest.mark.slow
@pytest.mark.parametrize("route", sorted(DUMPS))
def test_keys_cached_before_rope_fail_at_the_step_that_wrote_them(
    route: str, golden: Path, tiny_model, tmp_path: Path, pytester: pytest.Pytester
) -> None:
    """The step attends with its rotated keys, so its output is right; only the cache it leaves is
    wrong (the next step reads it): the cache's noise ratio fails step 1's attention, first."""
    dump = DUMPS[route](golden, tiny_model("qwen3_moe"), tmp_path / "dump", "decode_cache_keys_unrotated")
    result, rows, summary = _chained(pytester, golden, dump)
    assert result.ret == 1
    assert summary["first_divergence"] == FIRST
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed[0]["id"] == FIRST
    assert all(r["status"] != "failed" for r in rows if r["step"] is None)  # the prefill never sees it
    checks = {(c["target"], c["name"]): c for c in failed[0]["checks"]}
    assert not checks["cache.keys", "noise_ratio"]["passed"] and checks["out", "noise_ratio"]["passed"]
    assert checks["cache.values", "noise_ratio"]["passed"]
    result.stdout.fnmatch_lines(
        [
            f"*parity {FIRST} *",
            "  cache.keys   noise_ratio * <= 1.5  FAIL",
            "  hint: the KV cache this decode step left, while its own output is right*",
            f"first divergence: {FIRST}  (the KV cache this decode step left*",
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("route", sorted(DUMPS))
def test_a_cache_written_a_position_early_fails_at_the_step_that_wrote_it(
    route: str, golden: Path, tiny_model, tmp_path: Path, pytester: pytest.Pytester
) -> None:
    """The new keys and values written over the last cached ones: the step's cache fails at its attention
    (port_qwen3's grows one position short: its shape; port_own's static cache leaves the new position
    empty: its ratio), and nothing before it."""
    dump = DUMPS[route](golden, tiny_model("qwen3_moe"), tmp_path / "dump", "decode_cache_overwrites_last")
    result, rows, summary = _chained(pytester, golden, dump)
    assert result.ret == 1 and summary["first_divergence"] == FIRST
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed[0]["id"] == FIRST
    assert {"cache.keys", "cache.values"} <= {c["target"] for c in failed[0]["checks"] if not c["passed"]}
    result.stdout.fnmatch_lines([f"*parity {FIRST} *", "  cache.keys * FAIL", f"first divergence: {FIRST}  *"])


def _without_cache_figures(golden: Path, dst: Path) -> Path:
    """The golden as recorded before the noise floor's chained runs kept the cache: no figure of it in
    the chained sets, nor any token's."""
    shutil.copytree(golden, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for entry in manifest["noise"].values():
        for figures in ("chain", "free"):
            for targets in entry[figures].values():
                targets.pop("cache.keys", None)
                targets.pop("cache.values", None)
        tokens = dst / entry["tokens"]["file"]
        kept = {
            k: v for k, v in load_file(str(tokens)).items() if not (k.split("/")[0] != "isolated" and "/cache." in k)
        }
        save_file(kept, str(tokens))
        entry["tokens"]["sha256"] = sha256_file(tokens)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.slow
def test_without_the_reference_s_figures_the_cache_is_judged_by_the_dtype_s_limits(
    golden: Path, tiny_model, tmp_path: Path, pytester: pytest.Pytester
) -> None:
    """A golden whose noise floor has no figure of the chained cache: the cache is judged by the bf16
    limits the isolated routes use, said in the row; a clean port passes, keys cached before RoPE fail
    at step 1's attention all the same."""
    old = _without_cache_figures(golden, tmp_path / "golden")
    model = tiny_model("qwen3_moe")
    clean, rows, summary = _chained(pytester, old, _recorded(old, model, tmp_path / "clean", None))
    assert clean.ret == 0 and summary["failed"] == 0, clean.stdout.str()
    row = next(r for r in rows if r["id"] == FIRST)
    assert {"rel_l2", "max_token_rel_l2"} <= {c["name"] for c in row["checks"] if c["target"] == "cache.keys"}
    said = "cache.keys: the golden holds no figure of the reference's own run for it: judged by the dtype's limits"
    assert any(note.startswith(said) for note in row["notes"]), row["notes"]
    shutil.rmtree(pytester.path / "report")
    bug = _recorded(old, model, tmp_path / "bug", "decode_cache_keys_unrotated")
    result, rows, summary = _chained(pytester, old, bug)
    assert result.ret == 1 and summary["first_divergence"] == FIRST
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["id"] == FIRST
    assert {c["target"] for c in failed["checks"] if not c["passed"]} == {"cache.keys"}
