"""`moe-parity report` (and `report --merge`, a sharded run's reports made one) and `moe-parity
diff`: reports redrawn, merged and compared run to run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..words import counted
from .common import EXIT_FAILED, EXIT_OK, Command, factor_arg, write_json


def _report_arguments(sub: Any) -> None:
    report = sub.add_parser(
        "report",
        help="redraw a report's pictures and print its summary from the JSON; --merge: the shards of a sharded run "
        "made one run's report (exit 1 where it failed or lacks a shard, 2 if they are not one run)",
    )
    report.add_argument(
        "report", type=Path, nargs="?", help="a --parity-report directory (or its comparison_report.json)"
    )
    report.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="the --parity-report directories of a run's shards (--parity-layers selections of one golden, candidate "
        "and settings): merged into --out",
    )
    report.add_argument("--out", type=Path, metavar="DIR", help="where --merge writes the merged run's reports")
    report.add_argument(
        "--previous",
        type=Path,
        metavar="DIR",
        help="with --merge: the previous run's merged report, diffed against tonight's (absent: said, not a failure)",
    )


def cmd_report(args: argparse.Namespace) -> int:
    """Redraw the pictures of a --parity-report directory from its JSON and print its summary."""
    if args.merge is not None or args.out is not None or args.previous is not None:
        return _report_merge(args)
    if args.report is None:
        raise BadInput("give a --parity-report DIR to redraw, or --merge DIR... --out DIR")
    from ..report.block import bug_report, bug_report_text
    from ..report.files import plots_line, read_report, report_rows
    from ..report.history import DIFF_FILE, load_diff
    from ..report.html import HTML_FILE, write_html
    from ..report.plots import render_plots
    from ..report.summary import summary_lines, summary_table

    report = read_report(args.report)
    directory = args.report if args.report.is_dir() else args.report.parent
    rows = report_rows(report)
    points = [r for r in rows if r.kind != "op"]  # a drill's ops are its table, not points
    written = render_plots(points, directory)  # what this command is for: without matplotlib, said and exit 2
    try:  # the page shows them: written again with them, and with a diff.json beside the report
        page = write_html(directory, report, pictures=written)
    except OSError as exc:
        raise BadInput(f"{directory}: cannot write {HTML_FILE} ({exc})") from None
    _, not_shown = load_diff(directory, report)
    print(f"moe-parity report: {directory} ({_describe_run(report)}, {counted(len(points), 'point')})")
    for line in summary_table(rows):
        print(line)
    for line, _ in summary_lines(rows):
        print(line)
    print(f"page: {page}" + (f" ({DIFF_FILE} not shown: {not_shown})" if not_shown else ""))
    print(plots_line(written, directory))
    for line in bug_report_text(bug_report(rows, report)):
        print(line)
    return EXIT_OK


def _report_merge(args: argparse.Namespace) -> int:
    """`moe-parity report --merge DIR... --out DIR`: exit 0 when the merged run is whole and every item passed,
    1 when an item failed or errored or the run lacks a shard (named, in the output and the merged summary), 2
    when the directories are not the shards of one run."""
    from ..report.merge import merge, merge_lines, problem_lines, write_merged
    from ..report.summary import summary_lines, summary_table

    if args.report is not None:
        raise BadInput(f"--merge takes the shards' directories; {args.report} is one more: add it after --merge")
    if not args.merge or args.out is None:
        raise BadInput("--merge DIR... and --out DIR go together: the shards' reports, and where the merged one goes")
    if args.out.resolve() in {p.resolve() for p in args.merge}:
        raise BadInput(f"--out {args.out} is one of the shards: write the merged report elsewhere")
    merged = merge(args.merge)
    try:
        written = write_merged(merged, args.out)
    except OSError as exc:
        raise BadInput(f"--out {args.out}: cannot write the merged report ({exc})") from None
    for line in merge_lines(merged):
        print(line)
    for line in summary_table(merged.rows):
        print(line)
    for line, _ in summary_lines(merged.rows, report_dir=args.out):
        print(line)
    for line in [*problem_lines(merged), *written]:
        print(line)
    if args.previous is not None:
        for line in _previous_lines(args.previous, args.out):
            print(line)
    return EXIT_OK if merged.passed else EXIT_FAILED


def _previous_lines(previous: Path, tonight: Path) -> list[str]:
    """The previous run's report diffed against tonight's merged one, best effort: a previous report
    that is not there or not comparable is said in a line, never a failure (a first night has none)."""
    from ..report.files import read_report
    from ..report.history import comparable, diff_reports
    from ..report.html import write_diff

    if not previous.exists():
        return [f"no previous report at {previous}: nothing to diff against (a first run)"]
    try:
        old, new = read_report(previous), read_report(tonight)
    except ValueError as exc:
        return [f"previous report not read: {exc}"]
    reason = comparable(old, new)
    if reason is not None:
        return [f"previous report not diffed: {reason}"]
    diff = diff_reports(old, new)
    lines = diff.lines(str(previous), str(tonight), 2.0)
    try:  # the merged run's page shows the diff too (diff.json beside its report)
        write_diff(tonight, new, diff.to_json(str(previous), str(tonight), 2.0))
    except OSError as exc:
        lines.append(f"the diff is not on the page: {exc}")
    return lines


def _describe_run(report: dict) -> str:
    return (
        f"{report.get('model_type', '?')} on --hw {report.get('hw', '?')} in {report.get('dtype', '?')}, "
        f"{report.get('mode', 'isolated')} mode"
    )


def _diff_arguments(sub: Any) -> None:
    diff = sub.add_parser(
        "diff", help="points that got worse from one report to the next (exit 1 when any did, 2 if not comparable)"
    )
    diff.add_argument("old", type=Path, help="the earlier --parity-report directory (or its JSON)")
    diff.add_argument("new", type=Path, help="the later one")
    diff.add_argument(
        "--factor", type=factor_arg, default=2.0, help="a figure counts as worse beyond this factor (default 2)"
    )
    diff.add_argument(
        "--min-error",
        type=float,
        default=1e-3,
        help="a rel_l2 below this is rounding, whatever its growth (default 1e-3)",
    )
    diff.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the diff as JSON (as NEW/diff.json, report.html shows it: moe-parity report NEW)",
    )


def cmd_diff(args: argparse.Namespace) -> int:
    """Points that got worse between two reports: exit 1 when any did, 2 when they are not comparable."""
    from ..report.files import read_report
    from ..report.history import comparable, diff_reports

    old, new = read_report(args.old), read_report(args.new)
    reason = comparable(old, new)
    if reason is not None:
        raise BadInput(reason)
    result = diff_reports(old, new, factor=args.factor, min_error=args.min_error)
    if not result.common:
        raise BadInput(f"{args.old} and {args.new} share no point; nothing to compare")
    for line in result.lines(str(args.old), str(args.new), args.factor):
        print(line)
    as_json = result.to_json(str(args.old), str(args.new), args.factor)
    if args.json is not None:
        write_json(args.json, as_json)
    return EXIT_FAILED if result.worse else EXIT_OK


REPORT = Command("report", _report_arguments, cmd_report)
DIFF = Command("diff", _diff_arguments, cmd_diff)
