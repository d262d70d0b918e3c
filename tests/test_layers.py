"""The package's layering: each module imports only from the layers below it, so that the next
backends and modes land on one seam each. The rule is the package docstring's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pytest_moe_parity"
# lowest first; a module may import from its own layer's package (inside a sub-package) and below
LAYERS = [
    {"points", "dtypes", "errors", "tree", "compat", "files", "host"},
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
    "points",
    "dtypes",
    "errors",
    "tree",
    "compat",
    "files",
    "host",
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


NXDI_ROOMS = ["tables", "imports", "weights", "evidence", "calls", "backend"]  # lowest first


@pytest.mark.parametrize("room", [*NXDI_ROOMS, "cpu"])
def test_the_nxdi_backend_is_a_package_of_rooms(room: str) -> None:
    """`backends/nxdi/`: each room imports only the rooms before it (tables, imports, weights,
    evidence, calls, backend; the backend its CPU build too), and the CPU build (`cpu/`) only NxDI's
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
