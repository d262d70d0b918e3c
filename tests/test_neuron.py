"""`--hw neuron` against a test double of torch_neuronx (tests/doubles) that enforces the documented
contract: positional tensors only, static shapes, weights kept out of the NEFF moved to the device
before running and swapped with replace_weights under the trace's own names. The graphs run on the
CPU, so verdicts are real: clean runs pass and port bugs fail at their own point."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import faults
import pytest
import torch
from helpers import NO_CONFIG, NO_WEIGHTS, assert_within_rounding, read_json, run_parity, usage_error

from pytest_moe_parity.backends.neuron import count_devices, format_cores, parse_cores, visible_cores
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")
DOUBLES = Path(__file__).resolve().parent / "doubles"


@pytest.fixture
def neuronx(monkeypatch: pytest.MonkeyPatch):
    """The double, importable as torch_neuronx (fresh: its call log starts empty)."""
    monkeypatch.syspath_prepend(str(DOUBLES))
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    monkeypatch.delenv("NEURON_RT_NUM_CORES", raising=False)
    import torch_neuronx

    torch_neuronx.calls.clear()
    yield torch_neuronx
    os.environ.pop("NEURON_RT_VISIBLE_CORES", None)  # what the backend set for this process


def neuron_args(cache: Path, *more: str) -> list[str]:
    return ["--hw", "neuron", "--hw-option", "devices=1", "--hw-option", f"cache_dir={cache}", *more]


def test_the_calls_made_follow_the_documented_contract(
    neuronx, pytester: pytest.Pytester, golden_dir, tmp_path
) -> None:
    golden = golden_dir("minimax_m2")
    store = GoldenStore(golden)
    report = tmp_path / "report"
    result = run_parity(
        pytester, golden, *neuron_args(tmp_path / "c", "--dtype", "bfloat16", "--parity-report", str(report))
    )
    result.assert_outcomes(passed=len(store.point_ids))
    names = [name for name, _ in neuronx.calls]
    traces = [details for name, details in neuronx.calls if name == "trace"]
    assert len(traces) == read_json(report / SUMMARY_FILE)["graphs"]["graphs"] == 9  # one per layer kind
    for i, (name, details) in enumerate(neuronx.calls):
        if name == "trace":  # the documented arguments, and every trace placed before anything else
            assert details["inline_weights_to_neff"] is False
            assert details["compiler_args"] == ["--auto-cast=none"]
            assert Path(details["compiler_workdir"]).is_relative_to(tmp_path / "c")
            assert all(isinstance(shape, tuple) for shape, _ in details["inputs"])
            assert neuronx.calls[i + 1][0] == "move_trace_to_device"
            assert neuronx.calls[i + 1][1]["module"] is details["module"]
    swaps = [details for name, details in neuronx.calls if name == "replace_weights"]
    assert swaps and all(all(k.startswith("mod.") for k in s["keys"]) for s in swaps)
    # weights swapped per layer: the router graph ran layers 1-3 on their own weights
    from helpers import load_fp32

    model = load_fp32(store.manifest["model"]["path"])
    routers = [s for s in swaps if "mod.weight" in s["keys"] and s["weights"]["mod.weight"].shape == (8, 64)]
    for layer, swap in zip((1, 2, 3), routers, strict=True):
        expected = model.get_parameter(f"model.layers.{layer}.mlp.gate.weight").to(torch.bfloat16)
        assert torch.equal(swap["weights"]["mod.weight"], expected)
    assert names.count("trace") == 9
    # a second run compiles nothing: each cached trace is loaded, placed, and given its weights
    neuronx.calls.clear()
    run_parity(pytester, golden, *neuron_args(tmp_path / "c", "--dtype", "bfloat16")).assert_outcomes(
        passed=len(store.point_ids)
    )
    names = [name for name, _ in neuronx.calls]
    assert "trace" not in names and names.count("move_trace_to_device") == 9


@pytest.mark.parametrize(
    "fault", ["gate_up_swapped", "score_bias_dropped_minimax", "o_proj_heads_permuted", "lm_head_scaled"]
)
def test_port_bugs_are_caught_at_their_point(fault, neuronx, pytester, tiny_model, golden_dir, tmp_path) -> None:
    arch, expected, make = faults.CASES[fault]
    golden = golden_dir(arch)
    candidate = faults.edit_checkpoint(tiny_model(arch), tmp_path / "candidate", make(golden)[0])
    args = neuron_args(tmp_path / "c", "--dtype", "bfloat16", "-x", NO_WEIGHTS, NO_CONFIG)
    result = run_parity(pytester, golden, *args, model=candidate)
    result.assert_outcomes(failed=1, passed=GoldenStore(golden).point_ids.index(expected))
    result.stdout.fnmatch_lines([f"first divergence: {expected}*"])


def test_torch_neuronx_missing_is_a_usage_error_with_the_install_command(pytester, golden_dir, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    result = run_parity(pytester, golden_dir("olmoe"), "--hw", "neuron")
    usage_error(result, "--hw neuron needs torch-neuronx, which is not installed: pip install --extra-index-url")
    assert "https://pip.repos.neuron.amazonaws.com" in result.stderr.str()


def test_no_device_and_too_many_workers_are_usage_errors(neuronx, pytester, golden_dir, monkeypatch) -> None:
    monkeypatch.setattr("pytest_moe_parity.backends.neuron.DEV", pytester.path / "no-dev")
    golden = golden_dir("olmoe")
    usage_error(run_parity(pytester, golden, "--hw", "neuron"), "--hw neuron: no Neuron device is visible")
    usage_error(
        run_parity(pytester, golden, "--hw", "neuron", "--hw-option", "devices=1", "-n", "3"),
        "--hw neuron: -n 3 with cores_per_worker=1 needs 3 NeuronCores, and 2 are visible (0-1); use -n 2 or fewer",
    )
    usage_error(
        run_parity(
            pytester,
            golden,
            "--hw",
            "neuron",
            "--hw-option",
            "devices=2",
            "--hw-option",
            "cores_per_worker=3",
            "-n",
            "2",
        ),
        "needs 6 NeuronCores, and 4 are visible (0-3); use -n 1 or fewer",
    )


@pytest.mark.slow
def test_each_xdist_worker_gets_its_own_neuroncore(
    pytester: pytest.Pytester, golden_dir, tmp_path, monkeypatch
) -> None:
    """Two workers, two cores: each worker's torch_neuronx import sees its own NEURON_RT_VISIBLE_CORES."""
    log = tmp_path / "imports.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(DOUBLES), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NEURON_DOUBLE_LOG", str(log))
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    golden = golden_dir("olmoe")
    args = neuron_args(tmp_path / "c", "-n", "2", "-m", "router or logits")
    result = run_parity(pytester, golden, *args, subprocess=True)
    result.assert_outcomes(passed=5)
    seen = sorted(line.split()[1] for line in log.read_text().splitlines() if len(line.split()) == 2)
    assert seen == ["0", "1"], log.read_text()


def test_core_lists_and_visibility(tmp_path: Path) -> None:
    assert parse_cores("0") == [0] and parse_cores("4-7") == [4, 5, 6, 7] and parse_cores("0,2,4-5") == [0, 2, 4, 5]
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cores(bad)
    assert format_cores([2, 3, 4]) == "2-4" and format_cores([1]) == "1" and format_cores([0, 2]) == "0,2"
    for name in ("neuron0", "neuron1", "neuron_monitor", "null"):
        (tmp_path / name).touch()
    assert count_devices(tmp_path) == 2
    assert visible_cores(2, 2, env={}) == [0, 1, 2, 3]
    assert visible_cores(2, 2, env={"NEURON_RT_VISIBLE_CORES": "2-7"}) == [2, 3]
    assert visible_cores(2, 2, env={"NEURON_RT_NUM_CORES": "3"}) == [0, 1, 2]
    assert visible_cores(0, 2, env={"NEURON_RT_VISIBLE_CORES": "0-3"}) == []


def test_worker_ranges(neuronx, golden_dir, tiny_model, monkeypatch) -> None:
    """Worker i of n takes cores [i*k, (i+1)*k) of those visible, and says so to the runtime."""
    from pytest_moe_parity.backends import BackendSetup
    from pytest_moe_parity.backends.neuron import NeuronBackend

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    store = GoldenStore(golden_dir("olmoe"))
    options = {"devices": "4", "cores_per_worker": "2"}
    for worker, expected in ((0, "4-5"), (1, "6-7")):
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
        NeuronBackend(BackendSetup(store, tiny_model("olmoe"), options=options, workers=2, worker=worker))
        assert os.environ["NEURON_RT_VISIBLE_CORES"] == expected
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    NeuronBackend(BackendSetup(store, tiny_model("olmoe"), options=options, workers=2, worker=None))
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "4-7"  # the controller leaves it to the workers


def test_the_double_enforces_what_it_claims() -> None:
    """So that a pass against it means something: each documented rule is checked."""
    sys.path.insert(0, str(DOUBLES))
    try:
        import torch_neuronx
    finally:
        sys.path.remove(str(DOUBLES))
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(torch_neuronx.ContractError, match="flat tuple of tensors"):
        torch_neuronx.trace(lin, ((x,),))
    with pytest.raises(torch_neuronx.ContractError, match="keyword-only"):
        torch_neuronx.trace(lin, (x,), None)
    separated = torch_neuronx.trace(lin, (x,), inline_weights_to_neff=False)
    assert isinstance(separated, torch.jit.ScriptModule)
    with pytest.raises(torch_neuronx.ContractError, match="move the trace with move_trace_to_device"):
        separated(x)
    torch_neuronx.move_trace_to_device(separated, 0)
    assert torch.equal(separated(x), lin(x))
    with pytest.raises(torch_neuronx.ContractError, match="static shapes"):
        separated(torch.randn(3, 4))
    with pytest.raises(torch_neuronx.ContractError, match="positional tensors only"):
        separated(input=x)
    with pytest.raises(torch_neuronx.ContractError, match="state_dict names"):
        torch_neuronx.replace_weights(separated, {"mod.weight": lin.weight})
    doubled, bias = lin.weight.detach() * 2, lin.bias.detach().clone()
    torch_neuronx.replace_weights(separated, {"weight": doubled, "bias": bias})
    # the trace's linear (one fused addmm) against a matmul then an add: 4-term sums, another kernel
    assert_within_rounding(separated(x), x @ doubled.T + bias, steps=4, where="replaced weights")
    inlined = torch_neuronx.trace(lin, (x,))
    with pytest.raises(torch_neuronx.ContractError, match="inline_weights_to_neff=False"):
        torch_neuronx.replace_weights(inlined, lin)
