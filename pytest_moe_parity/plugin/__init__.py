"""pytest hooks of pytest-moe-parity: with `--golden-dir`, one test item per capture point of the
golden, in forward order; without it, the plugin adds nothing and changes nothing. The work is done
by a `ParitySession` (session.py), which knows nothing of pytest. Its options and the session made
from them are here; the items and their collector in `items`, the fixtures of custom tests in
`fixtures`. Importing the plugin imports neither torch nor transformers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..points import COMPONENTS, positive_int
from .fixtures import candidate, golden, parity  # noqa: F401 (pytest finds a plugin's fixtures on it)
from .items import SESSION_KEY, ParityCollector, ParityItem, _CheckItem, _message
from .layer_first import LAYER_FIRST_KEY, LayerFirst, active, wanted

if TYPE_CHECKING:
    from ..session import ParitySession

COLLECTOR_NAME = "parity"


def _tolerance_arg(text: str) -> tuple[str, dict]:
    from ..judge.tolerances import parse_override

    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --flag, dest, extra keywords, help; every value is read in _make_session. The options of the kinds
# of items (--parity-weights ... --parity-parallel) are their checkers' (`Checker.options`, the rows
# of `session.CHECKERS`): repeated here because importing a checker imports torch, which adding
# options must not (tests/test_layers.py holds the two the same).
# fmt: off
_OPTIONS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("--golden-dir", "parity_golden_dir", {},
     "golden directory recorded by `moe-parity golden`; enables the parity items (ini: golden_dir)"),
    ("--hw", "parity_hw", {}, "candidate backend: cpu, cuda, trace, compile, neuron, nxdi, dump, or one registered "
     "under the entry-point group pytest_moe_parity.backends (default: cpu)"),
    ("--model", "parity_model", {}, "the candidate: a checkpoint directory, or for --hw dump a directory of "
     "dumped tensors (default: the golden's model, found relative to the golden first)"),
    ("--dtype", "parity_dtype", {}, "candidate dtype, e.g. bfloat16 (default: the backend's, else the golden's)"),
    ("--hw-option", "parity_hw_options", {"action": "append", "default": [], "metavar": "KEY=VALUE"},
     "a backend setting, e.g. device=cuda:1 or map=names.json; repeatable (ini: parity_hw_options)"),
    ("--parity-layers", "parity_layers", {"metavar": "1,17,20-29"},
     "run exactly these decoder layers (-k layer_1 also matches layers 10-19; ini: parity_layers)"),
    ("--parity-mode", "parity_mode", {"choices": ("isolated", "chain", "both")},
     "isolated: every point on the golden's inputs (default); chain: on the candidate's own outputs, as in a "
     "real run, judged against the reference's own error; both: each point both ways (ini: parity_mode)"),
    ("--parity-report", "parity_report", {"metavar": "DIR"},
     "write comparison_report.json and comparison_summary.json to DIR"),
    ("--parity-plots", "parity_plots", {"choices": ("yes", "no")},
     "draw the report's pictures beside its JSON (default: yes; ini: parity_plots)"),
    ("--parity-tol", "parity_tol", {"action": "append", "default": [], "type": _tolerance_arg,
                                    "metavar": "PATTERN:key=value,..."},
     "tolerance override for point ids matching PATTERN, e.g. 'layer_*.router:max_flip_share=0.1' "
     "(keys: {keys}); repeatable"),
    ("--noise-quant", "parity_noise_quant", {"metavar": "SPEC"},
     "judge each point against the golden's quantization noise floor of SPEC (recorded by `moe-parity golden "
     "--noise-quant SPEC`, e.g. fp8-block:128+dynamic-token): its error over the reference's own under that scheme; "
     "none: the candidate dtype's floor (default: the floor of the scheme of --hw-option quant, else for a quantized "
     "candidate checkpoint the golden's one quantization floor)"),
    ("--parity-map", "parity_map", {"metavar": "FILE"}, "same as --hw-option map=FILE (--hw dump)"),
    ("--parity-weights", "parity_weights", {"action": "store_true", "default": None},
     "check the candidate's weights against the golden's model before its activations: an item per layer "
     "(layer_N.weights) and one for the model-level weights (default: wherever the candidate is a checkpoint "
     "other than the golden's model and that model is on this machine; with this flag, say why not otherwise)"),
    ("--no-parity-weights", "parity_weights", {"action": "store_false", "default": None},
     "no weight items"),
    ("--no-parity-config", "parity_config", {"action": "store_false", "default": True},
     "no config item (by default the candidate checkpoint's config.json is checked against the reference's, "
     "field by field, before any forward)"),
    ("--parity-threads", "parity_threads", {"type": int, "metavar": "N"},
     "intra-op threads of each process running points (default: the cores / the xdist workers under -n, "
     "else torch's; ini: parity_threads)"),
    ("--parity-drill", "parity_drill", {"action": "append", "default": [], "metavar": "auto|POINTS"},
     "drill below these points (ids or globs, comma-separated, repeatable, e.g. 'layer_17.attention,layer_*.router'): "
     "an item per op of each, in forward order (POINT::OP), and POINT::drill with the op table and the culprit; "
     "auto: the op table of the run's first failing component in its failure text"),
    ("--parity-repro", "parity_repro", {"metavar": "DIR"},
     "with --parity-drill: write each culprit op's standalone repro (test_*.py + .safetensors) to DIR"),
    ("--parity-routing", "parity_routing", {"choices": ("ids", "ids+weights")},
     "after each MoE block, an item (POINT::routing) that replays it with the golden's expert ids (ids), then "
     "also its weights (ids+weights): it fails where the routing alone changes the block and names the level "
     "that recovers it (--hw cpu or cuda)"),
    ("--parity-batch-invariance", "parity_batch", {"action": "store_true", "default": False},
     "with a batch golden (--prompts): after each prefill point, an item (POINT::batch) that runs it on each row "
     "alone too and fails where a row's output in the batch differs from its own alone, naming the rows"),
    ("--parity-parallel", "parity_parallel", {"metavar": "A:B"},
     "after each point, an item (POINT::parallel) that runs it with the candidate built under plan A and plan B "
     "(e.g. tp=1:tp=2) and fails where B leaves A's limits, naming the parallelism (--hw nxdi, vllm: tp, ep)"),
    ("--parity-precision-search", "parity_precision", {"action": "append", "default": [], "metavar": "POINTS"},
     "after each of these points (ids or globs, comma-separated, repeatable, e.g. 'layer_*.router'), an item "
     "(POINT::precision) that, where the point fails, bisects for the fewest op groups of its submodules that must "
     "run in float32 for it to pass, and names them (--hw cpu, cuda, trace, compile)"),
    ("--parity-state", "parity_state", {"metavar": "reused|prefix|DIR"},
     "after each point, an item (POINT::state) that runs it in another serving state of the candidate against the "
     "prompt's clean run: after other requests in the same cache slots (reused), on a prefix-cache hit another "
     "request wrote (prefix), or a dump of the prompt taken under another state (DIR, with --hw dump --model "
     "CLEAN_DUMP); it fails where the state alone changes the output"),
    ("--parity-layer-first", "parity_layer_first", {"action": "store_true", "default": None},
     "run each decoder layer once and judge its output and components as that run made them; run the component "
     "items only where one fails (default: under -x, in an isolated run on cpu or cuda)"),
    ("--no-parity-layer-first", "parity_layer_first", {"action": "store_false", "default": None},
     "run every component item, also under -x"),
    ("--parity-require-candidate", "parity_require_candidate", {"action": "store_true", "default": False},
     "refuse a run that checks nothing about a port: the golden against itself (its own model, dtype and "
     "backend) or a selection with no point (a usage error; CI=true in the environment does the same)"),
    ("--parity-trust-remote-code", "parity_trust_remote_code", {"action": "store_true", "default": False},
     "allow the candidate checkpoint's own modeling code (off by default)"),
)
_INI = (
    ("golden_dir", "golden directory (same as --golden-dir)", None),
    ("parity_tolerances", "tolerance overrides, one 'PATTERN:key=value,...' per line", "linelist"),
    ("parity_hw_options", "backend settings, one KEY=VALUE per line", "linelist"),
    ("parity_layers", "decoder layers to run, e.g. 1,17,20-29 (same as --parity-layers)", None),
    ("parity_mode", "isolated, chain or both (same as --parity-mode)", None),
    ("parity_plots", "yes or no (same as --parity-plots)", None),
    ("parity_threads", "intra-op threads of each process running points (same as --parity-threads)", None),
)
# fmt: on


def pytest_addoption(parser: pytest.Parser) -> None:
    from ..judge.tolerances import KEYS

    group = parser.getgroup("moe-parity", "MoE layer-by-layer parity against a golden recording")
    for flag, dest, extra, text in _OPTIONS:
        group.addoption(flag, dest=dest, help=text.replace("{keys}", ", ".join(KEYS)), **extra)
    for name, text, kind in _INI:
        parser.addini(name, text, type=kind, default=[] if kind == "linelist" else None)


def _golden_dir_option(config: pytest.Config) -> Path | None:
    opt = config.getoption("parity_golden_dir")
    if opt:
        return Path(opt).expanduser().resolve()
    ini = config.getini("golden_dir")
    if ini:
        base = config.inipath.parent if config.inipath else config.rootpath
        return (base / str(ini)).expanduser().resolve()
    return None


def _make_session(config: pytest.Config, golden_dir: Path) -> ParitySession:
    from ..judge.tolerances import parse_ini_lines
    from ..session import CHECKERS, ParitySession, RunOptions, SetupError, quiet_transformers

    try:
        ini_tolerances = parse_ini_lines(config.getini("parity_tolerances"))
    except ValueError as exc:
        raise pytest.UsageError(f"parity_tolerances (ini): {exc}") from None
    hw_options = [*config.getini("parity_hw_options"), *config.getoption("parity_hw_options")]
    if config.getoption("parity_map"):
        hw_options.append(f"map={Path(config.getoption('parity_map')).expanduser().resolve()}")
    report = config.getoption("parity_report")
    plots = config.getoption("parity_plots") or config.getini("parity_plots") or "yes"
    if plots not in ("yes", "no"):
        raise pytest.UsageError(f"parity_plots (ini): expected yes or no, got {plots!r}")
    raw = config.getoption("parity_threads")
    raw = raw if raw is not None else (config.getini("parity_threads") or None)
    try:
        threads = None if raw is None else positive_int(raw)
    except ValueError as exc:
        raise pytest.UsageError(f"--parity-threads / parity_threads: {exc}") from None
    quiet_transformers()
    _refuse_a_dumped_golden(config, golden_dir)
    try:
        session = ParitySession(
            RunOptions(
                golden_dir=golden_dir,
                hw=config.getoption("parity_hw") or "cpu",
                model=config.getoption("parity_model"),
                dtype=config.getoption("parity_dtype"),
                hw_options=hw_options,
                cli_tolerances=config.getoption("parity_tol"),
                ini_tolerances=ini_tolerances,
                layers=config.getoption("parity_layers") or config.getini("parity_layers"),
                mode=config.getoption("parity_mode") or config.getini("parity_mode") or None,
                noise_quant=config.getoption("parity_noise_quant"),
                report_dir=Path(report).expanduser().resolve() if report else None,
                plots=plots == "yes",
                threads=threads,
                trust_remote_code=config.getoption("parity_trust_remote_code"),
                checks={kind.kind: kind.value(config.getoption) for kind in CHECKERS},
                freeze_gc=True,
                **_xdist_role(config),
            )
        )
    except SetupError as exc:
        raise pytest.UsageError(str(exc)) from None
    if (refused := _vacuous_refusal(config, session, session.vacuous)) is not None:
        session.close()  # not yet in the config's cleanups
        raise pytest.UsageError(refused)
    return session


def _refuse_a_dumped_golden(config: pytest.Config, golden_dir: Path) -> None:
    """`--hw dump --model GOLDEN`: the golden itself as the candidate's dump, a usage error
    (`replay.vacuous.dump_refusal`), as `moe-parity compare GOLDEN GOLDEN` is."""
    from ..replay.vacuous import dump_refusal, golden_itself, required

    model = config.getoption("parity_model")
    if config.getoption("parity_hw") == "dump" and golden_itself(golden_dir, model):
        raise pytest.UsageError(dump_refusal(model, required(config.getoption("parity_require_candidate")), "--model"))


def _vacuous_refusal(config: pytest.Config, session: ParitySession, reason: str | None) -> str | None:
    """The usage error's sentence of a run that checks nothing about a port (`replay.vacuous`) where a
    candidate is required (--parity-require-candidate, CI=true); None where the run is not vacuous or
    nothing requires a candidate."""
    from ..dtypes import dtype_name
    from ..replay.vacuous import refusal, required

    by = required(config.getoption("parity_require_candidate"))
    if reason is None or by is None:
        return None
    return refusal(reason, by, dtype_name(session.dtype), session.hw)


def _xdist_role(config: pytest.Config) -> dict[str, Any]:
    """How many processes run points and which one this is (backends that share devices need it)."""
    inputs = getattr(config, "workerinput", None)
    if inputs is not None:
        return {"workers": int(inputs["workercount"]), "worker": int(str(inputs["workerid"]).removeprefix("gw"))}
    count = getattr(config.option, "numprocesses", None) if config.pluginmanager.hasplugin("xdist") else None
    return {"workers": count if isinstance(count, int) and count > 0 else 1, "worker": None}


def pytest_configure(config: pytest.Config) -> None:
    from ..judge.tolerances import KEYS

    config.addinivalue_line("markers", f"parity({'=, '.join(KEYS)}=): tolerance for a moe-parity point or "
                            "for the `parity` fixture")  # fmt: skip
    golden_dir = _golden_dir_option(config)
    if golden_dir is None:
        return
    from ..host import bound_onednn_caches

    bound_onednn_caches()  # before the first bf16 forward of the candidate
    from ..session import CHECKERS

    for comp in COMPONENTS:
        config.addinivalue_line("markers", f"{comp}: moe-parity items of the {comp} component")
    for kind in CHECKERS:
        if kind.marker is not None:
            config.addinivalue_line("markers", f"{kind.kind}: {kind.marker}")
    session = _make_session(config, golden_dir)
    config.stash[SESSION_KEY] = session
    config.pluginmanager.register(ParityPlugin(config, session), "moe-parity-session")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Under xdist, keep each layer's items on one worker unless the user chose a --dist mode."""
    if not config.pluginmanager.hasplugin("xdist") or not _golden_dir_option(config):
        return
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Reject unknown `parity` marker keys, whether or not a golden is given; on an xdist worker,
    make sure each layer's items carry their group."""
    from ..judge.tolerances import validate_marker

    if getattr(config.option, "loadgroup", False):
        for item in items:
            if isinstance(item, ParityItem) and item.point.layer is not None and "@" not in item.nodeid:
                _suffix_group(item, item.point.group)
    for item in items:
        for marker in item.iter_markers("parity"):
            try:
                validate_marker(marker.args, marker.kwargs)
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.parity: {exc}") from None


def _suffix_group(item: pytest.Item, group: str) -> None:
    """What xdist's loadgroup does to a worker's nodeids (`id@group`), done where xdist's own
    `item._nodeid = ...` has no effect: pytest >= 9.2 derives `nodeid` from a structured `_id`."""
    from _pytest.nodeid import coerce_node_id

    item._id = coerce_node_id(f"{item.nodeid}@{group}")


class ParityPlugin:
    """The hooks of one parity session, registered only with a golden (as junitxml's LogXML)."""

    def __init__(self, config: pytest.Config, session: ParitySession):
        self.config = config
        self.session = session
        # Closed last (after pytest's own unconfigure and its garbage collections, which then skip
        # what the session froze): cleanups run in reverse, and this one is among the first.
        config.add_cleanup(session.close)
        self.worker = hasattr(config, "workerinput")
        self._node_collected = False  # an xdist controller: a worker's collection was read
        inputs = getattr(config, "workerinput", {})
        self.explicit_paths = (
            bool(inputs.get("parity_explicit_paths"))
            if self.worker
            else config.args_source == pytest.Config.ArgsSource.ARGS
        )
        if wanted(config, session):
            config.stash[LAYER_FIRST_KEY] = LayerFirst(session)
        if inputs.get("parity_loadgroup"):
            # workers re-parse the command line, so they never saw pytest_cmdline_main's --dist
            # loadgroup: without this, xdist does not group a layer's items on one worker
            config.option.loadgroup = True

    def pytest_report_header(self) -> list[str]:
        return self._header()

    def _header(self) -> list[str]:
        lf = active(self.config)
        return [*self.session.header_lines(), *([lf.header()] if lf else [])]

    def pytest_ignore_collect(self) -> bool | None:
        """`pytest --golden-dir G` with no path runs the parity items only."""
        return True if not self.explicit_paths else None

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:  # xdist controller -> worker
        node.workerinput["parity_explicit_paths"] = self.explicit_paths
        node.workerinput["parity_loadgroup"] = self.config.getoption("dist", "no") == "loadgroup"

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        golden_dir = self.session.golden.root
        collector = ParityCollector.from_parent(session, name=COLLECTOR_NAME, nodeid=COLLECTOR_NAME, path=golden_dir)
        parity_items = list(collector.collect())
        # Report the items like a collector would, so "collected N items", --lf and xdist see them.
        session.ihook.pytest_collectreport(report=pytest.CollectReport(collector.nodeid, "passed", None, parity_items))
        kept = [i for i in parity_items if self.session.selected(i.entry.layer)]
        if len(kept) < len(parity_items):
            self.config.hook.pytest_deselected(items=[i for i in parity_items if i not in kept])
        items[:0] = kept
        if (lf := active(self.config)) is not None:
            lf.collected(kept)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.worker:  # a worker runs the items it is sent, not those it collected
            return
        points = [i.point for i in session.items if isinstance(i, ParityItem)]
        # no point, and no other item: the user's tests (which may check the candidate through the
        # fixtures), the config and weight items (they check its checkpoint); an xdist controller holds
        # no items of its own
        others = any(not isinstance(i, ParityItem) for i in session.items)
        if self.session.options.workers == 1 and not others and not points:  # -k, -m, --parity-layers kept none
            self._selected_nothing()
        self.session.plan(points)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """An xdist controller collects nothing itself: its selection is what each worker collected (the
        same on every worker, or xdist stops), here the first's. None (no point, no other item) is the
        empty selection, as `pytest_collection_finish` finds it without xdist."""
        if not self._node_collected:
            self._node_collected = True
            if not ids:
                self._selected_nothing()

    def _selected_nothing(self) -> None:
        """A run whose selection holds no point and no other item: `replay.vacuous.NO_POINT`, said in the
        summary, and a usage error where a candidate is required."""
        from ..replay.vacuous import NO_POINT

        if self.session.vacuous is not None:  # the golden against itself, said already
            return
        self.session.vacuous = NO_POINT
        if (refused := _vacuous_refusal(self.config, self.session, NO_POINT)) is not None:
            raise pytest.UsageError(refused)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if isinstance(item, ParityItem | _CheckItem) and report.when in ("setup", "call"):
            # the row's JSON: xdist ships it from the worker with the report
            if report.when == "call" and item.row is not None:
                report.parity_row = item.row.to_json()
            elif report.failed or report.skipped:
                status = "skipped" if report.skipped else "error"
                report.parity_row = self.session.unjudged_row(item.entry, status, _message(call.excinfo)).to_json()
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        row = getattr(report, "parity_row", None)
        if row is not None:
            from ..report.rows import Row

            self.session.add_row(Row.from_json(row))

    def pytest_keyboard_interrupt(self) -> None:
        self.session.interrupted = True

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.worker:
            return
        self.session.interrupted |= exitstatus == pytest.ExitCode.INTERRUPTED
        if exitstatus == pytest.ExitCode.OK and self.session.nothing_compared():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self.session.write_reports()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker:
            return
        terminalreporter.write_sep("=", "moe-parity")
        if not terminalreporter.showheader or terminalreporter.no_header:  # -q, --no-header: say it here
            for line in self._header():
                terminalreporter.write_line(line)
        for line, colour in self.session.closing_lines():
            terminalreporter.write_line(line, **({colour: True, "bold": True} if colour else {}))
        if (lf := active(self.config)) is not None and (said := lf.closing()):
            terminalreporter.write_line(said)
        from ..replay.setup import missing_steps

        missing = missing_steps(self.session.golden, self.config.option.keyword)
        if missing:
            terminalreporter.write_line(missing, yellow=True, bold=True)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        del config.stash[SESSION_KEY]
        if LAYER_FIRST_KEY in config.stash:
            del config.stash[LAYER_FIRST_KEY]
        config.pluginmanager.unregister(self)
