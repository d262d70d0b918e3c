"""The commands of README.md and docs/*.md, run as written.

The convention, by the fenced block's info string (the first word is the language, as GitHub and
myst-parser read it; the other words are ours):

- ```bash           run, in order with the page's other run blocks, in one temporary directory per
                    page, with this environment's `moe-parity`, `pytest` and `python` first on PATH;
                    it must exit 0;
- ```bash exit=N    run the same way; it must exit N (a block that shows a failure: pytest exits 1);
- ```bash norun     never run: it needs a GPU, a Neuron device, a real checkpoint or the network, or
                    it is the test suite itself;
- ```text output    the output of the run block before it: each of its lines but `...` must be a line
                    of that block's real output, its numbers aside (another CPU may round otherwise);
- any other block   (text, python, toml, json) is not run; tests/test_backends.py installs and runs
                    the backend example of docs/backends.md.

`pip install` lines of a run block are not run (they would change this environment): the install
lines must be what `.ci/run` runs, which installs this environment from a clean clone. The README's
test command is `.ci/run`'s too. Running the pages takes a few minutes: all but the README's are
marked slow.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
PIP_INSTALL = re.compile(r"^\s*pip install\b")
# PyTorch's CPU wheel index, as its install selector gives it: the docs' torch line names it (a stock
# Linux machine's plain `pip install torch` takes the CUDA build); .ci/run leaves it out, since CI's
# pip reaches PyPI alone and finds torch's CPU build in a local wheel folder (and checks it is that build).
CPU_INDEX = ["--index-url", "https://download.pytorch.org/whl/cpu"]

# key output lines per command: a run block holding the command must print each of them
EXPECTED = {
    "moe-parity demo": ["matches the bundled golden: yes", "32 points: 32 passed, 0 failed, 0 errors"],
    "moe-parity golden --model model --out golden\n": ["golden written: 32 points"],
    "pytest --golden-dir golden --dtype bfloat16\n": ["first divergence: none"],
    "--model port --dtype bfloat16 -x\n": ["first divergence: config"],
    "--dtype bfloat16 -x --no-parity-config": ["first divergence: layer_0.router"],
    "--layers 1-2": ["a slice: layers 1-2 of 4"],
    "--parity-mode both -x": ["first divergence: none"],
    "cache_dir=trace-cache -q\n": ["9 from the cache"],
    "moe-parity compare golden dump": ["compared 17 of 32 points, candidate dtype bfloat16"],
    "--hw dump --model dump": ["17 passed, 15 skipped"],
    "moe-parity diff report tonight": ["layer_0.router"],
}


@dataclass
class Block:
    page: Path
    line: int
    words: list[str]
    code: str

    @property
    def runs(self) -> bool:
        return self.words[:1] == ["bash"] and "norun" not in self.words

    @property
    def exit_code(self) -> int:
        return next((int(w.split("=", 1)[1]) for w in self.words if w.startswith("exit=")), 0)

    @property
    def is_output(self) -> bool:
        return self.words[:2] == ["text", "output"]

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, m.start()) + 1, m.group(1).split(), m.group(2)) for m in FENCE.finditer(text)
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # no xdist worker ids
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "80"  # pytest's rules are as wide as the terminal: the shown output is 80 columns
    return env


def _numbers_aside(line: str) -> str:
    return " ".join(re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "N", line).split())


def run_page(page: Path, tmp_path: Path) -> None:
    env, last_out = _env(), None
    for block in blocks(page):
        if block.is_output:
            assert last_out is not None, f"{block}: an output block follows no run block"
            real = {_numbers_aside(li) for li in last_out.splitlines()}
            for line in block.code.splitlines():
                if line.strip() and line.strip() != "...":
                    assert _numbers_aside(line) in real, f"{block}: not in the real output: {line!r}\n{last_out}"
            continue
        if not block.runs:
            continue
        code = "\n".join(li for li in block.code.splitlines() if not PIP_INSTALL.match(li))
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", code],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        last_out = proc.stdout + proc.stderr
        assert proc.returncode == block.exit_code, (
            f"{block}: exit {proc.returncode}, expected {block.exit_code}\n{code}\n--- output ---\n{last_out[-4000:]}"
        )
        for command, lines in EXPECTED.items():
            if command in block.code + "\n":
                for line in lines:
                    assert line in last_out, f"{block}: {command.strip()!r} did not print {line!r}\n{last_out[-4000:]}"


def test_every_page_has_its_blocks_marked() -> None:
    """Shell commands only in bash blocks, run or marked norun; every expected output is still there."""
    all_code = ""
    for page in PAGES:
        for block in blocks(page):
            assert block.words, f"{block}: a code block without a language"
            if block.words[0] in ("sh", "shell", "console"):
                pytest.fail(f"{block}: shell commands go in ```bash blocks (```bash norun where they cannot run here)")
            if block.words[0] == "bash":
                assert set(block.words[1:]) <= {"norun"} | {w for w in block.words if w.startswith("exit=")}, block
            if block.runs:
                all_code += block.code + "\n"
    for command in EXPECTED:
        assert command in all_code, f"no run block holds {command.strip()!r} any more: update EXPECTED"


def test_the_readme_test_command_is_what_ci_runs() -> None:
    ci = {li.strip() for li in CI_RUN.read_text().splitlines()}
    tests = [b for b in blocks(README) if b.words[:1] == ["bash"] and "python -m pytest" in b.code]
    assert tests, "the README has no test command"
    for line in tests[0].code.splitlines():
        assert line.split("#")[0].strip() in ci, f"the README's test command {line!r} is not what .ci/run runs"


def test_install_lines_are_what_ci_runs() -> None:
    """The install lines a run block skips are those .ci/run installs this environment with (its
    extras may be more: it also builds the docs)."""

    def parsed(line: str) -> tuple[list[str], set[str]]:
        words = [w for w in shlex.split(line.split("#")[0]) if w != "--quiet"]
        if words[2:3] == ["torch==2.13.0"] and words[3:] == CPU_INDEX:
            words = words[:3]  # CI's pip has no such index (see CPU_INDEX)
        extras = {e for w in words for group in re.findall(r"\[([^]]*)\]", w) for e in group.split(",")}
        return [re.sub(r"\[.*\]", "", w) for w in words], extras

    ci = [parsed(li) for li in CI_RUN.read_text().splitlines() if PIP_INSTALL.match(li)]
    found = 0
    for page in PAGES:
        for block in filter(lambda b: b.runs, blocks(page)):
            for line in filter(PIP_INSTALL.match, block.code.splitlines()):
                words, extras = parsed(line)
                assert any(words == w and extras <= e for w, e in ci), f"{block}: {line!r} is not what .ci/run runs"
                found += 1
    assert found, "no install lines in the docs"


def test_the_first_install_line_takes_torch_s_cpu_build_on_a_stock_machine() -> None:
    """Every run block's torch line pins the version CI installs and names PyTorch's CPU index: on a
    stock Linux machine `pip install torch==X` alone takes the CUDA build. CI checks what it got."""
    ci = [li for li in CI_RUN.read_text().splitlines() if PIP_INSTALL.match(li) and "torch==" in li]
    assert len(ci) == 1, ci
    pin = next(w for w in shlex.split(ci[0]) if w.startswith("torch=="))
    assert "torch.version.cuda" in CI_RUN.read_text(), ".ci/run no longer checks it installed the CPU build"
    lines = [li for page in PAGES for b in blocks(page) if b.runs for li in b.code.splitlines()
             if PIP_INSTALL.match(li) and re.search(r"\btorch\b", li.split("#")[0])]  # fmt: skip
    assert len(lines) >= 2, lines  # the README's and the getting-started page's
    for line in lines:
        assert shlex.split(line.split("#")[0]) == ["pip", "install", pin, *CPU_INDEX], line


def test_the_stack_table_is_the_same_in_the_readme_and_the_neuron_page() -> None:
    def table(page: Path) -> list[str]:
        lines = page.read_text().split("## Which stack runs what", 1)[1].splitlines()
        return [li for li in lines if li.startswith("|")]

    assert table(README) and table(README) == table(ROOT / "docs" / "neuron.md")


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, id=p.name, marks=() if p == README else pytest.mark.slow)
        for p in PAGES
        if any(b.runs for b in blocks(p))
    ],
)
def test_the_pages_commands_run(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path)
