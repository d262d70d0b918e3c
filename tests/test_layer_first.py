"""Layer-first under -x (`plugin/layer_first.py`): each decoder layer is run once and judged with its
components as that run made them; their items run only where one fails, and the first failing component
is the same as without it."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
from helpers import run_parity

from pytest_moe_parity.golden import GoldenStore

pytestmark = pytest.mark.usefixtures("_import_everything_once")

HEADER = "moe-parity: layer-first (-x): each decoder layer is run once and judged with its components*"


@pytest.fixture
def faulty(tiny_model, pytester: pytest.Pytester) -> Path:
    """The 4-layer qwen3_moe with layer 2's input norm scaled by 1.25."""
    edit = faults.scale("input_layernorm", 2, 1.25)
    return faults.edit_checkpoint(tiny_model("qwen3_moe"), pytester.path / "c", edit)


def test_under_x_the_layers_before_the_fault_run_their_output_alone(pytester, golden_dir, faulty) -> None:
    result = run_parity(pytester, golden_dir("qwen3_moe"), "-x", "--no-parity-weights", model=faulty)
    # config, embedding, rotary, layer_0.output, layer_1.output; their 12 components skipped; then layer 2's
    # components run, and -x stops at the first that fails
    result.assert_outcomes(passed=5, skipped=12, failed=1)
    result.stdout.fnmatch_lines([HEADER])
    result.stdout.fnmatch_lines(
        [
            "layer_0.input_norm * skipped * layer-first: layer_0.output and its components pass on one r*",
            "layer_1.output * passed *",
            "layer_2.input_norm * failed *",
            "first divergence: layer_2.input_norm *",
            "layer-first: the components of 2 layers that passed on one run of the layer were not run again (*)",
        ]
    )


def test_no_parity_layer_first_runs_every_item_to_the_same_first_failure(pytester, golden_dir, faulty) -> None:
    result = run_parity(
        pytester, golden_dir("qwen3_moe"), "-x", "--no-parity-weights", "--no-parity-layer-first", model=faulty
    )
    result.assert_outcomes(passed=17, failed=1)
    result.stdout.fnmatch_lines(["first divergence: layer_2.input_norm *"])
    assert "layer-first" not in result.stdout.str()


def test_a_clean_run_under_x_judges_the_prefill_s_layers_in_one_run_and_runs_each_decode_item(
    pytester, golden_dir
) -> None:
    golden = golden_dir("qwen3_moe", decode=1)
    points = GoldenStore(golden).points
    components = [p for p in points if p.layer is not None and p.component != "output" and p.step is None]
    assert any(p.step == 1 and p.layer is not None for p in points)
    result = run_parity(pytester, golden, "-x", "--no-parity-weights")
    result.assert_outcomes(passed=len(points) - len(components), skipped=len(components))
    result.stdout.fnmatch_lines(["first divergence: none", "layer-first: the components of 4 layers that passed*"])


def test_asked_without_x_it_runs_the_failing_layer_s_components_and_goes_on(pytester, golden_dir, faulty) -> None:
    result = run_parity(pytester, golden_dir("qwen3_moe"), "--parity-layer-first", "--no-parity-weights", model=faulty)
    # layer 2's input norm and output fail, its other 5 components pass; layers 0, 1 and 3 run their output alone
    result.assert_outcomes(passed=13, skipped=18, failed=2)
    result.stdout.fnmatch_lines(["first divergence: layer_2.input_norm *", "*components of 3 layers*"])


def test_a_component_selected_without_its_layer_s_output_runs(pytester, golden_dir, faulty) -> None:
    result = run_parity(pytester, golden_dir("qwen3_moe"), "-x", "-k", "layer_2.input_norm", model=faulty)
    result.assert_outcomes(failed=1)
    assert "components of" not in result.stdout.str()


def test_a_component_its_layer_s_output_hides_is_still_found_first(pytester, golden_dir, tiny_model) -> None:
    """Gate and up swapped in every expert of layer 2 of a mixtral: the experts' output is 17% off, the
    layer's output within its limits (the residual stream around it); the layer's one run judges the
    experts on what it gave them, so -x still stops at layer_2.experts."""
    golden = golden_dir("mixtral")
    port = faults.edit_checkpoint(tiny_model("mixtral"), pytester.path / "c", faults.swap_gate_up(2))
    every = run_parity(pytester, golden, "--no-parity-weights", "--no-parity-config", "--dtype", "bfloat16", model=port)
    every.stdout.fnmatch_lines(["layer_2.experts * failed *"])
    every.stdout.fnmatch_lines(["layer_2.output * passed *"])  # the output alone would hide it
    result = run_parity(
        pytester, golden, "-x", "--no-parity-weights", "--no-parity-config", "--dtype", "bfloat16", model=port
    )
    result.assert_outcomes(passed=GoldenStore(golden).point_ids.index("layer_2.experts") - 12, skipped=12, failed=1)
    result.stdout.fnmatch_lines(["first divergence: layer_2.experts *"])


def test_chained_runs_and_compiled_backends_run_every_item(pytester, golden_dir) -> None:
    from pytest_moe_parity.backends.compiled import CompiledBackend
    from pytest_moe_parity.backends.hf import TorchBackend

    assert TorchBackend.captures_parts and not CompiledBackend.captures_parts
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    result = run_parity(pytester, golden, "-x", "--parity-mode", "both")
    result.assert_outcomes(passed=len(GoldenStore(golden).points))
    assert "layer-first" not in result.stdout.str()
