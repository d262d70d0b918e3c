"""Compiled candidates, on the CPU: the positional wrapper, one graph per layer kind with weights
swapped per layer, the cache across runs, and the CPU twins `--hw trace` and `--hw compile` as
candidates in their own right (clean runs pass, port bugs are caught at their own point)."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import NO_CONFIG, NO_WEIGHTS, load_fp32, read_json, run_parity

from pytest_moe_parity.backends.compiled import PointModule, flatten_call, graph_key
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.golden.spec import named_tensor
from pytest_moe_parity.judge.routing import routing_view, with_experts_call
from pytest_moe_parity.record.tiny import available_archs
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

TWIN_ARCHS = ["mixtral", "qwen3_moe", "deepseek_v3", "minimax_m2", "gpt_oss"]
# Distinct layer kinds, counted by hand: embedding, rotary, one RMSNorm shape (input, post-attention
# and final norms), attention, router, experts, moe, decoder layer, lm_head; DeepSeek-V3 adds a dense
# first layer (mlp and its own decoder layer) and shared experts; gpt_oss has sliding-window and
# full-attention layers (two attentions, two decoder layers).
KINDS = {"mixtral": 9, "qwen3_moe": 9, "deepseek_v3": 12, "minimax_m2": 9, "gpt_oss": 11}


# -- the positional wrapper ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", available_archs())
def test_wrapper_round_trip_and_routing(arch: str, golden_dir, tiny_model) -> None:
    """Every point of every architecture through PointModule, eagerly: the rebuilt output is the
    module's own output bit for bit, and the routing returned through the wrapper is the routing a
    hook on the router sees."""
    golden = GoldenStore(golden_dir(arch))
    model = load_fp32(tiny_model(arch))
    for point in golden.points:
        record = golden.load(point)
        module = model.get_submodule(point.module)
        call = flatten_call(record.args, record.kwargs, lambda name: named_tensor(model, name))
        assert all(isinstance(t, torch.Tensor) for t in call.inputs)
        router = golden.router_of(point) if point.routed_block else None
        experts = golden.experts_of(router) if router else None
        inside = experts is not None and experts.module.startswith(point.module + ".")  # DBRX's: its top-k
        hooked: list = []
        called: list = []
        handles = []
        if router is not None:
            handles.append(
                model.get_submodule(router.module).register_forward_hook(lambda m, a, o, seen=hooked: seen.append(o))
            )
        if inside:
            handles.append(
                model.get_submodule(experts.module).register_forward_pre_hook(
                    lambda m, a, k, seen=called: seen.append((a, k)), with_kwargs=True
                )
            )
        with torch.no_grad():
            expected = module(*call.rebuild(call.inputs)[0], **call.rebuild(call.inputs)[1])
        for handle in handles:
            handle.remove()
        wrapper = PointModule(
            module,
            call.spec,
            router.module.removeprefix(point.module + ".") if router else None,
            experts.module.removeprefix(point.module + ".") if inside else None,
        )
        with torch.no_grad():
            flat = wrapper(*call.inputs)
        from pytest_moe_parity.backends.compiled import Graph

        graph = Graph("k", None, wrapper.out_spec, wrapper.n_outputs, "compiled", 0.0, [])
        output, routing = graph.rebuild(flat)
        _assert_same(output, expected, point.id)
        _assert_same(record.output, output, point.id, omitted_ok=True)
        if router is not None:
            # Llama 4's pair as the triple; DBRX's logits with the top-k its experts were called with
            hooked_routing = routing_view(with_experts_call(hooked[-1], called[-1] if called else None))
            routing = routing_view(routing)
            assert routing is not None and len(routing) == 3
            for got, want in zip(routing, hooked_routing[:3], strict=True):
                assert torch.equal(got, want), point.id
        else:
            assert routing is None


def _assert_same(a, b, where: str, *, omitted_ok: bool = False) -> None:
    if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
        if omitted_ok and a is None:  # an output the golden omits (attention weights)
            return
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(b, tuple | list):
        assert type(a) is type(b) and len(a) == len(b), where
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y, where, omitted_ok=omitted_ok)
    else:
        assert a == b, where


def test_graph_key_ignores_the_layer_number_only(tiny_model) -> None:
    model = load_fp32(tiny_model("gpt_oss"))
    x = torch.randn(1, 16, model.config.hidden_size)

    def key(path: str) -> str:
        call = flatten_call([x], {}, lambda name: named_tensor(model, name))
        return graph_key(model.get_submodule(path), call, None, {"backend": "t"})[0]

    layers = model.model.layers
    assert key("model.layers.0.input_layernorm") == key("model.layers.3.post_attention_layernorm")
    assert layers[0].self_attn.layer_idx != layers[2].self_attn.layer_idx
    assert key("model.layers.0.self_attn") == key("model.layers.2.self_attn")  # both sliding-window
    assert key("model.layers.0.self_attn") != key("model.layers.1.self_attn")  # sliding vs full
    other = flatten_call([x.double()], {}, lambda name: named_tensor(model, name))
    assert graph_key(layers[0].input_layernorm, other, None, {"backend": "t"})[0] != key(
        "model.layers.0.input_layernorm"
    )


# -- the twins as candidates -----------------------------------------------------------------------


@pytest.mark.parametrize("hw", ["trace", pytest.param("compile", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", TWIN_ARCHS)
def test_twin_clean_run_one_graph_per_kind_and_a_warm_second_run(
    hw: str, arch: str, pytester: pytest.Pytester, golden_dir, tmp_path: Path
) -> None:
    golden = golden_dir(arch)
    n = len(GoldenStore(golden).point_ids)
    cache = tmp_path / "cache"  # a cold cache: the first run compiles, the second does not
    args = ["--hw", hw, "--dtype", "bfloat16", "--hw-option", f"cache_dir={cache}"]
    fresh = hw == "compile"  # each run in its own process: torch.compile also caches in memory
    first = run_parity(pytester, golden, *args, "--parity-report", str(tmp_path / "r1"), subprocess=fresh)
    first.assert_outcomes(passed=n)
    first.stdout.fnmatch_lines(["first divergence: none", f"{KINDS[arch]} graphs for {n} points*"])
    summary = read_json(tmp_path / "r1" / SUMMARY_FILE)
    assert summary["graphs"]["graphs"] == KINDS[arch]
    if arch == "deepseek_v3":  # the dense first layer and the MoE layers: two kinds of decoder layer
        assert summary["graphs"]["layer_graphs"] == 2
    made = _made(tmp_path / "r1")
    assert len(made) == KINDS[arch]  # one graph made per kind, every other point reuses one
    if hw == "trace":
        assert made == ["compiled"] * KINDS[arch]
    else:  # dynamo may serve an equal graph from what it compiled for another kind (gpt_oss attention)
        assert set(made) <= {"compiled", "reused"} and "compiled" in made
    second = run_parity(pytester, golden, *args, "--parity-report", str(tmp_path / "r2"), subprocess=fresh)
    second.assert_outcomes(passed=n)
    made = _made(tmp_path / "r2")
    assert len(made) == KINDS[arch] and "compiled" not in made  # a second run compiles nothing
    assert made == ["cache"] * KINDS[arch] if hw == "trace" else "cache" in made


def _made(report: Path) -> list[str]:
    """Where each graph made in a run came from, in order (points that reused one are left out)."""
    return [r["backend"]["origin"] for r in read_json(report / REPORT_FILE)["points"] if "compile_s" in r["backend"]]


def test_fp32_trace_matches_the_golden(pytester: pytest.Pytester, golden_dir, cache_dir) -> None:
    """float32 through traced graphs with swapped weights: the same numbers as eager transformers,
    but for the dense experts' order of summation (~1e-7)."""
    golden = golden_dir("minimax_m2")
    report = pytester.path / "report"
    args = ["--hw", "trace", "--hw-option", f"cache_dir={cache_dir}", "--parity-report", str(report)]
    run_parity(pytester, golden, *args).assert_outcomes(passed=len(GoldenStore(golden).point_ids))
    for row in read_json(report / REPORT_FILE)["points"]:
        worst = max(m["rel_l2"] for m in row["metrics"].values())
        assert worst < (1e-6 if row["component"] in ("experts", "moe", "output") else 1e-12), (row["id"], worst)


def _fault_is_caught(hw: str, fault: str, pytester: pytest.Pytester, tiny_model, golden_dir, cache_dir) -> None:
    arch, expected, make = faults.CASES[fault]
    golden = golden_dir(arch)
    tensor_edit, config_edit = make(golden)
    candidate = faults.edit_checkpoint(tiny_model(arch), pytester.path / "candidate", tensor_edit or (lambda t: None))
    if config_edit:
        faults.edit_config(candidate, config_edit)
    report = pytester.path / "report"
    args = ["--hw", hw, "--dtype", "bfloat16", "-x", NO_WEIGHTS, NO_CONFIG, "--hw-option", f"cache_dir={cache_dir}"]
    result = run_parity(pytester, golden, *args, "--parity-report", str(report), model=candidate)
    order = GoldenStore(golden).point_ids
    result.assert_outcomes(failed=1, passed=order.index(expected))
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == expected


@pytest.mark.parametrize("fault", sorted(faults.CASES))
def test_trace_catches_the_fault_at_its_own_point(fault, pytester, tiny_model, golden_dir, cache_dir) -> None:
    _fault_is_caught("trace", fault, pytester, tiny_model, golden_dir, cache_dir)


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(faults.CASES))
def test_compile_catches_the_fault_at_its_own_point(
    fault, pytester, tiny_model, golden_dir, cache_dir, _import_inductor_once
) -> None:
    """In process: inductor is imported before pytester's module snapshot (a fixture argument is
    set up before pytester), and dynamo reuses what it compiled for the clean weights."""
    _fault_is_caught("compile", fault, pytester, tiny_model, golden_dir, cache_dir)


def test_an_untraceable_point_errors_and_the_run_goes_on(pytester: pytest.Pytester, golden_dir, cache_dir) -> None:
    """transformers' eager experts loop over the routed tokens: a trace would freeze its example's
    routing. Those points error with the reason; every other point still runs."""
    golden = golden_dir("mixtral")
    report = pytester.path / "report"
    args = ["--hw", "trace", "--hw-option", "experts=eager", "--hw-option", f"cache_dir={cache_dir}"]
    result = run_parity(pytester, golden, *args, "--parity-report", str(report))
    n = len(GoldenStore(golden).point_ids)
    result.assert_outcomes(passed=n - 12, errors=12)  # experts, moe and the decoder layer of 4 layers
    result.stdout.fnmatch_lines(["layer_0.experts cannot be traced to a static graph: Iterating over a tensor*"])
    rows = read_json(report / REPORT_FILE)["points"]
    assert {r["component"] for r in rows if r["status"] == "error"} == {"experts", "moe", "output"}
    assert read_json(report / SUMMARY_FILE)["first_divergence"] is None


def test_a_bad_cache_entry_is_discarded_and_rebuilt(pytester: pytest.Pytester, golden_dir, tmp_path: Path) -> None:
    golden = golden_dir("olmoe")
    cache = tmp_path / "cache"
    args = ["--hw", "trace", "-m", "router", "--hw-option", f"cache_dir={cache}"]
    run_parity(pytester, golden, *args).assert_outcomes(passed=4)
    (pt,) = (cache / "trace").glob("*.pt")
    (meta,) = (cache / "trace").glob("*.json")
    pt.write_bytes(b"not a trace")
    report = pytester.path / "report"
    result = run_parity(pytester, golden, *args, "--parity-report", str(report))
    result.assert_outcomes(passed=4)
    first = read_json(report / REPORT_FILE)["points"][0]
    assert first["backend"]["origin"] == "compiled"
    assert any("discarded and rebuilt: a trace file that does not match its sha256" in n for n in first["notes"])
    record = json.loads(meta.read_text())
    record["made_of"]["backend"] = "someone else's"
    record["sha256"] = "0" * 64
    meta.write_text(json.dumps(record))
    run_parity(pytester, golden, *args, "--parity-report", str(report)).assert_outcomes(passed=4)
    first = read_json(report / REPORT_FILE)["points"][0]
    assert any("a record made of something else" in n for n in first["notes"])
    assert read_json(report / REPORT_FILE)["points"][1]["backend"]["origin"] == "reused"


def test_bad_experts_option(pytester: pytest.Pytester, golden_dir) -> None:
    from helpers import usage_error

    usage_error(
        run_parity(pytester, golden_dir("olmoe"), "--hw", "trace", "--hw-option", "experts=magic"),
        "--hw-option experts=magic: not an experts implementation; one of dense, eager",
    )
