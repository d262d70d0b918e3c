"""The pieces of `--hw nxdi --hw-option build=cpu` that need neither NxDI nor the Neuron stack: the
stand-ins for the Neuron-only packages, the reading of a transformers 5 config on 4.57, and the CPU
`build_module`'s checks. The build itself runs on NxDI's real code in CI's second leg
(tests_neuron/, `.ci/neuron-leg`)."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch

from pytest_moe_parity import compat
from pytest_moe_parity.backends.nxdi.cpu import ranks, standins


@pytest.fixture
def standin_packages(monkeypatch):
    """The stand-ins installed for this test only: what another test imported of these packages (the
    doubles of tests/doubles) is hidden meanwhile, and the finder and its modules go afterwards."""
    for name in [m for m in sys.modules if m.partition(".")[0] in standins.ROOTS]:
        monkeypatch.delitem(sys.modules, name)
    before = list(sys.meta_path)
    try:
        yield standins.install()
    finally:
        sys.meta_path[:] = before
        torch.classes.__dict__.pop("neuron", None)
        for name in [m for m in sys.modules if m.partition(".")[0] in standins.ROOTS]:
            if getattr(sys.modules[name], "__standin__", False):
                del sys.modules[name]


def test_a_missing_neuron_package_imports_as_a_stand_in_that_raises_when_called(standin_packages) -> None:
    assert set(standin_packages) == set(standins.ROOTS)  # none of them is installed here
    from torch_neuronx.xla_impl.ops import RmsNorm  # a name read from a stand-in module

    with pytest.raises(standins.DeviceOnly, match=r"^torch_neuronx\.xla_impl\.ops\.RmsNorm\.apply needs a Neuron"):
        RmsNorm.apply(torch.ones(2), torch.ones(2), 1e-6, 0)
    with pytest.raises(standins.DeviceOnly, match="run it with --hw-option build=neuron on a Neuron host"):
        __import__("nkilib.core.topk", fromlist=["topk"]).topk(torch.ones(3), 1)


def test_what_runs_at_import_time_is_given_a_stand_in(standin_packages) -> None:
    """A kernel decorated at import time imports and raises only when called; a type built as a
    value (an enum member, a kernel's argument record) is an inert value; NxD subclasses them."""
    import nki
    from nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode

    @nki.jit
    def kernel(x):
        return x

    with pytest.raises(standins.DeviceOnly, match=r"nki\.jit\(.*kernel\) needs a Neuron device"):
        kernel(1)
    assert isinstance(SkipMode(False, False), SkipMode)

    class Sub(SkipMode):
        pass

    assert issubclass(Sub, SkipMode)


def test_stand_ins_pickle_by_name_as_ranks_receive_them(standin_packages) -> None:
    from nkilib.core.moe.moe_cte.moe_cte_utils import BlockShardStrategy

    member = BlockShardStrategy.HI_LO
    assert pickle.loads(pickle.dumps(member)) is member
    assert pickle.loads(pickle.dumps({"strategy": member}))["strategy"] is member


def test_host_queries_and_plain_math_are_answered(standin_packages, monkeypatch) -> None:
    from torch_neuronx.testing.validation import custom_allclose
    from torch_neuronx.utils import get_platform_target

    assert get_platform_target() == "trn1"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert get_platform_target() == "trn2"
    expected = torch.tensor([10.0, 1.0])
    # rtol scales with the largest |expected| (10): 0.5 off at the small element is within 0.1 * 10
    assert custom_allclose(expected, expected + torch.tensor([0.0, 0.5]), atol=0, rtol=0.1) == (True, 0.5)
    assert custom_allclose(expected, expected + torch.tensor([0.0, 1.5]), atol=0, rtol=0.1)[0] is False


def test_an_installed_package_is_never_stood_in(monkeypatch) -> None:
    monkeypatch.setattr(standins, "ROOTS", ("torch",))
    assert standins.missing_roots() == ()


def test_a_transformers_5_config_needs_nothing_under_transformers_5(tiny_model) -> None:
    """Under transformers 5 the config is read as written; the rotary settings NxDI reads come from
    `rope_parameters` whichever version reads them."""
    config = compat.load_config(tiny_model("mixtral"))
    assert compat.MAJOR >= 5 and compat.config_overrides(config.to_dict(), type(config)) == {}
    assert compat.legacy_rope({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}) == {
        "rope_theta": 1e4,
        "rope_scaling": None,
    }
    yarn = {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}
    assert compat.legacy_rope({"rope_parameters": yarn}) == {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    assert compat.legacy_rope({"rope_theta": 1e4}) == {}


def test_the_cpu_build_module_checks_its_arguments_as_nxdi_s_does() -> None:
    with pytest.raises(ValueError, match="example_inputs must be a list of tensor tuples"):
        ranks.build_module(torch.nn.Linear, [torch.ones(1)], checkpoint_path="x")
    with pytest.raises(ValueError, match="exactly one input"):
        ranks.build_module(torch.nn.Linear, [(torch.ones(1),), (torch.ones(1),)], checkpoint_path="x")
    with pytest.raises(NotImplementedError, match="the CPU build loads a checkpoint"):
        ranks.build_module(torch.nn.Linear, [(torch.ones(1),)])
    with pytest.raises(NotImplementedError, match="the CPU build runs a world of tp_degree ranks"):
        ranks.build_module(torch.nn.Linear, [(torch.ones(1),)], tp_degree=2, world_size=4, checkpoint_path="x")
