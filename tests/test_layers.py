"""The package's layering: each module imports only from the layers below it, so that the next
backends and modes land on one seam each. The rule is the package docstring's."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_moe_parity"
# lowest first; a module may import from its own layer's package (inside a sub-package) and below
LAYERS = [
    {"errors"},
    {"points", "dtypes", "tree", "compat", "files", "host", "formats", "words"},
    {"golden", "judge", "model"},
    {"report"},
    {"record", "dump"},
    {"backends"},
    {"replay"},
    {"drill"},
    {"session", "scan", "routes"},
    {"sweep"},
    {"plugin", "cli"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
ORDER = [
    "errors",
    "points",
    "dtypes",
    "tree",
    "compat",
    "files",
    "host",
    "formats",
    "words",
    "golden",
    "judge",
    "model",
    "report",
    "record",
    "dump",
    "backends",
    "replay",
    "drill",
    "session",
    "scan",
    "routes",
    "sweep",
    "plugin",
    "cli",
]  # how the docstring lists them


def _top(module: str) -> str:
    """The first component below the package: `golden` for pytest_moe_parity.golden.store."""
    return module.split(".")[1] if module.count(".") >= 1 else ""


def _imports(path: Path) -> list[tuple[str, int]]:
    """Intra-package modules imported by the file at `path` (absolute dotted names, line numbers)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            found += [(name, node.lineno) for name in names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pytest_moe_parity"):
            found.append((node.module, node.lineno))
    return found


def test_every_module_belongs_to_a_layer() -> None:
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")}
    assert tops - {"__init__", "fixtures"} <= set(RANK), tops - set(RANK)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path: Path) -> None:
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if own == "__init__":
        return
    for module, line in _imports(path):
        top = _top(module)
        if top in ("", "__version__") or top == own:
            continue
        assert RANK[top] < RANK[own], f"{path.name}:{line} imports {module}: {top} is not below {own}"


@pytest.mark.parametrize("layer", ["model", "dump", "backends", "replay", "drill", "report"])
def test_record_means_recording_only(layer: str) -> None:
    """What replay shares with recording lives in `model/`: a backend, the replay, the drill, dumps and
    reports never import `record/` (only the commands that record do: `cli`, `scan`)."""
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, layer
    found = [
        f"{path.relative_to(PACKAGE)}:{line} imports {module}"
        for path in files
        for module, line in _imports(path)
        if _top(module) == "record"
    ]
    assert not found


def test_the_docstring_states_the_rule() -> None:
    doc = (PACKAGE / "__init__.py").read_text()
    rule = " <- ".join(", ".join(sorted(names, key=ORDER.index)) for names in LAYERS)
    assert rule in doc, rule


def test_item_kinds_are_checkers_in_their_own_wings() -> None:
    """Each kind of item beside the points is a checker in its own wing (the weight items beside the
    weight check, the drill's in `drill/`); the session composes them and imports nothing else of the
    drill's."""
    from pytest_moe_parity.drill.items import DrillItems
    from pytest_moe_parity.replay.checks import Checker
    from pytest_moe_parity.replay.config import ConfigItems
    from pytest_moe_parity.replay.weights import WeightItems

    assert all(issubclass(kind, Checker) for kind in (ConfigItems, DrillItems, WeightItems))
    drill = {module for module, _ in _imports(PACKAGE / "session.py") if _top(module) == "drill"}
    assert drill <= {"pytest_moe_parity.drill", "pytest_moe_parity.drill.items"}, drill  # the face, the checker


def test_relative_errors_are_the_judges() -> None:
    """One family of comparison functions (`judge.distance`): no module outside the judge defines a
    relative error of its own (a repro file's template, a string, is standalone by design)."""
    import re

    own = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "judge"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and re.match(r"_?rel(_|$)", node.name)
    ]
    assert not own, own


NXDI_ROOMS = ["tables", "imports", "weights", "evidence", "calls", "ran", "precision", "backend"]  # lowest first


@pytest.mark.parametrize("room", [*NXDI_ROOMS, "cpu"])
def test_the_nxdi_backend_is_a_package_of_rooms(room: str) -> None:
    """`backends/nxdi/`: each room imports only the rooms before it (tables, imports, weights,
    evidence, calls, ran, precision, backend; the backend its CPU build too), and the CPU build (`cpu/`) only NxDI's
    imports: it knows nothing of the backend that uses it (NxDI's own module tests run through it
    alone)."""
    home = PACKAGE / "backends" / "nxdi"
    paths = sorted((home / "cpu").glob("*.py")) if room == "cpu" else [home / f"{room}.py"]
    allowed = {"imports"} if room == "cpu" else {*NXDI_ROOMS[: NXDI_ROOMS.index(room)], *("cpu",) * (room == "backend")}
    prefix = "pytest_moe_parity.backends.nxdi."
    found = [
        f"{path.name}:{line} imports {module}"
        for path in paths
        for module, line in _imports(path)
        if module.startswith(prefix) and (own := module[len(prefix) :].split(".")[0]) != room and own not in allowed
    ]
    assert not found


def test_per_architecture_tables_are_read_one_way() -> None:
    """NxDI's capture names (`dump/`) and NxDI's modules (`backends/nxdi/`) are JSON tables per
    architecture, read by `files.read_table` alone."""
    readers = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted([*(PACKAGE / "dump").rglob("*.py"), *(PACKAGE / "backends").rglob("*.py")])
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value == "*.json"
    ]
    assert not readers, readers


def _checker_classes() -> dict[str, Path]:
    """Each class of `session.CHECKERS` and the file that defines it."""
    import inspect

    from pytest_moe_parity.session import CHECKERS

    return {kind.__name__: Path(inspect.getfile(kind)).resolve() for kind in CHECKERS}


def test_a_kind_is_its_module_and_its_name_in_checkers() -> None:
    """A kind of item is its checker's module plus its name in `session.CHECKERS`: no other module
    names a checker class (the plugin's options, markers and items, the session's setup, header,
    run options and rows all come from the tuple)."""
    own = _checker_classes()
    home = PACKAGE / "session.py"
    named = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} names {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        for name in [getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)]
        if name in own and path.resolve() not in (own[name], home)
    ]
    assert not named, named


def test_the_plugin_adds_the_checkers_options_as_they_declare_them() -> None:
    """Adding pytest's options must not import torch, which the checkers' modules do: the plugin
    repeats their options (`Checker.options`), row for row."""
    from pytest_moe_parity.plugin import _OPTIONS
    from pytest_moe_parity.session import CHECKERS

    declared = sorted((tuple(option) for kind in CHECKERS for option in kind.options), key=lambda o: o[0])
    dests = {option[1] for option in declared}
    assert sorted((row for row in _OPTIONS if row[1] in dests), key=lambda o: o[0]) == declared


@pytest.mark.usefixtures("_import_everything_once")  # an in-process inner session (see the fixture)
def test_a_checker_in_checkers_gets_its_marker_items_and_rows(
    pytester: pytest.Pytester, golden_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A throwaway kind, named in CHECKERS alone, is asked (`value`), set up (`from_options`), gets
    its marker, its items (of its family) after each point it schedules, and its rows in the report."""
    import json

    from pytest_moe_parity import session as session_module
    from pytest_moe_parity.golden import GoldenStore
    from pytest_moe_parity.replay.checks import AtPoint, Checker
    from pytest_moe_parity.report.rows import drill_row

    @dataclass(frozen=True)
    class Echo(AtPoint):
        order: float
        kind = "echo"

        @property
        def name(self) -> str:
            return "echo"

    class EchoItems(Checker):
        kind, family, marker = "echo", "check", "moe-parity items of a throwaway kind"

        @classmethod
        def value(cls, get):
            return True

        @classmethod
        def from_options(cls, setup, value):
            return cls() if value else None

        def after(self, point, selected):
            if selected and point.component == "router":
                yield Echo(point, self.place(point))

        def check(self, entry, rows):
            return drill_row(entry, "passed", None, None), None

        def unjudged_row(self, entry, status, message):
            return drill_row(entry, status, None, None)

    monkeypatch.setattr(session_module, "CHECKERS", (*session_module.CHECKERS, EchoItems))
    golden = golden_dir("qwen3_moe")
    routers = [p.id for p in GoldenStore(golden).points if p.component == "router"]
    report = pytester.path / "report"
    result = pytester.runpytest(
        "--golden-dir", str(golden), "--no-parity-config", "--no-parity-weights", "-m", "echo", "-v",
        "--strict-markers", "--parity-report", str(report), "--parity-plots", "no", "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(passed=len(routers))
    result.stdout.fnmatch_lines([f"*{routers[0]}::echo PASSED*"])
    written = json.loads((report / "comparison_report.json").read_text())
    assert [r["id"] for r in written["points"]] == [f"{r}::echo" for r in routers]
    assert written["run_options"]["echo"] is True


def test_a_drill_of_any_size_keeps_its_rows_in_order() -> None:
    """The rows' order is (point, before or after it, the kind's rank in CHECKERS, index): a drill of
    400 ops (more than the 331 that the float offsets 0.997-0.999 left room for) stays before the
    point's differentials, and those before the next unit's weight item and point."""
    from pytest_moe_parity.drill.items import DrillItems
    from pytest_moe_parity.points import Point
    from pytest_moe_parity.replay.parallel import ParallelItems
    from pytest_moe_parity.replay.routing import RoutingItems
    from pytest_moe_parity.replay.weights import WeightItems
    from pytest_moe_parity.session import CHECKERS

    class Ops:
        def op_names(self, point: Point) -> list[str]:
            return [f"op_{i}" for i in range(400)]

    class Golden:
        def router_of(self, point: Point) -> str:
            return "router"

    block, next_norm = Point("moe", 0, order=7), Point("input_norm", 1, order=8)
    kinds = {}
    for kind in (WeightItems, DrillItems, ParallelItems, RoutingItems):
        checker = kinds[kind] = object.__new__(kind)
        checker.rank = CHECKERS.index(kind)
    kinds[DrillItems].patterns, kinds[DrillItems].driller = ["layer_0.moe"], Ops()
    kinds[RoutingItems].golden = Golden()
    kinds[WeightItems]._first = {1: next_norm.id}
    after = [entry for kind in (DrillItems, ParallelItems, RoutingItems) for entry in kinds[kind].after(block, True)]
    orders = [block.order, *(e.order for e in after), *(e.order for e in kinds[WeightItems].before(next_norm))]
    orders.append(next_norm.order)
    assert len(orders) == 1 + 401 + 2 + 1 + 1
    assert orders == sorted(orders) and len(set(orders)) == len(orders)


def test_the_command_is_a_package_by_family() -> None:
    """`cli/`: the `moe-parity` command as a package by family of commands (pip's `commands/`), each
    module under 400 lines, and each command's facts beside it (its `Command`)."""
    from pytest_moe_parity.cli import COMMANDS, build_parser

    modules = sorted((PACKAGE / "cli").glob("*.py"))
    assert len(modules) > 2
    long = [f"{p.name}: {n} lines" for p in modules if (n := len(p.read_text().splitlines())) >= 400]
    assert not long, long
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert list(choices) == list(COMMANDS)  # each command's parser is named as its Command


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package (a package by its own name) -> the package's modules it imports,
    at module level or inside a function."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str:  # `pkg.mod.NAME` -> `pkg.mod`
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {
        name: {target for imported, _ in _imports(path) if (target := module_of(imported)) != name}
        for name, path in modules.items()
    }


def test_no_module_imports_itself_in_a_circle() -> None:
    """No import circle between the package's modules (a function-level import counts: it hides a
    circle, it does not break it)."""
    graph = _module_graph()
    done: set[str] = set()
    circles = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(" -> ".join([*path[path.index(module) :], module]))
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, circles


def test_the_report_imports_its_own_modules_at_the_top() -> None:
    """`report/` imports none of its own modules inside a function (what a circle would need)."""
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted((PACKAGE / "report").rglob("*.py"))
        for function in ast.walk(ast.parse(path.read_text()))
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("pytest_moe_parity"))
    ]
    assert not found, found


# a module split along the seams its docstring named: (the room split off, the module it came from)
SPLIT_ROOMS = [
    ("drill/rows.py", "drill/match.py"),  # rows by identity, below the matching's passes
    ("judge/result.py", "judge/verdict.py"),  # a point's result types, below how a point is judged
    ("record/reference.py", "record/run.py"),  # reading the reference, below `moe-parity golden`
]


def _module(path: str) -> str:
    return "pytest_moe_parity." + path.removesuffix(".py").replace("/", ".")


@pytest.mark.parametrize(("room", "above"), SPLIT_ROOMS, ids=[room for room, _ in SPLIT_ROOMS])
def test_split_modules_are_rooms_in_order(room: str, above: str) -> None:
    """As `backends/nxdi/`: the room split off a module imports nothing of that module, which
    imports it (the order of the two is one way)."""
    top = _module(above)
    found = [
        f"{room}:{line} imports {module}"
        for module, line in _imports(PACKAGE / room)
        if module == top or module.startswith(top + ".")
    ]
    assert not found
    assert any(module.startswith(_module(room)) for module, _ in _imports(PACKAGE / above)), above


def test_one_reference_class() -> None:
    """Two things called `Reference` got two names: among the class names that more than one module
    defines, no `Reference` (the drill's reference side keeps the name; recording's is `LoadedReference`)."""
    defined: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: where for name, where in defined.items() if len(set(where)) > 1}
    assert "Reference" not in shared, shared["Reference"]


def test_the_noise_floor_is_written_once() -> None:
    """The noise floor's formula (eps(dtype) / NOISE_FLOOR_EPS) is `judge.tolerances.noise_floor`:
    no other module names NOISE_FLOOR_EPS (a docstring may)."""
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE) != Path("judge", "tolerances.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Name) and node.id == "NOISE_FLOOR_EPS")
        or (isinstance(node, ast.Attribute) and node.attr == "NOISE_FLOOR_EPS")
        or (isinstance(node, ast.alias) and node.name == "NOISE_FLOOR_EPS")
    ]
    assert not found, found


MODULE_LINES, FUNCTION_LINES, SESSION_LINES = 900, 80, 450  # the sizes a reader takes in at once


def test_no_module_or_function_outgrows_a_reading() -> None:
    """No module of the package over 900 lines, no function (nested ones included, each counted whole)
    over 80, and the session, which composes the checkers, under 450: the rooms stay rooms."""
    modules = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    big = [f"{name}: {n} lines" for name, text in modules.items() if (n := len(text.splitlines())) > MODULE_LINES]
    long = [
        f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, text in modules.items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    ]
    assert not big and not long, big + long
    assert len(modules["session.py"].splitlines()) < SESSION_LINES
