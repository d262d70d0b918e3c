"""The trn1 nightly workflow: valid for actionlint (expressions, contexts, action inputs, shell) and
for GitHub's workflow schema (SchemaStore's, vendored by check-jsonschema)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

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
    assert parity["needs"] == "golden" and "trn1" in parity["runs-on"]
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
