"""No vacuous green (issue 53): the golden against itself, and a selection with no point, say so, and
are usage errors where a candidate is required (CI=true, --parity-require-candidate)."""

from __future__ import annotations

import shutil

import pytest
from helpers import cli, read_json, run_parity, session, usage_error

from pytest_moe_parity.replay.vacuous import AGAINST_ITSELF, NO_POINT, REQUIRE_FLAG, required
from pytest_moe_parity.report.files import SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

ARCH = "mixtral"
SAID = f"moe-parity: {AGAINST_ITSELF}: this checks nothing about a port (pass --model CANDIDATE, --dtype or --hw)"
ONE_LAYER = ("-k", "layer_0 and not weights", "--no-parity-config")


def test_the_golden_against_itself_says_so_and_passes(pytester: pytest.Pytester, golden_dir) -> None:
    report = pytester.path / "report"
    result = run_parity(pytester, golden_dir(ARCH), *ONE_LAYER, "--parity-report", str(report))
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([SAID, "*= moe-parity =*", "*points:*", SAID])  # the header, then the summary
    assert read_json(report / SUMMARY_FILE)["vacuous"] == AGAINST_ITSELF


def test_model_naming_the_goldens_own_directory_is_the_golden_against_itself(
    pytester: pytest.Pytester, golden_dir, tiny_model
) -> None:
    result = run_parity(pytester, golden_dir(ARCH), *ONE_LAYER, model=tiny_model(ARCH))
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([SAID])


@pytest.mark.parametrize("how", ["CI=true", REQUIRE_FLAG])
def test_required_candidate_refuses_the_golden_against_itself(
    how: str, pytester: pytest.Pytester, golden_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = list(ONE_LAYER)
    if how == REQUIRE_FLAG:
        argv.append(REQUIRE_FLAG)
    else:
        monkeypatch.setenv("CI", "true")
    result = run_parity(pytester, golden_dir(ARCH), *argv)
    usage_error(result, f"the candidate is the golden's own model in the golden's own dtype (float32) on --hw cpu, "
                f"{AGAINST_ITSELF}, which checks nothing about a port, and {how} requires a candidate: "
                "pass the port with --model CANDIDATE (and its --dtype, --hw)")  # fmt: skip


def test_another_dtype_or_model_is_a_candidate(
    pytester: pytest.Pytester, golden_dir, tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    golden = golden_dir(ARCH)
    for argv, model in (((*ONE_LAYER, "--dtype", "bfloat16"), None), (ONE_LAYER, tiny_model(ARCH, seed=1))):
        result = run_parity(pytester, golden, *argv, REQUIRE_FLAG, model=model)
        out = result.stdout.str() + result.stderr.str()
        assert result.ret in (0, 1) and AGAINST_ITSELF not in out, out
        assert "INTERNALERROR" not in out


def test_a_selection_with_no_point_says_so(pytester: pytest.Pytester, golden_dir) -> None:
    result = run_parity(pytester, golden_dir(ARCH), "--dtype", "bfloat16", "-k", "no_such_point")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, out
    result.stdout.fnmatch_lines(["no parity items ran", f"moe-parity: {NO_POINT}: this checks nothing*"])
    assert AGAINST_ITSELF not in out


@pytest.mark.parametrize("how", ["CI=true", REQUIRE_FLAG])
def test_required_candidate_refuses_a_selection_with_no_point(
    how: str, pytester: pytest.Pytester, golden_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--dtype", "bfloat16", "-k", "no_such_point"]
    if how == REQUIRE_FLAG:
        argv.append(REQUIRE_FLAG)
    else:
        monkeypatch.setenv("CI", "true")
    usage_error(
        run_parity(pytester, golden_dir(ARCH), *argv),
        f"{NO_POINT}: -k, -m or --parity-layers deselected every point of the golden, which checks nothing, "
        f"and {how} requires a candidate's points: select at least one point",
    )


@pytest.mark.parametrize("required", [False, True], ids=["said", "CI=true"])
def test_an_xdist_run_with_no_point_says_so(
    required: bool, pytester: pytest.Pytester, golden_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under xdist the controller collects nothing itself: the workers' empty selection is found there,
    said in the summary, and refused where a candidate is required (CI=true), as without xdist."""
    if required:
        monkeypatch.setenv("CI", "true")
    result = run_parity(pytester, golden_dir(ARCH), "--dtype", "bfloat16", "-k", "no_such_point", "-n", "2")
    if required:
        usage_error(result, f"{NO_POINT}: -k, -m or --parity-layers deselected every point of the golden, which "
                    "checks nothing, and CI=true requires a candidate's points: select at least one point")  # fmt: skip
    else:
        assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout.str()
        result.stdout.fnmatch_lines([f"moe-parity: {NO_POINT}: this checks nothing*"])


@pytest.mark.parametrize("ci", [False, True], ids=["said", "CI=true"])
def test_compare_refuses_the_golden_as_its_own_dump(
    ci: bool, capsys: pytest.CaptureFixture[str], pytester: pytest.Pytester, golden_dir, tmp_path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`moe-parity compare GOLDEN GOLDEN` (or a copy of it), and `--hw dump --model GOLDEN`: the golden
    against itself, refused in one sentence (exit 2, a usage error), naming CI=true where it requires a
    candidate."""
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    golden = golden_dir(ARCH)
    copy = shutil.copytree(golden, tmp_path / "copy")
    by = ", and CI=true requires a candidate" if ci else ""
    for candidate in (golden, copy):
        code, out, err = cli(capsys, "compare", str(golden), str(candidate))
        assert code == 2 and out == "" and "Traceback" not in err, err
        assert err == (
            f"moe-parity: error: CANDIDATE_DIR {candidate} is the golden itself, {AGAINST_ITSELF}, which checks "
            f"nothing about a port{by}: pass the port's dump as CANDIDATE_DIR\n"
        )
    usage_error(run_parity(pytester, golden, "--hw", "dump", model=copy),
                f"--model {copy} is the golden itself, {AGAINST_ITSELF}, which checks nothing about a port{by}: "
                "pass the port's dump as --model")  # fmt: skip


def test_the_session_knows(golden_dir, tiny_model) -> None:
    """Without pytest: the golden's own model in its own dtype on cpu is vacuous; bf16, trace, another
    model are not."""
    golden = golden_dir(ARCH)
    cases = [
        ({}, AGAINST_ITSELF),
        ({"model": tiny_model(ARCH)}, AGAINST_ITSELF),
        ({"dtype": "bfloat16"}, None),
        ({"hw": "trace"}, None),
        ({"model": tiny_model(ARCH, seed=1)}, None),
    ]
    for options, expected in cases:
        run = session(golden, **options)
        try:
            assert run.vacuous == expected, options
            assert run.meta()["vacuous"] == expected
        finally:
            run.close()


@pytest.mark.parametrize(
    ("option", "env", "expected"),
    [
        (False, {}, None),
        (False, {"CI": "true"}, "CI=true"),
        (False, {"CI": "1"}, "CI=true"),
        (False, {"CI": "false"}, None),
        (False, {"CI": ""}, None),
        (True, {}, REQUIRE_FLAG),
    ],
)
def test_what_requires_a_candidate(option: bool, env: dict[str, str], expected: str | None) -> None:
    assert required(option, env) == expected


def test_a_run_of_the_users_own_tests_alone_is_not_empty(pytester: pytest.Pytester, golden_dir) -> None:
    """Paths given and every point deselected: the user's tests run, which may check the candidate."""
    pytester.makepyfile(test_mine="def test_mine(golden):\n    assert golden.points\n")
    result = run_parity(pytester, golden_dir(ARCH), "test_mine.py", "--dtype", "bfloat16", "-k", "mine", REQUIRE_FLAG)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert NO_POINT not in result.stdout.str()


def test_a_run_of_the_weight_items_alone_is_not_empty(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path
) -> None:
    """Every point deselected but the weight items kept (`-k weights`, a candidate's checkpoint of its
    own): they check the candidate, so the run is not empty, required or not."""
    candidate = shutil.copytree(tiny_model(ARCH), tmp_path / "candidate")
    argv = ("--dtype", "bfloat16", "-k", "weights", REQUIRE_FLAG)
    result = run_parity(pytester, golden_dir(ARCH), *argv, model=candidate)
    out = result.stdout.str()
    assert result.ret == 0, out + result.stderr.str()
    assert NO_POINT not in out and result.parseoutcomes()["passed"] >= 2, out
