"""`--parity-state reused|prefix|DIR`: whether the candidate's serving state alone changes a prompt's
output. After each point, an item `POINT::state` runs the point's golden call twice on the candidate: as
the prompt's own clean run (`Backend.run`: a fresh cache) and in another state (`Backend.run_state`):
after other requests in the same cache slots and buffers (`reused`), on a prefix-cache hit whose keys
and values another request wrote (`prefix`), or, for a candidate that is a dump (`--hw dump --model
CLEAN_DUMP`), the dump of the same prompt taken under any other state (`DIR`: after a KV transfer, on
another replica). The state's output is judged against the clean run's by the point's tolerance, as
the reference's own run-to-run difference is (none: the same prompt, the same call): the item fails
where only the state changes the output, names the state as the backend says it ("after another
request in slot 0"), the token rows it changes and, where the backend shows the keys and values its
attention read (`CandidateOutput.cache`), the cache rows that differ; each run's error to the golden is
beside it (the clean run right and the state's wrong: the state is the fault). A backend that runs
every call afresh (cpu, cuda, trace, compile) has no state to change: its items are skipped, with
that one reason."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import BackendError, BackendFailure, PointUnavailable, SetupError
from ..golden import GoldenStore
from ..points import Point, describe_layers
from ..report.rows import Row, StateRow, unjudged_row
from ..report.text import brief
from ..tree import first_tensor
from .checks import Checker, CheckerSetup, Option, RunAgain, result_figures
from .runner import ParityRunner

KIND = "state"
# the states a backend runs itself (`Backend.states`), in words
STATES = {
    "reused": "after other requests in the same cache slots and buffers",
    "prefix": "on a prefix-cache hit whose keys and values another request wrote",
}
HINTS = {
    "reused": (
        "state an earlier request left: a cache slot or buffer not reset for the next request (a length or "
        "offset kept, stale keys and values its mask lets it read), a buffer written in place"
    ),
    "prefix": (
        "a prefix-cache entry that is not this prompt's: keyed by something other than its tokens (the prefix "
        "length, a block index), or its keys and values written by a request that did not share the prefix"
    ),
    "dump": (
        "the state the dump was taken under (keys and values transferred from another instance, another replica's "
        "cache, earlier requests) changes it: a transfer that drops or reorders cache rows, a layout or dtype "
        "read otherwise, state left in the slots"
    ),
}


@dataclass(frozen=True)
class StateEntry(RunAgain):
    """The state differential of a point (`layer_N.attention::state`): right after it."""

    kind = KIND


class StateItems(Checker):
    """The state differential's items of a run: the point in another serving state against its clean run."""

    kind = KIND
    family = "differential"
    marker = "moe-parity items of a point run in another serving state of the candidate (--parity-state)"
    options = (
        Option("--parity-state", "parity_state", {"metavar": "reused|prefix|DIR"},
               "after each point, an item (POINT::state) that runs it in another serving state of the candidate "
               "against the prompt's clean run: after other requests in the same cache slots (reused), on a "
               "prefix-cache hit another request wrote (prefix), or a dump of the prompt taken under another state "
               "(DIR, with --hw dump --model CLEAN_DUMP); it fails where the state alone changes the output"),
    )  # fmt: skip

    @classmethod
    def from_options(cls, setup: CheckerSetup, value: str | None) -> StateItems | None:
        return state_items(setup.golden, setup.runner, value, setup.hw, cls.flag(setup))

    def __init__(self, golden: GoldenStore, runner: ParityRunner, state: str | Path, skip: str | None = None):
        self.golden, self.runner, self.state, self.skip = golden, runner, state, skip
        self.word = "dump" if isinstance(state, Path) else state

    @property
    def asked(self) -> str:
        return str(self.state)

    def header_lines(self) -> list[str]:
        if self.skip:
            return [f"moe-parity: --parity-state {self.asked}: its items are skipped: {self.skip}"]
        words = f"in the dump {self.state}" if self.word == "dump" else STATES[self.word]
        return [f"moe-parity: --parity-state {self.asked}: each point run {words}, against the prompt's clean run"]

    def after(self, point: Point, selected: bool) -> Iterator[StateEntry]:
        if selected:
            yield StateEntry(point, self.place(point))

    def unjudged_row(self, entry: StateEntry, status: str, message: str) -> Row:
        return unjudged_row(self._row(entry, "passed"), status, message)

    def _row(self, entry: StateEntry, status: str, **more: Any) -> StateRow:
        point = entry.point
        return StateRow(
            id=entry.id, order=entry.order, layer=point.layer, step=point.step, component=point.component,
            status=status, serving_state=self.asked, **more,
        )  # fmt: skip

    def check(self, entry: StateEntry, rows: Mapping[str, Row]) -> tuple[Row, str | None]:
        if self.skip:
            raise PointUnavailable(self.skip)
        point, runner = entry.point, self.runner
        record = self.golden.load(point, row_masks=runner.backend.row_masks)
        clean = runner.call(point, record)
        default = f"in the dump {self.state}" if self.word == "dump" else STATES[self.word]
        try:
            other = runner.call(point, record, state=self.state)
        except BackendFailure as exc:  # the clean run ran: that the state's cannot is the state's finding
            raised = str(exc).removeprefix(f"{point.id}: ")
            note = f"{default}, it raises where its clean run runs: {raised}"
            row = self._row(entry, "failed", said=default, figures={"raised": raised}, notes=[note], hint=self._hint())
            return row, f"{entry.id}: {note}\n  hint: {row.hint}"
        said = str(other.info.get("state") or default)
        router = self.golden.router_of(point)
        bias = runner.score_bias(point, record)
        judged = runner.judge_between(point, clean.output, other.output, (router, other.routing, clean.routing), bias)
        golden = [
            runner.judge_between(point, record.output, out.output, (router, None, None), bias).main
            for out in (clean, other)
        ]
        tol, _ = runner.tolerance(point)
        changed = changed_rows(clean.output, other.output, tol.token_rel_l2)
        cache = cache_rows(clean.cache, other.cache, tol.token_rel_l2)
        main = judged.main
        figures = {
            "state_vs_clean": main.rel_l2 if main else None,
            "clean_vs_golden": golden[0].rel_l2 if golden[0] else None,
            "state_vs_golden": golden[1].rel_l2 if golden[1] else None,
            "rows": changed,
            **cache,
            "failed": result_figures(judged)["failed"],
        }
        metrics = {"state_vs_clean": main} if main is not None else {}
        if judged.passed:
            note = f"{said}: as its clean run, within the point's limits"
            return self._row(entry, "passed", said=said, figures=figures, metrics=metrics, notes=[note]), None
        where = f" at tokens {describe_layers(changed)}" if changed else ""
        note = (
            f"{said}, its output differs from its clean run's{where}: rel_l2 {brief(figures['state_vs_clean'])} "
            f"(to the golden: clean {brief(figures['clean_vs_golden'])}, "
            f"in the state {brief(figures['state_vs_golden'])}){cache_words(cache)}"
        )
        row = self._row(entry, "failed", said=said, figures=figures, metrics=metrics, notes=[note],
                        hint=self._hint(said))  # fmt: skip
        text = [f"{entry.id}: the state alone changes it: {note}", f"  failed: {', '.join(figures['failed'])}"]
        return row, "\n".join([*text, f"  hint: {row.hint}"])

    def _hint(self, said: str = "") -> str:
        return f"the serving state ({said or self.asked}): {HINTS[self.word]}"


def changed_rows(clean: Any, other: Any, limit: float) -> list[int]:
    """The token rows (positions of a one-row output, else rows of its tokens flattened) where the state's
    output leaves `limit` (a token's relative L2) around the clean run's."""
    a, b = first_tensor(clean), first_tensor(other)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dim() < 2:
        return []
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    scale = a.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nonzero((b - a).norm(dim=-1) > limit * scale).flatten().tolist()


def cache_rows(clean: Any, other: Any, limit: float) -> dict[str, Any]:
    """Where both runs show the keys and values the attention read (`CacheState`, [B, heads, rows, D]): the
    cache rows whose keys (`key_rows`), and values (`value_rows`), differ beyond `limit` of the clean run's
    (a row one holds and the other not differs), and how many rows each read (`cache_held`)."""
    if clean is None or other is None:
        return {}
    found: dict[str, Any] = {"cache_held": [int(clean.keys.shape[-2]), int(other.keys.shape[-2])]}
    for name in ("keys", "values"):
        a, b = (getattr(c, name).detach().float().cpu() for c in (clean, other))
        rows = max(a.shape[-2], b.shape[-2])
        shared = min(a.shape[-2], b.shape[-2])
        a_rows, b_rows = a[..., :shared, :].transpose(-2, 0), b[..., :shared, :].transpose(-2, 0)
        a_flat, b_flat = a_rows.reshape(shared, -1), b_rows.reshape(shared, -1)
        scale = a_flat.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        differ = torch.nonzero((b_flat - a_flat).norm(dim=-1) > limit * scale).flatten().tolist()
        found[f"{name[:-1]}_rows"] = differ + list(range(shared, rows))
    return found


def cache_words(cache: dict[str, Any]) -> str:
    """`; its keys differ at cache rows 0-15, its values at 0-15 (it read 32 rows, its clean run 16)`."""
    if not cache:
        return ""
    keys, values = cache.get("key_rows") or [], cache.get("value_rows") or []
    clean, other = cache["cache_held"]
    held = f" (it read {other} cache rows, its clean run {clean})" if clean != other else ""
    if not keys and not values:
        return f"; its keys and values are its clean run's{held}"
    said = [f"its keys differ at cache rows {describe_layers(keys)}" if keys else "its keys are its clean run's"]
    said.append(f"its values at {describe_layers(values)}" if values else "its values are its clean run's")
    return "; " + ", ".join(said) + held


def state_items(golden: GoldenStore, runner: ParityRunner, text: str | None, hw: str, flag: str) -> StateItems | None:
    """The run's state differential (`--parity-state reused|prefix|DIR`), or None where not asked; SetupError
    where the state is neither a word nor a directory, or DIR cannot be the prompt's dump under another state."""
    if not text:
        return None
    backend = runner.backend
    if text in STATES:
        if text not in backend.states:
            has = f"the {hw} backend runs {', '.join(backend.states)}, not {text}" if backend.states else ""
            return StateItems(golden, runner, text, skip=has or backend.stateless())
        try:
            backend.check_state(text)
        except BackendError as exc:
            raise SetupError(f"{flag} {text}: {exc}") from None
        return StateItems(golden, runner, text)
    root = Path(text).expanduser()
    if not root.is_dir():
        if root.exists() or any(sep in text for sep in ("/", "\\")) or text.startswith("."):
            raise SetupError(f"{flag} {text}: not a directory: name the dump of the prompt taken under the other state")
        raise SetupError(
            f"{flag} {text}: not a state: expected reused, prefix, or the directory of a dump of the golden's "
            "prompt taken under another state"
        )
    if backend.chain_kind != "recorded":
        raise SetupError(
            f"{flag} {text}: a dump under another state is judged against the prompt's clean run dumped the same "
            f"way, and the {hw} backend runs the candidate afresh (no dump): pass the clean run's dump as "
            "--hw dump --model CLEAN_DUMP"
        )
    if backend.setup.model_dir is not None and root.resolve() == Path(backend.setup.model_dir).resolve():
        raise SetupError(
            f"{flag} {text}: this is the candidate's own dump (--model): name the dump taken under the other state"
        )
    try:
        backend.check_state(root)
    except BackendError as exc:
        raise SetupError(f"{flag} {text}: {exc}") from None
    return StateItems(golden, runner, root)
