"""The vLLM Neuron plugin's acceptance terms in the reports: each point's figures (in its row, under
`backend.vllm_neuron`, as `backends.neuron_plugin` computed them) gathered into the run's: how many points
`assert_close_three_way`'s rule passes and the first it fails, and the plugin's logit validation over the
generated tokens (`judge.neuron_terms.logit_validation`). In `comparison_summary.json` (`vllm_neuron`), in
the closing lines and as a section of report.html: beside this tool's verdict, for a Neuron review."""

from __future__ import annotations

from typing import Any

from ..judge.neuron_terms import (
    BC_THRESHOLD,
    DYNAMIC_MULTIPLIER,
    MAX_L2_RATIO,
    MAX_LINF_RATIO,
    SIGMA_THRESHOLD,
    logit_validation,
)
from .markup import Safe, el
from .text import fmt

KEY = "vllm_neuron"
RULE = (
    f"assert_close_three_way: (BC >= {BC_THRESHOLD} or sigma-ratio <= {SIGMA_THRESHOLD}) and worst L-inf ratio < "
    f"{MAX_LINF_RATIO} and worst L2 ratio < {MAX_L2_RATIO}; tokens within: compare_tensors_three_way's "
    f"L-inf and L2 ratios < {DYNAMIC_MULTIPLIER}; logit validation: sigma-ratio <= {SIGMA_THRESHOLD} or every "
    f"generated token's BC >= {BC_THRESHOLD}"
)

SOURCE = (
    "vllm_neuron/accuracy of the vLLM Neuron plugin, as read in jinhuang12/vllm-neuron: testing.py "
    "(16045ea5d04a14e57d4178205a9485c0e89720dc), logit_validation.py (10c6804db2035ce7de5a19474a00b78223d9ebb4), "
    "tensor_compare.py (as testing.py imports it)"
)


def _figures(row: Any) -> tuple[str, str, dict[str, Any]] | None:
    """(id, status, the plugin's figures) of a row (a report row's JSON or a Row), or None."""
    if isinstance(row, dict):
        pid, status, backend = row.get("id"), row.get("status"), row.get("backend") or {}
    else:
        pid, status, backend = row.id, row.status, getattr(row, "backend", None) or {}
    said = backend.get(KEY) if isinstance(backend, dict) else None
    return (pid, status, said) if isinstance(said, dict) and "module" in said else None


def _num(value: Any) -> float:
    return float("inf") if value == "inf" else float("nan") if value == "nan" else float(value)


def summarize(rows: list[Any]) -> dict[str, Any] | None:
    """The run's terms, in the rows' order; None where no row has them."""
    found = [f for r in rows if (f := _figures(r)) is not None]
    if not found:
        return None
    failing = [pid for pid, _, said in found if not said["module"]["passed"]]
    both = sum(1 for _, status, said in found if said["module"]["passed"] == (status == "passed"))
    out: dict[str, Any] = {
        "rule": RULE,
        "source": SOURCE,
        "points": len(found),
        "passed": len(found) - len(failing),
        "first_failing": failing[0] if failing else None,
        "failing": failing,
        "agree_with_verdict": both,
    }
    tokens = sorted((said for _, _, said in found if "logit" in said), key=lambda s: s["gen_token"])
    if tokens:
        logits = [{k: _num(v) if k not in ("n",) else v for k, v in t["logit"].items()} for t in tokens]
        validated = logit_validation(logits)
        validated["per_token_bc"] = dict(zip([t["gen_token"] for t in tokens], validated["per_token_bc"], strict=True))
        sigma = validated["agg_sigma_ratio"]
        validated["agg_sigma_ratio"] = sigma if sigma != float("inf") else "inf"
        out["logit_validation"] = validated
    return out


def closing_line(rows: list[Any]) -> str | None:
    said = summarize(rows)
    if said is None:
        return None
    line = f"the vLLM Neuron plugin's terms: assert_close_three_way passes {said['passed']} of {said['points']} points"
    first = said["first_failing"]
    if first is not None:
        terms = next(f[2]["module"] for r in rows if (f := _figures(r)) is not None and f[0] == first)
        line += f" (first failing {first}: {describe(terms)})"
    lv = said.get("logit_validation")
    if lv is not None:
        line += (
            f"; logit validation over {lv['tokens']} generated token{'s' if lv['tokens'] > 1 else ''}: sigma-ratio "
            f"{fmt(_num(lv['agg_sigma_ratio']), 3)}, agg_bc {lv['agg_bc']}: {'passes' if lv['passed'] else 'fails'}"
        )
    return line


def describe(terms: dict[str, Any]) -> str:
    return (
        f"sigma-ratio {fmt(_num(terms['sigma_ratio']), 3)}, BC {fmt(_num(terms['bc']), 4)}, worst L-inf ratio "
        f"{fmt(_num(terms['worst_linf_ratio']), 3)}x, worst L2 ratio {fmt(_num(terms['worst_l2_ratio']), 3)}x"
    )


def section(summary: dict[str, Any], rows: list[Any]) -> Safe | None:
    """report.html's section: the rule, the logit validation, each point's terms beside its verdict."""
    said = summary.get(KEY)
    if not said:
        return None
    parts: list[Any] = [
        el("p", f"The vLLM Neuron plugin's own acceptance terms, computed as its accuracy module does: {RULE}."),
        el("p", closing_line(rows) or ""),
    ]
    cols = ["point", "verdict", "sigma-ratio", "BC", "worst L-inf ratio", "worst L2 ratio", "tokens within", "plugin"]
    body = []
    for pid, status, figures in (f for r in rows if (f := _figures(r)) is not None):
        m = figures["module"]
        figures_ = ("sigma_ratio", "bc", "worst_linf_ratio", "worst_l2_ratio")
        cells = [pid, status, *(fmt(_num(m[k]), 4) for k in figures_)]
        cells += [f"{m['tokens_within']}/{m['inputs']}", "passes" if m["passed"] else "fails"]
        body.append(el("tr", [el("td", c) for c in cells], class_=None if m["passed"] else "r-failed"))
    head = el("tr", [el("th", c) for c in cols])
    parts.append(el("div", el("table", el("thead", head), el("tbody", body), class_="data"), class_="scroll"))
    return el("div", parts)
