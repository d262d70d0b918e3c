"""`moe-parity estimate --shards N / --budget TIME`: each shard's --parity-layers and wall, from a
cost model of the replay (FLOPs from the checkpoint's headers and config) and a throughput from a
previous report or a calibration."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from helpers import cli, read_json
from test_audit import _sparse_checkpoint

from pytest_moe_parity.errors import BadInput
from pytest_moe_parity.record.shards import (
    Throughput,
    Unit,
    parse_duration,
    partitions,
    plan_shards,
    replay_units,
    selection,
)

# A Qwen3-MoE-30B-A3B layer's shape (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of 768,
# top-8), two layers, headers only
H, HEADS, KV, D, E, I, K, V = 2048, 32, 4, 128, 128, 768, 8, 151936  # noqa: E741


def _qwen3_like(tmp: Path) -> Path:
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [V, H])}
    for layer in range(2):
        p = f"model.layers.{layer}"
        tensors.update({
            f"{p}.input_layernorm.weight": ("BF16", [H]),
            f"{p}.self_attn.q_proj.weight": ("BF16", [HEADS * D, H]),
            f"{p}.self_attn.k_proj.weight": ("BF16", [KV * D, H]),
            f"{p}.self_attn.v_proj.weight": ("BF16", [KV * D, H]),
            f"{p}.self_attn.o_proj.weight": ("BF16", [H, HEADS * D]),
            f"{p}.self_attn.q_norm.weight": ("BF16", [D]),
            f"{p}.post_attention_layernorm.weight": ("BF16", [H]),
            f"{p}.mlp.gate.weight": ("BF16", [E, H]),
        })  # fmt: skip
        for e in range(E):
            for name, shape in (("gate_proj", [I, H]), ("up_proj", [I, H]), ("down_proj", [H, I])):
                tensors[f"{p}.mlp.experts.{e}.{name}.weight"] = ("BF16", shape)
    tensors.update({"model.norm.weight": ("BF16", [H]), "lm_head.weight": ("BF16", [V, H])})
    model = _sparse_checkpoint(tmp / "m", tensors).parent
    config = {"model_type": "qwen3_moe", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "head_dim": D, "num_hidden_layers": 2, "num_experts": E, "num_experts_per_tok": K,
              "moe_intermediate_size": I, "vocab_size": V, "max_position_embeddings": 40960}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_each_point_s_flops_are_the_hand_formula_and_static_shapes_run_every_expert(tmp_path: Path) -> None:
    T = 256
    model = _qwen3_like(tmp_path)
    eager = {u.name: u for u in replay_units(model, T, {}, "cpu")}
    layer = eager["layer_1"].points
    attention = 2 * T * (HEADS * D * H + 2 * KV * D * H + H * HEADS * D) + 2 * T * T * HEADS * (D + D)
    experts = 2 * T * E * 3 * I * H * K / E  # top-k of E experts per token
    router = 2 * T * E * H
    assert layer["attention"] == attention and layer["router"] == router
    assert layer["experts"] == pytest.approx(experts)
    assert layer["moe"] == pytest.approx(router + experts)
    assert layer["output"] == pytest.approx(attention + router + experts + 2 * layer["input_norm"])
    assert "mlp" not in layer and "shared_experts" not in layer
    assert eager["model"].points["logits"] == 2 * T * V * H
    static = {u.name: u for u in replay_units(model, T, {}, "neuron")}["layer_1"].points
    assert static["experts"] == pytest.approx(layer["experts"] * E / K)  # every expert, every token
    assert static["attention"] == layer["attention"]


def test_a_dense_layer_and_shared_experts_are_their_own_points(tiny_model) -> None:
    """DeepSeek-V3: its first layers dense (an MLP), the others routed and shared experts."""
    model = tiny_model("deepseek_v3")
    config = json.loads((model / "config.json").read_text())
    units = replay_units(model, 16, {}, "cpu")
    dense = config["first_k_dense_replace"]
    assert dense >= 1 and [u.name for u in units] == ["model", *(f"layer_{i}" for i in range(len(units) - 1))]
    for u in units[1:]:
        if u.layer < dense:
            assert "mlp" in u.points and "experts" not in u.points
        else:
            assert {"router", "experts", "shared_experts", "moe"} <= u.points.keys() and "mlp" not in u.points
            assert u.points["moe"] == pytest.approx(
                u.points["router"] + u.points["experts"] + u.points["shared_experts"]
            )


def test_the_split_is_the_best_contiguous_one() -> None:
    """Against every split into n contiguous parts, on seeded random costs."""
    rng = random.Random(7)
    for _ in range(20):
        costs = [rng.uniform(0.1, 10) for _ in range(rng.randint(1, 9))]
        for n, bounds in enumerate(partitions(costs), start=1):
            assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
            assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
            best = min(
                max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *cuts, len(costs))))
                for cuts in itertools.combinations(range(1, len(costs)), n - 1)
            )
            assert max(sum(costs[a:b]) for a, b in bounds) == pytest.approx(best)


def _units(costs: list[float]) -> list[Unit]:
    return [Unit("model", None, {"logits": costs[0]}, 0)] + [
        Unit(f"layer_{i}", i, {"output": c}, 0) for i, c in enumerate(costs[1:])
    ]


def test_the_budget_takes_the_fewest_shards_whose_longest_fits() -> None:
    speed = Throughput(flops_per_s=1.0, per_call_s=0.0, per_point_s=0.0, read_bps=1.0, source="a test")
    costs = [5.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]  # seconds at 1 FLOP/s
    plan = plan_shards(_units(costs), speed, shards=None, budget_s=9.5, setup_s=1.0)
    walls = [s for _, s in plan.shards]
    assert plan.to_fit == len(plan.shards) and max(walls) <= 9.5 and plan.fits
    fewer = plan_shards(_units(costs), speed, shards=plan.to_fit - 1, budget_s=9.5, setup_s=1.0)
    assert max(s for _, s in fewer.shards) > 9.5 and fewer.fits is False
    by_name = {"model": costs[0], **{str(i): c for i, c in enumerate(costs[1:])}}
    for sel, wall in plan.shards:  # each shard: its setup and its units' seconds
        names = [w for part in sel.split(",") for w in _expand(part)]
        assert wall == pytest.approx(1.0 + sum(by_name[n] for n in names))
    assert plan_shards(_units(costs), speed, shards=None, budget_s=2.0).to_fit is None  # no split: 5 s alone
    with pytest.raises(BadInput, match="--shards 9: the model has 7 units"):
        plan_shards(_units(costs), speed, shards=9, budget_s=None)
    assert selection(_units(costs)[:1]) == "model"


def _expand(part: str) -> list[str]:
    if part == "model":
        return [part]
    a, _, b = part.partition("-")
    return [str(i) for i in range(int(a), int(b or a) + 1)]


@pytest.mark.parametrize("text, seconds", [("60m", 3600), ("1h30m", 5400), ("3600s", 3600), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, golden_dir) -> Path:
    """A report of a whole run of the tiny qwen3_moe on the CPU (its points' measured seconds)."""
    from pytest_moe_parity.session import ParitySession, RunOptions

    out = tmp_path_factory.mktemp("measured") / "report"
    session = ParitySession(RunOptions(golden_dir=golden_dir("qwen3_moe"), report_dir=out, plots=False))
    try:
        list(session.run_all(items=True))
        session.write_reports()
    finally:
        session.close()
    return out


def test_shards_from_a_report_add_up_to_its_run(measured: Path, tiny_model, tmp_path: Path, capsys) -> None:
    """At the report's own tokens, the units' seconds are its points' measured forwards and what the
    run spent beside them: together, the run's wall."""
    report = read_json(measured / "comparison_report.json")
    model = tiny_model("qwen3_moe")
    args = ["estimate", "--model", model, "--seq-len", report["tokens"], "--shards", 2, "--from-report", measured]
    code, out, err = cli(capsys, *args, "--json", tmp_path / "e.json")
    assert code == 0, err
    plan = read_json(tmp_path / "e.json")["shard_plan"]
    assert f"throughput from the report {measured}: " in out and "points' measured seconds at 16 tokens" in out
    assert plan["one_runner_s"] == pytest.approx(report["wall_seconds"], rel=0.1)
    shards = read_json(tmp_path / "e.json")["shards"]
    assert len(shards) == 2 and shards[0].startswith("model,0") and shards[1].endswith("-3")
    assert plan["one_runner_s"] / 2 <= plan["longest_s"] <= plan["one_runner_s"]
    # --cores scales a CPU run's rate from the threads it ran on
    threads = report["host"]["threads"]
    code, _, _ = cli(capsys, *args, "--cores", 4 * threads, "--json", tmp_path / "c.json")
    scaled = read_json(tmp_path / "c.json")["shard_plan"]["throughput"]
    assert scaled["flops_per_s"] == pytest.approx(4 * plan["throughput"]["flops_per_s"])
    assert f"scaled linearly from {threads} cores to --cores {4 * threads}" in scaled["notes"]
    # a budget: the fewest shards that fit, and a plan that does not is exit 1
    code, out, _ = cli(capsys, *args[:-4], "--budget", "10h", "--from-report", measured)
    assert code == 0 and "--budget 10h0m0s: 1 shard fits" in out
    code, out, _ = cli(capsys, *args, "--budget", "0.01s")
    assert code == 1 and "these 2 shards do not fit --budget 0.01s" in out


def test_a_calibration_says_so_and_its_json_is_a_matrix(tiny_model, tmp_path: Path, capsys) -> None:
    model = tiny_model("deepseek_v3")
    code, out, err = cli(
        capsys, "estimate", "--model", model, "--shards", 3, "--hw", "neuron", "--json", tmp_path / "e"
    )
    assert code == 0, err
    assert "throughput from a calibration on this host" in out and "every expert for every token" in out
    assert "a CPU's figures: for --hw neuron pass --from-report" in out
    data = read_json(tmp_path / "e")
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    shards = data["shards"]
    assert len(shards) == 3 and shards[0].split(",")[0] == "model"
    covered = []
    for s in shards:
        for part in (p for p in s.split(",") if p != "model"):
            a, _, b = part.partition("-")
            covered += range(int(a), int(b or a) + 1)
    assert covered == list(range(layers))  # each layer once, in order


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--shards", "2", "--budget", "60"], "--budget '60' is not a duration: give its unit"),
        (["--cores", "32"], "--cores goes with --shards N or --budget TIME"),
        (["--shards", "99"], "--shards 99: the model has 5 units to share"),
        (["--shards", "2", "--from-report", "nowhere"], "--from-report: no comparison_report.json in nowhere"),
    ],
)
def test_bad_input_is_one_line(extra: list[str], message: str, tiny_model, capsys) -> None:
    code, _, err = cli(capsys, "estimate", "--model", tiny_model("qwen3_moe"), *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_report_of_another_model_is_bad_input(measured: Path, tiny_model, capsys) -> None:
    code, _, err = cli(capsys, "estimate", "--model", tiny_model("mixtral"), "--shards", 2, "--from-report", measured)
    assert code == 2 and "is a report of a qwen3_moe model, and --model is a mixtral" in err
