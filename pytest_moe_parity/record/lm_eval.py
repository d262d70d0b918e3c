"""lm-eval's failures as prompts (`moe-parity prompts --from-lm-eval REF [CAND] --out FILE`): the
per-document samples lm-eval writes with `--log_samples` (`samples_<task>_<date>.jsonl`, beside the
run's `results_<date>.json`) of a reference run and of a candidate run, read and matched document by
document, and the documents where the candidate scores worse written as a prompts file
(`record.prompts`: one JSON object a line, its `text` what the model read, the rest carried along).

Nothing here imports lm-eval: the samples are JSON lines. Both layouts lm-eval 0.4 has written are
read: `arguments` as a list of argument lists or as `{"gen_args_0": {"arg_0": ..., "arg_1": ...}}`,
and `resps`/`filtered_resps` as numbers or as the strings 0.4.3 onwards writes (`"-5.36"`, `"False"`)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..words import counted

# lm-eval's file names: samples_<task>_<date>.jsonl beside results_<date>.json, <date> its date_id
SAMPLES_NAME = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")
RESULTS_NAME = "results_{date}.json"
# the aggregated results' keys that say which tokenizer a run used: another model's when they differ
TOKENIZER_KEYS = ("tokenizer_bos_token", "tokenizer_eos_token", "tokenizer_pad_token", "eot_token_id")
HINT = "give the samples_<task>_<date>.jsonl files (or their folder) that `lm_eval --log_samples --output_path` writes"


# ------------------------------------------------------------------------------------------- reading


@dataclass
class Doc:
    """One document of one run: its requests' arguments, its responses (a log-likelihood per request
    for a log-likelihood task, a text for a generation task), its score on the task's metric."""

    doc_id: int
    requests: list[list[Any]]
    responses: list[Any]
    target: str
    score: float
    doc_hash: str | None = None
    prompt_hash: str | None = None

    @property
    def loglikelihoods(self) -> list[float] | None:
        """Per request, where every response is lm-eval's `(log-likelihood, is_greedy)`."""
        values = [_number(r[0]) if isinstance(r, list | tuple) and len(r) == 2 else None for r in self.responses]
        return None if not values or any(v is None for v in values) else values  # type: ignore[return-value]

    @property
    def generated(self) -> bool:
        """A generation request (`generate_until`: the context and its generation settings)."""
        return bool(self.requests) and len(self.requests[0]) == 2 and isinstance(self.requests[0][1], dict)

    def gold(self) -> int:
        """The request of the right answer: the target's index among the choices, or the request whose
        continuation is the target; the first otherwise."""
        target = self.target.strip()
        if target.lstrip("-").isdigit() and 0 <= int(target) < len(self.requests) and len(self.requests) > 1:
            return int(target)
        conts = [str(r[1]).strip() if len(r) > 1 else "" for r in self.requests]
        return conts.index(target) if target in conts else 0

    def text(self) -> str:
        """What the model read for this document: the context and the right answer's continuation for
        a log-likelihood task (the tokens lm-eval scored), the context alone for a generation task."""
        request = self.requests[self.gold()] if self.requests else [""]
        if self.generated or len(request) < 2:
            return str(request[0])
        return str(request[0]) + str(request[1])

    def answer(self) -> str:
        """The run's answer: the continuation of its most likely request, or the text it generated."""
        lls = self.loglikelihoods
        if lls is not None and len(lls) > 1:
            best = max(range(len(lls)), key=lambda i: lls[i])
            return str(self.requests[best][1]) if len(self.requests[best]) > 1 else str(best)
        if lls is not None:
            return str(self.requests[0][1]) if len(self.requests[0]) > 1 else ""
        first = self.responses[0] if self.responses else ""
        return str(first[0] if isinstance(first, list) and first else first)

    def margin(self) -> float | None:
        """How much more likely the run found its answer than the right one (0 where it chose it)."""
        lls = self.loglikelihoods
        return None if lls is None or len(lls) < 2 else max(lls) - lls[self.gold()]


@dataclass
class Samples:
    """One task's samples of one run: where they were read, the task and model they name, its metric."""

    path: Path
    task: str | None
    metric: str
    higher_is_better: bool
    docs: dict[int, Doc]
    results: dict[str, Any] = field(default_factory=dict)  # the aggregated results json beside it

    @property
    def label(self) -> str:
        return self.task or self.path.name

    @property
    def model(self) -> str | None:
        name = self.results.get("model_name")
        return str(name) if name else None

    def mean(self) -> float:
        return sum(d.score for d in self.docs.values()) / max(len(self.docs), 1)


def _number(value: Any) -> float | None:
    """A response's number as lm-eval wrote it (a number, or its string from 0.4.3 on)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _requests(arguments: Any) -> list[list[Any]]:
    """The requests' argument lists, from either layout lm-eval writes."""
    if isinstance(arguments, dict):
        return [
            [args[k] for k in sorted(args, key=lambda k: int(k.split("_")[-1]))] if isinstance(args, dict) else [args]
            for _, args in sorted(arguments.items(), key=lambda kv: int(kv[0].split("_")[-1]))
        ]
    if isinstance(arguments, list):
        return [list(a) if isinstance(a, list | tuple) else [a] for a in arguments]
    raise ValueError("arguments")


def _line(entry: Any, where: str) -> dict[str, Any]:
    """A samples line checked for what every lm-eval samples line holds."""
    keys = ("doc_id", "arguments", "filtered_resps")
    if not isinstance(entry, dict) or any(k not in entry for k in keys):
        raise BadInput(f"{where} is not lm-eval samples (no doc_id, arguments and filtered_resps); {HINT}")
    return entry


_NOT_METRICS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                "doc_hash", "prompt_hash", "target_hash"}  # fmt: skip


def _metric(entry: dict[str, Any], where: str) -> str:
    """The task's metric: the first lm-eval lists for it whose per-document score is a number."""
    named = entry.get("metrics") or [k for k in entry if k not in _NOT_METRICS]
    for name in named:
        if _number(entry.get(name)) is not None:
            return str(name)
    raise BadInput(
        f"{where} has no per-document score that is a number (metrics: {', '.join(map(str, named)) or 'none'}): "
        "a task scored over the whole corpus (perplexity, BLEU) cannot rank documents; give a task scored per "
        "document (acc, exact_match)"
    )


def read_samples(path: Path, task: str | None = None, results: dict[str, Any] | None = None) -> Samples:
    """One samples file: its documents under the first filter lm-eval lists (a task with several
    filters writes a line per document and filter). BadInput, one sentence, for a file that is not
    lm-eval's samples."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read it ({exc}); {HINT}") from None
    docs: dict[int, Doc] = {}
    metric, chosen = None, None
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{path}, line {number},"
        try:
            entry = _line(json.loads(raw), where)
        except json.JSONDecodeError:
            raise BadInput(f"{where} is not JSON, so not lm-eval samples; {HINT}") from None
        chosen = entry.get("filter") if chosen is None else chosen
        if entry.get("filter") != chosen:
            continue
        metric = metric or _metric(entry, where)
        doc = _doc(entry, metric, where)
        docs[doc.doc_id] = doc
    if not docs or metric is None:
        raise BadInput(f"{path} holds no samples; {HINT}")
    results = results or {}
    better = results.get("higher_is_better", {}).get(task or "", {}).get(metric, True)
    return Samples(path, task, metric, bool(better), docs, results)


def _doc(entry: dict[str, Any], metric: str, where: str) -> Doc:
    try:
        requests = _requests(entry["arguments"])
        score = _number(entry.get(metric))
        if score is None or not requests:
            raise ValueError(metric)
        return Doc(
            doc_id=int(entry["doc_id"]),
            requests=requests,
            responses=list(entry["filtered_resps"]),
            target=str(entry.get("target", "")),
            score=score,
            doc_hash=entry.get("doc_hash"),
            prompt_hash=entry.get("prompt_hash"),
        )
    except (ValueError, TypeError, KeyError):
        raise BadInput(f"{where} is not lm-eval samples (its doc_id, arguments or {metric} score unreadable); "
                       f"{HINT}") from None  # fmt: skip


def _results_beside(path: Path, date: str | None) -> dict[str, Any]:
    """The aggregated results lm-eval wrote beside a samples file (the same date), or {}."""
    if date is None:
        return {}
    beside = path.parent / RESULTS_NAME.format(date=date)
    try:
        data = json.loads(beside.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_run(path: Path, role: str) -> dict[str | None, Samples]:
    """A run's samples by task: one file, or a folder of lm-eval's output (searched below it; the
    newest file of each task). BadInput for a folder with none, or with the samples of two models."""
    if path.is_file():
        match = SAMPLES_NAME.match(path.name)
        task, date = (match["task"], match["date"]) if match else (None, None)
        return {task: read_samples(path, task, _results_beside(path, date))}
    if not path.is_dir():
        raise BadInput(f"{role} samples {path} do not exist; {HINT}")
    found = [
        (file, match) for file in sorted(path.rglob("samples_*.jsonl")) if (match := SAMPLES_NAME.match(file.name))
    ]
    if not found:
        raise BadInput(f"{role} samples: {path} holds no lm-eval samples (samples_<task>_<date>.jsonl); {HINT}")
    newest: dict[str, tuple[str, Path]] = {}
    for file, match in found:
        if match["task"] not in newest or match["date"] > newest[match["task"]][0]:
            newest[match["task"]] = (match["date"], file)
    folders = sorted({str(file.parent.relative_to(path)) for file, _ in found})
    if len(folders) > 1:
        raise BadInput(
            f"{role} samples: {path} holds the samples of {len(folders)} runs ({', '.join(folders)}); give one run's "
            "folder (lm-eval writes one per model under --output_path)"
        )
    return {
        task: read_samples(file, task, _results_beside(file, date)) for task, (date, file) in sorted(newest.items())
    }


# ------------------------------------------------------------------------------------------- matching


def check_same_task(ref: Samples, cand: Samples) -> list[int]:
    """The documents both runs scored, checked to be the same task of the same model; BadInput naming
    what differs: the task named, the tokenizer the results name, a document or prompt, the metric."""
    if ref.task and cand.task and ref.task != cand.task:
        raise BadInput(
            f"the reference's samples are of task {ref.task} and the candidate's of {cand.task}; give both runs' "
            "samples of the same task"
        )
    differ = [k for k in TOKENIZER_KEYS if k in ref.results and k in cand.results and ref.results[k] != cand.results[k]]
    if differ:
        key = differ[0]
        raise BadInput(
            f"{ref.label}: the reference ran {ref.model or ref.path} and the candidate {cand.model or cand.path} with "
            f"another tokenizer ({key} {ref.results[key]} against {cand.results[key]}): samples of another model; "
            "give two runs of the same model"
        )
    if ref.metric != cand.metric:
        raise BadInput(f"{ref.label}: the reference is scored by {ref.metric} and the candidate by {cand.metric}; "
                       "give two runs of the same task")  # fmt: skip
    common = sorted(set(ref.docs) & set(cand.docs))
    if not common:
        raise BadInput(f"{ref.label}: the two runs share no document id; give two runs of the same task")
    for doc_id in common:
        a, b = ref.docs[doc_id], cand.docs[doc_id]
        for what, x, y in (("document", a.doc_hash, b.doc_hash), ("prompt", a.prompt_hash, b.prompt_hash)):
            if x and y and x != y:
                raise BadInput(
                    f"{ref.label}: document {doc_id} has another {what} in the candidate's samples than in the "
                    "reference's: another task, version, few-shot count or template; give two runs of the same task"
                )
    return common


def match_runs(ref: dict[str | None, Samples], cand: dict[str | None, Samples]) -> list[tuple[Samples, Samples]]:
    """The two runs' samples paired by task (one task on each side pair, whatever their names say)."""
    if len(ref) == 1 and len(cand) == 1:  # check_same_task names the tasks where both are known and differ
        return [(next(iter(ref.values())), next(iter(cand.values())))]
    common = [t for t in ref if t in cand]
    if not common:
        raise BadInput(
            f"the reference's samples are of {', '.join(map(str, ref))} and the candidate's of "
            f"{', '.join(map(str, cand))}: no task in common; give both runs' samples of the same tasks"
        )
    return [(ref[t], cand[t]) for t in common]


# ------------------------------------------------------------------------------------------- ranking


@dataclass(frozen=True)
class Ranked:
    """A document to record, with what ranks it: `tier` 0 where the reference is right and the
    candidate wrong, 1 where the candidate only scores lower; `gap` how far the two runs'
    log-likelihoods part (nats, the most over the document's requests), or the one run's margin."""

    record: dict[str, Any]
    tier: int
    gap: float | None
    drop: float

    def key(self) -> tuple:
        return (self.tier, -(self.gap if self.gap is not None else -math.inf), -self.drop, self.record["doc_id"])


def _right(score: float, higher: bool) -> bool:
    return score >= 1.0 if higher else score <= 0.0


def _gap(a: Doc, b: Doc) -> float | None:
    la, lb = a.loglikelihoods, b.loglikelihoods
    if la is None or lb is None or len(la) != len(lb):
        return None
    return max(abs(x - y) for x, y in zip(la, lb, strict=True))


def _side(doc: Doc, metric: str) -> dict[str, Any]:
    side: dict[str, Any] = {"answer": doc.answer(), metric: doc.score}
    if doc.loglikelihoods is not None:
        side["loglikelihoods"] = [round(v, 6) for v in doc.loglikelihoods]
    return side


def worse_documents(ref: Samples, cand: Samples) -> list[Ranked]:
    """The documents the candidate scores worse than the reference on the task's metric, with the
    record each writes."""
    ranked = []
    for doc_id in check_same_task(ref, cand):
        a, b = ref.docs[doc_id], cand.docs[doc_id]
        drop = (a.score - b.score) if ref.higher_is_better else (b.score - a.score)
        if drop <= 0:
            continue
        flipped = _right(a.score, ref.higher_is_better) and not _right(b.score, ref.higher_is_better)
        gap = _gap(a, b)
        record = {
            "text": a.text(), "task": ref.label, "doc_id": doc_id, "metric": ref.metric, "target": _target(a),
            "reference": _side(a, ref.metric), "candidate": _side(b, ref.metric), "flipped": flipped,
            "loglikelihood_gap": None if gap is None else round(gap, 6),
        }  # fmt: skip
        ranked.append(Ranked(record, 0 if flipped else 1, gap, drop))
    return ranked


def failed_documents(run: Samples) -> list[Ranked]:
    """One run alone: the documents it scored wrong (below the best its metric gives), the most
    confidently wrong first (its answer's log-likelihood furthest above the right one's)."""
    scores = [d.score for d in run.docs.values()]
    best = max([*scores, 1.0]) if run.higher_is_better else min([*scores, 0.0])
    ranked = []
    for doc_id, doc in sorted(run.docs.items()):
        if doc.score == best:
            continue
        margin = doc.margin()
        record = {
            "text": doc.text(), "task": run.label, "doc_id": doc_id, "metric": run.metric, "target": _target(doc),
            "run": _side(doc, run.metric), "margin": None if margin is None else round(margin, 6),
        }  # fmt: skip
        ranked.append(Ranked(record, 0, margin, abs(best - doc.score)))
    return ranked


def _target(doc: Doc) -> str:
    """The right answer as text: the gold request's continuation, or lm-eval's target."""
    request = doc.requests[doc.gold()] if doc.requests else []
    if not doc.generated and len(request) > 1 and len(doc.requests) > 1:
        return str(request[1])
    return doc.target


# ------------------------------------------------------------------------------------------- the command


@dataclass
class Outcome:
    """What `prompts --from-lm-eval` found: the records written, and a line per task."""

    records: list[dict[str, Any]]
    lines: list[str]


def prompts_from_lm_eval(ref_path: Path, cand_path: Path | None, top: int | None = None) -> Outcome:
    """The prompts file's records, ranked: with both runs, the documents the candidate scores worse
    (the reference right and the candidate wrong first, then the rest; each by how far their
    log-likelihoods part); with one run, the documents it failed, the most confidently wrong first.
    BadInput where no document qualifies (nothing is written then)."""
    if cand_path is not None and ref_path.resolve() == cand_path.resolve():
        raise BadInput(f"{ref_path} is given as both runs; give the reference's samples, then the candidate's")
    ref = read_run(ref_path, "the reference's")
    ranked: list[Ranked] = []
    lines = []
    if cand_path is None:
        for run in ref.values():
            found = failed_documents(run)
            ranked += found
            lines.append(f"{run.label}: {len(found)} of {counted(len(run.docs), 'document')} failed "
                         f"({run.metric} {run.mean():.3g})")  # fmt: skip
    else:
        for a, b in match_runs(ref, read_run(cand_path, "the candidate's")):
            found = worse_documents(a, b)
            ranked += found
            flips = sum(r.tier == 0 for r in found)
            lines.append(
                f"{a.label}: {len(found)} of {counted(len(a.docs), 'document')} scored worse by the candidate "
                f"({flips} right -> wrong; {a.metric} {a.mean():.3g} -> {b.mean():.3g})"
            )
    if not ranked:
        what = "the run failed no document" if cand_path is None else "the candidate scores no document worse"
        raise BadInput(f"{what} ({'; '.join(lines)}): no prompts to record, and no file written")
    ranked.sort(key=Ranked.key)
    return Outcome([r.record for r in ranked[:top]], lines)
