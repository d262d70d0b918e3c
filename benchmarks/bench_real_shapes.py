"""Recording and replay at a named real model's layer shapes: what the tiny models cannot say (a
real layer's reads, its experts' compute, a 150k vocabulary's logits), measured at a few layers and
extrapolated to the real depth.

    python benchmarks/bench_real_shapes.py [--model Qwen3-30B-A3B] [--layers 2] [--seq-len 256]
        [--experts N] [--stream] [--record-dtype float32] [--repeat 1] [--breakdown] [--keep DIR] [--no-cuda]

A checkpoint with the model's real layer shapes (its hub config, `--layers` deep) is built from the
transformers config class on the meta device, each tensor filled at random with a fixed seed (matrices
N(0, initializer_range), norm weights 1 + N(0, 0.1), biases N(0, 0.05)) and written as bf16
safetensors in the hub's per-expert layout, sharded (`--shard-size`, 2 GB) with an index: the host
holds one shard at a time, never the model. It lives in a temporary directory (or `--keep DIR`, reused
when it matches) and is never committed. `--experts N` keeps every other shape and routes over N
experts (DeepSeek-V3's 256 experts are 22.5 GB of bf16 per layer); the output says so. Then, each in a
fresh process (OMP_NUM_THREADS=2 unless set), `--repeat` rounds interleaved (the least kept):

- recording: `moe-parity golden --model M --out G --seq-len N [--stream]`: wall, the golden's size,
  peak RSS (VmHWM), the per-layer intervals of its progress lines; with CUDA also `--device cuda` and
  its torch.cuda.max_memory_allocated;
- replay: `pytest --golden-dir G --hw cpu --dtype bfloat16 --parity-report R --junitxml J
  -p no:cacheprovider` (with CUDA also `--hw cuda`): wall, peak RSS, each layer's and each point kind's
  time (the report rows' `seconds`: the forward alone; the JUnit items' time: the forward, its reads
  and the judging), the report's `wall_seconds`; `--breakdown`: one more replay timed by part (backend
  start, forwards and read waits, judging, golden reads, the rest) and its longest judgings;
- the reference: one forward of the model at the golden's tokens through the project's lazy path
  (`LazyModel.streaming`, one decoder layer held, eager attention and experts as recorded), in bf16
  and in the recording's dtype, its unit reads (read and converted, as a replay reads them) timed
  apart from the forward, per layer too; one raw read of every checkpoint tensor; one write of the
  golden's bytes.

Goals, as ratios of one run (PASS/MISS): replay <= 1.5 x (one read of every layer's weights + one
forward, bf16); per-layer replay cost flat: the last layer's JUnit time over the first's of the same
kind <= 1.25, and the spread (max/min) of the middle layers <= 1.5 (the first layer waits for its own
read, the last reads no layer beside it: fixed costs, printed); recording <= 2 x (one read + one
forward in the recording's dtype + one write of the golden's bytes). A closing line extrapolates to
the real depth, each further layer at the built middle layers' cost. A shape the host cannot hold
(RAM: the MemAvailable of /proc/meminfo, against what the largest step holds; disk: shutil.disk_usage
of the work directory) is refused before anything is built, in one line (exit 2); an unknown model
name and `--experts` its routing cannot use too.

Measured on this project's shared host: 2 cores, no GPU, 24 GiB RAM, AVX-512 bf16, beside other
engineers' runs (a load of 2-4). Hence OMP_NUM_THREADS=1: two OpenMP threads on taken cores stall for
up to seconds at a time (128 bf16 index_add_ calls of the eager experts: 1.5 ms on one thread, 4.5 s
on two), and the replay's forwards run mostly on one thread (a layer is read beside them) while the
reference's would run on two. 256 tokens, a float32 golden, a bf16 replay, GB = 1e9 bytes:

    OMP_NUM_THREADS=1 python benchmarks/bench_real_shapes.py --breakdown        # 1.7 min, the build included
    OMP_NUM_THREADS=1 python benchmarks/bench_real_shapes.py --layers 4 --repeat 2 --breakdown --keep DIR
    OMP_NUM_THREADS=1 python benchmarks/bench_real_shapes.py --model Mixtral-8x7B --repeat 2 --breakdown
    OMP_NUM_THREADS=1 python benchmarks/bench_real_shapes.py --model DeepSeek-V3 --layers 4 --experts 16 --stream

                     checkpoint  recording  golden   peak RSS  replay  peak RSS  read+forward  replay/   recording/
                     (bf16)      (after imports)                               (bf16)        read+fwd  read+fwd+write
    Qwen3-30B-A3B x2 3.74 GB     19.1 s     0.20 GB   9.48 GB  10.8 s   5.59 GB  3.8 + 3.6 s   x1.46 ok  x1.25 ok
    Qwen3-30B-A3B x4 6.23 GB     30.2 s     0.24 GB  14.47 GB  12.9 s   5.65 GB  6.9 + 4.2 s   x1.16 ok  x1.69 ok
    Mixtral-8x7B x2  6.33 GB     28.4 s     0.13 GB  19.20 GB  14.3 s   9.27 GB  5.8 + 4.5 s   x1.38 ok  x1.22 ok
    DeepSeek-V3 x4   9.08 GB     38.2 s     0.40 GB  17.23 GB  25.3 s  10.70 GB  5.5 + 10.5 s  x1.59 MISS x1.15 ok
      (DeepSeek-V3: 16 of 256 routed experts, --stream; layers 0-2 dense; the replays: every point passed)

Per layer (replay items): Qwen3 x2 3.3, 0.8 s; Qwen3 x4 2.5, 1.1, 1.3, 1.1 s (last/first x0.43, the middle
layers x1.16: PASS); Mixtral 6.1, 3.4 s (x0.56); DeepSeek dense 3.5-4.1 s (x0.87, middle x1.03), MoE 4.8 s.
At the real depth: Qwen3-30B-A3B 48 layers, recording ~3.4 min (x1.34 read + forward + write), golden
~1.09 GB, replay ~1.1 min (x0.68), peak RSS ~5.65 GB whatever the depth; Mixtral-8x7B 32 layers ~6.6 min,
~1.27 GB, ~2.6 min (x1.24), ~9.3 GB; DeepSeek-V3 61 layers at 16 experts ~8.5 min, ~4.59 GB, ~5.0 min
(x1.51), ~10.7 GB. The replay's peak is the process, the model-level weights, two decoder layers and two
layers of captures (max_layers 2, one read ahead); a recording in memory holds every weight in float32
(122 GB for Qwen3-30B-A3B): at the real depth, --stream (two layers: DeepSeek's 17.2 GB above). DeepSeek
at its 256 experts, 4 layers, is refused: "needs 120.0 GB of RAM (the recording: every weight in float32;
its largest layer is 23.0 GB in bf16) and 31.2 GB of disk; this host has 22.2 GB available (MemAvailable)".

Where the time goes (--breakdown): the isolated points run each layer's parts again (the MoE block its
router and experts, the layer's output its attention and MLP), so their forwards alone are x1.0 (Qwen3,
whose lazy reads cost 4x its forward) to x1.57 (DeepSeek, compute-bound: MLA with 128 heads) one forward;
beside them a fixed 6-9 s: the embedding's read (nothing to hide it behind; 3.3 s for DeepSeek's 1.85 GB),
the first layer's wait for its read, backend start (2.1 s), the logits' judging (1.3-1.6 s at a 129-152k
vocabulary; 0.7 s since it takes one exponential of each matrix) and pytest (1 s). DeepSeek's MISS is the
first part: above the goal before any read, at 16 experts. Its real 256 read 12x more a MoE layer and
compute the same top-8: with --experts, a last line projects the real depth at the real experts, each MoE
layer's read grown with its weights and its forward as measured. Checked from 16 to 32 experts (4 layers,
--stream, bf16 recording for 32): a MoE layer's read 1.10 -> 1.83 s (its weights x1.75), its forward
1.58 -> 1.71 s (+8 ms an expert: fewer tokens an expert, the same weights streamed), its replay items
4.4 -> 5.2 s (the read alone predicts 5.1 s); replay / (read + forward) at 61 layers x1.62 -> x1.47, and
at 256 experts x1.12 (the forward's growth added three times, as the replay runs the experts three
times: ~x1.3). Reads
through transformers' conversion cost 3-6x a raw read in bf16, 10x into float32 (Qwen3: 6.23 GB in 6.9 and
11.9 s vs 1.2 s): the experts are stacked, then gate and up concatenated, then cast (two or three copies
of each layer); they are most of a recording's time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_replay import TIMED
from bench_replay import run_child as child

GB = 1e9
MARKER = "bench_real_shapes.json"  # written last into a built checkpoint: what it holds (for --keep)
BASE_BYTES = int(0.6 * GB)  # a process that imported torch, transformers and pytest (measured 0.35-0.5 GB)
SLACK_BYTES = int(0.5 * GB)  # the judge's and the allocator's temporaries beyond the estimate's activations
# A unit read with transformers' conversion holds its mapped bf16 pages and the experts stacked, then
# concatenated (gate and up), then cast: measured above the weights kept, in x the layer's bf16 bytes,
# 1.4 (Qwen3-30B-A3B) and 2.2 (Mixtral-8x7B) into float32, 1.3 and 0.9 into bf16 (the replay).
CONVERSION = {4: 2.5, 2: 1.5}
GOAL_REPLAY, GOAL_FLAT, GOAL_SPREAD, GOAL_RECORD = 1.5, 1.25, 1.5, 2.0


@dataclass(frozen=True)
class Real:
    """A published model: its hub config.json (text part, quantization left out: the checkpoint is
    written in bf16, as a dequantized one is) and its depth."""

    name: str
    model_type: str
    depth: int
    experts_key: str
    config: dict[str, Any]


MODELS = {
    m.name.lower(): m
    for m in (
        Real("Qwen3-30B-A3B", "qwen3_moe", 48, "num_experts", {
            "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151645,
        }),
        Real("Mixtral-8x7B", "mixtral", 32, "num_local_experts", {
            "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.02,
            "bos_token_id": 1, "eos_token_id": 2,
        }),
        Real("DeepSeek-V3", "deepseek_v3", 61, "n_routed_experts", {
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "num_attention_heads": 128,
            "num_key_value_heads": 128, "vocab_size": 129280, "max_position_embeddings": 163840, "rope_theta": 10000,
            "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 0,
            "eos_token_id": 1,
        }),
    )
}  # fmt: skip


class Refused(SystemExit):
    """One line on stderr and exit 2: a usage error, or a shape this host cannot hold."""

    def __init__(self, line: str):
        print(line, file=sys.stderr)
        super().__init__(2)


def find_model(name: str) -> Real:
    real = MODELS.get(name.lower())
    if real is None:
        known = ", ".join(m.name for m in MODELS.values())
        raise Refused(f"unknown model {name!r}: the known ones are {known}")
    return real


# -- the shapes -----------------------------------------------------------------------------------
def config_dict(real: Real, layers: int, experts: int | None = None) -> dict[str, Any]:
    """The real config at `layers` depth, with `experts` routed experts (checked: the routing must be
    able to pick its top-k, and DeepSeek's group routing needs at least two experts a group)."""
    if layers < 1:
        raise Refused(f"--layers {layers}: at least one layer")
    cfg = {**real.config, "num_hidden_layers": layers}
    if experts is not None:
        top_k, groups = cfg["num_experts_per_tok"], cfg.get("n_group", 1)
        per_group = experts // groups
        grouped = groups > 1 and (per_group < 2 or cfg["topk_group"] * per_group < top_k)
        if experts < top_k or experts % groups or grouped:
            need = (
                f"a multiple of its {groups} groups, >= 2 a group and >= {top_k} in its top {cfg['topk_group']} groups"
                if groups > 1
                else f">= {top_k}"
            )
            raise Refused(f"--experts {experts}: {real.name} routes top-{top_k}, so its experts must be {need}")
        cfg[real.experts_key] = experts
    return cfg


def make_config(real: Real, layers: int, experts: int | None = None):
    from transformers import AutoConfig

    config = AutoConfig.for_model(real.model_type, **config_dict(real, layers, experts))
    config.dtype = "bfloat16"  # what config.json says, as the hub's do
    return config


def is_dense(cfg: dict[str, Any], layer: int) -> bool:
    """A layer with a dense MLP instead of experts (DeepSeek's first_k_dense_replace, Qwen's
    mlp_only_layers and decoder_sparse_step)."""
    if layer < cfg.get("first_k_dense_replace", 0) or layer in cfg.get("mlp_only_layers", []):
        return True
    step = cfg.get("decoder_sparse_step", 1)
    return step > 1 and (layer + 1) % step != 0


def layer_params(model_type: str, cfg: dict[str, Any], layer: int) -> int:
    """A decoder layer's parameters counted from the config alone (the published architectures'
    formulas, independent of transformers' modules: the check of the shapes the builder writes)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    n = 2 * h  # input and post-attention norms
    if "kv_lora_rank" in cfg:  # multi-head latent attention
        qr, kvr, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        qk, v = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
        n += (h * qr + qr + qr * heads * qk) if qr else h * heads * qk
        n += h * (kvr + rope) + kvr + kvr * heads * (cfg["qk_nope_head_dim"] + v) + heads * v * h
    else:
        hd, kv = cfg.get("head_dim") or h // heads, cfg["num_key_value_heads"]
        n += h * heads * hd + 2 * h * kv * hd + heads * hd * h
        n += 2 * hd if model_type == "qwen3_moe" else 0  # Qwen3's per-head q and k norms
    if is_dense(cfg, layer):
        return n + 3 * h * cfg["intermediate_size"]
    experts = next(cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in cfg)
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    n += experts * 3 * h * inter + experts * h  # the experts and the router
    n += cfg.get("n_shared_experts", 0) * 3 * h * inter  # DeepSeek's shared expert (one MLP)
    if model_type == "deepseek_v3":
        n += experts  # the router's score-correction bias (a buffer, in the checkpoint)
    return n


def model_level_params(cfg: dict[str, Any]) -> int:
    """The embedding, the final norm and an untied lm_head."""
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    return v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def unit_of(key: str) -> int | str:
    """The decoder layer a checkpoint key belongs to, or the key's module (model-level)."""
    m = _LAYER.search(key)
    return int(m.group(1)) if m else key.rsplit(".", 1)[0]


def _forward_order(key: str) -> tuple:
    unit = unit_of(key)
    if isinstance(unit, int):
        return (1, unit, key)
    return (0 if "embed" in key else 3 if "lm_head" in key else 2, 0, key)


def hub_shapes(config) -> list[tuple[str, tuple[int, ...], Any]]:
    """(key, shape, dtype) of every tensor of the checkpoint in the hub's layout (per-expert tensors:
    transformers' save conversion reverted on a meta-device model), in forward order. Nothing is
    allocated: the whole of DeepSeek-V3's 61 layers would do."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from pytest_moe_parity.session import quiet_transformers

    quiet_transformers()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hub = revert_weight_conversion(model, dict(model.state_dict()))
    return sorted(((k, tuple(t.shape), t.dtype) for k, t in hub.items()), key=lambda s: _forward_order(s[0]))


def unit_table(shapes: list[tuple[str, tuple[int, ...], Any]]) -> tuple[dict[int | str, int], dict[int | str, int]]:
    """Parameters and bytes per unit (decoder layer number or model-level module)."""
    params: dict[int | str, int] = {}
    size: dict[int | str, int] = {}
    for key, shape, dtype in shapes:
        unit, n = unit_of(key), math.prod(shape)
        params[unit] = params.get(unit, 0) + n
        size[unit] = size.get(unit, 0) + n * dtype.itemsize
    return params, size


# -- what the host must hold ------------------------------------------------------------------------
@dataclass
class Needs:
    ram: int
    ram_step: str  # the step that holds the most, in words
    disk: int
    steps: dict[str, int]  # RAM per step: build, record, reference, replay


def plan_shards(shapes: list[tuple[str, tuple[int, ...], Any]], limit: int) -> list[list[tuple]]:
    """Consecutive tensors (forward order) up to `limit` bytes a shard; a larger tensor alone."""
    shards: list[list[tuple]] = [[]]
    held = 0
    for s in shapes:
        n = math.prod(s[1]) * s[2].itemsize
        if shards[-1] and held + n > limit:
            shards.append([])
            held = 0
        shards[-1].append(s)
        held += n
    return shards


def estimate_needs(
    config, shapes, tokens: int, record_size: int, stream: bool, shard_limit: int, built: bool, cuda: bool
) -> Needs:
    """The most RAM one step holds and the disk the run writes, from the shapes and the project's own
    capture and activation estimates (`moe-parity estimate`'s): the recording holds every weight in its
    dtype (`--stream`: the model-level ones and two layers) plus the unit being converted and two
    layers of captures; the reference the model-level weights and the layer being read; the replay the
    model-level weights, two layers, the one being read and two layers of captures, in bf16; the build
    a shard (and safetensors' serialisation of it). Checked against the measured peaks: above them."""
    from pytest_moe_parity.record.audit import Shape

    cfg = config.to_dict()
    shape = Shape.from_config(cfg)
    _, size = unit_table(shapes)
    layers = sorted((b for u, b in size.items() if isinstance(u, int)), reverse=True)
    model_level = sum(b for u, b in size.items() if not isinstance(u, int))
    top2, largest = sum(layers[:2]), layers[0]
    scale = record_size / 2  # the checkpoint is bf16
    captures, model_caps = shape.capture(tokens), shape.model_level_capture(tokens)
    act = shape.activations(tokens, record_size) + 3 * tokens * shape.vocab * 4 + SLACK_BYTES
    held = top2 if stream else sum(layers)
    shard = max(sum(math.prod(s[1]) * s[2].itemsize for s in sh) for sh in plan_shards(shapes, shard_limit))
    flight, flight_bf16 = int(CONVERSION[record_size] * largest), int(CONVERSION[2] * largest)  # a unit being read
    steps = {
        "build": BASE_BYTES + 2 * shard,
        "record": BASE_BYTES + int(scale * (model_level + held)) + flight + 2 * captures + model_caps + act,
        "reference": BASE_BYTES + int(scale * (model_level + largest)) + flight + act,
        "replay": BASE_BYTES + model_level + top2 + flight_bf16 + 2 * captures + model_caps + act,
    }
    dtype_name = "bf16" if scale == 1 else "float32"
    words = {
        "build": "the build: one shard",
        "record": f"the recording: {'two layers' if stream else 'every weight'} in {dtype_name}",
        "reference": "the reference forward: one layer",
        "replay": "the replay: two layers in bf16",
    }
    step = max(steps, key=lambda k: steps[k])
    golden = model_caps + captures * len(layers)
    checkpoint = 0 if built else sum(size.values())
    disk = checkpoint + golden * (3 if cuda else 2)  # the golden, the write of its bytes (and the CUDA golden)
    return Needs(steps[step], words[step], disk, steps)


def available(root: Path) -> tuple[int, int]:
    """(MemAvailable of /proc/meminfo, free bytes on the filesystem of `root`)."""
    with open("/proc/meminfo") as fh:
        mem = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    probe = root
    while not probe.exists():
        probe = probe.parent
    return mem, shutil.disk_usage(probe).free


def check_fits(label: str, needs: Needs, root: Path, largest_layer: int) -> tuple[int, int]:
    """Refuse, in one line and before anything is built, a run this host cannot hold."""
    mem, free = available(root)
    if needs.ram <= mem and needs.disk <= free:
        return mem, free
    raise Refused(
        f"refused: {label} needs {needs.ram / GB:.1f} GB of RAM ({needs.ram_step}; its largest layer is "
        f"{largest_layer / GB:.1f} GB in bf16) and {needs.disk / GB:.1f} GB of disk; this host has "
        f"{mem / GB:.1f} GB available (MemAvailable) and {free / GB:.1f} GB free under {root} "
        "(--experts N scales the routed experts down, --layers fewer, --stream holds two layers)"
    )


# -- the checkpoint ---------------------------------------------------------------------------------
def fill(key: str, shape: tuple[int, ...], dtype, seed: int, std: float):
    """One tensor's random values, the same for the same key and seed whatever the order or sharding."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    t = torch.empty(shape, dtype=dtype)
    if len(shape) >= 2:
        return t.normal_(0.0, std, generator=gen)
    if "norm" in key:
        return t.normal_(1.0, 0.1, generator=gen)
    return t.normal_(0.0, 0.05, generator=gen)  # biases, DeepSeek's score-correction bias


def write_checkpoint(config, shapes, out: Path, seed: int, shard_limit: int, what: dict[str, Any]) -> Path:
    """The checkpoint in the hub's layout: config.json, `model-0000k-of-0000n.safetensors` shards of
    up to `shard_limit` bytes, `model.safetensors.index.json`; a shard at a time in memory. Reused
    when `out` already holds what `what` describes."""
    from safetensors.torch import save_file

    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == what:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config.save_pretrained(out)
    std = float(getattr(config, "initializer_range", 0.02))
    shards = plan_shards(shapes, shard_limit)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: fill(key, shape, dtype, seed, std) for key, shape, dtype in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    marker.write_text(json.dumps(what))
    return out


# -- the measurements, each in a fresh process ------------------------------------------------------
RSS = """
import json, sys, time
def rss(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":")) * 1024
def cuda_peak():
    import torch
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
"""

RECORD_CHILD = (
    RSS
    + """
import torch, transformers
from pytest_moe_parity.cli import main
import pytest_moe_parity.record.run
baseline, t1 = rss("VmRSS"), time.perf_counter()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "baseline": baseline, "peak": rss("VmHWM"), "after_imports_s": time.perf_counter() - t1,
                  "cuda_peak": cuda_peak()}))
"""
)

PYTEST_CHILD = (
    RSS
    + """
import pytest, torch, transformers
baseline, t1 = rss("VmRSS"), time.perf_counter()
code = int(pytest.main(sys.argv[1:]))
print(json.dumps({"code": 0 if code == 1 else code, "failures": code == 1, "baseline": baseline, "peak": rss("VmHWM"),
                  "after_imports_s": time.perf_counter() - t1, "cuda_peak": cuda_peak()}))
"""
)

REFERENCE_CHILD = (
    RSS
    + """
import torch, transformers
from pytest_moe_parity.model.lazy_model import LazyModel
from pytest_moe_parity.session import quiet_transformers
quiet_transformers()
model_dir, dtype, device, ids = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
baseline, t1 = rss("VmRSS"), time.perf_counter()
lazy = LazyModel(model_dir, dtype=dtype, device=device, max_layers=1, fit_threads=False)
read, ensure, per_layer = [0.0], lazy.ensure, {}
def timed(unit):  # a unit's read and conversion, and the eviction that makes room for it
    start = time.perf_counter()
    try:
        return ensure(unit)
    finally:
        took = time.perf_counter() - start
        read[0] += took
        if isinstance(unit, int):
            per_layer.setdefault(unit, [0.0, 0.0])[0] += took
lazy.ensure = timed
with torch.no_grad(), lazy.streaming() as model:
    for i, layer in enumerate(model.get_submodule(lazy._layers_path)):  # after streaming's own hook: its read
        layer.register_forward_pre_hook(lambda m, a, i=i: per_layer.setdefault(i, [0.0, 0.0]).__setitem__(
            1, -time.perf_counter()))
        layer.register_forward_hook(lambda m, a, o, i=i: per_layer[i].__setitem__(1, per_layer[i][1]
                                                                                   + time.perf_counter()))
    model(input_ids=torch.tensor(ids, device=device), use_cache=False)
if device.startswith("cuda"):
    torch.cuda.synchronize()
wall = time.perf_counter() - t1
print(json.dumps({"code": 0, "baseline": baseline, "peak": rss("VmHWM"), "after_imports_s": wall, "read_s": read[0],
                  "forward_s": wall - read[0], "per_layer": per_layer, "cuda_peak": cuda_peak()}))
"""
)

READ_CHILD = (
    RSS
    + """
from pathlib import Path
from safetensors import safe_open
root, t1, total = Path(sys.argv[1]), time.perf_counter(), 0
index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
for file in sorted(set(index.values())):
    with safe_open(str(root / file), framework="pt") as fh:
        for key in fh.keys():
            t = fh.get_tensor(key)
            total += t.numel() * t.element_size()
            del t
print(json.dumps({"code": 0, "bytes": total, "read_s": time.perf_counter() - t1, "peak": rss("VmHWM")}))
"""
)


BREAKDOWN_CHILD = (
    TIMED
    + """
judged = {}
timed(TorchBackend, "start", "backend start")
timed(TorchBackend, "run", "forwards and read waits")
timed(ParityRunner, "judge", "judging")
timed(GoldenStore, "load", "golden reads")
judge = ParityRunner.judge
def per_point(self, prepared, marker=None):
    start = time.perf_counter()
    try:
        return judge(self, prepared, marker)
    finally:
        judged[prepared.point.id] = time.perf_counter() - start
ParityRunner.judge = per_point
wall = time.perf_counter()
code = int(pytest.main(sys.argv[1:]))
wall = time.perf_counter() - wall
spent["pytest, the plugin and the rest"] = wall - sum(spent.values())
top = sorted(judged.items(), key=lambda kv: -kv[1])[:3]
print(json.dumps({"code": 0 if code == 1 else code, "after_imports_s": wall, "parts": spent, "judged": top}))
"""
)


_PROGRESS = re.compile(r"^\s+layer_(\d+): \d+ points, [\d.]+ MB \[\d+/\d+ layers, [\d.]+ MB written, ([\d.]+)s\]")


def record(model_dir: Path, golden: Path, tokens: int, dtype: str, *extra: str) -> dict:
    """One recording in a fresh process: its figures, the manifest's stats, each layer's interval and
    the golden's files."""
    argv = ["golden", "--model", str(model_dir), "--out", str(golden), "--seq-len", str(tokens), "--dtype", dtype,
            "--overwrite", *extra]  # fmt: skip
    out, stdout = child(RECORD_CHILD, *argv)
    stats = json.loads((golden / "manifest.json").read_text())["stats"]
    done = {int(m.group(1)): float(m.group(2)) for m in map(_PROGRESS.match, stdout.splitlines()) if m}
    previous, per_layer = stats["load_seconds"], {}
    for layer in sorted(done):  # each layer's interval: its forward, captures and write (its read too, in memory)
        per_layer[layer], previous = done[layer] - previous, done[layer]
    files = {p.name: p.stat().st_size for p in golden.glob("*.safetensors")}
    return {**out, "stats": stats, "per_layer": per_layer, "files": files, "bytes": sum(files.values())}


def replay(golden: Path, root: Path, hw: str, name: str) -> dict:
    """One replay over every point in a fresh process, with its report and JUnit times."""
    report, junit = root / f"report-{name}", root / f"junit-{name}.xml"
    argv = ["--golden-dir", str(golden), "--hw", hw, "--dtype", "bfloat16", "--parity-report", str(report),
            "--junitxml", str(junit), "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
            "--rootdir", str(root)]  # fmt: skip
    out, _ = child(PYTEST_CHILD, *argv, cwd=root)  # cwd: never the repository's own tests
    data = json.loads((report / "comparison_report.json").read_text())
    summary = json.loads((report / "comparison_summary.json").read_text())
    items = {tc.get("name"): float(tc.get("time", 0)) for tc in ET.parse(junit).getroot().iter("testcase")}
    return {**out, "rows": data["points"], "report_wall_s": data.get("wall_seconds"), "items": items,
            "summary": summary}  # fmt: skip


def write_bytes(root: Path, sizes: list[int]) -> float:
    """Seconds to write files of these sizes (the golden's), as the recorder does: no fsync."""
    chunk = bytes(os.urandom(1 << 20)) * 64
    target = root / "write-test"
    target.mkdir(exist_ok=True)
    start = time.perf_counter()
    for i, n in enumerate(sizes):
        with open(target / f"f{i}", "wb") as fh:
            while n > 0:
                fh.write(chunk[: min(n, len(chunk))])
                n -= len(chunk)
    seconds = time.perf_counter() - start
    shutil.rmtree(target)
    return seconds


# -- the figures ------------------------------------------------------------------------------------
def layer_kind(cfg: dict[str, Any], layer: int) -> str:
    return "dense" if is_dense(cfg, layer) else "MoE"


def by_layer(rows: list[dict], items: dict[str, float]) -> dict[int, dict[str, float]]:
    """Each decoder layer's forward seconds (the rows') and item seconds (JUnit: reads and judging too)."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        if row.get("layer") is None or row.get("step") is not None:
            continue
        entry = out.setdefault(row["layer"], {"forward": 0.0, "item": 0.0, "points": 0})
        entry["forward"] += float(row.get("seconds") or 0.0)
        entry["item"] += items.get(row["id"], 0.0)
        entry["points"] += 1
    return out


def by_kind(rows: list[dict], items: dict[str, float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        entry = out.setdefault(row.get("component") or row["id"], {"forward": 0.0, "item": 0.0, "points": 0})
        entry["forward"] += float(row.get("seconds") or 0.0)
        entry["item"] += items.get(row["id"], 0.0)
        entry["points"] += 1
    return out


def flatness(cfg: dict[str, Any], layers: dict[int, dict[str, float]], key: str = "item") -> list[tuple]:
    """Per kind of layer with two or more of them: (kind, first, last, last/first, max/min over them all,
    max/min over the middle layers or None for fewer than two). The model's first decoder layer waits
    for its own read (only the embedding runs before it), the last has no layer to read while it runs
    (only the lm_head): the middle layers, each read while the one before runs, are what a deeper
    model repeats."""
    out = []
    for kind in ("dense", "MoE"):
        ids = [i for i in sorted(layers) if layer_kind(cfg, i) == kind]
        times = [layers[i][key] for i in ids]
        middle = [layers[i][key] for i in ids if min(layers) < i < max(layers)]
        if len(times) >= 2:
            steady = max(middle) / min(middle) if len(middle) >= 2 else None
            out.append((kind, times[0], times[-1], times[-1] / times[0], max(times) / min(times), steady))
    return out


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def typical(cfg: dict[str, Any], measured: dict[int, list[float]], kind: str) -> list[float] | None:
    """The mean figures of the built layers of a kind (the middle ones where there are), or None."""
    built = sorted(measured)
    same = [j for j in built if layer_kind(cfg, j) == kind]
    middle = [j for j in same if built[0] < j < built[-1]] or same
    if not middle:
        return None
    return [sum(measured[j][k] for j in middle) / len(middle) for k in range(len(measured[middle[0]]))]


def deeper(cfg: dict[str, Any], depth: int, measured: dict[int, float], total: float) -> float | None:
    """`total` (seconds or bytes of a run over the built layers) with the real model's further layers
    added, each at the mean of the built layers of its kind (the middle ones where there are: the
    first and the last carry fixed costs); None where a kind the real model has was not built."""
    built = sorted(measured)
    out = total
    for i in range(len(built), depth):
        same = [j for j in built if layer_kind(cfg, j) == layer_kind(cfg, i)]
        if not same:
            return None
        middle = [j for j in same if built[0] < j < built[-1]] or same
        out += sum(measured[j] for j in middle) / len(middle)
    return out


def at_real_experts(real: Real, cfg: dict[str, Any], ref: dict, peak: float, replay: float, base: float) -> str:
    """The real depth at the real number of routed experts, from a run scaled down by --experts (a
    model, said as one): each MoE layer's read grows with its weights, its forward does not (top-k of
    any number of experts, the same tokens), and replay and reference both read each layer once, so
    both gain the same seconds per MoE layer; the replay's peak gains two MoE layers' growth in bf16."""
    full = config_dict(real, real.depth, None)
    moe = next(i for i in range(cfg["num_hidden_layers"]) if not is_dense(cfg, i))
    grow = layer_params(real.model_type, full, moe) / layer_params(real.model_type, cfg, moe)
    read = typical(cfg, {int(i): t for i, t in ref["per_layer"].items()}, "MoE")[0]  # a MoE layer's bf16 read
    layers = sum(not is_dense(full, i) for i in range(real.depth))
    more = layers * read * (grow - 1)
    held = 2 * 2 * (layer_params(real.model_type, full, moe) - layer_params(real.model_type, cfg, moe))
    return (
        f"at the real depth with its {full[real.experts_key]} routed experts (projected, not measured: a MoE "
        f"layer's read x{grow:.1f}, {read:.2f} -> {read * grow:.1f} s, its forward as measured): replay "
        f"~{(replay + more) / 60:.1f} min against one read + forward ~{(base + more) / 60:.1f} min, "
        f"x{(replay + more) / (base + more):.2f} (goal <= {GOAL_REPLAY}); peak RSS ~{gb(peak + held)}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-30B-A3B", help=f"one of {', '.join(m.name for m in MODELS.values())}")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers to build (2-4 keeps it to minutes)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens of the golden (default 256)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the model's)")
    ap.add_argument("--stream", action="store_true", help="record with --stream (two layers held)")
    ap.add_argument("--record-dtype", default="float32", choices=("float32", "bfloat16"), help="the golden's dtype")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the measurements, interleaved (minimum kept)")
    ap.add_argument("--breakdown", action="store_true", help="then time the parts of one more replay (in-process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=float, default=2.0, help="GB per checkpoint shard (default 2)")
    ap.add_argument("--keep", type=Path, default=None, help="build (and reuse) the checkpoint, golden, reports here")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA runs even where a GPU is")
    return ap.parse_args(argv)


@dataclass
class Plan:
    """What one invocation builds and measures, checked against the host before anything is built."""

    real: Real
    config: Any
    cfg: dict[str, Any]  # the hub's names (transformers renames some: Qwen3's num_experts)
    shapes: list[tuple[str, tuple[int, ...], Any]]
    params: dict[int | str, int]
    size: dict[int | str, int]
    label: str
    what: dict[str, Any]
    built: bool
    cuda: bool
    needs: Needs
    mem: int
    free: int

    @property
    def layer_bytes(self) -> dict[int, int]:
        return {u: b for u, b in self.size.items() if isinstance(u, int)}

    @property
    def model_level(self) -> int:
        return sum(b for u, b in self.size.items() if not isinstance(u, int))


def plan(args: argparse.Namespace) -> Plan:
    """The shapes, and the refusal of a run this host cannot hold (before anything is built)."""
    real = find_model(args.model)
    config = make_config(real, args.layers, args.experts)
    cfg = config_dict(real, args.layers, args.experts)
    shapes = hub_shapes(config)
    params, size = unit_table(shapes)
    what = {"model": real.name, "layers": args.layers, "experts": args.experts, "seed": args.seed,
            "shard_size": args.shard_size}  # fmt: skip
    scaled = "" if args.experts is None else ", scaled down by --experts"
    label = f"{real.name} at {args.layers} layers ({cfg[real.experts_key]} routed experts{scaled})"
    marker = args.keep / "checkpoint" / MARKER if args.keep else None
    built = marker is not None and marker.is_file() and json.loads(marker.read_text()) == what
    import torch

    cuda = torch.cuda.is_available() and not args.no_cuda
    record_size = 4 if args.record_dtype == "float32" else 2
    shard_limit = int(args.shard_size * GB)
    needs = estimate_needs(config, shapes, args.seq_len, record_size, args.stream, shard_limit, built, cuda)
    layer_bytes = [b for u, b in size.items() if isinstance(u, int)]
    mem, free = check_fits(label, needs, args.keep or Path(tempfile.gettempdir()), max(layer_bytes))
    return Plan(real, config, cfg, shapes, params, size, label, what, built, cuda, needs, mem, free)


def describe(args: argparse.Namespace, p: Plan) -> None:
    real, cfg = p.real, p.cfg
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    print(f"{p.label}, {args.seq_len} tokens, seed {args.seed}, OMP_NUM_THREADS={threads}")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2 and threads != "1":
        print(f"  note: this host is busy (load {load:.1f} on {cores} cores): two OpenMP threads on taken cores stall "
              "for up to seconds at a time (bf16 index_add_ of the eager experts), the replay's forwards mostly run "
              "on one (a layer is read beside them) and the reference's on two; OMP_NUM_THREADS=1 keeps the ratios "
              "steady")  # fmt: skip
    if args.experts is not None:
        print(f"  SCALED DOWN: {args.experts} of the real model's {real.config[real.experts_key]} routed experts per "
              "MoE layer (every other shape as published): its MoE layers' weights and reads shrink, the compute "
              "per token (top-k) does not")  # fmt: skip
    for kind in sorted({layer_kind(cfg, i) for i in p.layer_bytes}):
        layer = next(i for i in sorted(p.layer_bytes) if layer_kind(cfg, i) == kind)
        print(f"  a {kind} layer: {p.params[layer] / 1e6:,.0f} M parameters, {gb(p.layer_bytes[layer])} in bf16")
    full = config_dict(real, real.depth)
    real_params = model_level_params(full) + sum(layer_params(real.model_type, full, i) for i in range(real.depth))
    print(f"  model-level (embedding, final norm, lm_head): {gb(p.model_level)}; checkpoint {gb(sum(p.size.values()))}"
          f"; the real model: {real.depth} layers, {real_params / 1e9:.1f} B parameters, {gb(2 * real_params)} in "
          "bf16")  # fmt: skip
    print(f"  host: needs about {gb(p.needs.ram)} of RAM (most in {p.needs.ram_step}) and {gb(p.needs.disk)} of "
          f"disk; {gb(p.mem)} available, {gb(p.free)} free")  # fmt: skip


def fastest(samples: list[dict], key: str = "after_imports_s") -> dict:
    return min(samples, key=lambda s: s[key])


def measure(args: argparse.Namespace, p: Plan, root: Path) -> dict[str, Any]:
    """Build, then `--repeat` rounds of every measurement, interleaved (this host's speed drifts by tens
    of percent over minutes: a block of runs of one kind would carry the drift into a ratio)."""
    started = time.perf_counter()
    model_dir = write_checkpoint(p.config, p.shapes, root / "checkpoint", args.seed, int(args.shard_size * GB), p.what)
    shards = len(list(model_dir.glob("*.safetensors")))
    print(f"checkpoint: {shards} shards in {model_dir} ({'reused' if p.built else 'built'} in "
          f"{time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    extra = ("--stream",) if args.stream else ()
    golden = root / "golden"
    runs: dict[str, list] = {k: [] for k in ("record", "write", "ref_bf16", "ref_rec", "raw", "replay")}
    for n in range(args.repeat):
        runs["record"].append(record(model_dir, golden, args.seq_len, args.record_dtype, *extra))
        runs["write"].append({"after_imports_s": write_bytes(root, list(runs["record"][-1]["files"].values()))})
        ids = json.dumps(json.loads((golden / "manifest.json").read_text())["inputs"]["input_ids"])
        runs["ref_bf16"].append(child(REFERENCE_CHILD, str(model_dir), "bfloat16", "cpu", ids)[0])
        if args.record_dtype != "bfloat16":
            runs["ref_rec"].append(child(REFERENCE_CHILD, str(model_dir), args.record_dtype, "cpu", ids)[0])
        runs["raw"].append(child(READ_CHILD, str(model_dir))[0])
        runs["replay"].append(replay(golden, root, "cpu", f"cpu-{n}"))
        print(f"  round {n + 1}/{args.repeat}: recording {runs['record'][-1]['after_imports_s']:.1f} s, replay "
              f"{runs['replay'][-1]['after_imports_s']:.1f} s, reference (bf16) "
              f"{runs['ref_bf16'][-1]['after_imports_s']:.1f} s", flush=True)  # fmt: skip
    out: dict[str, Any] = {k: fastest(v, "read_s" if k == "raw" else "after_imports_s") for k, v in runs.items() if v}
    out["ref_rec"] = out.get("ref_rec", out["ref_bf16"])
    out["rounds"] = runs
    if args.breakdown:
        argv = ["--golden-dir", str(golden), "--hw", "cpu", "--dtype", "bfloat16", "-p", "no:cacheprovider",
                "-p", "no:xdist", "-q", "--rootdir", str(root)]  # fmt: skip
        out["breakdown"] = child(BREAKDOWN_CHILD, *argv, cwd=root)[0]
    if p.cuda:
        g_cuda = root / "golden-cuda"
        out["cuda_record"] = record(model_dir, g_cuda, args.seq_len, args.record_dtype, "--device", "cuda", *extra)
        shutil.rmtree(g_cuda, ignore_errors=True)
        out["cuda_replay"] = replay(golden, root, "cuda", "cuda")
    out["total_s"] = time.perf_counter() - started
    return out


def show(args: argparse.Namespace, p: Plan, m: dict[str, Any]) -> None:
    """The figures, the goals with PASS/MISS, and the real depth."""
    rec, rep, ref_bf16, ref_rec, raw = m["record"], m["replay"], m["ref_bf16"], m["ref_rec"], m["raw"]
    write_s, cfg, real = m["write"]["after_imports_s"], p.cfg, p.real
    stats = rec["stats"]
    print(f"\nrecording (moe-parity golden --seq-len {args.seq_len} --dtype {args.record_dtype}"
          f"{' --stream' if args.stream else ''}): wall {rec['wall_s']:.1f} s (after imports "
          f"{rec['after_imports_s']:.1f} s: load {stats['load_seconds']:.1f} s, forward, reads and captures "
          f"{stats['record_seconds']:.1f} s), golden {gb(rec['bytes'])} in {len(rec['files'])} files, peak RSS "
          f"{gb(rec['peak'])} (process {gb(rec['baseline'])}, host weights {gb(stats['host_weight_bytes'])}; "
          f"estimated {gb(p.needs.steps['record'])})")  # fmt: skip
    print("  per layer: " + ", ".join(f"layer_{i} {s:.1f} s" for i, s in sorted(rec["per_layer"].items())))
    line = (f"reference (one forward, the lazy path, one layer held): bf16 read {ref_bf16['read_s']:.1f} s + forward "
            f"{ref_bf16['forward_s']:.1f} s, peak RSS {gb(ref_bf16['peak'])}")  # fmt: skip
    if ref_rec is not ref_bf16:
        line += (f"; {args.record_dtype} read {ref_rec['read_s']:.1f} s + forward {ref_rec['forward_s']:.1f} s, "
                 f"peak RSS {gb(ref_rec['peak'])} (estimated {gb(p.needs.steps['reference'])})")  # fmt: skip
    print(line)
    for kind in ("dense", "MoE"):
        per = {name: typical(cfg, {int(i): t for i, t in r["per_layer"].items()}, kind)
               for name, r in (("bf16", ref_bf16), (args.record_dtype, ref_rec))}  # fmt: skip
        if per["bf16"] is not None:
            print(f"  a {kind} layer of it: " + ", ".join(f"{name} read {t[0]:.2f} s + forward {t[1]:.2f} s"
                                                           for name, t in per.items()))  # fmt: skip
    print(f"one raw read of every tensor (safetensors, no conversion): {gb(raw['bytes'])} in {raw['read_s']:.1f} s; "
          f"one write of the golden's bytes: {write_s:.2f} s")  # fmt: skip
    counts = ", ".join(f"{rep['summary'].get(k)} {k}" for k in ("passed", "failed", "error"))
    forwards = sum(float(r.get("seconds") or 0.0) for r in rep["rows"])
    items = sum(rep["items"].values())
    print(f"replay (pytest --hw cpu --dtype bfloat16, {len(rep['rows'])} points: {counts}): wall {rep['wall_s']:.1f} s "
          f"(after imports {rep['after_imports_s']:.1f} s, the report's wall {rep['report_wall_s']:.1f} s, its items "
          f"{items:.1f} s, their forwards {forwards:.1f} s), peak RSS {gb(rep['peak'])} (process "
          f"{gb(rep['baseline'])}; estimated {gb(p.needs.steps['replay'])})")  # fmt: skip
    rounds = [by_layer(r["rows"], r["items"]) for r in m["rounds"]["replay"]]
    layers = {i: {k: min(r[i][k] for r in rounds) for k in rounds[0][i]} for i in rounds[0]}  # each the least
    least = "" if args.repeat == 1 else f", the least of {args.repeat} rounds"
    for i, t in sorted(layers.items()):
        print(f"  layer_{i:<3} {layer_kind(cfg, i):<5} items {t['item']:6.1f} s, forwards {t['forward']:6.1f} s "
              f"({int(t['points'])} points{least})")  # fmt: skip
    kinds = sorted(by_kind(rep["rows"], rep["items"]).items(), key=lambda kv: -kv[1]["item"])
    print("  per kind, items / forwards: " + ", ".join(f"{k} {v['item']:.1f}/{v['forward']:.1f} s" for k, v in kinds))
    beside = sorted(((rep["items"].get(r["id"], 0.0) - float(r.get("seconds") or 0.0), r["id"]) for r in rep["rows"]),
                    reverse=True)[:3]  # fmt: skip
    print("  most time beside a forward (reads waited for, judging): "
          + ", ".join(f"{pid} {s:.1f} s" for s, pid in beside))  # fmt: skip
    if "breakdown" in m:
        b = m["breakdown"]
        print(f"replay by part (one more run, in-process, after imports {b['after_imports_s']:.1f} s): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(b["parts"].items(), key=lambda kv: -kv[1]))
              + "; the longest judgings: " + ", ".join(f"{k} {v:.1f} s" for k, v in b["judged"]))  # fmt: skip
    for name in ("cuda_record", "cuda_replay"):
        if name in m:
            r = m[name]
            device = r.get("cuda_peak") or (r.get("stats") or {}).get("peak_memory_bytes")
            print(f"{name.replace('_', ' ')}: wall {r['wall_s']:.1f} s, peak RSS {gb(r['peak'])}, device memory peak "
                  f"{device if not isinstance(device, int | float) else gb(device)}")  # fmt: skip

    print(
        f"\ngoals (ratios of one run{'' if args.repeat == 1 else f', each figure the least of {args.repeat} rounds'}):"
    )
    base = ref_bf16["read_s"] + ref_bf16["forward_s"]
    ratio = rep["after_imports_s"] / base
    print(f"  replay / (one read + one forward, bf16) = {rep['after_imports_s']:.1f} / {base:.1f} s = x{ratio:.2f} "
          f"(goal <= {GOAL_REPLAY}): {verdict(ratio <= GOAL_REPLAY)}; its points' forwards alone are "
          f"x{forwards / ref_bf16['forward_s']:.2f} one forward")  # fmt: skip
    flat = flatness(cfg, layers)
    for kind, first, last, r, spread, after in flat:
        steady = (
            "no middle layer to judge it on (--layers 4 or more)"
            if after is None
            else f"the middle layers' x{after:.2f} (goal <= {GOAL_SPREAD}): {verdict(after <= GOAL_SPREAD)}"
        )
        print(f"  {kind} layers' items: last / first {last:.1f} / {first:.1f} s = x{r:.2f} (goal <= {GOAL_FLAT}): "
              f"{verdict(r <= GOAL_FLAT)}; spread max/min x{spread:.2f} over all of them (the first waits for its "
              f"own read, the last reads no layer beside it), {steady}")  # fmt: skip
    if not flat:
        print("  per-layer flatness: not measured (fewer than two layers of a kind)")
    denom = ref_rec["read_s"] + ref_rec["forward_s"] + write_s
    ratio = rec["after_imports_s"] / denom
    print(f"  recording / (one read + one forward, {args.record_dtype}, + one write of its bytes) = "
          f"{rec['after_imports_s']:.1f} / {denom:.1f} s = x{ratio:.2f} (goal <= {GOAL_RECORD}): "
          f"{verdict(ratio <= GOAL_RECORD)}")  # fmt: skip

    # The real depth: each further layer at the mean of the built ones of its kind.
    files = {int(n.split("_")[1].split(".")[0]): b for n, b in rec["files"].items() if n.startswith("layer_")}
    ref_layers = {key: {int(i): sum(t) for i, t in r["per_layer"].items()} for key, r in
                  (("bf16", ref_bf16), ("rec", ref_rec))}  # fmt: skip
    at = {
        "record": deeper(cfg, real.depth, rec["per_layer"], rec["after_imports_s"]),
        "ref_rec": deeper(cfg, real.depth, ref_layers["rec"], ref_rec["after_imports_s"]),
        "replay": deeper(cfg, real.depth, {i: t["item"] for i, t in layers.items()}, rep["after_imports_s"]),
        "ref_bf16": deeper(cfg, real.depth, ref_layers["bf16"], ref_bf16["after_imports_s"]),
        "golden": deeper(cfg, real.depth, files, rec["bytes"]),
    }
    if None in at.values():
        print(f"at the real depth, {real.depth} layers: not extrapolated (no layer of a kind the real model has: "
              f"--layers {real.config.get('first_k_dense_replace', 0) + 1} or more)")  # fmt: skip
    else:
        held = p.model_level + 2 * max(p.layer_bytes.values())
        full = config_dict(real, real.depth, args.experts)
        weights = model_level_params(full) + sum(layer_params(real.model_type, full, i) for i in range(real.depth))
        weights *= 4 if args.record_dtype == "float32" else 2
        scaled = " (with the scaled-down experts)" if args.experts else ""
        write = write_s * at["golden"] / rec["bytes"]
        memory = (f"the recording holds two layers (--stream): its peak RSS stays ~{gb(rec['peak'])}" if args.stream
                  else f"the recording in memory holds every weight ({gb(weights)} in {args.record_dtype}): at that "
                       "depth, record with --stream (two layers held)")  # fmt: skip
        print(f"at the real depth, {real.depth} layers{scaled}: recording ~{at['record'] / 60:.1f} min (x"
              f"{at['record'] / (at['ref_rec'] + write):.2f} one read + forward in {args.record_dtype} + write, "
              f"~{(at['ref_rec'] + write) / 60:.1f} min), golden ~{gb(at['golden'])}; replay ~{at['replay'] / 60:.1f} "
              f"min (x{at['replay'] / at['ref_bf16']:.2f} one read + forward in bf16, ~{at['ref_bf16'] / 60:.1f} min), "
              f"its peak RSS ~{gb(rep['peak'])} whatever the depth (bounded by the process, the model-level weights "
              f"and two decoder layers, {gb(held)} in bf16, and two layers of captures); {memory}")  # fmt: skip
        if args.experts is not None:
            print(at_real_experts(real, cfg, ref_bf16, rep["peak"], at["replay"], at["ref_bf16"]))
    print(f"(the whole benchmark: {m['total_s'] / 60:.1f} min)")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    p = plan(args)
    describe(args, p)
    kept = contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory()
    with kept as tmp:
        root = Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        show(args, p, measure(args, p, root))


if __name__ == "__main__":
    main()
