"""What a run prints: the failure text of one point, the summary table and the closing lines,
shared by the pytest plugin and `moe-parity compare`. Rows are the plain dicts of the JSON report
(`PointResult.to_row()`, or `status_row` for points that were skipped or errored). No pytest here."""

from __future__ import annotations

import math
import textwrap
from typing import Any

from ..judge.verdict import PointResult
from ..points import Point

WIDTH = 100  # failure text: no line wider than this
STATUSES = ("passed", "failed", "error", "skipped")


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool | int):
        return str(x)
    if not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}g}" if abs(x) < 0.99 else f"{x:.{digits + 2}g}"
    return f"{x:.{digits - 1}e}"


def _wrapped(prefix: str, text: str, indent: int = 4) -> list[str]:
    """`text` wrapped at spaces only: a token (a point id, a figure, a path) is never cut."""
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=prefix,
        subsequent_indent=" " * indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


def failure_text(r: PointResult) -> str:
    """pytest-regressions style: shapes, a check table with limits, the count and the worst elements
    of what differs, worst tokens and experts, routing flips, the noise ratio, a hint and the
    tolerance that would accept it. In both modes, the failing verdict in full and a line for the
    passing one."""
    parts = [(r.mode, r), *((("chain", r.chain),) if r.chain is not None else ())]
    failing = [(mode, res) for mode, res in parts if res.verdicts.get(mode) == "failed"] or parts
    where = {"isolated": "", "chain": " on its own inputs"}
    inputs = " on the golden's inputs and on its own" if len(failing) > 1 else where[failing[0][0]]
    lines = _wrapped("", f"{r.id}: candidate ({r.candidate_dtype}) diverges from the golden ({r.golden_dtype}){inputs}")
    for mode, res in parts:
        if (mode, res) not in failing:
            main = res.main
            figures = f"rel_l2 {_fmt(main.rel_l2)}" if main is not None else ""
            if res.noise_ratio is not None:
                figures += f", noise ratio {_fmt(res.noise_ratio, 3)}"
            label = "golden inputs" if mode == "isolated" else "its own inputs"
            lines.append(f"  {mode} ({label}): passed ({figures})")
    for i, (mode, res) in enumerate(failing):
        if len(failing) > 1:
            lines += ([""] if i else []) + [f"  {mode}:"]
        lines += _verdict_lines(res)
    hint = r.hint
    if r.chain is not None and r.verdicts.get("isolated") == "passed":
        hint = HINT_CHAIN_ONLY
    elif r.mode == "chain":
        hint = f"{hint}; or error accumulated from the points before (see their noise ratios)" if hint else hint
    if hint:
        lines.extend(_wrapped("  hint: ", hint))
    remedy = r.remedy()
    if remedy:  # one line, however long: it is pasted as it stands
        lines.append(f"  to accept this result: {remedy}")
    lines.extend(_wrapped("  tolerance from: ", " < ".join(r.tolerance_sources)))
    return "\n".join(lines)


HINT_CHAIN_ONLY = (
    "right on the golden's inputs, wrong on its own: what the candidate builds around its modules "
    "(attention mask, position ids, rotary, the cache), or error accumulated from the points before "
    "(see their noise ratios)"
)


def _noise_lines(noise: dict[str, Any]) -> list[str]:
    parts = [
        f"{target} {_fmt(t['ratio'], 3)}x (reference rel_l2 {_fmt(t.get('reference_rel_l2'), 3)})"
        for target, t in noise["targets"].items()
    ]
    return _wrapped("  noise ratio (error / the reference's own in this dtype): ", ", ".join(parts))


def _verdict_lines(r: PointResult) -> list[str]:
    lines = []
    for target, m in r.metrics.items():
        lines.append(
            f"  {target}: golden {tuple(m.shape_golden)} {m.dtype_golden}, "
            f"candidate {tuple(m.shape_candidate)} {m.dtype_candidate}"
        )
    lines.append("")
    lines.append(f"  {'tensor':<9}{'metric':<16}{'value':>14}{'limit':>14}  verdict")
    for c in r.checks:
        limit = "-" if c.limit is None else f"{c.op} {_fmt(c.limit)}"
        lines.append(f"  {c.target:<9}{c.name:<16}{_fmt(c.value):>14}{limit:>14}  {'ok' if c.passed else 'FAIL'}")
    checked = {(c.target, c.name) for c in r.checks}
    for target, m in r.metrics.items():
        judged = "".join(
            f"{name} {_fmt(getattr(m, name), 6)}, " for name in ("cosine", "rel_l2") if (target, name) not in checked
        )
        lines.extend(
            _wrapped(
                f"  {target:<9}",
                f"{judged}snr {_fmt(m.snr_db)} dB, pearson {_fmt(m.pearson, 6)}, "
                f"max_abs {_fmt(m.max_abs)}, mean_abs {_fmt(m.mean_abs)}, max_rel {_fmt(m.max_rel)}",
                indent=11,
            )
        )
        if m.shape_match:
            share = m.mismatched / m.numel * 100 if m.numel else 0.0
            lines.append(
                f"  {'':<9}outside atol={_fmt(m.atol)}/rtol={_fmt(m.rtol)}: {m.mismatched} / {m.numel} ({share:.2f}%)"
            )
        if m.nan_candidate or m.inf_candidate or m.nan_golden or m.inf_golden:
            lines.append(
                f"  {'':<9}NaN/Inf: candidate {m.nan_candidate}/{m.inf_candidate}, "
                f"golden {m.nan_golden}/{m.inf_golden}, first non-finite at {m.first_nonfinite}"
            )
    if r.noise:
        lines.extend(_noise_lines(r.noise))
    for target, rows in r.worst_elements.items():
        lines.append(f"  worst elements of {target}:")
        lines.append(f"    {'index':<22}{'golden':>14}{'candidate':>14}{'difference':>14}")
        for index, g, c, d in rows:
            lines.append(f"    {index!s:<22}{_fmt(g):>14}{_fmt(c):>14}{_fmt(d):>14}")
    if r.worst:
        worst = ", ".join(f"{t} ({_fmt(e, 3)})" for t, e in r.worst)
        lines.extend(_wrapped("  worst tokens (position, rel error): ", worst))
    if r.worst_experts:
        experts = ", ".join(f"#{e} {_fmt(err, 3)} over {n} token{'s' * (n != 1)}" for e, n, err in r.worst_experts)
        lines.extend(_wrapped("  worst experts (rel error over their golden-routed tokens): ", experts))
    if r.logits is not None:
        lines.extend(_logits_lines(r.logits.to_dict()))
    if r.routing:
        lines.extend(_routing_lines(r.routing))
    for note in r.notes:
        lines.extend(_wrapped("  note: ", note))
    return lines


def _routing_lines(rt: dict[str, Any]) -> list[str]:
    lines = [
        f"  routing: {rt['num_tokens']} tokens, top-{rt['top_k']} of {rt['num_experts']} experts, "
        f"set agreement {rt['set_agreement'] * 100:.1f}%, real flips {len(rt['flips'])}, ties {len(rt['ties'])}"
    ]
    shown = rt["flips"][:8] or rt["ties"][:4]
    if shown:
        lines.append(f"    {'token':>6}  {'golden only':<24}{'candidate only':<24}{'score gap':>10}  kind")
        for f in shown:
            lost = sorted(set(f["golden_experts"]) - set(f["candidate_experts"]))
            gained = sorted(set(f["candidate_experts"]) - set(f["golden_experts"]))
            lines.append(
                f"    {f['token']:>6}  {lost!s:<24}{gained!s:<24}{_fmt(f['gap'], 3):>10}  "
                f"{'tie' if f['is_tie'] else 'flip'}"
            )
        more = len(rt["flips"]) - len(rt["flips"][:8])
        if more > 0:
            lines.append(f"    ... and {more} more flips")
    return lines


def _logits_lines(lg: dict[str, Any]) -> list[str]:
    top1 = lg["top1"]
    lines = _wrapped(
        "  next token: ",
        f"top-1 agreement {lg['top1_agreement'] * 100:.1f}% of {lg['num_tokens']} tokens "
        f"(real flips {len(top1['flips'])}, ties {len(top1['ties'])}), top-{lg['top_k']} overlap "
        f"{lg['top_k_overlap'] * 100:.1f}%, KL mean {_fmt(lg['kl_mean'], 3)} max {_fmt(lg['kl_max'], 3)} nats",
    )
    for f in (top1["flips"] or top1["ties"])[:5]:
        lines.append(
            f"    token {f['token']}: golden top-1 {f['golden_experts'][0]}, candidate {f['candidate_experts'][0]}, "
            f"golden logit gap {_fmt(f['gap'], 3)} ({'tie' if f['is_tie'] else 'flip'})"
        )
    return lines


def status_row(point: Point, status: str, message: str) -> dict[str, Any]:
    """The report row of a point that was not judged: `skipped` (with a reason) or `error`."""
    return {
        "id": point.id,
        "order": point.order,
        "layer": point.layer,
        "step": point.step,
        "component": point.component,
        "status": status,
        "error" if status == "error" else "reason": message,
        "metrics": {},
        "checks": [],
    }


def weights_row(name: str, layer: int | None, order: float, findings: list[str]) -> dict[str, Any]:
    """The report row of a weight item (`layer_N.weights`, `weights`): ordered just before its
    unit's first point, failed with the findings in words."""
    return {
        "id": name,
        "order": order,
        "layer": layer,
        "step": None,
        "component": "weights",
        "status": "failed" if findings else "passed",
        "metrics": {},
        "checks": [],
        "findings": findings,
        **({"hint": findings[0]} if findings else {}),
    }


def number(x: Any) -> float | None:
    """A JSON figure as a float ("inf"/"nan" strings included); None when absent."""
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def by_mode(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A report row's verdicts per mode: {"isolated": row, "chain": its chained row}."""
    out = {row.get("mode", "isolated"): row}
    if row.get("chain"):
        out[row["chain"].get("mode", "chain")] = row["chain"]
    return out


def main_metrics(row: dict[str, Any]) -> dict[str, Any] | None:
    """The figures of a row's main tensor: its output (or the logits), else its first tensor."""
    metrics = row.get("metrics") or {}
    return metrics.get("out") or metrics.get("logits") or next(iter(metrics.values()), None)


def figure(row: dict[str, Any], name: str) -> float | None:
    """`rel_l2` (or another figure) of a row's main tensor, or its `noise_ratio`; None when absent."""
    if name == "noise_ratio":
        return number((row.get("noise") or {}).get("ratio"))
    main = main_metrics(row)
    return number(main.get(name)) if main else None


def short_metrics(row: dict[str, Any]) -> tuple[str, str, str]:
    main = main_metrics(row)
    if not main:
        return "-", "-", "-"
    cos = main.get("cosine")
    rel = main.get("rel_l2")
    mx = main.get("max_abs")
    return (
        _fmt(cos, 6) if isinstance(cos, float) else str(cos),
        _fmt(rel) if isinstance(rel, float) else str(rel),
        _fmt(mx) if isinstance(mx, float) else str(mx),
    )


def row_note(row: dict[str, Any]) -> str:
    parts = []
    routing = row.get("routing")
    if routing and (routing.get("flips") or routing.get("ties")):
        parts.append(f"flips {len(routing['flips'])} ties {len(routing['ties'])}")
    if row.get("excluded_tokens"):
        parts.append(f"{len(row['excluded_tokens'])} tok excluded")
    if row.get("status") != "passed":
        failed = [f"{c['target']}.{c['name']}" for c in row.get("checks", []) if not c.get("passed")]
        if failed:
            parts.append("failed " + ", ".join(failed))
        if row.get("error"):
            parts.append(row["error"][:60])
        if row.get("reason"):
            parts.append(row["reason"][:60])
        if row.get("findings"):  # a weight item: the first tensor found wrong
            more = len(row["findings"]) - 1
            parts.append(row["findings"][0].rpartition(".")[2][:60] + (f" (+{more} more)" if more else ""))
    return "; ".join(parts)


def first_divergence(rows: list[dict[str, Any]], mode: str | None = None) -> dict[str, Any] | None:
    """The first failed point in forward order (with `mode`, the first whose verdict in that mode
    failed). Errors are the backend's, not divergences."""
    if mode is None:
        bad = [r for r in rows if r["status"] == "failed"]
    else:
        bad = [r for r in rows if (r.get("verdicts") or {}).get(mode) == "failed"]
    return min(bad, key=lambda r: r["order"]) if bad else None


def modes(rows: list[dict[str, Any]]) -> list[str]:
    """The modes the rows were judged in, isolated first."""
    seen = {m for r in rows for m in (r.get("verdicts") or {})}
    return [m for m in ("isolated", "chain") if m in seen]


def _decode_logits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logits rows of the decode steps, by step."""
    steps = (r for r in rows if r["component"] == "logits" and r.get("step") and r.get("logits"))
    return sorted(steps, key=lambda r: r["step"])


def first_decode_difference(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The first decode step whose next token (the logits' top-1) differs, with its flip or tie."""
    for r in _decode_logits(rows):
        top1 = r["logits"]["top1"]
        differing = sorted([*top1["flips"], *top1["ties"]], key=lambda f: f["token"])
        if differing:
            return r, differing[0]
    return None


def decode_line(rows: list[dict[str, Any]]) -> tuple[str, str | None] | None:
    """Over the decode steps: the first step whose next token differs, and whether the golden's
    logit gap there is within the dtype's rounding (a tie: reported, not failed)."""
    steps = _decode_logits(rows)
    if not steps:
        return None
    found = first_decode_difference(rows)
    if found is None:
        return (f"decode: the next token agrees with the golden at every step judged ({len(steps)})", "green")
    row, flip = found
    what = (
        f"golden {flip['golden_experts'][0]}, candidate {flip['candidate_experts'][0]}, "
        f"golden logit gap {_fmt(flip['gap'], 3)}"
    )
    if flip["is_tie"]:
        return (f"decode: the next token first differs at step_{row['step']} ({what}): a tie within "
                f"{row['candidate_dtype']} rounding, not a failure", None)  # fmt: skip
    return (f"decode: the next token first differs at step_{row['step']} ({what})", "red")


def first_error(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    bad = [r for r in rows if r["status"] == "error"]
    return min(bad, key=lambda r: r["order"]) if bad else None


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {s: sum(1 for r in rows if r["status"] == s) for s in STATUSES}


def graph_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """For compiled backends: how many graphs served the points, how many were compiled or loaded
    from the cache, and the graphs of the decoder layers (the kinds of layer: DeepSeek-V3 has two)."""
    info = [(r, r["backend"]) for r in rows if (r.get("backend") or {}).get("graph")]
    if not info:
        return None
    compiled = [b for _, b in info if b.get("origin") == "compiled"]
    return {
        "graphs": len({b["graph"] for _, b in info}),
        "points": len(info),
        "compiled": len(compiled),
        "from_cache": sum(b.get("origin") == "cache" for _, b in info),
        "compile_seconds": round(sum(b.get("compile_s", 0.0) for b in compiled), 3),
        "layers": len({r["layer"] for r, _ in info if r["layer"] is not None}),
        "layer_graphs": len({b["graph"] for r, b in info if r["component"] == "output"}),
    }


def summary_lines(rows: list[dict[str, Any]], *, report_dir: Any = None) -> list[tuple[str, str | None]]:
    """The closing lines of a run, as (text, colour): counts, the first divergence, the first
    backend error. The plugin and `moe-parity compare` print the same lines."""
    n = counts(rows)
    lines: list[tuple[str, str | None]] = [
        (
            f"{len(rows)} points: {n['passed']} passed, {n['failed']} failed, {n['error']} errors"
            + (f", {n['skipped']} skipped" if n["skipped"] else "")
            + (f"; reports in {report_dir}" if report_dir else ""),
            None,
        )
    ]
    first = first_divergence(rows)
    if first is None:
        lines.append(("first divergence: none", "green"))
    else:
        hint = f"  ({first['hint']})" if first.get("hint") else ""
        lines.append((f"first divergence: {first['id']}{hint}", "red"))
    if len(modes(rows)) > 1:  # both modes: where the error is introduced, and where it shows chained
        for mode in modes(rows):
            found = first_divergence(rows, mode)
            lines.append((f"first {mode} divergence: {found['id'] if found else 'none'}", "red" if found else None))
    decode = decode_line(rows)
    if decode is not None:
        lines.append(decode)
    error = first_error(rows)
    if error is not None:
        lines.append((f"backend errors: {n['error']}, first at {error['id']}: {error.get('error', '')}", "red"))
    graphs = graph_summary(rows)
    if graphs is not None:
        lines.append(
            (
                f"{graphs['graphs']} graphs for {graphs['points']} points ({graphs['layer_graphs']} for the "
                f"decoder layers of {graphs['layers']} layers); compiled {graphs['compiled']} in "
                f"{graphs['compile_seconds']:.1f} s, {graphs['from_cache']} from the cache",
                None,
            )
        )
    return lines


def _ratio(row: dict[str, Any] | None) -> str:
    noise = (row or {}).get("noise")
    return _fmt(noise["ratio"], 3) if noise else "-"


def _extra_columns(rows: list[dict[str, Any]]) -> list[tuple[str, int, Any]]:
    """Columns shown when some row has them: the noise ratio, the chained error (both modes)."""
    columns: list[tuple[str, int, Any]] = []
    if any(r.get("noise") for r in rows):
        columns.append(("noise R", 9, _ratio))
    if any(r.get("chain") for r in rows):
        columns.append(("chain rel", 11, lambda r: short_metrics(r["chain"])[1] if r.get("chain") else "-"))
        if any((r.get("chain") or {}).get("noise") for r in rows):
            columns.append(("chain R", 9, lambda r: _ratio(r.get("chain"))))
    return columns


def summary_table(rows: list[dict[str, Any]], *, full_limit: int = 40, context: int = 1) -> list[str]:
    """Every row for small runs; for big ones the failures with `context` rows around them."""
    ordered = sorted(rows, key=lambda r: r["order"])
    if len(ordered) <= full_limit:
        shown = set(range(len(ordered)))
    else:
        shown = set()
        for i, r in enumerate(ordered):
            if r["status"] in ("failed", "error"):
                shown.update(range(max(0, i - context), min(len(ordered), i + context + 1)))
    width = max([26, *(len(r["id"]) + 2 for r in ordered)])
    extra = _extra_columns(ordered)
    head = "".join(f"{name:>{w}}" for name, w, _ in extra)
    lines = [f"{'point':<{width}}{'status':<8}{'cosine':>12}{'rel_l2':>11}{head}{'max_abs':>11}  notes"]
    last = -1
    for i, r in enumerate(ordered):
        if i not in shown:
            continue
        if i != last + 1:
            lines.append(f"{'...':<{width}}({i - last - 1} passing points)")
        cos, rel, mx = short_metrics(r)
        cells = "".join(f"{value(r):>{w}}" for _, w, value in extra)
        lines.append(f"{r['id']:<{width}}{r['status']:<8}{cos:>12}{rel:>11}{cells}{mx:>11}  {row_note(r)}")
        last = i
    if not shown:
        lines.append(f"(all {len(ordered)} points passed)")
    elif last != len(ordered) - 1:
        lines.append(f"{'...':<{width}}({len(ordered) - 1 - last} passing points)")
    return lines
