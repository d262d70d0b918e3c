"""Checks that need a CUDA GPU (CI has none): `--hw cuda` and `--hw compile` replays, a golden
recorded on the GPU, and an accelerate placement over GPU, host and disk read one unit at a time
against the same placement through `from_pretrained`; with `--quant`, the quantized paths a GPU has
(docs/quantization.md): an FP8 and an MXFP4 checkpoint recorded on the GPU, `--reference-quant native`
(transformers' fp8 / mxfp4 kernels, compute capability 8.9 for fp8) against the dequantized reference,
and `--hw cuda --hw-option quant=SPEC` judged against the golden's floor of SPEC.

    python benchmarks/gpu_check.py [--archs qwen3_moe,mixtral,minimax_m2] [--quant] [--out summary.json]

Run it from the repository root. On a bare GPU machine where the package cannot be installed (no
build backend, no index), `--register DIR` writes the package's entry points (the plugin and the
backends) as a dist-info into DIR, which the checks then find on PYTHONPATH. transformers' native fp8
and mxfp4 kernels come from the Hugging Face hub through the `kernels` package; on a machine that
cannot reach the hub, `--local-kernels DIR` (with `--register`) puts a stand-in `kernels` package in
DIR that imports a kernels-community kernel's sources from `DIR/<name>/torch-ext/<package>` (a checkout
of github.com/huggingface/kernels-community). The checks run `--jobs` at a time (each its own
processes on the one GPU). Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FROM_PRETRAINED = """
import sys
from pytest_moe_parity.record import run
run.reader = lambda *args, **kwargs: "from_pretrained"
from pytest_moe_parity.cli import main
sys.exit(main(sys.argv[1:]))
"""


SITE: list[str] = []


def register(site: Path) -> None:
    """The entry points of pyproject.toml as an installed distribution's, under `site`."""
    import tomllib

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    info = site / f"pytest_moe_parity-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = {**project.get("entry-points", {}), "console_scripts": project.get("scripts", {})}
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n" for g, items in groups.items())
    (info / "entry_points.txt").write_text(text)
    SITE.append(str(site))


LOCAL_KERNELS = '''"""A stand-in for the `kernels` package where the Hugging Face hub cannot be reached (written by
benchmarks/gpu_check.py --local-kernels): `get_kernel` imports a kernels-community kernel's Python sources
from MOE_PARITY_LOCAL_KERNELS; the layer mappings transformers registers are kept and never applied."""
import contextlib
import enum
import importlib
import os
import sys
import types
from pathlib import Path

import torch


class _Spec:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


CUDAProperties = ROCMProperties = Device = LayerRepository = LocalLayerRepository = _Spec


class Mode(enum.Flag):
    INFERENCE = 1
    TRAINING = 2
    TORCH_COMPILE = 4


class KernelizeFallback(enum.Enum):
    ALL = "all"
    NONE = "none"


def register_kernel_mapping(*args, **kwargs):
    pass


def replace_kernel_forward_from_hub(*args, **kwargs):
    pass


@contextlib.contextmanager
def use_kernel_mapping(*args, **kwargs):
    yield


def use_kernel_forward_from_hub(*args, **kwargs):
    return lambda cls: cls


def use_kernelized_func(*args, **kwargs):
    return lambda cls: cls


def kernelize(model, *args, **kwargs):
    raise RuntimeError("kernelize needs the hub: this is a local stand-in for the kernels package")


def get_kernel(repo_id, revision=None, version=None, **kwargs):
    name = repo_id.split("/")[-1]
    src = Path(os.environ["MOE_PARITY_LOCAL_KERNELS"]) / name / "torch-ext"
    if not src.is_dir():
        raise FileNotFoundError(f"{repo_id}: no local sources at {src}")
    package = name.replace("-", "_")
    # the `_ops` module the kernel builder generates: the kernel's torch.library namespace
    ops = types.ModuleType(f"{package}._ops")
    ops.ops = getattr(torch.ops, f"_{package}_local")
    ops.add_op_namespace_prefix = lambda op: f"_{package}_local::{op}"
    sys.modules[ops.__name__] = ops
    sys.path.insert(0, str(src))
    return importlib.import_module(package)
'''


def local_kernels(site: Path, sources: Path) -> None:
    """The stand-in `kernels` package (at the version transformers asks for) under `site`."""
    from transformers.utils import import_utils

    version = import_utils.KERNELS_MIN_VERSION
    (site / "kernels").mkdir(parents=True, exist_ok=True)
    (site / "kernels" / "__init__.py").write_text(LOCAL_KERNELS)
    info = site / f"kernels-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    os.environ["MOE_PARITY_LOCAL_KERNELS"] = str(sources.resolve())


def sh(*argv: str, code: str | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, *argv]
    path = [os.getcwd(), *SITE, os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def cli(*argv: str) -> tuple[int, str]:
    return sh("-m", "pytest_moe_parity.cli", *argv)


def progress(arch: str, step: str, code: int, started: float) -> None:
    """One line per step as it ends (the summary is printed at the end): where a long run stands."""
    print(f"{arch}: {step} exit {code} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def parity(golden: Path, model: Path, *argv: str) -> tuple[int, str]:
    return sh("-m", "pytest", "-p", "no:cacheprovider", "--golden-dir", str(golden), "--model", str(model), "-q", *argv)


def same_golden(a: Path, b: Path) -> str:
    """'' when both hold the same points, call structures and tensors bit for bit; else what differs."""
    import torch
    from safetensors.torch import load_file

    ma, mb = (json.loads((g / "manifest.json").read_text()) for g in (a, b))
    pa, pb = ({p["id"]: p for p in m["points"]} for m in (ma, mb))
    if list(pa) != list(pb):
        return "different points"
    for pid in pa:
        if any(pa[pid][k] != pb[pid][k] for k in ("inputs", "output", "extras", "tensors")):
            return f"{pid}: call structure differs"
    for file in sorted({p["file"] for p in pa.values()}):
        ta, tb = load_file(a / file), load_file(b / file)
        for key in ta:
            if not torch.equal(ta[key], tb[key]):
                return f"{key}: max diff {(ta[key].float() - tb[key].float()).abs().max().item():.3g}"
    return ""


def line(text: str, needle: str) -> str:
    return next((x for x in text.splitlines() if needle in x), "")


def check(arch: str, root: Path) -> dict:
    out: dict = {"arch": arch}
    model, g_cpu, g_cuda = root / f"m-{arch}", root / f"g-cpu-{arch}", root / f"g-cuda-{arch}"
    code, text = cli("tiny-model", "--arch", arch, "--out", str(model))
    if code:
        return {**out, "skipped": text.strip().splitlines()[-1]}
    code, text = cli("golden", "--model", str(model), "--out", str(g_cpu), "-q")
    out["golden_cpu"] = code == 0 or text[-500:]
    for name, args in {
        "hw_cuda_bf16": ("--hw", "cuda", "--dtype", "bfloat16"),
        "hw_cuda_fp32": ("--hw", "cuda"),
        "hw_compile_cuda_bf16": ("--hw", "compile", "--hw-option", "device=cuda", "--dtype", "bfloat16"),
    }.items():
        started = time.perf_counter()
        code, text = parity(g_cpu, model, *args)
        out[name] = {"exit": code, "summary": line(text, " points: "), "first": line(text, "first divergence"),
                     "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        if code:
            out[name]["tail"] = text[-1500:]
        progress(arch, name, code, started)
    started = time.perf_counter()
    code, text = cli("golden", "--model", str(model), "--out", str(g_cuda), "--device", "cuda")
    progress(arch, "golden --device cuda", code, started)
    out["golden_cuda"] = {"exit": code, "placement": line(text, "placement:"), "memory": line(text, "memory:")}
    code, text = parity(g_cuda, model, "--hw", "cuda")
    out["cuda_golden_on_cuda"] = {"exit": code, "summary": line(text, " points: ")}
    caps = ("--device-map", "auto", "--max-memory", "0:1MB,cpu:500KB")  # of 1.8 MB: GPU, host and disk
    placed, pretrained = root / f"g-placed-{arch}", root / f"g-fp-{arch}"
    started = time.perf_counter()
    argv = ("golden", "--model", str(model), "--out", str(placed), *caps, "--offload-folder", str(root / f"o1-{arch}"))
    code, text = cli(*argv)
    progress(arch, "golden placed by unit", code, started)
    out["placed_by_unit"] = {"exit": code, "placement": line(text, "placement:"), "memory": line(text, "memory:")}
    if code:
        out["placed_by_unit"]["tail"] = text[-1500:]
    offload = str(root / f"o2-{arch}")
    argv = ("golden", "--model", str(model), "--out", str(pretrained), *caps, "--offload-folder", offload)
    code, text = sh(*argv, code=FROM_PRETRAINED)
    out["placed_by_from_pretrained"] = {"exit": code, "placement": line(text, "placement:")}
    if not code and not out["placed_by_unit"]["exit"]:
        out["placed_same_as_from_pretrained"] = same_golden(pretrained, placed) or "bitwise"
        out["placed_same_as_cuda"] = same_golden(g_cuda, placed) or "bitwise"
    return out


QUANT = "fp8-block:32+dynamic-token"


def quant_check(arch: str, scheme: str, root: Path) -> dict:
    """A quantized tiny checkpoint on the GPU: its golden dequantized on cuda against the CPU's, the
    native kernels' golden against the dequantized one (how far the maker's W8A8 path is from it), and
    the emulated FP8 candidate on cuda against the floor of its scheme."""
    out: dict = {"arch": arch, "scheme": scheme}
    model, g_cpu = root / f"q-{arch}", root / f"qg-cpu-{arch}"
    code, text = cli("tiny-model", "--arch", arch, "--out", str(model), "--quant", scheme)
    if code:
        return {**out, "skipped": text.strip().splitlines()[-1]}
    spec = QUANT if scheme.startswith("fp8") else "mxfp4+dynamic-token"
    code, text = cli("golden", "--model", str(model), "--out", str(g_cpu), "--noise-dtype", "bfloat16",
                     "--noise-quant", spec, "-q")  # fmt: skip
    out["golden_cpu"] = code == 0 or text[-500:]
    for name, extra in {"dequant": (), "native": ("--reference-quant", "native")}.items():
        golden = root / f"qg-{name}-{arch}"
        argv = ("golden", "--model", str(model), "--out", str(golden), "--device", "cuda", *extra, "-q")
        code, text = cli(*argv)
        if code and name == "native":  # the maker's kernels take bfloat16 activations (mxfp4's must)
            out["golden_cuda_native"] = {"exit": code, "tail": text[-600:]}
            code, text = cli(*argv, "--dtype", "bfloat16")
            name = "native_bf16"
        out[f"golden_cuda_{name}"] = {"exit": code, "tail": text[-600:] if code else line(text, "golden written")}
        if not code:  # the CPU's dequantized checkpoint judged against this golden
            code, text = parity(golden, model, "--hw", "cpu")
            out[f"cpu_against_cuda_{name}"] = {"exit": code, "summary": line(text, " points: "),
                                               "first": line(text, "first divergence")}  # fmt: skip
    code, text = parity(g_cpu, model, "--hw", "cuda", "--dtype", "bfloat16", "--hw-option", f"quant={spec}",
                        "--noise-quant", spec, "--parity-mode", "both")  # fmt: skip
    out["hw_cuda_emulated"] = {
        "exit": code,
        "summary": line(text, " points: "),
        "first": line(text, "first divergence"),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen3_moe,mixtral,minimax_m2", help="'none': the quantized checks alone")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--register", type=Path, default=None, help="write the entry points here (no install)")
    ap.add_argument("--quant", action="store_true", help="also the quantized checks (FP8, MXFP4)")
    ap.add_argument("--local-kernels", type=Path, default=None, help="kernels-community sources (no hub here)")
    ap.add_argument("--jobs", type=int, default=4, help="checks run at a time")
    args = ap.parse_args()
    if args.register:
        register(args.register)
        if args.local_kernels:
            local_kernels(args.register, args.local_kernels)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: these checks need one")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(check, arch, Path(tmp)) for arch in args.archs.split(",") if arch != "none"]
        if args.quant:
            quant = [("qwen3_moe", "fp8-block:32"), ("deepseek_v3", "fp8-block:8"), ("gpt_oss", "mxfp4")]
            runs += [pool.submit(quant_check, arch, scheme, Path(tmp)) for arch, scheme in quant]
        results = [run.result() for run in runs]
    text = json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "results": results}, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    failed = [
        r["arch"]
        for r in results
        if "skipped" not in r
        and "scheme" not in r
        and (
            any(r[k]["exit"] for k in ("hw_cuda_bf16", "hw_cuda_fp32", "golden_cuda", "placed_by_unit"))
            or r.get("placed_same_as_from_pretrained") != "bitwise"
        )
    ]
    # the quantized checks: the dequantized golden on cuda and the emulated candidate must hold (native's
    # distance from the dequantized reference is a figure, not a failure)
    failed += [
        f"{r['arch']} {r['scheme']}"
        for r in results
        if "scheme" in r
        and "skipped" not in r
        and any(
            r.get(k, {"exit": 1})["exit"]
            for k in ("golden_cuda_dequant", "cpu_against_cuda_dequant", "hw_cuda_emulated")
        )
    ]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
