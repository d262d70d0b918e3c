"""The backend contract: registration through entry points, options validated up front, inputs
handed over cast to the candidate's dtype, errors of a backend reported as such, and the README's
example backend, run exactly as a stranger would install it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar

import pytest
import tomllib
import torch
from helpers import NO_WEIGHTS, read_json, run_parity, session, usage_error

from pytest_moe_parity import backends
from pytest_moe_parity.backends import Backend, BackendError, BackendSetup, CandidateOutput, parse_hw_options
from pytest_moe_parity.backends.hf import TorchBackend
from pytest_moe_parity.errors import BackendFailure
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")
# the backend example and its registration: the docs page for backend authors
BACKENDS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "backends.md"


def register(monkeypatch: pytest.MonkeyPatch, cls: type[Backend]) -> None:
    monkeypatch.setitem(backends.registry(), cls.name, cls)


def test_builtin_backends_are_entry_points() -> None:
    found = backends.registry()
    assert {"cpu", "cuda", "dump"} <= set(found)
    assert backends.backend_class("cpu") is TorchBackend
    with pytest.raises(KeyError):
        backends.backend_class("tpu")


def test_hw_options_are_parsed_and_validated(golden_dir, tiny_model) -> None:
    assert parse_hw_options(["device=cpu", "max_layers=3", "max_layers=4"]) == {"device": "cpu", "max_layers": "4"}
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_hw_options(["=3"])
    setup = BackendSetup(GoldenStore(golden_dir("olmoe")), tiny_model("olmoe"), options={"max_layers": "3"})
    assert TorchBackend(setup).hw_options == {
        "device": None, "max_layers": 3, "threads": None, "attention_budget": 48.0, "quant": None,
        "attention": None, "experts": None,
    }  # fmt: skip
    with pytest.raises(BackendError, match="no option 'speed'; its options: device, max_layers, threads, attention_b"):
        TorchBackend(BackendSetup(setup.golden, setup.model_dir, options={"speed": "1"}))
    with pytest.raises(BackendError, match="threads"):
        TorchBackend(BackendSetup(setup.golden, setup.model_dir, options={"threads": "0"}))
    with pytest.raises(BackendError, match="attention_budget=-1: expected a number of at least 0"):
        TorchBackend(BackendSetup(setup.golden, setup.model_dir, options={"attention_budget": "-1"}))


def test_construction_is_cheap_and_loading_lazy(golden_dir, tiny_model) -> None:
    """Validation at construction reads the shard index only; weights come with the first point."""
    run = session(golden_dir("olmoe"), tiny_model("olmoe"))
    assert run.backend.lazy is None and not run.runner.started
    run.runner.run("layer_1.router")
    assert run.backend.read_stats()["units"] == ["layer_1"]


class Recording(TorchBackend):
    """A backend that checks what it is handed: inputs in its dtype, no golden output."""

    name = "recording"
    seen: ClassVar[list[tuple[str, set[torch.dtype], object]]] = []

    def run(self, point, golden):
        floats = {t.dtype for t in _tensors((golden.args, golden.kwargs)) if t.is_floating_point()}
        Recording.seen.append((point.id, floats, golden.output))
        return super().run(point, golden)


def _tensors(obj):
    from pytest_moe_parity.tree import leaves

    return [t for t in leaves(obj) if isinstance(t, torch.Tensor)]


def test_a_backend_gets_inputs_in_its_dtype_and_not_the_answer(
    monkeypatch, pytester: pytest.Pytester, golden_dir
) -> None:
    register(monkeypatch, Recording)
    Recording.seen.clear()
    golden = golden_dir("minimax_m2")
    run_parity(pytester, golden, "--hw", "recording", "--dtype", "bfloat16").assert_outcomes(
        passed=len(GoldenStore(golden).point_ids)
    )
    assert Recording.seen and all(floats <= {torch.bfloat16} for _, floats, _ in Recording.seen)
    assert all(output is None for _, _, output in Recording.seen)


def test_row_masks_belong_to_the_run_that_takes_them() -> None:
    """A golden's causal mask comes a block of rows at a time (`row_masks`) only to a `run` that says
    it takes one: `cpu`/`cuda`'s own; a subclass with a `run` of its own gets tensors unless it says so."""
    assert {name: backends.backend_class(name).row_masks for name in ("cpu", "cuda", "trace", "compile", "dump")} == {
        "cpu": True, "cuda": True, "trace": False, "compile": False, "dump": False
    }  # fmt: skip

    class Faster(TorchBackend):  # the same run: it takes them
        name = "faster"

    class Own(TorchBackend):
        name = "own"

        def run(self, point, golden):
            return super().run(point, golden)

    class OwnSaysSo(Own):
        row_masks = True

        def run(self, point, golden):
            return super().run(point, golden)

    assert (Faster.row_masks, Own.row_masks, OwnSaysSo.row_masks) == (True, False, True)


CRASHING = """
from pytest_moe_parity.backends.hf import TorchBackend


class Crashing(TorchBackend):
    name = "crashing"

    def run(self, point, golden):
        out = super().run(point, golden)
        if point.id == "layer_1.post_attn_norm":
            out.output = out.output[:, :-1]  # a wrong shape: a divergence
        if point.id == "layer_2.post_attn_norm":
            raise RuntimeError("device lost")  # the backend's own failure: an error, not a divergence
        return out
"""


def install(
    monkeypatch: pytest.MonkeyPatch, site: Path, module: str, source: str, entry_points: dict[str, str]
) -> None:
    """A backend package as pip leaves it: the module and a dist-info with its entry points, on
    sys.path and PYTHONPATH (xdist workers are other processes)."""
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / f"{module}.py").write_text(source)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[pytest_moe_parity.backends]\n{lines}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(backends, "_REGISTRY", {})  # read the entry points again


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_backend_exceptions_are_errors_not_divergences(xdist, monkeypatch, pytester: pytest.Pytester, golden_dir):
    install(
        monkeypatch, pytester.path / "site", "crashing_backend", CRASHING, {"crashing": "crashing_backend:Crashing"}
    )
    report = pytester.path / "report"
    args = ["--hw", "crashing", "-m", "post_attn_norm", "--parity-report", str(report), *xdist]
    result = run_parity(pytester, golden_dir("olmoe"), *args, subprocess=bool(xdist))
    result.assert_outcomes(passed=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of *layer_2.post_attn_norm*",
            "layer_2.post_attn_norm: the backend raised RuntimeError: device lost",
            "*in run*",
            "*RuntimeError: device lost",
            "*out: shape mismatch: golden (1, 16, 64) vs candidate (1, 15, 64)*",
            "first divergence: layer_1.post_attn_norm*",
            "backend errors: 1, first at layer_2.post_attn_norm: *RuntimeError: device lost",
        ]
    )
    assert "INTERNALERROR" not in result.stdout.str() and "runner.py" not in result.stdout.str()
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] == "layer_1.post_attn_norm"
    assert (summary["failed"], summary["error"], summary["first_error"]) == (1, 1, "layer_2.post_attn_norm")


def test_an_error_alone_is_no_divergence(monkeypatch, pytester: pytest.Pytester, golden_dir) -> None:
    install(
        monkeypatch, pytester.path / "site", "crashing_backend", CRASHING, {"crashing": "crashing_backend:Crashing"}
    )
    report = pytester.path / "report"
    result = run_parity(
        pytester,
        golden_dir("olmoe"),
        "--hw",
        "crashing",
        "-k",
        "layer_2.post_attn_norm",
        "--parity-report",
        str(report),
    )
    result.assert_outcomes(errors=1)
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None
    result.stdout.fnmatch_lines(["first divergence: none"])


class FailingStart(TorchBackend):
    name = "failing-start"

    def _start(self):
        raise OSError("no NeuronCore visible")


@pytest.mark.parametrize("mode", ["isolated", "chain"])
def test_a_failing_start_is_said_once_and_stops_the_run(
    mode: str, monkeypatch, pytester: pytest.Pytester, golden_dir
) -> None:
    """No point can run on a backend that did not start: one error, the backend's, and the run stops
    (without -x), in either mode; start() is not tried again."""
    starts: list[int] = []
    monkeypatch.setattr(FailingStart, "start", lambda self: starts.append(1) or FailingStart._start(self))
    register(monkeypatch, FailingStart)
    golden = golden_dir("olmoe", noise="bfloat16")
    result = run_parity(pytester, golden, "--hw", "failing-start", "--parity-mode", mode, NO_WEIGHTS)
    result.assert_outcomes(errors=1)
    said = "the backend failed to start (before embedding, its first point): OSError: no NeuronCore visible"
    result.stdout.fnmatch_lines([said, "*in _start*", f"*moe-parity: --hw failing-start: {said}*"])
    assert result.ret == 1 and len(starts) == 1


class Unconfigurable(Backend):
    name = "unconfigurable"
    needs_checkpoint = False

    def __init__(self, setup):
        super().__init__(setup)
        raise BackendError("torch_neuronx is not installed; pip install torch-neuronx from the Neuron index")

    def run(self, point, golden):  # pragma: no cover - never constructed
        raise AssertionError


def test_a_backend_that_cannot_be_set_up_is_a_usage_error(monkeypatch, pytester, golden_dir) -> None:
    register(monkeypatch, Unconfigurable)
    result = run_parity(pytester, golden_dir("olmoe"), "--hw", "unconfigurable", model=golden_dir("olmoe"))
    usage_error(result, "--hw unconfigurable: torch_neuronx is not installed")


class NoRouting(TorchBackend):
    """A backend that cannot see the candidate's routing."""

    name = "no-routing"

    def run(self, point, golden):
        out = super().run(point, golden)
        return CandidateOutput(out.output)


def test_without_routing_every_token_is_compared_and_the_text_says_so(
    monkeypatch, pytester: pytest.Pytester, golden_dir
) -> None:
    register(monkeypatch, NoRouting)
    report = pytester.path / "report"
    result = run_parity(
        pytester, golden_dir("minimax_m2"), "--hw", "no-routing", "-m", "moe", "--parity-report", str(report)
    )
    result.assert_outcomes(passed=4)  # fp32: nothing flips
    rows = read_json(report.parent / "report" / "comparison_report.json")["points"]
    assert all("does not expose the candidate's routing" in " ".join(r["notes"]) for r in rows)


def test_interrupted_run_leaves_no_half_written_report(monkeypatch, pytester: pytest.Pytester, golden_dir) -> None:
    class Interrupting(TorchBackend):
        name = "interrupting"

        def run(self, point, golden):
            if point.id == "layer_2.attention":
                raise KeyboardInterrupt
            return super().run(point, golden)

    register(monkeypatch, Interrupting)
    report = pytester.path / "report"
    argv = ["--golden-dir", str(golden_dir("olmoe")), "--hw", "interrupting", "--parity-report", str(report)]
    result = pytester.runpytest(*argv, "-p", "no:cacheprovider", no_reraise_ctrlc=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    summary = read_json(report / SUMMARY_FILE)  # complete JSON, marked incomplete
    assert summary["complete"] is False and summary["failed"] == 0
    assert not list(report.glob(".*tmp*"))


def test_runner_wraps_backend_exceptions(golden_dir, tiny_model, monkeypatch) -> None:
    run = session(golden_dir("olmoe"), tiny_model("olmoe"), hw="cpu")

    def boom(point, golden):
        raise ValueError("bad layout")

    monkeypatch.setattr(run.backend, "run", boom)
    with pytest.raises(BackendFailure, match=r"layer_0\.router: the backend raised ValueError: bad layout"):
        run.runner.run("layer_0.router")


# -- the documented backend (docs/backends.md), installed as the page says -------------------------


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", BACKENDS_PAGE.read_text(), flags=re.S)


def test_the_readme_backend_example_works_as_documented(
    monkeypatch, pytester: pytest.Pytester, golden_dir, tiny_model
) -> None:
    """The example module and its pyproject lines, taken from the README, installed as an entry
    point (a dist-info on sys.path, as pip would leave it): its ported points pass in bf16, the
    others are skipped with the backend's reason, and a port bug fails at its point."""
    import faults

    code = next(b for b in _readme_blocks("python") if b.startswith("# my_port_parity.py"))
    toml = next(b for b in _readme_blocks("toml") if "pytest_moe_parity.backends" in b)
    entry_points = tomllib.loads(toml)["project"]["entry-points"]["pytest_moe_parity.backends"]
    install(monkeypatch, pytester.path / "site", "my_port_parity", code, entry_points)
    golden = golden_dir("qwen3_moe", noise="bfloat16", decode=3)
    n = len(GoldenStore(golden).point_ids)
    ported = (4 * 3 + 1) * 4  # input_norm, post_attn_norm and experts of 4 layers, the final norm; 4 steps
    for mode in ("isolated", "chain", "both"):
        report = pytester.path / f"r-{mode}"
        result = run_parity(
            pytester, golden, "--hw", "handport", "--dtype", "bfloat16", "-rs", "--parity-mode", mode,
            "--hw-option", "fp32_norm_weight=on", "--parity-report", str(report),
        )  # fmt: skip
        result.assert_outcomes(passed=ported, skipped=n - ported)
        result.stdout.fnmatch_lines(["*layer_0.attention: not ported yet*"])
        rows = {r["id"]: r for r in read_json(report / "comparison_report.json")["points"]}
        assert rows["step_3.layer_3.experts"]["status"] == "passed"
        if mode != "isolated":

            def chained(pid: str, rows: dict = rows, mode: str = mode) -> dict:
                return rows[pid] if mode == "chain" else rows[pid]["chain"]

            assert chained("layer_1.experts")["mode"] == "chain" and chained("layer_1.experts")["noise"]
            notes = " ".join(chained("layer_1.post_attn_norm")["notes"] + rows["step_1.layer_0.input_norm"]["notes"])
            assert "stayed golden (the point that produces it was not run by the candidate)" in notes
            assert "decode steps are judged on the golden's inputs: the handport backend does not chain them" in notes
    buggy = faults.edit_checkpoint(tiny_model("qwen3_moe"), pytester.path / "buggy", faults.swap_gate_up(2))
    result = run_parity(pytester, golden, "--hw", "handport", "--dtype", "bfloat16", "-m", "experts", model=buggy)
    result.assert_outcomes(passed=12, failed=4)  # layer_2.experts of the prefill and of each decode step
    result.stdout.fnmatch_lines(["first divergence: layer_2.experts*"])
    # the drill, through the page's drill_call: the port's own code (its experts gather each expert's
    # tokens in token order, gate and up in two matmuls), matched to the reference's ops
    drilled = run_parity(pytester, golden, "--hw", "handport", "--dtype", "bfloat16", "--parity-report",
                         str(pytester.path / "d"), "--parity-drill", "layer_2.experts", "-k", "layer_2.experts",
                         "--hw-option", "fp32_norm_weight=on", model=buggy)  # fmt: skip
    record = read_json(pytester.path / "d" / "comparison_summary.json")["drills"]["layer_2.experts"]
    rows = {r["id"].split("::")[1]: r for r in read_json(pytester.path / "d" / "comparison_report.json")["points"]
            if "::" in r["id"] and r.get("op")}  # fmt: skip
    failed = {name: r["op"]["verdict"] for name, r in rows.items() if r["status"] == "failed"}
    # every expert's gate_up_proj (computed as two matmuls, gate and up swapped) introduced it, and only those
    assert failed and {v for n, v in failed.items() if n.endswith(".gate_up_proj")} == {"introduced"}, failed
    assert all(v == "inherited" for n, v in failed.items() if not n.endswith(".gate_up_proj")), failed
    assert record["culprit"].endswith(".gate_up_proj") and record["recovery_introduced"] >= 0.9, record
    assert not record["structure"] and record["accumulation"] is None
    # one culprit, the group: every expert's gate_up_proj (the first expert's op alone is a share of it)
    assert record["culprit_group"].startswith("gate_up_proj in ") and record["group_recovery"] >= 0.9, record
    said = f"{record['culprit_group']} introduced the divergence (the first: {record['culprit']})"
    drilled.stdout.fnmatch_lines([f"  culprit: {said.replace('[', '[[]')}"])
    clean = run_parity(pytester, golden, "--hw", "handport", "--dtype", "bfloat16", "--hw-option",
                       "fp32_norm_weight=on", "--parity-drill", "layer_2.experts,layer_2.post_attn_norm",
                       "-k", "layer_2.experts or layer_2.post_attn_norm")  # fmt: skip
    assert clean.ret == 0, clean.stdout.str()[-3000:]  # the port's own code, drilled clean: no culprit
    clean.stdout.fnmatch_lines(
        ["drill layer_2.post_attn_norm: * 0 failed; no culprit", "drill layer_2.experts: * 0 failed; no culprit"]
    )
    usage_error(
        run_parity(pytester, golden, "--hw", "handport", "--hw-option", "eps=tiny"),
        "--hw-option eps=tiny: could not convert string to float: 'tiny'",
    )
    usage_error(
        run_parity(pytester, golden, "--hw", "handport", "--hw-option", "fp32_norm_weight=maybe"),
        "--hw-option fp32_norm_weight=maybe: expected on or off, got 'maybe'",
    )
