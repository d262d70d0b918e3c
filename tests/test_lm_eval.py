"""`moe-parity prompts --from-lm-eval`: lm-eval's per-document samples of a reference and a candidate
as a prompts file. The parsing and ranking run on samples the real lm-eval wrote (fixtures/lm_eval/);
the end-to-end test runs lm-eval here on a tiny reference and its faulty candidate, and follows the
prompts file through `moe-parity golden --prompts` to the fault's point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import NO_CONFIG, NO_WEIGHTS, assert_stops_at, cli, run_parity
from lm_eval_task import FAULT_POINT, TASK, write_models, write_task

from pytest_moe_parity.record.prompts import read_prompts

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"
REF, CAND = FIXTURE / "ref", FIXTURE / "cand"


def samples_file(run: Path) -> Path:
    (path,) = run.rglob("samples_*.jsonl")
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_doc(run: Path) -> dict[int, dict]:
    return {entry["doc_id"]: entry for entry in lines(samples_file(run))}


def written(capsys, tmp_path: Path, *argv) -> tuple[list[dict], str]:
    out = tmp_path / "prompts.jsonl"
    code, stdout, stderr = cli(capsys, "prompts", "--from-lm-eval", *argv, "--out", out)
    assert code == 0, stderr
    return lines(out), stdout


def test_the_documents_the_candidate_scores_worse_right_to_wrong_first(tmp_path: Path, capsys) -> None:
    """Exactly the documents whose acc the candidate lowers, each with its task, doc id, the right
    answer and both runs' answers, the right-to-wrong ones first and by how far the log-likelihoods part."""
    ref, cand = by_doc(REF), by_doc(CAND)
    records, stdout = written(capsys, tmp_path, REF, CAND)
    worse = {d for d in ref if cand[d]["acc"] < ref[d]["acc"]}
    assert worse and {r["doc_id"] for r in records} == worse
    assert [r["doc_id"] for r in records] == sorted(
        worse, key=lambda d: (not (ref[d]["acc"] == 1 and cand[d]["acc"] == 0), -_gap(ref[d], cand[d]))
    )
    for r in records:
        entry = ref[r["doc_id"]]
        gold = entry["arguments"][f"gen_args_{int(entry['target'])}"]
        assert r["task"] == TASK and r["metric"] == "acc"
        assert r["text"] == gold["arg_0"] + gold["arg_1"] and r["target"] == gold["arg_1"]
        assert r["reference"]["answer"] == _argmax_choice(entry)
        assert r["candidate"]["answer"] == _argmax_choice(cand[r["doc_id"]])
        assert r["reference"]["acc"] > r["candidate"]["acc"]
        assert r["loglikelihood_gap"] == pytest.approx(_gap(entry, cand[r["doc_id"]]), abs=1e-5)
    assert f"{TASK}: {len(worse)} of 16 documents scored worse by the candidate" in stdout
    # files instead of folders, and --top
    top, _ = written(capsys, tmp_path, samples_file(REF), samples_file(CAND), "--top", "1")
    assert top == records[:1]


def _gap(a: dict, b: dict) -> float:
    return max(abs(float(x[0]) - float(y[0])) for x, y in zip(a["filtered_resps"], b["filtered_resps"], strict=True))


def _argmax_choice(entry: dict) -> str:
    lls = [float(r[0]) for r in entry["filtered_resps"]]
    return entry["arguments"][f"gen_args_{lls.index(max(lls))}"]["arg_1"]


def test_the_prompts_file_is_read_with_its_documents_named(tmp_path: Path, capsys) -> None:
    records, _ = written(capsys, tmp_path, REF, CAND)
    prompts = read_prompts(tmp_path / "prompts.jsonl")
    assert [p.text for p in prompts] == [r["text"] for r in records]
    first = prompts[0]
    assert first.source is not None and first.source["candidate"] == records[0]["candidate"]
    assert first.preview().startswith(f"{TASK} doc {records[0]['doc_id']}: Q: ")


def test_one_run_alone_gives_the_documents_it_failed_most_confidently_wrong_first(tmp_path: Path, capsys) -> None:
    records, stdout = written(capsys, tmp_path, CAND)
    cand = by_doc(CAND)
    failed = {d for d, e in cand.items() if e["acc"] == 0}
    assert {r["doc_id"] for r in records} == failed
    margins = [r["margin"] for r in records]
    assert margins == sorted(margins, reverse=True) and all(m > 0 for m in margins)
    assert all(r["run"]["acc"] == 0 for r in records) and "reference" not in records[0]
    assert f"{TASK}: {len(failed)} of 16 documents failed" in stdout


def test_a_generation_task_s_prompt_is_its_context(tmp_path: Path, capsys) -> None:
    """generate_until samples (lm-eval's text responses, scored by exact_match): the context alone is the
    prompt, the text generated the run's answer; no log-likelihood, so the documents keep their order."""
    gen = by_doc(FIXTURE / "gen")
    records, _ = written(capsys, tmp_path, FIXTURE / "gen")
    failed = [d for d, e in sorted(gen.items()) if e["exact_match"] < 1]
    assert failed and [r["doc_id"] for r in records] == failed
    for r in records:
        entry = gen[r["doc_id"]]
        assert r["task"] == "tiny_gen" and r["metric"] == "exact_match" and r["margin"] is None
        assert r["text"] == entry["arguments"]["gen_args_0"]["arg_0"] and r["target"] == entry["target"]
        assert r["run"] == {"answer": entry["filtered_resps"][0], "exact_match": entry["exact_match"]}


def test_lm_eval_s_older_layout_reads_the_same(tmp_path: Path, capsys) -> None:
    """lm-eval before 0.4.3 wrote the arguments as lists and the responses as numbers."""
    old = {}
    for name, run in (("ref", REF), ("cand", CAND)):
        path = tmp_path / name / samples_file(run).name
        path.parent.mkdir()
        entries = lines(samples_file(run))
        for e in entries:
            e["arguments"] = [[a["arg_0"], a["arg_1"]] for a in e["arguments"].values()]
            e["filtered_resps"] = [[float(r[0]), r[1] == "True"] for r in e["filtered_resps"]]
            e["resps"] = [[x] for x in e["filtered_resps"]]
        path.write_text("".join(json.dumps(e) + "\n" for e in entries))
        old[name] = path
    records, _ = written(capsys, tmp_path, old["ref"], old["cand"])
    expected, _ = written(capsys, tmp_path, REF, CAND)
    assert records == expected


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_lines(run: Path, edit) -> None:
    path = samples_file(run)
    entries = lines(path)
    for e in entries:
        edit(e)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def _another_task(tmp: Path) -> list[Path]:
    src = samples_file(CAND)
    other = tmp / src.name.replace(f"samples_{TASK}_", "samples_arc_easy_")
    shutil.copy(src, other)
    return [samples_file(REF), other]


def _another_model(tmp: Path) -> list[Path]:
    cand = _copy(CAND, tmp / "cand")
    (results,) = cand.rglob("results_*.json")
    data = json.loads(results.read_text())
    data["tokenizer_eos_token"] = ["</s>", "2"]
    results.write_text(json.dumps(data))
    return [REF, cand]


def _another_prompt(tmp: Path) -> list[Path]:
    cand = _copy(CAND, tmp / "cand")
    _edit_lines(cand, lambda e: e.update(prompt_hash="0" * 64) if e["doc_id"] == 3 else None)
    return [REF, cand]


def _not_samples(tmp: Path) -> list[Path]:
    path = tmp / "samples_tiny_mc_2026-01-01T00-00-00.000000.jsonl"
    path.write_text('{"text": "a prompts file, not samples"}\n')
    return [REF, path]


def _no_worse(tmp: Path) -> list[Path]:
    return [REF, _copy(REF, tmp / "again")]


def _two_runs_in_one_folder(tmp: Path) -> list[Path]:
    both = tmp / "out"
    _copy(REF, both / "a")
    _copy(CAND, both / "b")
    return [both]


BAD = {
    "another task": (_another_task, "the reference's samples are of task tiny_mc and the candidate's of arc_easy"),
    "another model": (_another_model, "with another tokenizer (tokenizer_eos_token ['[EOS]', '2'] against"),
    "another prompt": (_another_prompt, "document 3 has another prompt in the candidate's samples"),
    "not samples": (_not_samples, "line 1, is not lm-eval samples (no doc_id, arguments and filtered_resps)"),
    "no document worse": (_no_worse, "the candidate scores no document worse (tiny_mc: 0 of 16 documents"),
    "two runs in one folder": (_two_runs_in_one_folder, "holds the samples of 2 runs (a/__tmp__lmf__ref, b/__tm"),
    "the same run twice": (lambda tmp: [REF, REF], "is given as both runs"),
    "three runs": (lambda tmp: [REF, CAND, REF], "--from-lm-eval takes the reference's samples and the candidate's"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_sentence_and_no_file(tmp_path: Path, capsys, case: str) -> None:
    make, message = BAD[case]
    out = tmp_path / "prompts.jsonl"
    code, _, stderr = cli(capsys, "prompts", "--from-lm-eval", *make(tmp_path), "--out", out)
    assert code == 2 and message in stderr, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert not out.exists()


# ------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="session")
def lm_eval_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model) -> dict[str, Path]:
    """lm-eval run here, in this process, on the tiny reference and its faulty candidate over the local
    task, its samples written as `lm_eval --log_samples --output_path` writes them."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: pip install -e '.[dev]'")
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    out = tmp_path_factory.mktemp("lm-eval")
    write_task(out)
    models = dict(zip(("ref", "cand"), write_models(tiny_model("qwen3_moe", 2), out), strict=True))
    tasks = TaskManager(include_path=str(out), include_defaults=False)
    runs = {"ref_model": models["ref"]}
    for name, model in models.items():
        tracker = EvaluationTracker(output_path=str(out / "out" / name))
        results = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={model},dtype=float32", tasks=[TASK], task_manager=tasks,
            device="cpu", batch_size=4, log_samples=True, evaluation_tracker=tracker,
        )  # fmt: skip
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        tracker.save_results_samples(task_name=TASK, samples=samples[TASK])
        runs[name] = out / "out" / name
    runs["cand_model"] = models["cand"]
    return runs


@pytest.mark.slow
@pytest.mark.usefixtures("_import_everything_once")
def test_lm_eval_s_failures_record_a_golden_that_stops_at_the_fault(
    pytester: pytest.Pytester, tmp_path: Path, capsys, lm_eval_runs
) -> None:
    """The done-when of issue 55's first item: lm-eval on a faulty tiny candidate and its reference, the
    documents it scores worse as prompts, a golden of them, and the candidate's replay stops at the fault."""
    prompts = tmp_path / "prompts.jsonl"
    code, stdout, stderr = cli(
        capsys, "prompts", "--from-lm-eval", lm_eval_runs["ref"], lm_eval_runs["cand"], "--out", prompts
    )
    assert code == 0, stderr
    records = lines(prompts)
    assert records and records[0]["flipped"], stdout
    golden = tmp_path / "golden"
    code, _, stderr = cli(capsys, "golden", "--model", lm_eval_runs["ref_model"], "--out", golden, "--prompts", prompts)
    assert code == 0, stderr
    manifest = json.loads((golden / "manifest.json").read_text())["inputs"]
    assert [s["doc_id"] for s in manifest["prompt_sources"]] == [r["doc_id"] for r in records]
    result = run_parity(pytester, golden, "--hw", "cpu", "-x", NO_WEIGHTS, NO_CONFIG, model=lm_eval_runs["cand_model"])
    assert_stops_at(result, golden, FAULT_POINT)
