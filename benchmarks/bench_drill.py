"""What a drill costs against its component's own replay, and how big its repro file is.

1. **Cost.** For each component of one layer (attention, router, experts, the MoE block, the
   decoder layer), the point's replay on `--hw cpu` in bf16 (the candidate's forward and its verdict:
   `ParityRunner.prepare` + `judge`, best of `--repeat`) against its drill on a fresh driller:
   `drill s`, the reference captured on this machine (in float32 and in bf16: in a pytest run, at
   collection) and then the drill; `stored s`, the reference's ops read from the golden, where
   `moe-parity drill-ops` stored them once (as the golden itself is recorded once), and then the
   drill; `ref s` and `rest s`, the first split into the reference's side and the rest (the
   candidate's capture, every op judged chained and isolated, the culprit substituted), on a model
   of `--hidden` width and `--tokens` tokens. The target: at most 5x (compile excluded: `--hw cpu`
   has none). With `--port own`, the candidate is the second test port's own code (`tests/port_own.py`,
   `--hw ownport`: its attention, router and sorted-dispatch experts, matched to the reference's ops by
   value, place and row identity), `--bugs` its bugs (e.g. `mask_one_ahead`), and with `--whole-runs`
   the user's figure: `pytest -k POINT` in a fresh process with and without `--parity-drill POINT`.
2. **Repro size.** A 48-layer tiny model's golden against the repro file of an RMSNorm-eps fault in
   layer 17's attention (`--parity-repro`): the target is under 1% of the golden.

    python benchmarks/bench_drill.py [--hidden 256] [--tokens 64] [--repeat 3] [--layers 48]
                                     [--port own [--bugs NAME,...] [--whole-runs]]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


FACTOR = 1.5  # the noise factor each drill is judged with (the default tolerance's)
WIDTHS = ((9, 4), (8, 4), (6, 2), (9, 4), (6, 2), (7, 4), (7, 4), (6, 2))  # the table's columns


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cost(work: Path, hidden: int, tokens: int, repeat: int, port: str | None = None, bugs: str = "") -> None:
    from pytest_moe_parity import backends
    from pytest_moe_parity.drill import Driller, store
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model
    from pytest_moe_parity.session import ParitySession, RunOptions

    overrides = {"hidden_size": hidden, "moe_intermediate_size": hidden // 2, "intermediate_size": hidden * 2}
    model = write_tiny_model("qwen3_moe", work / "model", layers=2, overrides=overrides)
    golden = work / "golden"
    record_golden(model, golden, seq_len=tokens)
    # freeze_gc as the plugin and the CLI run a session: what is alive once the backend started is left
    # out of the collector's walks
    hw: dict = {}
    points = ("layer_1.attention", "layer_1.router", "layer_1.experts", "layer_1.moe", "layer_1.output")
    if port == "own":  # the second test port's own code, as an entry-point backend gives it
        from drill_port import OwnPortBackend

        backends.registry()[OwnPortBackend.name] = OwnPortBackend
        hw = {"hw": OwnPortBackend.name, "model": model, "hw_options": [f"bugs={bugs}"]}
        points = points[:3]
    options = RunOptions(golden_dir=golden, dtype="bfloat16", weights=False, drill=["layer_1.*"], freeze_gc=True, **hw)
    session = ParitySession(options)
    where = f"--hw {hw['hw']} (bugs: {bugs or 'none'})" if hw else "--hw cpu"
    print(f"qwen3_moe, hidden {hidden}, {tokens} tokens, {where}, bfloat16 (best of {repeat})")
    names = ("replay s", "drill s", "ratio", "stored s", "ratio", "ref s", "rest s", "ratio")
    head = " ".join(f"{name:>{w}}" for name, (w, _) in zip(names, WIDTHS, strict=True))
    print(f"  {'point':18} {head}  ops  culprit")

    def timed(fn, make) -> tuple[float, object]:
        """Best of `repeat` runs of fn(driller) on a fresh driller each (make()), and the last driller."""
        times, driller = [], None
        for _ in range(repeat):
            if driller is not None:
                driller.close()
            driller = make()
            started = time.perf_counter()
            fn(driller)
            times.append(time.perf_counter() - started)
        return min(times), driller

    def warmed(point):  # a driller whose reference layer is read from disk: not the drill's own cost
        driller = Driller(session.golden, model, session.backend)
        driller.reference(point)
        driller._references.clear()
        return driller

    for pid in points:
        point = session.golden.point(pid)
        session.runner.judge(session.runner.prepare(pid))  # warm: the layer read, the first forward
        replay = min(_seconds(lambda pid=pid: session.runner.judge(session.runner.prepare(pid))) for _ in range(repeat))
        make = functools.partial(warmed, point)
        # the reference's side alone (its two captures, matched to each other), then the whole drill
        refs = timed(lambda driller, point=point: driller.reference(point), make)[0]
        d = timed(lambda driller, point=point: (driller.reference(point), driller.drill(point, FACTOR)), make)[0]
        graphs, _ = make().capture(point, [session.backend.dtype])
        store.save(golden, pid, graphs)  # moe-parity drill-ops: once, where the golden is recorded
        # the reference's ops read from the golden, then the drill
        without_model = functools.partial(Driller, session.golden, None, session.backend)
        s, driller = timed(lambda driller, point=point: driller.drill(point, FACTOR), without_model)
        result = driller.drills[pid]
        rest = d - refs
        figures = [replay, d, d / replay, s, s / replay, refs, rest, rest / replay]
        row = " ".join(f"{v:{w}.{n}f}" for v, (w, n) in zip(figures, WIDTHS, strict=True))
        print(f"  {pid:18} {row}  {len(result.rows):3}  {result.culprit}")
    session.close()


def whole_runs(work: Path, hidden: int, tokens: int, repeat: int, bugs: str) -> None:
    """The user's figure: `pytest` on one point of the second port, with and without its drill (a
    fresh process each, as a user runs it: imports, collection, the reference read from the golden,
    the point's replay; with `--parity-drill`, the drill's items too), best of `repeat`."""
    import subprocess

    from pytest_moe_parity.cli import main as moe_parity
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model

    overrides = {"hidden_size": hidden, "moe_intermediate_size": hidden // 2, "intermediate_size": hidden * 2}
    model = write_tiny_model("qwen3_moe", work / "model-runs", layers=2, overrides=overrides)
    golden = work / "golden-runs"
    record_golden(model, golden, seq_len=tokens)
    points = ("layer_1.attention", "layer_1.router", "layer_1.experts")
    assert moe_parity(["drill-ops", str(golden), "--points", ",".join(points), "--dtype", "bfloat16"]) == 0
    here = work / "runs"
    here.mkdir()
    (here / "conftest.py").write_text(  # the second test port, as an entry-point backend gives it
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from drill_port import OwnPortBackend\nfrom pytest_moe_parity import backends\n"
        "backends.registry()[OwnPortBackend.name] = OwnPortBackend\n"
    )
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--golden-dir", str(golden),
            "--model", str(model), "--hw", "ownport", "--hw-option", f"bugs={bugs}", "--dtype", "bfloat16",
            "--no-parity-weights"]  # fmt: skip

    def best(argv: list[str]) -> float:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            subprocess.run(argv, cwd=here, capture_output=True, check=False)
            times.append(time.perf_counter() - started)
        return min(times)

    print(f"whole runs: pytest -k POINT, one process each (bugs: {bugs or 'none'}; best of {repeat})")
    print(f"  {'point':18} {'run s':>7} {'drilled s':>9} {'ratio':>6}")
    for point in points:
        plain = best([*base, "-k", point])
        drilled = best([*base, "-k", point, "--parity-drill", point])
        print(f"  {point:18} {plain:7.2f} {drilled:9.2f} {drilled / plain:6.2f}")


def repro_size(work: Path, layers: int) -> None:
    from faults import edit_checkpoint, edit_config

    from pytest_moe_parity.drill import Driller
    from pytest_moe_parity.record.run import record_golden
    from pytest_moe_parity.record.tiny import write_tiny_model
    from pytest_moe_parity.session import ParitySession, RunOptions

    model = write_tiny_model("qwen3_moe", work / "model48", layers=layers)
    golden = work / "golden48"
    record_golden(model, golden)
    candidate = edit_checkpoint(model, work / "cand48", lambda t: None)
    edit_config(candidate, lambda c: c.update(rms_norm_eps=c["rms_norm_eps"] * 1000))
    repro = work / "repro"
    options = {"dtype": "bfloat16", "weights": False, "drill": ["layer_17.attention"]}
    session = ParitySession(RunOptions(golden_dir=golden, model=candidate, **options))
    driller: Driller = session.checkers["drill"].driller
    result = driller.drill(session.golden.point("layer_17.attention"), FACTOR)
    driller.write_repro(result, repro)
    g, r = _size(golden), _size(repro)
    print(f"repro of {result.point}::{result.culprit}: {r} bytes ({', '.join(p.name for p in repro.iterdir())})")
    print(f"golden of {layers} layers: {g} bytes; the repro is {100 * r / g:.3f}% of it")
    session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--port", choices=["own"], help="drill the second test port's own code (tests/port_own.py)")
    ap.add_argument("--bugs", default="", help="with --port own: its bugs, comma-separated (port_own.BUGS)")
    ap.add_argument("--whole-runs", action="store_true", help="with --port own: pytest runs with and without the drill")
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench-drill-"))
    try:
        cost(work, args.hidden, args.tokens, args.repeat, args.port, args.bugs)
        if args.port is not None and args.whole_runs:
            whole_runs(work, args.hidden, args.tokens, args.repeat, args.bugs)
        if args.port is None:
            repro_size(work, args.layers)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
