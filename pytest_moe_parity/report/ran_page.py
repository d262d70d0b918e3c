"""What each point ran, on report.html: a point's `ran` paragraph and last night's diff's points that ran
otherwise (`report.ran` says them in words)."""

from __future__ import annotations

from typing import Any

from ..words import counted
from .markup import Safe, el, join
from .ran import ran_of, ran_words
from .rows import Row


def ran_html(row: Row) -> Safe | None:
    """A point's `ran: ...` paragraph on the page (a failed point says it in its failure text); each mode's."""
    parts = []
    for mode, mode_row in row.by_mode().items():
        words = ran_words(ran_of(mode_row))
        if words:
            label = f"ran ({mode}): " if len(row.by_mode()) > 1 else "ran: "
            parts.append(el("p", el("b", label), words, class_="figs ran"))
    return join(parts) if parts else None


def ran_diff_html(entries: list[dict[str, Any]], linked: set[str]) -> Safe | None:
    """A diff's points that ran otherwise (`diff.json`'s `ran`) as a table: point, mode, what changed."""
    if not entries:
        return None
    head = el("tr", el("th", "point"), el("th", "mode"), el("th", "ran otherwise"))
    body = []
    for entry in entries:
        pid = str(entry.get("id"))
        link = el("a", pid, href=f"#p-{pid}", class_="pid") if pid in linked else el("span", pid, class_="pid")
        said = "; ".join(f"{c.get('what')} {c.get('old')} → {c.get('new')}" for c in entry.get("changes") or [])
        body.append(el("tr", el("td", link), el("td", str(entry.get("mode"))), el("td", said)))
    title = el("h3", f"ran otherwise: {counted(len({e.get('id') for e in entries}), 'point')}")
    return join(title, el("table", el("thead", head), el("tbody", body), class_="data ran-diff"))
