"""Routing at two levels (`--parity-routing`) and an engine's routed-experts trace (`moe-parity routes`):
a MoE block replayed with the golden's expert ids, then ids and weights, names the level that recovers
it; a trace of the experts an engine chose is judged layer by layer against the golden's routing. Each
on faults that live in the routing only (a score-correction bias, the top-k weights' normalisation),
on a fault that is not the routing (an expert's weights), and on clean bf16 candidates of several
architectures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from faults import edit_checkpoint, edit_config
from helpers import NO_CONFIG, NO_WEIGHTS, cli, read_json, run_parity, usage_error

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.judge.routing import SelectionRule, compare_routing, routing_view, scattered_routing, weights_for
from pytest_moe_parity.judge.tolerances import default_tolerance
from pytest_moe_parity.judge.verdict import Case, judge_point
from pytest_moe_parity.points import Point
from pytest_moe_parity.report.files import REPORT_FILE
from pytest_moe_parity.report.rows import RoutingRow, Row
from pytest_moe_parity.routes import golden_routers, golden_trace, read_trace, write_trace

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYERS = 2


def _rows(report: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}


@pytest.fixture(scope="module")
def biased(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MiniMax-M2 port whose routers' score-correction bias is off: the same logits and weights for
    the experts it picks, other experts picked (a selection fault)."""
    torch.manual_seed(1)

    def edit(t: dict[str, torch.Tensor]) -> None:
        for key in [k for k in t if k.endswith("e_score_correction_bias")]:
            t[key] = t[key] + 0.05 * torch.randn(t[key].shape)

    return edit_checkpoint(tiny_model("minimax_m2", LAYERS), tmp_path_factory.mktemp("biased") / "port", edit)


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2", "mixtral"])
def test_clean_bf16_candidates_pass_every_routing_item(
    pytester: pytest.Pytester, golden_dir, arch: str, tmp_path: Path
) -> None:
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden_dir(arch, LAYERS), "--dtype", "bfloat16", "--parity-routing", "ids+weights",
        "-k", "routing", "--parity-report", str(report),
    )  # fmt: skip
    result.assert_outcomes(passed=LAYERS)
    result.stdout.fnmatch_lines(["layer_0.moe::routing *passed*own routing within limits*", "first divergence: none"])
    # the pictures are the points': a routing item is its block replayed again, not a point to draw
    result.stdout.fnmatch_lines(["plots: no point to draw*"])
    assert not (report / "heatmap.png").exists()
    rows = _rows(report)
    for layer in range(LAYERS):
        row = rows[f"layer_{layer}.moe::routing"]
        assert [level["level"] for level in row["levels"]] == ["own", "ids", "ids+weights"]
        assert all(level["status"] == "passed" for level in row["levels"]) and row["recovered"] is None
        # read back as its kind
        assert isinstance(Row.from_json(row), RoutingRow)
        assert Row.from_json(row).to_json() == row


def test_a_selection_fault_is_recovered_by_the_golden_ids(
    pytester: pytest.Pytester, golden_dir, biased: Path, tmp_path: Path
) -> None:
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden_dir("minimax_m2", LAYERS), "--dtype", "bfloat16", "--parity-routing", "ids+weights",
        NO_WEIGHTS, NO_CONFIG, "--parity-report", str(report), model=biased,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "layer_0.moe::routing: the routing alone changes the block: the experts it selects*",
            "  level *rel_l2 *cosine *worst token  verdict",
            "  own *FAIL",
            "  ids *pass",
            "  ids+weights *pass",
            "  * token(s) routed to other experts, carrying *% of the golden's routing weight*",
            "  hint: the router selects other experts than the reference*see layer_0.router",
        ]
    )
    rows = _rows(report)
    routing = rows["layer_0.moe::routing"]
    assert routing["status"] == "failed" and routing["recovered"] == "ids"
    assert routing["routing"]["flips"] and 0 < routing["routing"]["flipped_weight"] < 1
    # the router names the fault first; the block, judged without its flipped tokens, hides it
    assert read_json(report / "comparison_summary.json")["first_divergence"] == "layer_0.router"
    assert rows["layer_0.moe"]["status"] == "passed"
    assert "real flip(s) carry" in " ".join(rows["layer_0.router"]["notes"])


def test_a_weights_fault_needs_the_golden_weights(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    port = shutil.copytree(tiny_model("qwen3_moe", LAYERS), tmp_path / "port")
    edit_config(port, lambda c: c.update(norm_topk_prob=not c.get("norm_topk_prob", True)))
    golden = golden_dir("qwen3_moe", LAYERS)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-routing", "ids+weights", NO_CONFIG, "-k", "routing",
        "--parity-report", str(report), model=port,
    )  # fmt: skip
    result.assert_outcomes(failed=LAYERS)
    result.stdout.fnmatch_lines(
        ["layer_0.moe::routing: the routing alone changes the block: the weights it gives the experts*", "  own *FAIL",
         "  ids *FAIL", "  ids+weights *pass", "*layer_0.moe::routing *failed*recovered by ids+weights*"]
    )  # fmt: skip
    assert _rows(report)["layer_0.moe::routing"]["recovered"] == "ids+weights"
    # forcing the ids alone does not recover it, and says what was not tried
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "--parity-routing", "ids", NO_CONFIG, "-k", "routing", model=port
    )
    result.assert_outcomes(passed=LAYERS)
    result.stdout.fnmatch_lines(["layer_0.moe::routing *passed*the golden's ids do not recover it*"])


def test_an_expert_fault_is_not_the_routing(pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path) -> None:
    def scale_expert(t: dict[str, torch.Tensor]) -> None:
        for key in [k for k in t if ".layers.1." in k and ".experts.2." in k]:
            t[key] = t[key] * 1.5

    port = edit_checkpoint(tiny_model("mixtral", LAYERS), tmp_path / "port", scale_expert)
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden_dir("mixtral", LAYERS), "--dtype", "bfloat16", "--parity-routing", "ids+weights",
        NO_WEIGHTS, NO_CONFIG, "-k", "layer_1 and (experts or moe)", "--parity-report", str(report), model=port,
    )  # fmt: skip
    # the experts and the block fail; the routing item passes, saying the routing is not the cause
    result.assert_outcomes(failed=2, passed=1)
    result.stdout.fnmatch_lines(["layer_1.moe::routing *passed*not the routing: no level recovers it*"])
    row = _rows(report)["layer_1.moe::routing"]
    assert [level["status"] for level in row["levels"]] == ["failed"] * 3
    assert row["notes"][0].startswith("not the routing: with the golden's expert ids and weights the block still")


def test_parity_routing_bad_input(pytester: pytest.Pytester, golden_dir) -> None:
    golden = golden_dir("qwen3_moe", LAYERS)
    usage_error(
        run_parity(pytester, golden, "--hw", "trace", "--parity-routing", "ids"),
        "--parity-routing ids: the trace backend cannot replace a router's output inside its block",
    )
    result = run_parity(pytester, golden, "--parity-routing", "weights")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "invalid choice: 'weights'" in result.stderr.str()


# -- the reference's weight rule, and the weight flips carry --------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "minimax_m2", "deepseek_v3", "gpt_oss"])
def test_the_reference_rule_gives_the_golden_weights(golden_dir, arch: str) -> None:
    store = GoldenStore(golden_dir(arch, LAYERS))
    router = golden_routers(store)[0]
    logits, weights, ids = store.load(router).output[:3]
    rule = SelectionRule.of(router, torch.float32, 8.0, store.config)
    scale = float(store.config.get("routed_scaling_factor") or 1.0)
    got = weights_for(rule, logits, ids, weights, scale)
    torch.testing.assert_close(got.float(), weights.reshape(got.shape).float(), rtol=1e-4, atol=1e-5)


def test_flipped_weight_is_the_golden_weight_of_the_lost_experts() -> None:
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    golden = torch.tensor([[0, 1], [0, 1]])
    weights = torch.tensor([[0.75, 0.25], [0.6, 0.4]])
    metrics = compare_routing(scores, golden, torch.tensor([[0, 2], [1, 0]]), tolerance=0.0)
    metrics.weigh(golden, weights)
    assert [f.token for f in metrics.flips] == [0]
    assert metrics.flipped_weight == pytest.approx(0.25 / 2.0)  # of all the golden's routing weight
    assert metrics.max_flipped_weight == pytest.approx(0.25)  # of token 0's own
    assert "carry 12.5% of the golden's routing weight (at most 25.0% of one token's)" in metrics.weight_words()


# -- moe-parity routes ----------------------------------------------------------------------------------


def engine_trace(store: GoldenStore, model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What an engine exports: the experts its own whole run routed each token to, [T, L, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    seen: list[torch.Tensor] = []
    for router in golden_routers(store):
        model.get_submodule(router.module).register_forward_hook(
            lambda m, a, out: seen.append(out[2].reshape(-1, out[2].shape[-1]))
        )
    with torch.no_grad():
        model(input_ids=torch.tensor(store.manifest["inputs"]["input_ids"]).reshape(1, -1))
    return torch.stack(seen, dim=1)


@pytest.mark.parametrize("suffix", [".npy", ".safetensors", ".pt", ".json"])
def test_a_trace_written_is_read_back(golden_dir, tmp_path: Path, suffix: str) -> None:
    store = GoldenStore(golden_dir("qwen3_moe", LAYERS))
    ids = golden_trace(store)
    assert ids.shape == (16, LAYERS, 2)
    write_trace(tmp_path / f"t{suffix}", ids)
    assert torch.equal(read_trace(tmp_path / f"t{suffix}"), ids)


def test_npy_traces_are_read_as_numpy_writes_them(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    data = np.arange(24, dtype=np.int64).reshape(4, 3, 2)
    np.save(tmp_path / "t.npy", data)
    assert read_trace(tmp_path / "t.npy").tolist() == data.tolist()
    np.save(tmp_path / "f.npy", data.astype(np.float32))
    with pytest.raises(ValueError, match="holds <f4 values in C order: expected integer expert ids"):
        read_trace(tmp_path / "f.npy")


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2", "mixtral"])
def test_routes_passes_a_clean_engine(capsys, golden_dir, tiny_model, tmp_path: Path, arch: str) -> None:
    store = GoldenStore(golden_dir(arch, LAYERS))
    write_trace(tmp_path / "engine.npy", engine_trace(store, tiny_model(arch, LAYERS)))
    trace, report = str(tmp_path / "engine.npy"), str(tmp_path / "r.json")
    code, out, _ = cli(capsys, "routes", str(store.root), trace, "--json", report)
    assert code == 0, out
    assert "first divergence: none" in out
    verdict = json.loads((tmp_path / "r.json").read_text())
    assert verdict["first_divergence"] is None and [x["router"] for x in verdict["layers"]] == [
        f"layer_{n}.router" for n in range(LAYERS)
    ]


def test_routes_names_the_first_layer_an_engine_routes_otherwise(
    capsys, golden_dir, biased: Path, tmp_path: Path
) -> None:
    store = GoldenStore(golden_dir("minimax_m2", LAYERS))
    write_trace(tmp_path / "engine.safetensors", engine_trace(store, biased))
    report = tmp_path / "r.json"
    code, out, _ = cli(capsys, "routes", str(store.root), str(tmp_path / "engine.safetensors"), "--json", str(report))
    assert code == 1, out
    lines = out.splitlines()
    assert any(line.split()[:1] == ["layer_0.router"] and line.endswith("FAIL") for line in lines), out
    assert "first divergence: layer_0.router: " in out and "of the golden's routing weight" in out
    # each figure in its own column, under a header that says what it is: the flip share beside its limit,
    # the flipped routing weight apart
    header = next(line for line in lines if line.split()[:1] == ["router"])
    assert header.split()[1:] == ["agree", "flips", "ties", "flip", "share", "share", "limit", "flip", "weight",
                                  "verdict"], header  # fmt: skip
    layer = json.loads(report.read_text())["layers"][0]
    cells = next(line for line in lines if line.split()[:1] == ["layer_0.router"]).split()[1:]
    routing = layer["routing"]
    assert cells == [f"{routing['set_agreement']:.1%}", str(len(routing["flips"])), str(len(routing["ties"])),
                     f"{routing['flip_share']:.1%}", f"{layer['limit']:.1%}", f"{routing['flipped_weight']:.1%}",
                     "FAIL"], (cells, layer)  # fmt: skip
    assert routing["flip_share"] > layer["limit"]
    for name, value in zip(("flip share", "share limit", "flip weight"), cells[3:6], strict=True):
        at = header.index(name) + len(name)  # right-aligned under its header
        row = next(line for line in lines if line.split()[:1] == ["layer_0.router"])
        assert row[at - len(value) : at] == value, (name, header, row)
    assert "  columns: agree: the share of tokens whose top-k set is the golden's; " in out


def test_routes_bad_input(capsys, golden_dir, tmp_path: Path) -> None:
    root = golden_dir("qwen3_moe", LAYERS)
    ids = golden_trace(GoldenStore(root))

    def fails(trace: torch.Tensor | None, message: str, *more: str) -> None:
        args = ["routes", str(root), *more]
        if trace is not None:
            write_trace(tmp_path / "t.json", trace)
            args.insert(2, str(tmp_path / "t.json"))
        code, out, err = cli(capsys, *args)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert out == ""

    fails(ids[:, :1], "the trace has 1 MoE layer, the golden records 2 (layers 0, 1)")
    fails(ids[:, :, :1], "the trace routes each token to 1 expert, the golden's router to 2")
    fails(ids[:5], "the trace has 5 tokens, the golden 16 real tokens")
    fails(ids + 100, "to expert 10")
    fails(None, "give the engine's TRACE to judge, or --write FILE")
    (tmp_path / "x.csv").write_text("1,2")
    code, _, err = cli(capsys, "routes", str(root), str(tmp_path / "x.csv"))
    assert code == 2 and "a trace is one of .npy, .safetensors, .pt, .json" in err
    (tmp_path / "flat.json").write_text("[1, 2, 3]")
    code, _, err = cli(capsys, "routes", str(root), str(tmp_path / "flat.json"))
    assert code == 2 and "holds [3], not expert ids [tokens, moe_layers, top_k]" in err


# -- a router's output in another form: Llama 4's (scores, logits) -----------------------------------


def _llama4_router(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' Llama4Router returns: its top-k's sigmoid scattered into [T, E], and the logits."""
    top, ids = logits.topk(k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, ids, top)
    return torch.sigmoid(scores), logits


def test_a_router_that_scatters_its_top_k_is_read_as_the_triple() -> None:
    """Llama 4's (scores, logits): the logits' top-k with the scores there, and back again (the routing
    differential hands the router's consumer its own form); any other output as it is."""
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    pair = _llama4_router(logits, 2)
    view = routing_view(pair)
    assert view[0] is logits and torch.equal(view[2], logits.topk(2, dim=1).indices)
    assert torch.equal(view[1], torch.sigmoid(logits.topk(2, dim=1).values))
    assert torch.equal(scattered_routing(view, pair)[0], pair[0]) and scattered_routing(view, pair)[1] is logits
    triple = (logits, view[1], view[2])
    assert routing_view(triple) is triple and scattered_routing(triple, triple) is triple
    dense = (torch.softmax(logits, 1), logits)  # every expert's probability: no top-k in it
    signed = (logits.clone(), logits)  # not scores
    assert routing_view(dense) is dense and routing_view(signed) is signed


def test_experts_run_on_every_token_leave_out_a_flipped_token_under_every_expert() -> None:
    """Llama 4's experts run on every token, a row per expert and token ([E*T, H], expert-major): a
    token the candidate routed otherwise is left out under every expert, so its rows do not fail a
    block whose other tokens agree; and a broken expert still fails."""
    gen = torch.Generator().manual_seed(1)
    tokens, experts, hidden = 6, 4, 8
    logits = torch.randn(tokens, experts, generator=gen)
    flipped = logits.clone()
    flipped[2] = flipped[2].flip(0)  # token 2 goes to another expert
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(experts, hidden, hidden, generator=gen)

    def experts_out(router_logits: torch.Tensor, broken: float = 1.0) -> torch.Tensor:
        scores = _llama4_router(router_logits, 1)[0]
        routed = x.repeat(experts, 1) * scores.t().reshape(-1, 1)  # as Llama4TextMoe feeds its experts
        out = torch.bmm(routed.view(experts, tokens, hidden), w).view(-1, hidden)
        used = int(logits[0].argmax())  # token 0's expert
        out[used * tokens : (used + 1) * tokens] *= broken
        return out

    point, tol = Point.parse("layer_0.experts"), default_tolerance(torch.bfloat16, "experts")

    def judged(candidate: torch.Tensor):
        return judge_point(Case(point, experts_out(logits), candidate, tol, torch.bfloat16,
                                router=Point.parse("layer_0.router"), golden_router=_llama4_router(logits, 1),
                                candidate_router=_llama4_router(flipped, 1)))  # fmt: skip

    clean = judged(experts_out(flipped).to(torch.bfloat16))
    assert clean.passed and clean.excluded_tokens == [2], clean.notes
    broken = judged(experts_out(flipped, broken=1.5).to(torch.bfloat16))
    assert not broken.passed and broken.excluded_tokens == [2]
