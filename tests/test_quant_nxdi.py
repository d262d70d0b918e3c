"""`--hw nxdi --hw-option quantized=int8|f8e4m3` (issue 51, item 4): NxDI's own quantization. The weight
items read the quantized state dict NxDI's `save_quantized_state_dict` writes (NxD's per-channel
symmetric contract, as the test double in tests/doubles keeps it: each linear's weight as int8 or
e4m3 beside `scale`, float32, one per output channel), map its names back to the reference's and judge
each weight as stored, within its format's rounding at its channel's scale; a scale bug in that state
dict fails its layer's weight item at its tensor, naming the channels; a value NxD has no dtype for,
or a checkpoint NxDI's quantization does not take, is bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_parity, usage_error
from torch import nn

from pytest_moe_parity.backends.nxdi.weights import QUANTIZED, stored_unit
from pytest_moe_parity.judge.quant_weights import judge_quantized
from pytest_moe_parity.record.tiny import write_tiny_model

pytestmark = pytest.mark.usefixtures("_import_everything_once")
DOUBLES = Path(__file__).resolve().parent / "doubles"
ARGS = ("--hw", "nxdi", "-x", "-k", "weights")
TORCH = {"int8": torch.int8, "f8e4m3": torch.float8_e4m3fn}

# a scale bug in the quantized state dict NxDI writes: layer 1's q_proj scales inverted
INVERTED = """
from neuronx_distributed_inference.models import application_base as a

prepare = a.NeuronApplicationBase.prepare_quantized_state_dict.__func__


def inverted(cls, model):
    state = prepare(cls, model)
    key = "layers.1.self_attn.q_proj.scale"
    state[key] = 1 / state[key]
    return state


a.NeuronApplicationBase.prepare_quantized_state_dict = classmethod(inverted)
"""


@pytest.fixture
def candidate(tiny_model, tmp_path: Path) -> Path:
    """The golden's model under another path: the candidate NxDI converts and quantizes."""
    return Path(shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "candidate"))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.proj = nn.Linear(64, 48, bias=False)
        self.lm_head = nn.Linear(48, 32, bias=False)


@pytest.mark.parametrize("dtype", list(QUANTIZED))
def test_nxd_s_per_channel_weights_are_read_as_stored_and_a_scale_bug_names_its_channels(dtype, nxdi_double) -> None:
    """The double's NxD quantization of a linear, read back by `stored_unit` as a per-channel `Stored`
    under the reference's names: within one rounding at each channel's scale; one channel's scale off
    by 4 is named, with its tensor."""
    from neuronx_distributed.quantization.quantization_utils import quantize_pytorch_model_per_channel_symmetric

    tiny = Tiny()
    ref = {"model.proj.weight": tiny.model.proj.weight.detach().clone(), "lm_head.weight": tiny.lm_head.weight.detach()}
    quantize_pytorch_model_per_channel_symmetric(tiny, inplace=True, dtype=TORCH[dtype])
    state = {**tiny.model.state_dict(), **{f"lm_head.{k}": v for k, v in tiny.lm_head.state_dict().items()}}
    assert state["proj.scale"].dtype == torch.float32 and tuple(state["proj.scale"].shape) == (48, 1)
    stored = stored_unit(state, None, {"prefix": "model.", "top_level": ["lm_head."]}, QUANTIZED[dtype])
    assert set(stored) == set(ref)
    assert stored["model.proj.weight"].block == (1, 64)
    for name, weight in stored.items():
        assert not judge_quantized(name, ref[name], weight.dequantized(), weight).findings, name
    state["proj.scale"][5] *= 4
    bad = stored_unit(state, None, {"prefix": "model.", "top_level": ["lm_head."]}, QUANTIZED[dtype])
    weight = bad["model.proj.weight"]
    found = judge_quantized("model.proj.weight", ref["model.proj.weight"], weight.dequantized(), weight).findings
    assert len(found) == 1 and found[0].startswith("model.proj.weight: channel 5"), found


@pytest.mark.parametrize("dtype", list(QUANTIZED))
def test_nxdi_s_quantized_state_dict_is_judged_and_an_inverted_scale_fails_its_layer(
    dtype: str, nxdi_double, golden_dir, candidate: Path, pytester: pytest.Pytester
) -> None:
    """A clean quantization passes every weight item, saying how the weights were judged; the same state
    dict with layer 1's q_proj scales inverted fails layer_1.weights first, at that tensor."""
    pytester.syspathinsert(DOUBLES)
    golden = golden_dir("qwen3_moe")
    result = run_parity(pytester, golden, *ARGS, "--hw-option", f"quantized={dtype}", model=candidate)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [f"*the nxdi backend's weights are NxDI's quantized state dict (per_channel_symmetric {dtype})*",
         "*quantized tensor(s) within their format's rounding*"]
    )  # fmt: skip
    pytester.makeconftest(INVERTED)
    result = run_parity(pytester, golden, *ARGS, "--hw-option", f"quantized={dtype}", model=candidate)
    result.stdout.fnmatch_lines(["first divergence: layer_1.weights  (model.layers.1.self_attn.q_proj.weight: *"])
    assert "the scale used where its inverse is meant" in result.stdout.str()
    result.assert_outcomes(passed=2, failed=1)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("int4", "--hw-option quantized=int4: expected one of int8, f8e4m3, got 'int4'"),
        ("fp8", "is quantized already, and NxDI's per-channel quantization quantizes a float checkpoint"),
        ("mixtral", "has no save_quantized_state_dict: NxDI cannot quantize this model"),
    ],
    ids=["unknown-dtype", "quantized-checkpoint", "no-quantization"],
)
def test_bad_quantized_values_are_usage_errors(
    case: str, message: str, nxdi_double, golden_dir, tiny_model, candidate: Path, pytester: pytest.Pytester,
    tmp_path: Path,
) -> None:  # fmt: skip
    """An unknown dtype, a checkpoint quantized already (NxD quantizes a float model), or an application
    without NxDI's quantization (the double's Mixtral) is one sentence and exit 4."""
    pytester.syspathinsert(DOUBLES)
    arch, model = "qwen3_moe", candidate
    if case == "mixtral":
        arch, model = "mixtral", Path(shutil.copytree(tiny_model("mixtral"), tmp_path / "m"))
    elif case == "fp8":
        model = write_tiny_model("qwen3_moe", tmp_path / "fp8", quant="fp8-block:32")
    value = "int4" if case == "int4" else "int8"
    result = run_parity(pytester, golden_dir(arch), *ARGS, "--hw-option", f"quantized={value}", model=model)
    usage_error(result, message)
