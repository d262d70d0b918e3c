"""pytest hooks of pytest-moe-parity: with `--golden-dir`, one test item per capture point of the
golden, in forward order; without it, the plugin adds nothing and changes nothing. The real work
lives in modules that know nothing of pytest (golden, backends, runner, verdict, report)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .points import COMPONENTS

if TYPE_CHECKING:
    from .golden import GoldenStore
    from .judge.verdict import PointResult
    from .replay.runner import ParityRunner

COLLECTOR_NAME = "parity"
CONFIG_KEYS_THAT_MUST_MATCH = (
    ("model_type", ("model_type",)),
    ("hidden_size", ("hidden_size",)),
    ("num_hidden_layers", ("num_hidden_layers",)),
    ("experts", ("num_local_experts", "num_experts", "n_routed_experts")),
    ("top_k", ("num_experts_per_tok", "moe_topk", "top_k")),
    ("vocab_size", ("vocab_size",)),
)


@dataclass
class ParityState:
    """Everything the plugin holds for one session (one per xdist worker)."""

    golden_dir: Path
    golden: GoldenStore
    hw: str
    model_dir: Path
    dtype: Any  # torch.dtype
    report_dir: Path | None
    cli_tolerances: list = field(default_factory=list)
    ini_tolerances: list = field(default_factory=list)
    trust_remote_code: bool = False
    map_file: Path | None = None
    explicit_paths: bool = False
    runner: ParityRunner | None = None
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    interrupted: bool = False

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def backend_options(self):
        from .backends import BackendOptions

        return BackendOptions(
            golden=self.golden,
            model_dir=self.model_dir,
            dtype=self.dtype,
            device="cuda" if self.hw == "cuda" else "cpu",
            trust_remote_code=self.trust_remote_code,
            extra={"map": self.map_file} if self.map_file else {},
        )

    def get_runner(self) -> ParityRunner:
        if self.runner is None:
            from .backends import backend_class
            from .replay.runner import ParityRunner

            cls = backend_class(self.hw)
            options = self.backend_options()
            _quiet_transformers()
            self.runner = ParityRunner(
                self.golden,
                lambda: cls(options),
                self.dtype,
                cli_tolerances=self.cli_tolerances,
                ini_tolerances=self.ini_tolerances,
            )
        return self.runner


STATE_KEY = pytest.StashKey[ParityState]()


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()


# -- options -------------------------------------------------------------------------------------


def _tolerance_arg(text: str) -> tuple[str, dict]:
    import argparse

    from .judge.tolerances import parse_override

    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moe-parity", "MoE layer-by-layer parity against a golden recording")
    group.addoption(
        "--golden-dir",
        dest="parity_golden_dir",
        default=None,
        help="golden directory recorded by `moe-parity golden`; enables the parity items (ini: golden_dir)",
    )
    group.addoption(
        "--hw",
        dest="parity_hw",
        default=None,
        help="candidate backend: cpu, cuda, or one registered under pytest_moe_parity.backends (default: cpu)",
    )
    group.addoption(
        "--model",
        dest="parity_model",
        default=None,
        help="candidate checkpoint directory (default: the model recorded in the golden manifest)",
    )
    group.addoption(
        "--dtype",
        dest="parity_dtype",
        default=None,
        help="candidate dtype, e.g. bfloat16 (default: the golden's dtype)",
    )
    group.addoption(
        "--parity-report",
        dest="parity_report",
        default=None,
        metavar="DIR",
        help="write comparison_report.json and comparison_summary.json to DIR",
    )
    group.addoption(
        "--parity-tol",
        dest="parity_tol",
        action="append",
        default=[],
        type=_tolerance_arg,
        metavar="PATTERN:key=value,...",
        help="tolerance override for point ids matching PATTERN, e.g. 'layer_*.router:max_flip_share=0.1' "
        "(keys: cosine, rel_l2, atol, rtol, within, max_flip_share, tie_factor); repeatable",
    )
    group.addoption(
        "--parity-map",
        dest="parity_map",
        default=None,
        metavar="FILE",
        help="with --hw dump: JSON map of point ids to dumped tensor names, e.g. "
        '\'{"layer_{layer}.attention": "decoder.{layer}.attn_out"}\'',
    )
    group.addoption(
        "--parity-trust-remote-code",
        dest="parity_trust_remote_code",
        action="store_true",
        default=False,
        help="allow the candidate checkpoint's own modeling code (off by default)",
    )
    parser.addini("golden_dir", "golden directory (same as --golden-dir)", default=None)
    parser.addini(
        "parity_tolerances",
        "tolerance overrides, one 'PATTERN:key=value,...' per line (e.g. 'layer_*.logits:rel_l2=0.05')",
        type="linelist",
        default=[],
    )


# -- configuration ---------------------------------------------------------------------------------


def _golden_dir_option(config: pytest.Config) -> Path | None:
    opt = config.getoption("parity_golden_dir")
    if opt:
        return Path(opt).expanduser().resolve()
    ini = config.getini("golden_dir")
    if ini:
        base = config.inipath.parent if config.inipath else config.rootpath
        return (base / str(ini)).expanduser().resolve()
    return None


def _candidate_dir(golden: GoldenStore, option: str | None) -> Path:
    if option:
        path = Path(option).expanduser().resolve()
        if not path.is_dir():
            raise pytest.UsageError(f"--model {option}: candidate checkpoint directory does not exist")
        return path
    model = golden.manifest["model"]
    for candidate in (model.get("path"), model.get("path_relative")):
        if not candidate:
            continue
        path = Path(candidate)
        if not path.is_absolute():
            path = (golden.root / path).resolve()
        if path.is_dir():
            return path
    raise pytest.UsageError(
        f"the golden's model {model.get('path')} does not exist on this machine; "
        "pass the candidate checkpoint with --model DIR"
    )


def _config_value(cfg: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return None


def config_differences(golden_cfg: dict[str, Any], candidate_cfg: dict[str, Any]) -> list[str]:
    diffs = []
    for label, names in CONFIG_KEYS_THAT_MUST_MATCH:
        g, c = _config_value(golden_cfg, names), _config_value(candidate_cfg, names)
        if g != c:
            diffs.append(f"{label}: golden {g!r}, candidate {c!r}")
    return diffs


def _check_candidate_config(state: ParityState) -> None:
    config_file = state.model_dir / "config.json"
    if not config_file.is_file():
        raise pytest.UsageError(f"candidate {state.model_dir} is not a transformers checkpoint (no config.json)")
    try:
        candidate = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"{config_file} is not valid JSON ({exc})") from None
    golden_cfg = dict(state.golden.manifest["model"].get("config", {}))
    golden_cfg.setdefault("model_type", state.golden.model_type)
    diffs = config_differences(golden_cfg, candidate)
    if diffs:
        raise pytest.UsageError(f"candidate {state.model_dir} does not match the golden's model: " + "; ".join(diffs))


def _make_state(config: pytest.Config, golden_dir: Path) -> ParityState:
    from .backends import BackendError, available_backends, backend_class
    from .golden import GoldenError, GoldenStore
    from .judge.tolerances import parse_ini_lines

    try:
        golden = GoldenStore(golden_dir)
    except GoldenError as exc:
        raise pytest.UsageError(f"--golden-dir: {exc}") from None
    hw = config.getoption("parity_hw") or "cpu"
    backends = available_backends()
    if hw not in backends:
        raise pytest.UsageError(f"--hw {hw!r} is not a known backend; available: {', '.join(sorted(backends))}")
    try:
        ini_tols = parse_ini_lines(config.getini("parity_tolerances"))
    except ValueError as exc:
        raise pytest.UsageError(f"parity_tolerances (ini): {exc}") from None
    try:
        cls = backend_class(hw)
    except BackendError as exc:
        raise pytest.UsageError(f"--hw {hw}: {exc}") from None
    model_option = config.getoption("parity_model")
    if not cls.needs_checkpoint and not model_option:
        raise pytest.UsageError(f"--hw {hw} needs the candidate's location: pass --model DIR")
    report = config.getoption("parity_report")
    map_file = config.getoption("parity_map")
    state = ParityState(
        golden_dir=golden_dir,
        golden=golden,
        hw=hw,
        model_dir=_candidate_dir(golden, model_option),
        dtype=None,
        map_file=Path(map_file).expanduser().resolve() if map_file else None,
        report_dir=Path(report).expanduser().resolve() if report else None,
        cli_tolerances=list(config.getoption("parity_tol")),
        ini_tolerances=ini_tols,
        trust_remote_code=config.getoption("parity_trust_remote_code"),
        explicit_paths=config.args_source == pytest.Config.ArgsSource.ARGS,
    )
    if cls.needs_checkpoint:
        _check_candidate_config(state)
    try:
        cls.check_options(state.backend_options())
        state.dtype = _candidate_dtype(config, golden, cls, state)
    except BackendError as exc:
        raise pytest.UsageError(f"--hw {hw}: {exc}") from None
    return state


def _candidate_dtype(config: pytest.Config, golden: GoldenStore, cls, state: ParityState):
    from .dtypes import parse_dtype

    name = config.getoption("parity_dtype")
    if name is None:
        found = cls.default_dtype(state.backend_options())
        if found is not None:
            return found
        name = golden.manifest["record"]["dtype"]
    try:
        return parse_dtype(name, floating=True)
    except ValueError:
        raise pytest.UsageError(f"--dtype {name!r} is not a floating-point torch dtype (e.g. bfloat16)") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "parity(cosine=, rel_l2=, atol=, rtol=, within=, max_flip_share=, tie_factor=): "
        "tolerance for a moe-parity point or for the `parity` fixture",
    )
    golden_dir = _golden_dir_option(config)
    if golden_dir is None:
        return
    for comp in COMPONENTS:
        config.addinivalue_line("markers", f"{comp}: moe-parity items of the {comp} component")
    state = _make_state(config, golden_dir)
    config.stash[STATE_KEY] = state
    config.pluginmanager.register(_SessionHooks(state), "moe-parity-session")


def _state(config: pytest.Config) -> ParityState | None:
    return config.stash.get(STATE_KEY, None)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Under xdist, keep each layer's items on one worker unless the user chose a --dist mode."""
    if not config.pluginmanager.hasplugin("xdist") or not _golden_dir_option(config):
        return
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadgroup"


# -- collection ------------------------------------------------------------------------------------


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`pytest --golden-dir G` with no path runs the parity items only."""
    state = _state(config)
    if state is not None and not state.explicit_paths and not _is_worker(config):
        return True
    if state is not None and _is_worker(config) and not _worker_explicit_paths(config):
        return True
    return None


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _worker_explicit_paths(config: pytest.Config) -> bool:
    return bool(config.workerinput.get("parity_explicit_paths", False))  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # xdist controller -> worker
    state = _state(node.config)
    if state is not None:
        node.workerinput["parity_explicit_paths"] = state.explicit_paths


class ParityFailure(AssertionError):
    def __init__(self, result: PointResult):
        super().__init__(result.id)
        self.result = result


class ParityCollector(pytest.Collector):
    def collect(self):
        state = _state(self.config)
        assert state is not None
        for point in state.golden.points:
            item = ParityItem.from_parent(self, name=point["id"], point=point)
            item.add_marker(getattr(pytest.mark, point["component"]))
            if point["layer"] is not None:
                item.add_marker(pytest.mark.xdist_group(name=f"layer_{point['layer']}"))
            yield item


class ParityItem(pytest.Item):
    def __init__(self, *, point: dict[str, Any], **kwargs: Any):
        super().__init__(**kwargs)
        self.point = point
        self.result: PointResult | None = None

    def runtest(self) -> None:
        state = _state(self.config)
        assert state is not None
        from .backends import PointUnavailable

        marker = self.get_closest_marker("parity")
        try:
            self.result = state.get_runner().run(self.point["id"], dict(marker.kwargs) if marker else None)
        except PointUnavailable as exc:
            raise pytest.skip.Exception(str(exc), _use_item_location=True) from None
        m = self.result.main
        if m is not None:
            self.user_properties.extend(
                [("cosine", m.cosine), ("rel_l2", m.rel_l2), ("max_abs", m.max_abs), ("snr_db", m.snr_db)]
            )
        self.user_properties.append(("parity_status", self.result.status))
        if not self.result.passed:
            raise ParityFailure(self.result)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        from .report.text import failure_text

        if isinstance(excinfo.value, ParityFailure):
            return failure_text(excinfo.value.result)
        exc = excinfo.value
        return f"{self.name}: {type(exc).__name__}: {exc}\n" + str(
            super().repr_failure(excinfo, style="short" if style is None else style)
        )

    def reportinfo(self):
        return self.path, 0, f"parity {self.name}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    if state is None:
        _validate_markers(items)
        return
    collector = ParityCollector.from_parent(session, name=COLLECTOR_NAME, nodeid=COLLECTOR_NAME, path=state.golden_dir)
    parity_items = list(collector.collect())
    # Report the items like a collector would, so "collected N items", --lf and xdist see them.
    session.ihook.pytest_collectreport(report=pytest.CollectReport(collector.nodeid, "passed", None, parity_items))
    items[:0] = parity_items
    _validate_markers(items)


def _validate_markers(items: list[pytest.Item]) -> None:
    from .judge.tolerances import validate

    for item in items:
        for marker in item.iter_markers("parity"):
            if marker.args:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.parity takes keyword arguments only")
            try:
                validate(dict(marker.kwargs))
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.parity: {exc}") from None


# -- results and reports ---------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if isinstance(item, ParityItem) and report.when in ("setup", "call"):
        if item.result is not None and report.when == "call":
            report.parity_row = json.dumps(item.result.to_row())
        elif report.failed or report.skipped:
            message = str(call.excinfo.value) if call.excinfo else ""
            row = {
                "id": item.point["id"],
                "order": item.point["order"],
                "layer": item.point["layer"],
                "component": item.point["component"],
                "status": "skipped" if report.skipped else "error",
                "error" if report.failed else "reason": message,
                "metrics": {},
                "checks": [],
            }
            report.parity_row = json.dumps(row)
    return report


class _SessionHooks:
    """Hooks that need the session state but receive no config: registered per session."""

    def __init__(self, state: ParityState):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = getattr(report, "parity_row", None)
        if row is not None:
            data = json.loads(row)
            self.state.rows[data["id"]] = data

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.state.interrupted = True


def _meta(state: ParityState) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "golden_dir": str(state.golden_dir),
        "model_type": state.golden.model_type,
        "candidate_model": str(state.model_dir),
        "hw": state.hw,
        "dtype": state.dtype_name,
    }
    # What this process read (absent under xdist, where the workers did the reading).
    if state.golden.opened_files:
        meta["golden_files_read"] = sorted(set(state.golden.opened_files))
    lazy = getattr(state.runner.backend, "lazy", None) if state.runner and state.runner.backend_started else None
    if lazy is not None:
        meta["candidate_reads"] = {
            "units": sorted(lazy.loaded_units),
            "keys": list(lazy.stats.keys),
            "bytes": lazy.stats.bytes,
            "files": sorted(lazy.stats.files),
        }
    return meta


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = _state(session.config)
    if state is None:
        return
    if state.runner is not None:
        state.runner.close()
    if _is_worker(session.config):
        return
    interrupted = state.interrupted or exitstatus == pytest.ExitCode.INTERRUPTED
    if state.report_dir is not None and state.rows:
        from .report.files import write_reports

        write_reports(state.report_dir, list(state.rows.values()), meta=_meta(state), interrupted=interrupted)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    state = _state(config)
    if state is None or _is_worker(config):
        return
    from .report.text import first_divergence, summary_table

    tr = terminalreporter
    rows = list(state.rows.values())
    m = state.golden.manifest
    tr.write_sep("=", "moe-parity")
    tr.write_line(
        f"golden {state.golden_dir} ({m['model']['model_type']}, {m['model'].get('num_hidden_layers')} layers, "
        f"{m['inputs']['seq_len']} tokens, {m['record']['dtype']}) vs {state.hw} "
        f"{state.dtype_name} candidate {state.model_dir}"
    )
    if not rows:
        tr.write_line("no parity items ran")
        return
    for line in summary_table(rows):
        tr.write_line(line)
    first = first_divergence(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "error", "skipped")}
    tr.write_line(
        f"{len(rows)} points: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors"
        + (f", {counts['skipped']} skipped" if counts["skipped"] else "")
        + (f"; reports in {state.report_dir}" if state.report_dir else "")
    )
    if first is None:
        tr.write_line("first divergence: none", green=True, bold=True)
    else:
        hint = f"  ({first['hint']})" if first.get("hint") else ""
        tr.write_line(f"first divergence: {first['id']}{hint}", red=True, bold=True)


# -- fixtures for custom tests ---------------------------------------------------------------------


def _require_state(request: pytest.FixtureRequest) -> ParityState:
    state = _state(request.config)
    if state is None:
        pytest.skip("needs a golden recording: pass --golden-dir (or set golden_dir in the ini file)")
    return state


@pytest.fixture(scope="session")
def golden(request: pytest.FixtureRequest) -> GoldenStore:
    """The golden store: `golden.load("layer_3.attention")` gives its args, kwargs and output."""
    return _require_state(request).golden


class CandidateHandle:
    """The candidate for custom tests: `candidate.module("layer_3.attention")` (torch backends),
    `candidate.call(record)` runs a golden record's inputs through the candidate."""

    def __init__(self, state: ParityState):
        self._state = state

    @property
    def backend(self):
        return self._state.get_runner().backend

    @property
    def dtype(self):
        return self._state.dtype

    def module(self, point_or_path: str):
        backend = self.backend
        lazy = getattr(backend, "lazy", None)
        if lazy is None:
            raise TypeError(f"the {backend.name} backend has no transformers modules; use candidate.call()")
        golden = self._state.golden
        path = golden.point(point_or_path)["module"] if point_or_path in golden.point_ids else point_or_path
        return lazy.module(path)

    def call(self, record) -> Any:
        return self.backend.run(record.point, record).output


@pytest.fixture(scope="session")
def candidate(request: pytest.FixtureRequest) -> CandidateHandle:
    return CandidateHandle(_require_state(request))


@pytest.fixture
def parity(request: pytest.FixtureRequest):
    """parity(golden_tensor, candidate_tensor, component="custom") compares under the resolved
    tolerance (the test's parity marker, --parity-tol / ini patterns over the test name, dtype
    defaults) and fails with the metrics table; returns the PointResult."""
    state = _state(request.config)

    def check(golden_tensor, candidate_tensor, *, component: str = "custom", point_id: str | None = None):
        __tracebackhide__ = True
        from .dtypes import dtype_name
        from .judge.tolerances import resolve
        from .judge.verdict import judge_point
        from .report.text import failure_text

        dtype = state.dtype if state is not None else candidate_tensor.dtype
        name = point_id or request.node.name
        marker = request.node.get_closest_marker("parity")
        tol, sources = resolve(
            name,
            component,
            dtype,
            marker=dict(marker.kwargs) if marker else None,
            cli=state.cli_tolerances if state else [],
            ini=state.ini_tolerances if state else [],
        )
        point = {"id": name, "layer": None, "component": component, "order": 0}
        result = judge_point(point, golden_tensor, candidate_tensor, tol, dtype)
        result.tolerance_sources = sources
        result.golden_dtype = dtype_name(golden_tensor.dtype)
        if not result.passed:
            pytest.fail(failure_text(result), pytrace=False)
        return result

    return check


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    state = _state(config)
    if state is None:
        return None
    return [
        f"moe-parity: golden {state.golden_dir} ({len(state.golden.point_ids)} points), "
        f"--hw {state.hw}, candidate {state.model_dir} in {state.dtype_name}"
    ]
