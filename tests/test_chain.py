"""Chain mode and the noise floor: the candidate on its own inputs, as in a real run, and every point
judged against the reference's own error in the candidate's dtype (`moe-parity golden --noise-dtype`)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import faults
import pytest
from helpers import NO_CONFIG, NO_WEIGHTS, TABLE_ARCHS, cli, read_json, run_parity, session, usage_error
from safetensors.torch import save_file

from pytest_moe_parity import backends
from pytest_moe_parity.backends import Backend, CandidateOutput
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.model.calls import output_tensors
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def test_inputs_name_the_point_that_produced_them(golden_dir) -> None:
    """What chain mode feeds the candidate's own outputs into: recorded by value, never guessed."""
    store = GoldenStore(golden_dir("qwen3_moe"))

    def origins(pid: str) -> list:
        from pytest_moe_parity.golden.spec import describe_origin, spec_origins

        entry = store.entry(pid)
        specs = [*entry["inputs"]["args"], *entry["inputs"]["kwargs"].values()]
        return [describe_origin(o) for s in specs for o in spec_origins(s)]

    assert origins("layer_1.input_norm") == ["layer_0.output.out[0]"]
    assert origins("layer_1.post_attn_norm") == ["layer_0.output.out[0] + layer_1.attention.out[0]"]
    assert origins("layer_1.experts") == [
        "layer_1.post_attn_norm.out[0]",
        "layer_1.router.out[2]",
        "layer_1.router.out[1]",
    ]
    assert origins("logits") == ["final_norm.out[0]"]
    assert origins("embedding") == []  # input ids and masks are the golden's in every mode


@pytest.mark.parametrize("hw", ["cpu", "trace"])
@pytest.mark.parametrize("arch", TABLE_ARCHS)
def test_clean_bf16_passes_both_modes_under_the_noise_verdict(
    arch: str, hw: str, pytester: pytest.Pytester, golden_dir, cache_dir
) -> None:
    """cpu chains the candidate's whole-model forward; trace feeds each compiled point the
    candidate's own earlier outputs. Either way a healthy bf16 candidate passes every point, both
    ways, with its noise ratio reported."""
    golden = golden_dir(arch, noise="bfloat16")
    report = pytester.path / "report"
    args = ["--dtype", "bfloat16", "--parity-mode", "both", "--parity-report", str(report)]
    if hw == "trace":
        args += ["--hw", "trace", "--hw-option", f"cache_dir={cache_dir}"]
    junit = pytester.path / "junit.xml"
    result = run_parity(pytester, golden, *args, f"--junitxml={junit}")
    n = len(GoldenStore(golden).point_ids)
    result.assert_outcomes(passed=n)
    result.stdout.fnmatch_lines(
        ["point*status*cosine*rel_l2*noise R*chain rel*chain R*", "first isolated divergence: none",
         "first chain divergence: none"]
    )  # fmt: skip
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_divergence"] is None and summary["first_chain_divergence"] is None
    assert summary["mode"] == "both" and summary["noise_dtypes"] == ["bfloat16"]
    for row in read_json(report / REPORT_FILE)["points"]:
        assert row["verdicts"] == {"isolated": "passed", "chain": "passed"}, row["id"]
        assert row["noise"]["ratio"] < 1.5 and row["chain"]["noise"]["ratio"] < 1.5, row["id"]
        assert row["chain"]["mode"] == "chain" and row["chain"]["metrics"]
    text = junit.read_text()
    assert text.count('name="noise_ratio"') == n and text.count('name="chain_noise_ratio"') == n


@pytest.mark.parametrize("fault", sorted(faults.CASES))
def test_faults_localize_in_chain_mode(fault: str, pytester: pytest.Pytester, tiny_model, golden_dir) -> None:
    arch, expected, make = faults.CASES[fault]
    golden = golden_dir(arch, noise="bfloat16")
    tensor_edit, config_edit = make(golden)
    candidate = faults.edit_checkpoint(tiny_model(arch), pytester.path / "c", tensor_edit or (lambda t: None))
    if config_edit:
        faults.edit_config(candidate, config_edit)
    report = pytester.path / "report"
    args = [
        "--dtype",
        "bfloat16",
        "--parity-mode",
        "chain",
        "-x",
        NO_WEIGHTS,
        NO_CONFIG,
        "--parity-report",
        str(report),
    ]
    result = run_parity(pytester, golden, *args, model=candidate)
    result.assert_outcomes(failed=1, passed=GoldenStore(golden).point_ids.index(expected))
    result.stdout.fnmatch_lines([f"{expected}: candidate (bfloat16) diverges * on its own inputs"])
    assert read_json(report / SUMMARY_FILE)["first_divergence"] == expected


NOISE_FAULTS = {
    # an RMSNorm eps 10x the config's: input_norm rel_l2 ~4.8x the healthy bf16 error
    "rms_norm_eps_10x": ("layer_0.input_norm", lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * 10), None),
    # the router's softmax in bf16: the routing weights' error doubles
    "router_softmax_bf16": ("layer_0.router", None, "router_softmax_bf16"),
}


@pytest.mark.parametrize("fault", sorted(NOISE_FAULTS))
def test_a_bug_of_1e_2_passes_fixed_limits_and_fails_the_noise_verdict(
    fault: str, pytester: pytest.Pytester, tiny_model, golden_dir
) -> None:
    expected, config_edit, code = NOISE_FAULTS[fault]
    candidate = faults.edit_checkpoint(tiny_model("qwen3_moe"), pytester.path / "c", lambda t: None)
    if config_edit:
        faults.edit_config(candidate, config_edit)
    plain, golden = golden_dir("qwen3_moe"), golden_dir("qwen3_moe", noise="bfloat16")

    def run(golden: Path, *args: str) -> pytest.RunResult:
        with faults.code_fault(code) if code else contextlib.nullcontext():
            return run_parity(pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, NO_CONFIG, *args, model=candidate)

    run(plain).assert_outcomes(passed=len(GoldenStore(plain).point_ids))  # the fixed bf16 limits cannot see it
    for mode in ("isolated", "chain"):
        report = pytester.path / f"report-{mode}"
        result = run(golden, "-x", "--parity-mode", mode, "--parity-report", str(report))
        result.assert_outcomes(failed=1, passed=GoldenStore(golden).point_ids.index(expected))
        result.stdout.fnmatch_lines(["*noise_ratio*<= 1.5  FAIL", "*noise ratio (error / the reference's own*"])
        row = read_json(report / REPORT_FILE)["points"][-1]
        assert row["id"] == expected and row["noise"]["ratio"] > 2, row["noise"]


def test_a_wrong_causal_mask_passes_isolated_and_fails_chained_at_the_first_layer(
    pytester: pytest.Pytester, golden_dir
) -> None:
    """The mask is a golden input of every isolated point; only the candidate's own forward builds it."""
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    report = pytester.path / "report"
    args = ["--dtype", "bfloat16", "--parity-mode", "both", "--parity-report", str(report)]
    with faults.code_fault("causal_mask_one_ahead"):
        result = run_parity(pytester, golden, *args)
    summary = read_json(report / SUMMARY_FILE)
    assert summary["first_isolated_divergence"] is None
    assert summary["first_chain_divergence"] == summary["first_divergence"] == "layer_0.attention"
    result.stdout.fnmatch_lines(["first divergence: layer_0.attention*", "first chain divergence: layer_0.attention"])
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows["layer_0.input_norm"]["verdicts"] == {"isolated": "passed", "chain": "passed"}
    assert rows["layer_0.attention"]["verdicts"] == {"isolated": "passed", "chain": "failed"}


def test_chain_mode_asks_for_what_it_needs(monkeypatch, pytester: pytest.Pytester, golden_dir, tiny_model) -> None:
    plain = golden_dir("olmoe")
    usage_error(
        run_parity(pytester, plain, "--dtype", "bfloat16", "--parity-mode", "chain"),
        "--parity-mode chain in bfloat16 judges each point against the reference's own bfloat16 error, and "
        f"{plain} has none: record the golden with `moe-parity golden ... --noise-dtype bfloat16`",
    )
    usage_error(
        run_parity(pytester, plain, "--dtype", "bfloat16", "--parity-tol", "layer_*:noise_factor=2"),
        "noise_factor (layer_*) needs the reference's own error in bfloat16, which",
    )
    golden = golden_dir("olmoe", noise="bfloat16")
    import torch

    (pytester.path / "dump").mkdir()
    save_file({"logits": torch.zeros(1)}, str(pytester.path / "dump" / "d.safetensors"))
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", "--parity-mode", "both", model=pytester.path / "dump"),
        "--parity-mode both: a dump candidate holds one run of its own",
    )

    class Isolated(Backend):
        name = "isolated-only"

        def run(self, point, golden):
            return CandidateOutput(None)

    class Unknown(Isolated):
        name = "unknown-chain"
        chain = "layers"

    monkeypatch.setitem(backends.registry(), Isolated.name, Isolated)
    monkeypatch.setitem(backends.registry(), Unknown.name, Unknown)
    able = [n for n in sorted(backends.registry()) if backends.backend_class(n).chain_kind in backends.CHAIN_KINDS]
    assert {"compile", "cpu", "cuda", "dump", "neuron", "trace"} <= set(able)  # and whatever else is installed
    usage_error(
        run_parity(pytester, golden, "--hw", "isolated-only", "--parity-mode", "chain"),
        "--parity-mode chain: the isolated-only backend cannot run the candidate on its own inputs; "
        f"backends that can: {', '.join(able)} (a backend chains by declaring `chain_kind`",
    )
    usage_error(
        run_parity(pytester, golden, "--hw", "unknown-chain", "--parity-mode", "chain"),
        "--parity-mode chain: the unknown-chain backend declares chain = 'layers'; a backend's chain is one of "
        "model, points, recorded (or None)",
    )
    # float32 has no noise floor to ask for: chained verdicts use the fixed float32 limits
    run_parity(pytester, plain, "--parity-mode", "chain", model=tiny_model("olmoe")).assert_outcomes(
        passed=len(GoldenStore(plain).point_ids)
    )


def test_noise_dtype_is_checked_before_recording(tmp_path: Path, tiny_model, capsys) -> None:
    model = tiny_model("olmoe")
    code, _, err = cli(capsys, "golden", "--model", model, "--out", tmp_path / "g", "--noise-dtype", "int8")
    assert code == 2 and "--noise-dtype 'int8' is not a floating-point torch dtype" in err
    assert not (tmp_path / "g").exists()
    code, _, err = cli(capsys, "golden", "--model", model, "--out", tmp_path / "g", "--noise-dtype", "float32")
    assert code == 2 and "--noise-dtype float32 is the dtype the reference records in" in err
    code, out, _ = cli(capsys, "golden", "--model", model, "--out", tmp_path / "g", "--noise-dtype", "bf16")
    assert code == 0 and "noise floor in bfloat16" in out.splitlines()[-1]
    store = GoldenStore(tmp_path / "g")
    assert store.noise_dtypes == ["bfloat16"]
    assert set(store.manifest["noise"]["bfloat16"]["chain"]) == set(store.point_ids)
    figures = store.noise("bfloat16", "isolated", "layer_1.router")
    assert set(figures) == {"logits", "weights", "top_k"} and 0 < figures["logits"]["rel_l2"] < 0.02


def test_a_dumped_whole_model_run_is_compared_chained(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    """A dump of the candidate's own forward (e.g. a tensor capture during generation) inherits the
    error of every layer before: judged against the reference's own chained error, it passes."""
    golden = golden_dir("mixtral", noise="bfloat16")
    run = session(golden, tiny_model("mixtral"), dtype="bfloat16")
    import torch

    outputs = run.backend.run_model(torch.tensor(run.golden.manifest["inputs"]["input_ids"]), run.points)
    tensors = {}
    for pid, out in outputs.items():
        found = output_tensors(out)
        tensors.update({pid: found[0]} if len(found) == 1 else {f"{pid}.{i}": t for i, t in enumerate(found)})
    dump = tmp_path / "dump"
    dump.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dump / "run.safetensors"))
    code, out, err = cli(
        capsys, "compare", golden, dump, "--mode", "chain", "--dtype", "bfloat16", "--report", tmp_path / "r"
    )
    assert code == 0, out + err
    assert "first divergence: none" in out
    rows = read_json(tmp_path / "r" / REPORT_FILE)["points"]
    assert {r["mode"] for r in rows} == {"chain"} and all(r["noise"] for r in rows)


def test_tokens_routed_elsewhere_are_left_out_and_steered_back(golden_dir, tiny_model) -> None:
    """A near-tie flip is put back to the golden's after its decoder layer (steered chains); where
    a run cannot be steered, the token and every later one of its sequence are left out."""
    import torch

    from pytest_moe_parity.replay.chain import ModelChain, RecordedChain, routing_disagreements

    golden = golden_dir("qwen3_moe", noise="bfloat16")
    run = session(golden, tiny_model("qwen3_moe"), dtype="bfloat16", mode="chain")
    chain = run.runner.chain
    assert isinstance(chain, ModelChain) and chain.steered
    store = run.golden
    logits, weights, index = store.load("layer_1.router").output
    flipped = index.clone()
    flipped[[3, 9]] = index[[3, 9]].roll(1, dims=0)  # tokens 3 and 9 swap experts
    flipped[3, 0] = (set(range(8)) - set(index[3].tolist())).pop()
    assert routing_disagreements((logits, weights, index), (logits, weights, flipped)) == [3, 9]
    # steering a decoder layer's output: the flipped tokens' rows become the golden's, the rest stay
    point = store.point("layer_1.output")
    mine = store.load(point).output.to(torch.bfloat16) + 1.0
    steered = chain.steer(point, mine, (logits, weights, flipped))
    golden_out = store.load(point).output
    assert torch.equal(steered[0, [3, 9]], golden_out[0, [3, 9]].to(torch.bfloat16))
    assert torch.equal(steered[0, 4], mine[0, 4]) and chain.steer(store.point("layer_1.moe"), mine, None) is mine
    # left out of later verdicts: the tokens themselves, or (unsteered) from the first one on
    chain._taint = {p.id: [] for p in store.points if p.layer is not None}
    chain._taint["layer_1.router"] = [9, 3]
    assert chain.tainted(store.point("layer_1.attention")) == []  # same layer: before the router
    assert chain.tainted(store.point("layer_2.attention")) == [3, 9]
    recorded = RecordedChain(run.runner.chain_setup())
    recorded._taint = dict(chain._taint)
    assert not recorded.steered and recorded.tainted(store.point("logits")) == list(range(3, 16))


@pytest.mark.parametrize(
    ("rel_ratio", "token_ratio", "ratio", "passed"),
    [(1.0, 1.8, 1.0, True), (1.0, 4.0, 2.0, False), (2.0, 1.0, 2.0, False), (1.2, 2.6, 1.3, True)],
)
def test_the_noise_ratio_gives_the_worst_token_a_slack(rel_ratio, token_ratio, ratio, passed) -> None:
    """R = max(rel_l2 ratio, worst-token ratio / 2), judged against noise_factor 1.5."""
    import torch

    from pytest_moe_parity.judge.tolerances import default_tolerance
    from pytest_moe_parity.judge.verdict import Case, judge_point
    from pytest_moe_parity.points import Point

    golden = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    candidate = golden.clone()
    candidate[0, 3] += 5e-2 * golden[0, 3].norm() / 4**0.5  # one token off by 5e-2 of its norm (above the floor)
    case = Case(Point.parse("layer_0.attention"), golden, candidate, default_tolerance("bfloat16", "attention"),
                torch.bfloat16)  # fmt: skip
    m = judge_point(case).main
    noise = {"out": {"rel_l2": m.rel_l2 / rel_ratio, "max_token_rel_l2": m.max_token_rel_l2 / token_ratio}}
    res = judge_point(dataclasses.replace(case, noise=noise, fixed=False))
    target = res.noise["targets"]["out"]
    assert target["rel_l2_ratio"] == pytest.approx(rel_ratio)
    assert target["token_ratio"] == pytest.approx(token_ratio)
    assert res.noise_ratio == pytest.approx(ratio)
    assert res.passed is passed
    assert [c.name for c in res.checks] == ["noise_ratio"]


def test_errors_below_an_eighth_of_the_dtypes_epsilon_are_not_ratios() -> None:
    """Routing weights that mostly round exactly: 8e-4 against a reference of 5e-4 is no bug in bf16."""
    import torch

    from pytest_moe_parity.judge.tolerances import default_tolerance
    from pytest_moe_parity.judge.verdict import Case, judge_point
    from pytest_moe_parity.points import Point

    golden = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    candidate = golden * (1 + 8e-4)
    point, tol = Point.parse("layer_0.attention"), default_tolerance("bfloat16", "attention")
    noise = {"out": {"rel_l2": 5e-4, "max_token_rel_l2": 5e-4}}
    res = judge_point(Case(point, golden, candidate, tol, torch.bfloat16, noise=noise, fixed=False))
    floor = torch.finfo(torch.bfloat16).eps / 8
    assert res.noise_ratio == pytest.approx(8e-4 / floor) and res.passed
    res = judge_point(Case(point, golden, golden * (1 + 2.5e-3), tol, torch.bfloat16, noise=noise, fixed=False))
    assert res.noise_ratio == pytest.approx(2.5e-3 / floor) and not res.passed


def test_an_isolated_verdict_whose_reference_fails_the_dtypes_limits_is_judged_against_the_reference() -> None:
    """Isolated, with a noise floor: where the reference's own bf16 run is beyond the dtype's limits
    (DeepSeek-V3.2's sparse attention picks its keys by a top-k that rounding flips: rel_l2 0.08
    against a limit of 0.04), no bf16 candidate could meet them: that tensor is judged by its noise
    ratio alone, and says so; a candidate at twice the reference's error still fails. Without the
    floor, or where the reference meets the limits, the limits stand."""
    import torch

    from pytest_moe_parity.judge.tolerances import default_tolerance
    from pytest_moe_parity.judge.verdict import Case, judge_point
    from pytest_moe_parity.points import Point

    gen = torch.Generator().manual_seed(0)
    golden = torch.randn(1, 64, 16, generator=gen, dtype=torch.float64)
    direction = torch.randn(1, 64, 16, generator=gen, dtype=torch.float64)
    direction *= golden.norm() / direction.norm()
    at = lambda rel: golden + rel * direction  # noqa: E731  (a candidate at this rel_l2)
    point, tol = Point.parse("layer_0.attention"), default_tolerance("bfloat16", "attention")
    noisy = {"out": {"rel_l2": 0.08, "max_token_rel_l2": 0.3}}

    def judged(candidate, noise):
        return judge_point(Case(point, golden, candidate, tol, torch.bfloat16, noise=noise, fixed=True))

    like = judged(at(0.08), noisy)
    assert like.passed and [c.name for c in like.checks] == ["noise_ratio"], like.checks
    assert any("the reference's own bfloat16 run is beyond the dtype's limit here (rel_l2 0.08 > 0.04)" in n
               for n in like.notes), like.notes  # fmt: skip
    assert not judged(at(0.16), noisy).passed
    assert not judged(at(0.08), None).passed  # no floor: the dtype's limits
    quiet = judged(at(0.05), {"out": {"rel_l2": 0.004, "max_token_rel_l2": 0.01}})
    assert not quiet.passed and {"rel_l2", "noise_ratio"} <= {c.name for c in quiet.checks if not c.passed}


def test_a_points_chain_runs_each_point_once(golden_dir, tiny_model, cache_dir) -> None:
    """A `chain = "points"` backend (trace) is called once per point in a forward-order chained run,
    however many layers: earlier layers' outputs are forgotten as the chain moves on, never recomputed.
    A point asked for again after its layer was forgotten is computed again, from the start."""
    import torch

    golden = golden_dir("qwen3_moe", layers=6)
    run = session(golden, tiny_model("qwen3_moe", 6), hw="trace", hw_options=[f"cache_dir={cache_dir}"], mode="chain")
    backend = run.runner.backend
    calls: list[str] = []
    real = backend.run
    backend.run = lambda point, inputs: calls.append(point.id) or real(point, inputs)
    try:
        ids = run.golden.point_ids
        results = [run.runner.run(pid) for pid in ids]
        assert all(r.passed for r in results), [r.id for r in results if not r.passed]
        assert calls == ids  # each point once, in forward order
        first = run.runner.prepare("layer_1.output").chained.output  # forgotten: computed again up to it
        again = run.runner.prepare("layer_1.output").chained.output  # kept this time
        assert len(calls) == len(ids) + ids.index("layer_1.output") + 1
        assert torch.equal(first, again)
    finally:
        run.close()


def test_a_streamed_chain_judges_every_point_as_the_held_run_does(golden_dir, tiny_model) -> None:
    """The noise floor's chained runs are judged as the forward goes (`ModelChain.stream`), holding the
    running layer's outputs: the same verdicts and the same tokens left out as a run held whole, with
    two tokens that the candidate routes elsewhere at layer 1 (steered back, and left out after it)."""
    import torch

    from pytest_moe_parity.replay.noise import noise_figures

    golden = golden_dir("qwen3_moe", noise="bfloat16")
    judged: dict[bool, dict] = {}
    for streamed in (False, True):
        run = session(golden, tiny_model("qwen3_moe"), dtype="bfloat16", mode="chain")
        runner, store = run.runner, run.golden
        chain = runner.chain
        runner.start(store.points[0])
        router = run.backend.module(store.point("layer_1.router").module)

        def elsewhere(module, args, out):  # tokens 3 and 9 sent to other experts (the scores as they were)
            logits, weights, index = out
            index = index.clone()
            index[[3, 9], 0] = (index[[3, 9], 0] + 1) % logits.shape[-1]
            while bool((index[[3, 9], 0:1] == index[[3, 9], 1:]).any()):
                index[[3, 9], 0] = (index[[3, 9], 0] + 1) % logits.shape[-1]
            return logits, weights, index

        router.register_forward_hook(elsewhere)
        seen: dict[str, tuple] = {}
        if not streamed:
            early = store.point("layer_0.post_attn_norm")
            held_first = chain.output(early, store.load(early)).output.clone()
            chain.close()

        def judge(point, record, own, runner=runner, chain=chain, seen=seen, store=store) -> None:
            held = {store.point(pid).group for pid in chain._outputs}
            assert held == {point.group}, (point.id, held)  # the running layer's outputs, no earlier ones
            result = runner.judge_output(point, record, own, "chain", None)
            seen[point.id] = (noise_figures(result), chain.tainted(point))

        if streamed:
            chain.stream(judge)
        else:  # as a pytest run asks: a point at a time, the earlier layers' outputs let go as it moves on
            order = [p.group for p in chain.points]
            for point in chain.points:
                record = store.load(point)
                result = runner.judge_output(point, record, chain.output(point, record), "chain", None)
                seen[point.id] = (noise_figures(result), chain.tainted(point))
                held = {store.point(pid).group for pid in chain._outputs}
                assert min(order.index(g) for g in held) == order.index(point.group), (point.id, held)
            # asked for again: the model runs again, to the same output
            assert torch.equal(chain.output(early, store.load(early)).output, held_first)
        runner.close()
        judged[streamed] = seen
    assert judged[True] == judged[False]
    assert list(judged[True]) == [p.id for p in GoldenStore(golden).points]
    assert judged[True]["layer_1.attention"][1] == [] and judged[True]["layer_2.attention"][1] == [3, 9]
    assert judged[True]["logits"][1] == [3, 9]
    assert torch.isfinite(torch.tensor(judged[True]["layer_3.output"][0]["out"]["rel_l2"]))


def test_a_module_called_twice_in_a_forward_is_captured_at_the_golden_s_call() -> None:
    """MiMo-V2-Flash runs its rotary embedding once per layer type, iterating a set: which comes first
    changes from one process to the next (PYTHONHASHSEED), so a chained run that kept the first call
    compared the other layer type's tables to the golden's about every other run. The call whose
    values (not tensors) are the golden call's is the one kept."""
    import torch
    from torch import nn

    from pytest_moe_parity.model.calls import OutputCapture
    from pytest_moe_parity.points import Point

    class Rope(nn.Module):
        def forward(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
            return x * (2.0 if layer_type == "full_attention" else 3.0)

    class Model(nn.Module):
        def __init__(self, by_keyword: bool) -> None:
            super().__init__()
            self.rope = Rope()
            self.by_keyword = by_keyword

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.by_keyword:
                return self.rope(x, layer_type="sliding_attention") + self.rope(x, layer_type="full_attention")
            return self.rope(x, "sliding_attention") + self.rope(x, "full_attention")

    x = torch.ones(3)
    rotary = Point("rotary", None, module="rope")
    cases = [
        (False, {1: "full_attention"}, 2.0), (False, {1: "sliding_attention"}, 3.0),
        (True, {"layer_type": "full_attention"}, 2.0), (True, {"layer_type": "sliding_attention"}, 3.0),
        (False, {}, 3.0),  # no value in the golden call: the first call, as before
    ]  # fmt: skip
    for by_keyword, golden_call, factor in cases:
        model = Model(by_keyword)
        with OutputCapture(model, [rotary], calls={"rotary": golden_call}) as capture:
            model(x)
        assert torch.equal(capture.outputs["rotary"], x * factor), (by_keyword, golden_call)
