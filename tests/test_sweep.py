"""A length sweep: one golden per length of one prompt family (`moe-parity golden --sweep-lengths`), a
candidate over every length (`moe-parity sweep`): accumulation for clean bf16 candidates of three
architectures, and a defect named at its point and length for a port whose rotary tables change past
its own short context (dynamic scaling above 32 positions: right at 16 and 32 tokens, wrong at 64)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faults import edit_config
from helpers import cli, read_json, run_parity, usage_error

from pytest_moe_parity.sweep import Cell, SweepError, SweepResult, Trend, family, parse_lengths, sweep_lines, trend

pytestmark = pytest.mark.usefixtures("_import_everything_once")

LAYERS = 2
LENGTHS = "16,32,64"


@pytest.fixture(scope="module")
def sweeps(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    """sweeps(arch) -> a sweep of LENGTHS with the reference's own bf16 error, recorded once."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            out = tmp_path_factory.mktemp(f"sweep-{arch}") / "sweep"
            code = _golden(tiny_model(arch, LAYERS), out, "--noise-dtype", "bfloat16")
            assert code == 0
            made[arch] = out
        return made[arch]

    return make


def _golden(model: Path, out: Path, *more: str) -> int:
    from pytest_moe_parity.cli import main

    return main(["golden", "--model", str(model), "--out", str(out), "--sweep-lengths", LENGTHS, "-q", *more])


def short_context(model: Path, dst: Path) -> Path:
    """The port: the reference's checkpoint whose rotary scaling is dynamic above 32 positions."""
    port = shutil.copytree(model, dst)

    def edit(config: dict) -> None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
        config.update(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                   "rope_theta": theta})  # fmt: skip

    edit_config(port, edit)
    return port


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "minimax_m2"])
def test_a_clean_candidate_accumulates(capsys, sweeps, arch: str, tmp_path: Path) -> None:
    sweep = sweeps(arch)
    assert json.loads((sweep / "sweep.json").read_text())["lengths"] == [16, 32, 64]
    code, out, err = cli(capsys, "sweep", str(sweep), "--dtype", "bfloat16", "--json", str(tmp_path / "s.json"))
    assert code == 0, out + err
    assert "verdict: accumulation: no point leaves its limits at any length" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["point"])
    assert lines[header].split()[1:] == ["16", "32", "64"]
    assert [line.split()[0] for line in lines[header + 1 : header + 1 + LAYERS + 1]] == [
        *(f"layer_{n}.output" for n in range(LAYERS)),
        "logits",
    ]
    verdict = read_json(tmp_path / "s.json")
    assert verdict["verdict"] == "accumulation" and verdict["defect"] is None and verdict["noise"] is True
    cell = verdict["points"]["layer_0.output"]["64"]
    assert cell["reference"] > 0 and cell["ratio"] <= cell["limit"]
    # the verdict's words are what its figures do, the candidate's and the reference's own
    words = {"grows": "grows with length", "falls": "falls with length", "flat": "stays flat over length"}
    curves = [[verdict["points"][p][n] for n in ("16", "32", "64")] for p in (*[f"layer_{i}.output" for i in
                                                                                 range(LAYERS)], "logits")]  # fmt: skip
    for side, key in (("candidate", "rel_l2"), ("reference", "reference")):
        assert verdict["trend"][side] == vars(trend([16, 32, 64], [[c[key] for c in curve] for curve in curves]))
    said = verdict["trend"]["candidate"]
    assert f"the candidate's error {words[said['word']]} (x{said['factor']:.2g} from 16 to 64 tokens" in out, out
    assert (sweep / "sweep.png").is_file()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_short_rotary_context_is_a_defect_from_its_length_on(
    capsys, sweeps, tiny_model, arch: str, tmp_path: Path
) -> None:
    port = short_context(tiny_model(arch, LAYERS), tmp_path / "port")
    report = str(tmp_path / "s.json")
    sweep = str(sweeps(arch))
    code, out, err = cli(capsys, "sweep", sweep, "--dtype", "bfloat16", "--model", str(port), "--json", report)
    assert code == 1, out + err
    assert "verdict: a defect at rotary: right up to length 32, wrong from length 64" in out
    verdict = read_json(tmp_path / "s.json")
    assert verdict["defect"] == {"point": "rotary", "length": 64}
    assert verdict["points"]["rotary"]["32"]["status"] == "passed"


def test_sweep_bad_input(capsys, golden_dir, tiny_model, tmp_path: Path, pytester: pytest.Pytester, sweeps) -> None:
    model = tiny_model("qwen3_moe", LAYERS)

    def fails(args: list[str], message: str) -> None:
        code, _, err = cli(capsys, *args)
        assert code == 2 and message in err and "Traceback" not in err, err

    fails(["golden", "--model", str(model), "--out", str(tmp_path / "a"), "--sweep-lengths", "64,1024"],
          "1024 tokens are beyond the model's context of 512")  # fmt: skip
    assert not (tmp_path / "a").exists()  # nothing half-written
    fails(["golden", "--model", str(model), "--out", str(tmp_path / "b"), "--sweep-lengths", "64,32"],
          "expected two or more increasing token counts")  # fmt: skip
    fails(["golden", "--model", str(model), "--out", str(tmp_path / "c"), "--sweep-lengths", "16,32", "--seq-len", "8"],
          "--sweep-lengths sets each golden's length from one prompt family; drop --seq-len")  # fmt: skip
    fails(["sweep", str(golden_dir("qwen3_moe", LAYERS))], "is not a length sweep (no sweep.json)")
    usage_error(run_parity(pytester, sweeps("qwen3_moe")), "is a length sweep, a golden per length (len_16, len_32")


def test_the_prompt_family_is_prefixes_of_the_longest() -> None:
    ids = family([7, 8, 9], [2, 5, 7])
    assert ids == {2: [7, 8], 5: [7, 8, 9, 7, 8], 7: [7, 8, 9, 7, 8, 9, 7]}
    assert parse_lengths("16, 32,64") == [16, 32, 64]
    with pytest.raises(SweepError, match="two or more increasing"):
        parse_lengths("16")


def _result(candidate: dict[str, list[float]], reference: dict[str, list[float]] | None = None) -> SweepResult:
    """A sweep's grid from its figures: each curve's rel_l2 at 16, 32 and 64 tokens (and the reference's own)."""
    result = SweepResult([16, 32, 64], "bfloat16", "isolated", points=list(candidate))
    for pid, figures in candidate.items():
        for i, (n, rel) in enumerate(zip(result.lengths, figures, strict=True)):
            own = reference[pid][i] if reference else None
            ratio = rel / own if own else None
            result.cells[pid, n] = Cell("passed", rel, own, ratio, 4.0 if own else None)
    return result


def _verdict(result: SweepResult) -> str:
    return next(line for line in sweep_lines(result, None) if line.startswith("verdict: "))


def test_the_verdict_says_what_the_figures_do() -> None:
    """Grows, falls or flat as the figures go (the docs' clean bf16 sweep: 0.00507, 0.00494, 0.00457 falls),
    and the reference's own beside it, as it goes too."""
    falling = {"layer_0.output": [0.00507, 0.00494, 0.00457], "logits": [0.012, 0.010, 0.0081]}
    verdict = _verdict(_result(falling, falling))
    assert "the candidate's error falls with length (x0.78 from 16 to 64 tokens, fitted over 2 curves), as the " \
        "reference's own does (x0.78)" in verdict, verdict  # fmt: skip
    assert "grows" not in verdict
    growing = {"layer_0.output": [0.002, 0.003, 0.0045], "logits": [0.01, 0.015, 0.02]}
    flat = {"layer_0.output": [0.004, 0.0041, 0.004], "logits": [0.01, 0.0098, 0.0101]}
    verdict = _verdict(_result(growing, flat))
    assert "the candidate's error grows with length (x2.1 from 16 to 64 tokens, fitted over 2 curves), while the " \
        "reference's own stays flat over length (x1 from 16 to 64 tokens" in verdict, verdict  # fmt: skip
    verdict = _verdict(_result(flat))  # no noise floor: the candidate's alone
    assert "the candidate's error stays flat over length (x1 from 16 to 64 tokens, fitted over 2 curves) (the " \
        "sweep holds no noise floor" in verdict, verdict  # fmt: skip
    assert _result(growing).to_json()["trend"] == {
        "candidate": {"word": "grows", "factor": pytest.approx(2.12, abs=0.01), "curves": 2}, "reference": None
    }  # fmt: skip


def test_a_trend_is_fitted_on_the_figures() -> None:
    lengths = [256, 1024, 4096]
    assert trend(lengths, [[1e-3, 2e-3, 4e-3]]) == Trend("grows", pytest.approx(4.0), 1)
    assert trend(lengths, [[4e-3, 2e-3, 1e-3]]) == Trend("falls", pytest.approx(0.25), 1)
    assert trend(lengths, [[5.07e-3, 4.94e-3, 4.57e-3]]).word == "falls"  # the docs' layer_0.output, -10%
    # one curve up 10%, another down 10%: flat together; up and down again; up by 2% only
    assert trend(lengths, [[1e-3, 1.05e-3, 1.1e-3], [2e-3, 1.9e-3, 1.8e-3]]).word == "flat"
    assert trend(lengths, [[1e-3, 1.5e-3, 1e-3]]).word == "flat"
    assert trend(lengths, [[1e-3, 1.01e-3, 1.02e-3]]).word == "flat"
    assert trend(lengths, [[0.0, 0.0, 0.0]]) == Trend("flat", 1.0, 1)  # bitwise at every length
    assert trend(lengths, [[None, 1e-3, None]]) is None  # nothing to fit
