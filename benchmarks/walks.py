"""How far a reader travels: the package's modules one item's life and one `--hw-option` pass through.

Two walks, traced (every call from one of the package's modules into another, by `sys.setprofile`):

- **a point id**: `pytest --golden-dir G --hw cpu --dtype bfloat16 -k layer_0.experts` on a candidate
  whose layer-0 expert is broken, from collection to the failure text;
- **`--hw-option threads=1`**: from the command line to where it acts (torch's threads set).

Each is counted over the whole session and over the item's own run alone (its setup, call, report
and failure text: `pytest_runtest_protocol`), which leaves out the session's start (golden, backend);
and the item's run as a reader follows it, on calls and returns: its stays (each change of module)
and its climbs (a move to a higher layer that is not a return to the caller).

For each: the modules visited, the distinct module-to-module calls (steps), and those that go back
*up* the package's layers (a lower layer's module calling a higher one's, through an object it was
handed: the walk a reader has to climb back up). The layers are those of `tests/test_layers.py` in
the tree measured, so an older checkout is measured by its own rule:

    python benchmarks/walks.py                      # this checkout
    python benchmarks/walks.py --tree /tmp/before   # another checkout (e.g. a `git worktree`)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_TRACE = r"""
import json, sys, os
from pathlib import Path
package = Path(sys.argv[1]).resolve() / "pytest_moe_parity"
calls = set()
leg = set()  # the calls inside the item's own run (setup, call, its report and failure text)
threads_set = []
state = {"item": False}
sequence = []  # the item's run as a reader follows it: each change of module, on calls and on returns

def module_of(frame):
    path = frame.f_code.co_filename
    if not path.startswith(str(package)):
        return None
    rel = Path(path).resolve().relative_to(package).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or "__init__"

target = os.environ.get("WALK_VALUE", "")  # the value followed: a point id, or a `--hw-option` name
by_option = os.environ.get("WALK_KIND") == "option"
carried = []  # (module, function) of each call that receives the value, in order

def _holds(v, depth=0):
    # whether an argument carries the value followed: it is it, or holds it one or two levels in
    if isinstance(v, str):
        return (v.split("=")[0] == target) if by_option else v == target
    if depth > 2 or v is None or isinstance(v, (int, float, bool, bytes)):
        return False
    if isinstance(v, dict):
        if by_option and target in v:
            return True
        return any(_holds(x, depth + 1) for x in list(v.values())[:64])
    if isinstance(v, (list, tuple, set, frozenset)):
        return any(_holds(x, depth + 1) for x in list(v)[:64])
    if not by_option and getattr(type(v), "__module__", "").startswith("pytest_moe_parity"):
        try:
            if getattr(v, "id", None) == target:
                return True
        except Exception:
            return False
    try:
        fields = vars(v)
    except TypeError:
        return False
    names = ("point", "hw_options", "options", "setup", "result", "prepared") if depth < 2 else ("point", "id")
    return any(k in fields and _holds(fields[k], depth + 1) for k in names)

def _receives(frame):
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    loc = frame.f_locals
    if by_option and target in names and loc.get(target) is not None:
        return True
    return any(n != "self" and _holds(loc.get(n)) for n in names)

def profile(frame, event, arg):
    if event == "call" and target and (state["item"] or by_option):
        m = module_of(frame)
        if m and _receives(frame):
            caller = module_of(frame.f_back) if frame.f_back is not None else None
            carried.append((m, frame.f_code.co_qualname, caller))
    if event == "return" and state["item"]:
        back = module_of(frame.f_back) if frame.f_back is not None else None
        if back and module_of(frame) and (not sequence or sequence[-1] != back):
            sequence.append(back)
    if event != "call":
        return
    callee = module_of(frame)
    if state["item"] and callee and (not sequence or sequence[-1] != callee):
        sequence.append(callee)
    caller = module_of(frame.f_back) if frame.f_back is not None else None
    if callee and caller and callee != caller:
        calls.add((caller, callee))
        if state["item"]:
            leg.add((caller, callee))

import torch
real = torch.set_num_threads
def noted(n):
    f = sys._getframe(1)
    threads_set.append(module_of(f))
    return real(n)
torch.set_num_threads = noted

import pytest


class Leg:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        state["item"] = True
        yield
        state["item"] = False


args = sys.argv[3:]
sys.setprofile(profile)
try:
    pytest.main(args, plugins=[Leg()])
finally:
    sys.setprofile(None)
json.dump({"calls": sorted(calls), "leg": sorted(leg), "sequence": sequence, "threads_set_in": threads_set,
           "carried": carried},
          open(sys.argv[2], "w"))
"""


def layers_of(tree: Path) -> dict[str, int]:
    """The top-level name of each module -> its layer, from the tree's own layering test."""
    table = runpy.run_path(str(tree / "tests" / "test_layers.py"))["LAYERS"]
    return {name: rank for rank, names in enumerate(table) for name in names}


def trace(tree: Path, args: list[str], workdir: Path, value: str = "", kind: str = "point") -> dict:
    out = workdir / "trace.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "WALK_VALUE": value, "WALK_KIND": kind}
    cmd = [sys.executable, "-c", _TRACE, str(tree), str(out), *args, "-p", "no:cacheprovider", "-q"]
    subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


def figures(data: dict, rank: dict[str, int], key: str = "calls") -> dict[str, Any]:
    calls = [tuple(c) for c in data[key]]
    modules = {m for c in calls for m in c}

    def layer(module: str) -> int:
        return rank.get(module.split(".")[0], -1)

    up = [(a, b) for a, b in calls if layer(b) > layer(a) >= 0]
    return {"modules": len(modules), "steps": len(calls), "back up": len(up), "up": up, "names": sorted(modules)}


def stays_and_climbs(sequence: list[str], rank: dict[str, int]) -> tuple[int, int]:
    """The item's run as a sequence of modules (a stay per change of module, on calls and returns)
    and how many of its moves go to a higher layer other than by returning to the module that called
    (a lower module calling up through an object it holds, or a trip out and back)."""
    stack: list[str] = []
    climbs = 0
    layer = lambda m: rank.get(m.split(".")[0], -1)  # noqa: E731
    for prev, cur in itertools.pairwise(sequence):
        if stack and stack[-1] == cur:  # a return to the caller
            stack.pop()
            continue
        stack.append(prev)
        climbs += layer(cur) > layer(prev) >= 0
    return len(sequence), climbs


def value_walk(carried: list, rank: dict[str, int]) -> dict[str, Any]:
    """The review's walk, followed by the value: the functions that receive it (the id, the option,
    or an object holding it), as modules in the order met (one stay per change of module), and the
    calls among them made from a lower layer's module into a higher one's (a callback: the reader
    climbs back up)."""
    route: list[str] = []
    for module, _, _ in carried:
        if not route or route[-1] != module:
            route.append(module)
    layer = lambda m: rank.get(m.split(".")[0], -1)  # noqa: E731
    climbs = [(c, m) for m, _, c in carried if c and c != m and layer(m) > layer(c) >= 0]
    return {"stays": len(route), "modules": len(set(route)), "climbs": climbs, "route": route}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout measured")
    ap.add_argument("--verbose", action="store_true", help="list the modules and the calls back up")
    args = ap.parse_args()
    tree = args.tree.resolve()
    rank = layers_of(tree)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory(prefix="walks-") as tmp:
        work = Path(tmp)
        cli = [sys.executable, "-m", "pytest_moe_parity.cli"]
        subprocess.run([*cli, "tiny-model", "--arch", "qwen3_moe", "--out", str(work / "m")], env=env, check=True,
                       capture_output=True)  # fmt: skip
        subprocess.run([*cli, "golden", "--model", str(work / "m"), "--out", str(work / "g"), "--quiet"], env=env,
                       check=True, capture_output=True)  # fmt: skip
        broken = work / "broken"
        subprocess.run(["cp", "-r", str(work / "m"), str(broken)], check=True)
        from safetensors.torch import load_file, save_file

        index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
        key = next(k for k in sorted(index) if "layers.0.mlp.experts" in k)
        shard = str(broken / index[key])
        weights = load_file(shard)
        weights[key] = weights[key] * 0  # the layer's experts broken
        save_file(weights, shard, metadata={"format": "pt"})
        base = ["--golden-dir", str(work / "g"), "--model", str(broken), "--hw", "cpu", "--dtype", "bfloat16"]
        walks = {
            "a point id (-k layer_0.experts, failing)": (
                [*base, "-k", "layer_0.experts", "--no-parity-weights"],
                "layer_0.experts",
                "point",
            ),
            "--hw-option threads=1": (
                [*base, "-k", "layer_0.input_norm", "--hw-option", "threads=1"],
                "threads",
                "option",
            ),
        }
        print(f"tree {tree}")
        for name, (walk, value, kind) in walks.items():
            data = trace(tree, walk, work, value, kind)
            f = figures(data, rank)
            print(f"  {name}: {f['modules']} modules, {f['steps']} module-to-module calls, {f['back up']} back up")
            own = figures(data, rank, "leg")
            print(f"    the item's own run: {own['modules']} modules, {own['steps']} calls, {own['back up']} back up")
            stays, climbs = stays_and_climbs(data["sequence"], rank)
            print(f"    followed as a reader does (calls and returns): {stays} stays, {climbs} climbs up the layers")
            v = value_walk(data["carried"], rank)
            where = "the item's run" if kind == "point" else "the session"
            print(
                f"    followed by the value ({where}: the calls that receive it): {v['stays']} stays over "
                f"{v['modules']} modules, {len(v['climbs'])} back up"
            )
            if args.verbose:
                print(f"    its route: {' -> '.join(v['route'])}")
                print(f"    its climbs: {', '.join(f'{a} -> {b}' for a, b in v['climbs'])}")
                print(f"    its functions: {', '.join(dict.fromkeys(f'{m}:{q}' for m, q, _ in data['carried']))}")
                print(f"    its modules: {', '.join(own['names'])}")
            if args.verbose:
                print(f"    modules: {', '.join(f['names'])}")
                print(f"    back up: {', '.join(f'{a} -> {b}' for a, b in f['up'])}")
            if "threads" in name:
                print(f"    torch.set_num_threads called from: {sorted(set(filter(None, data['threads_set_in'])))}")


if __name__ == "__main__":
    main()
