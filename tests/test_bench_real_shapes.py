"""benchmarks/bench_real_shapes.py without running it: its shapes are the published models', what it
writes loads as a hub checkpoint, and a shape the host cannot hold is refused in one line before
anything is built (CI runs no benchmark, so its logic is covered here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_real_shapes", ROOT / "benchmarks" / "bench_real_shapes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run: it imports bench_replay beside it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize(
    ("name", "layers", "experts", "billions"),
    [("Qwen3-30B-A3B", 2, None, 30.5), ("Mixtral-8x7B", 2, None, 46.7), ("DeepSeek-V3", 4, None, 671.0),
     ("DeepSeek-V3", 4, 16, None)],
)  # fmt: skip
def test_shapes_are_the_published_models(bench, name, layers, experts, billions):
    """Each layer the builder writes (transformers' modules on the meta device, in the hub's per-expert
    layout) holds what the architecture's formula gives from the config alone, and the formula at the
    real depth gives the published parameter count."""
    real = bench.find_model(name)
    params, size = bench.unit_table(bench.hub_shapes(bench.make_config(real, layers, experts)))
    cfg = bench.config_dict(real, layers, experts)
    assert {u: n for u, n in params.items() if isinstance(u, int)} == {
        i: bench.layer_params(real.model_type, cfg, i) for i in range(layers)
    }
    assert sum(n for u, n in params.items() if not isinstance(u, int)) == bench.model_level_params(cfg)
    assert all(size[u] == 2 * params[u] for u in params if isinstance(u, int) and u < 3)  # bf16
    if billions is not None:
        full = bench.config_dict(real, real.depth)
        total = bench.model_level_params(full) + sum(
            bench.layer_params(real.model_type, full, i) for i in range(real.depth)
        )
        assert total / 1e9 == pytest.approx(billions, abs=0.05)
    if name == "DeepSeek-V3" and experts is None:  # the figure: 256 x 3 x 7168 x 2048 in bf16
        assert size[3] > 256 * 3 * 7168 * 2048 * 2 > size[2]  # a MoE layer (layers 0-2 are dense)


def test_refuses_a_shape_the_host_cannot_hold(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "available", lambda root: (24 * 2**30, 50 * 10**9))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", "deepseek-v3", "--layers", "4", "--keep", str(tmp_path / "run")])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert line.startswith("refused: DeepSeek-V3 at 4 layers (256 routed experts) needs ")
    assert "GB of RAM (the recording: every weight in float32; its largest layer is 23.0 GB in bf16)" in line
    assert "25.8 GB available (MemAvailable) and 50.0 GB free" in line
    assert not (tmp_path / "run").exists()  # nothing built


def test_refuses_on_disk_too(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "available", lambda root: (10**12, 10**9))
    with pytest.raises(SystemExit):
        bench.main(["--model", "Qwen3-30B-A3B", "--layers", "2", "--keep", str(tmp_path)])
    assert "GB of disk; this host has 1000.0 GB available (MemAvailable) and 1.0 GB free" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--model", "llama-70b"], "unknown model 'llama-70b': the known ones are Qwen3-30B-A3B, Mixtral-8x7B, "
                                "DeepSeek-V3"),
     (["--model", "DeepSeek-V3", "--experts", "12"], "--experts 12: DeepSeek-V3 routes top-8, so its experts must be"),
     (["--model", "Mixtral-8x7B", "--experts", "1"], "--experts 1: Mixtral-8x7B routes top-2, so its experts must "
                                                     "be >= 2"),
     (["--layers", "0"], "--layers 0: at least one layer")],
)  # fmt: skip
def test_usage_errors(bench, capsys, argv, says):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_written_checkpoint_loads_as_the_hubs(bench, tmp_path):
    """At a tiny scale: sharded with an index, per-expert keys, bf16, each tensor the same for the same
    key and seed; transformers loads it with no key missing or unexpected."""
    from transformers import AutoModelForCausalLM

    tiny = bench.Real("tiny", "qwen3_moe", 4, "num_experts", {
        **bench.MODELS["qwen3-30b-a3b"].config, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "intermediate_size": 128,
    })  # fmt: skip
    config = bench.make_config(tiny, 2)
    shapes = bench.hub_shapes(config)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in {k for k, _, _ in shapes}
    out = bench.write_checkpoint(config, shapes, tmp_path / "ckpt", seed=3, shard_limit=40_000, what={"x": 1})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    params, _ = bench.unit_table(shapes)
    assert sum(params.values()) == sum(p.numel() for p in model.parameters())
    again = bench.fill("model.layers.0.mlp.gate.weight", (8, 64), torch.bfloat16, 3, 0.02)
    assert torch.equal(again, model.model.layers[0].mlp.gate.weight.detach())
    assert bench.write_checkpoint(config, shapes, out, 3, 40_000, {"x": 1}) == out  # reused, not rebuilt


def test_the_figures_and_goals_from_a_run(bench, monkeypatch, capsys):
    """The closing figures from one run's measurements (made up here): the goals as ratios with
    PASS/MISS, each layer's time, and the real depth from the middle layers."""
    monkeypatch.setattr(bench, "available", lambda root: (10**12, 10**12))
    args = bench.parse(["--model", "Qwen3-30B-A3B", "--layers", "4"])
    plan = bench.plan(args)
    parts = ("input_norm", "attention", "post_attn_norm", "router", "experts", "moe", "output")
    rows = [{"id": "embedding", "layer": None, "component": "embedding", "seconds": 0.0}]
    rows += [{"id": f"layer_{i}.{c}", "layer": i, "component": c, "seconds": 0.2} for i in range(4) for c in parts]
    rows += [{"id": "logits", "layer": None, "component": "logits", "seconds": 0.5}]
    items = {r["id"]: r["seconds"] + (2.0 if r["id"] in ("embedding", "layer_0.input_norm") else 0.1) for r in rows}
    replay = {"rows": rows, "items": items, "summary": {"passed": 30, "failed": 0, "error": 0}, "wall_s": 20.0,
              "after_imports_s": 17.0, "report_wall_s": 15.0, "peak": 5.6e9, "baseline": 2.6e8}  # fmt: skip
    files = {
        "embedding.safetensors": 2e6,
        "logits.safetensors": 1.5e8,
        **{f"layer_{i}.safetensors": 2.2e7 for i in range(4)},
    }
    record = {"wall_s": 33.0, "after_imports_s": 30.0, "bytes": sum(files.values()), "files": files, "peak": 1.4e10,
              "baseline": 2.5e8, "per_layer": {0: 5.0, 1: 4.0, 2: 4.0, 3: 8.0},
              "stats": {"load_seconds": 1.5, "record_seconds": 27.0, "host_weight_bytes": 1.2e10}}  # fmt: skip
    ref = {"read_s": 7.0, "forward_s": 4.0, "after_imports_s": 11.0, "peak": 4.4e9,
           "per_layer": {str(i): [1.5, 0.8] for i in range(4)}}  # fmt: skip
    measured = {"record": record, "replay": replay, "ref_bf16": ref, "ref_rec": {**ref, "read_s": 12.0},
                "raw": {"bytes": 6.2e9, "read_s": 1.2}, "write": {"after_imports_s": 0.1},
                "rounds": {"replay": [replay]}, "total_s": 200.0}  # fmt: skip
    bench.show(args, plan, measured)
    out = capsys.readouterr().out
    assert "replay / (one read + one forward, bf16) = 17.0 / 11.0 s = x1.55 (goal <= 1.5): MISS" in out
    assert "MoE layers' items: last / first 2.1 / 4.0 s = x0.53 (goal <= 1.25): PASS; spread max/min x1.90" in out
    assert "the middle layers' x1.00 (goal <= 1.5): PASS" in out
    assert "recording / (one read + one forward, float32, + one write of its bytes) = 30.0 / 16.1 s = x1.86" in out
    assert "most time beside a forward (reads waited for, judging): layer_0.input_norm 2.0 s, embedding 2.0 s" in out
    assert "a MoE layer of it: bf16 read 1.50 s + forward 0.80 s" in out
    # 44 more layers at the middle layers' 4.0 s (recording) and 2.1 s (replay)
    assert "at the real depth, 48 layers: recording ~3.4 min (x1.83 one read + forward in float32 + write" in out
    assert "replay ~1.8 min (x0.98 one read + forward in bf16, ~1.9 min), its peak RSS ~5.60 GB whatever" in out


def test_the_real_experts_projected_from_a_scaled_down_run(bench):
    """With --experts, the real depth at the real routed experts: each of the real model's MoE layers
    adds its read's growth (the weights' ratio) to replay and reference alike, the forward as measured;
    said as a projection."""
    real = bench.find_model("DeepSeek-V3")
    cfg = bench.config_dict(real, 4, 16)
    full = bench.config_dict(real, real.depth)
    grow = bench.layer_params(real.model_type, full, 3) / bench.layer_params(real.model_type, cfg, 3)
    assert grow == pytest.approx(12.3, abs=0.05)  # 16 -> 256 experts of 3 x 7168 x 2048, and attention alike
    ref = {"per_layer": {"0": [0.5, 1.5], "1": [0.5, 1.5], "2": [0.5, 1.5], "3": [1.0, 1.6]}}
    line = bench.at_real_experts(real, cfg, ref, 10e9, 300.0, 200.0)
    more = 58 * 1.0 * (grow - 1)  # DeepSeek-V3's 61 layers, the first 3 dense
    assert line.startswith("at the real depth with its 256 routed experts (projected, not measured: a MoE layer's read")
    assert f"1.00 -> {grow:.1f} s" in line
    assert f"replay ~{(300 + more) / 60:.1f} min against one read + forward ~{(200 + more) / 60:.1f} min" in line
    assert f"x{(300 + more) / (200 + more):.2f} (goal <= 1.5)" in line
