"""`moe-parity vllm-dump --state clean|reused|prefix` and `pytest --parity-state DIR`: vLLM's engine serving a
40-token prompt alone, after another request in the KV blocks it held, and on a prefix-cache hit of its
first 32 tokens another request wrote; each state's dump judged against the clean one's, point by point
(three engine runs, about 10 s each on 2 cores)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from helpers import read_json, run_parity

from pytest_moe_parity.cli import main
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE

PROMPT = ",".join(str((7 * i + 3) % 250 + 3) for i in range(40))  # longer than a KV block of 32: a prefix hit


@pytest.fixture(scope="module")
def dumps(recorded, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, str]]]:
    """The 40-token golden, and each state's dump with what the command said."""
    root = recorded("qwen3_moe", head_dim=32, golden_args=("--input-ids", PROMPT))
    made = {}
    for state in ("clean", "reused", "prefix"):
        out = tmp_path_factory.mktemp("state") / state
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            code = main(["vllm-dump", "--model", str(root / "model"), "--golden", str(root / "golden"),
                         "--out", str(out), "--state", state])  # fmt: skip
        assert code == 0, said.getvalue()
        made[state] = out, said.getvalue()
    return root / "golden", made


def said_of(dump: Path) -> str:
    return json.loads((dump / "engine.json").read_text())["state"]["said"][0]


@pytest.mark.parametrize("state", ["reused", "prefix"])
def test_the_engine_in_another_state_gives_the_clean_run_s_output(dumps, pytester: pytest.Pytester, state: str):
    golden, made = dumps
    (clean, _), (dump, said) = made["clean"], made[state]
    if state == "reused":  # the prompt in the batch row and the KV blocks the other request held
        assert "state: after another request (40 tokens) in batch row 0: the prompt in batch row 0, KV blocks " in said
        assert "2 KV blocks the other request held" in said
    else:
        assert "state: on a prefix-cache hit of 32 tokens (blocks of 32) that another request wrote" in said
        assert json.loads((dump / "engine.json").read_text())["state"]["prompt"]["prefix_hit_tokens"] == 32
    report = pytester.path / "r"
    result = run_parity(pytester, golden, "--hw", "dump", "--parity-state", str(dump), "--parity-report", str(report),
                        model=clean)  # fmt: skip
    points = len(GoldenStore(golden).point_ids)
    result.assert_outcomes(passed=2 * points)
    rows = [r for r in read_json(report / REPORT_FILE)["points"] if r["id"].endswith("::state")]
    assert len(rows) == points and all(r["said"] == f"in the dump {dump} ({said_of(dump)})" for r in rows)
    # vLLM's CPU kernels in float32 give the state's run the clean run's bits, the prefix hit's rows included
    assert max(r["figures"]["state_vs_clean"] for r in rows) == 0.0


def test_a_prompt_no_prefix_hit_can_cover_is_one_line(head32: Path, capsys: pytest.CaptureFixture, tmp_path) -> None:
    """A 16-token prompt: a hit takes whole blocks of 32 and leaves the last token to compute (exit 2, before vLLM
    builds an engine, nothing written)."""
    code = main(["vllm-dump", "--model", str(head32 / "model"), "--golden", str(head32 / "golden"),
                 "--out", str(tmp_path / "out"), "--state", "prefix"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "the golden's prompt has 16 tokens: a prefix-cache hit takes whole blocks of 32" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
