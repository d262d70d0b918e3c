"""The trn1 nightly workflow: valid for actionlint (expressions, contexts, action inputs, shell) and
for GitHub's workflow schema (SchemaStore's, vendored by check-jsonschema)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "nightly-trn1.yml"


def _run(*argv: str) -> subprocess.CompletedProcess:
    tool = shutil.which(argv[0])
    assert tool, f"{argv[0]} is not installed: pip install -e '.[dev]'"
    return subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=120)


def test_actionlint() -> None:
    proc = _run("actionlint", "-no-color", str(WORKFLOW))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_github_workflow_schema() -> None:
    proc = _run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(WORKFLOW))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_nightly_does_what_the_readme_says() -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    assert flow[True]["schedule"]  # yaml reads the `on:` key as True
    parity = flow["jobs"]["parity"]
    assert "golden" in parity["needs"] and "trn1" in parity["runs-on"]
    steps = "\n".join(str(step.get("run", "")) + str(step.get("uses", "")) for step in parity["steps"])
    for needed in (
        "apt.repos.neuron.amazonaws.com",
        "pip.repos.neuron.amazonaws.com",
        "actions/cache",
        "--hw neuron",
        '-n "$PARITY_WORKERS"',
        "--junitxml",
        "--parity-report",
        "actions/upload-artifact",
    ):
        assert needed in steps, needed
    golden_steps = "\n".join(str(step.get("run", "")) for step in flow["jobs"]["golden"]["steps"])
    assert "moe-parity golden" in golden_steps


def _jobs() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]


def _step(job: dict, name: str) -> dict:
    return next(step for step in job["steps"] if step.get("name", "").startswith(name))


def test_the_nightly_is_sharded_and_merged() -> None:
    """plan -> one parity job per shard (a matrix of --parity-layers strings) -> merge, which runs
    whether or not a shard failed, and diffs against last night's merged report."""
    jobs = _jobs()
    plan, parity, merge = jobs["plan"], jobs["parity"], jobs["merge"]
    assert plan["outputs"]["shards"] == "${{ steps.shards.outputs.shards }}"
    shards = _step(plan, "Shards")["run"]
    assert "moe-parity estimate" in shards and "--json plan.json" in shards and '"$PARITY_SHARDS"' in shards
    assert parity["needs"] == ["golden", "plan"]
    assert parity["strategy"]["matrix"]["shard"] == "${{ fromJSON(needs.plan.outputs.shards) }}"
    assert parity["strategy"]["fail-fast"] is False
    run = _step(parity, "Parity on NeuronCores")
    assert run["env"]["SHARD"] == "${{ matrix.shard }}" and '--parity-layers "$SHARD"' in run["run"]
    assert _step(parity, "Reports")["with"]["name"] == "parity-shard-${{ strategy.job-index }}"
    assert merge["needs"] == ["plan", "parity"] and merge["if"].startswith("${{ always()")
    assert _step(merge, "The shards' reports")["with"]["pattern"] == "parity-shard-*"
    assert merge["permissions"]["actions"] == "read"  # to download the previous run's artifact
    merged = _step(merge, "Merge the shards")["run"]
    assert "moe-parity report --merge" in merged and "moe-parity diff previous merged" in merged
    assert _step(merge, "The merged report")["with"]["name"] == "parity-merged"


def _bash(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A step's `run` as GitHub runs it (bash -e -o pipefail), with `.venv` this environment."""
    venv = cwd / ".venv"
    if not venv.exists():
        venv.symlink_to(Path(sys.executable).parent.parent)
    full = {**os.environ, "GITHUB_OUTPUT": str(cwd / "output"), **env}
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_the_plan_and_merge_steps_run_as_written(tmp_path: Path, golden_dir) -> None:
    """The plan job's script estimates shards from a golden; shards run as the matrix gives them (here
    without pytest: the same session); the merge job's script merges those that wrote a report and
    names the one that did not."""
    from pytest_moe_parity.session import ParitySession, RunOptions

    jobs = _jobs()
    golden = golden_dir("qwen3_moe")
    proc = _bash(_step(jobs["plan"], "Shards")["run"], tmp_path, PARITY_SHARDS="", FROM_INPUT="", FROM_VARS=str(golden),
                 CANDIDATE="", SHARD_COUNT="3", SHARD_BUDGET="", PARITY_WORKERS="1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shards = json.loads((tmp_path / "output").read_text().strip().removeprefix("shards="))
    assert len(shards) == 3 and shards[0].startswith("model,")
    for i, shard in enumerate(shards[:-1]):  # the last shard's runner died: no report
        out = tmp_path / "shards" / f"parity-shard-{i}" / "parity"
        session = ParitySession(RunOptions(golden_dir=golden, layers=shard, report_dir=out, plots=False))
        list(session.run_all(items=True))
        session.write_reports()
        session.close()
    proc = _bash(_step(jobs["merge"], "Merge the shards")["run"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"not a whole run: no shard ran layer {shards[-1]} of the golden's 0-3" in proc.stdout
    assert "no previous merged report: nothing to diff against" in proc.stdout
    assert (tmp_path / "merged" / "comparison_summary.json").is_file()
    (tmp_path / "output").write_text("")
    proc = _bash(_step(jobs["plan"], "Shards")["run"], tmp_path, PARITY_SHARDS='["model,0-1", "2-3"]')
    assert proc.returncode == 0 and (tmp_path / "output").read_text() == 'shards=["model,0-1", "2-3"]\n'
