"""What a run's output says a user has: the hint names only the causes a failure's own figures leave
open (and what a drill proved, once it has), the table and pictures show the failing tensor, the
drill prints what its culprit was given that the reference's was not, and the worst experts are the
ones that carry the error. Each on a one-line port of a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from faults import edit_checkpoint, edit_config, permute_router_rows
from helpers import read_json, run_parity

from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

NO_WEIGHTS = "--no-parity-weights"


@pytest.fixture(scope="module")
def unrenormalised(golden_dir, tiny_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The docs' port: the reference's checkpoint with `norm_topk_prob` turned off."""
    import shutil

    port = shutil.copytree(tiny_model("qwen3_moe"), tmp_path_factory.mktemp("port") / "port")
    edit_config(port, lambda c: c.update(norm_topk_prob=False))
    return golden_dir("qwen3_moe"), port


def test_a_router_whose_logits_and_choices_agree_is_not_blamed_for_its_gate(
    pytester: pytest.Pytester, unrenormalised: tuple[Path, Path], tmp_path: Path
) -> None:
    golden, port = unrenormalised
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "-k", "layer_0", "--parity-report", str(report), model=port
    )
    routing_weights = "the routing weights differ while the logits and the chosen experts agree: their normalisation"
    result.stdout.fnmatch_lines(
        [
            "  hint: the routing weights differ while the logits and the chosen experts agree*",
            "  hints: docs/plugin.md#hints",
            "layer_0.router *failed *0.998* 0.69*  failed weights.cosine, weights.rel_l2*",
            f"first divergence: layer_0.router  ({routing_weights} (top-k renormalisation: norm_topk_prob*",
        ]
    )
    out = result.stdout.str()
    assert "gate weight rows permuted" not in out and "MoE block wrong while its router and experts pass" not in out
    result.stdout.fnmatch_lines(["  hint: layer_0.router runs inside this point and failed first*"])  # the moe's
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    router = rows["layer_0.router"]
    assert router["shown"] == "weights"
    # the per-token plot's figures are the failing tensor's: its worst token is the weights'
    assert max(e for e in router["token_errors"] if e is not None) == pytest.approx(
        router["metrics"]["weights"]["max_token_rel_l2"]
    )
    assert rows["layer_0.attention"]["shown"] == "out"
    # the heatmap's and layers.png's figure of the point (`summary.figure`) is the failing tensor's too
    from pytest_moe_parity.report.rows import Row
    from pytest_moe_parity.report.summary import figure

    assert figure(Row.from_json(router), "rel_l2") == pytest.approx(router["metrics"]["weights"]["rel_l2"])


def test_the_closing_line_says_what_the_drill_proved(
    pytester: pytest.Pytester, unrenormalised: tuple[Path, Path]
) -> None:
    golden, port = unrenormalised
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "-k", "layer_0", "--parity-drill", "layer_0.router", model=port
    )
    result.stdout.fnmatch_lines(
        [
            "first divergence: layer_0.router  (drill: the reference's renorm (sum), renorm#2 (div) have no "
            "counterpart in the candidate*",
        ]
    )


def test_the_drill_prints_the_constant_its_culprit_was_given(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    import shutil

    port = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "eps")
    edit_config(port, lambda c: c.update(rms_norm_eps=1e-3))
    result = run_parity(
        pytester, golden_dir("qwen3_moe"), "--dtype", "bfloat16", NO_WEIGHTS, "-k", "layer_0.input_norm",
        "--parity-drill", "layer_0.input_norm", model=port,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "  culprit: add introduced the divergence",
            "  the culprit's op differs: argument 1: 1e-06 in the reference, 0.001 in the candidate "
            "(a constant, not a kernel, bug)",
        ]
    )


def _down_projections_swapped(layer: int, a: int, b: int):
    """A converter's expert remap: two experts' down projections exchanged."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        ka, kb = (next(k for k in t if f"layers.{layer}.mlp.experts.{e}.down_proj" in k) for e in (a, b))
        t[ka], t[kb] = t[kb].clone(), t[ka].clone()

    return edit


def test_a_remapped_expert_is_named_with_the_weight_it_holds(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    golden = golden_dir("qwen3_moe")
    port = edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "remap", _down_projections_swapped(1, 3, 5))
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, "-k", "layer_1.experts",
        "--parity-drill", "layer_1.experts", "--parity-report", str(report), model=port,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            # the two experts' down_proj: one culprit, the group, each expert's op named with its weight
            "  culprit: down_proj in experts 3, 5 introduced the divergence (the first: expert[[]3].down_proj)",
            "  the culprit's op: expert[[]3].down_proj (mm)",
            "  the culprit's op differs: its weight down_proj differs from the reference's (rel_l2 *): a weight, "
            "not a kernel, bug; it holds the reference's down_proj[[]5] (expert 5's)",
            "  substituting the reference's outputs of down_proj in experts 3, 5 (2 ops) recovers 100% *",
        ]
    )
    row = next(r for r in read_json(report / REPORT_FILE)["points"] if r["id"] == "layer_1.experts")
    # the two remapped experts carry the error; the healthy ones that share their tokens do not
    assert {e for e, *_ in row["worst_experts"][:2]} == {3, 5}, row["worst_experts"]
    assert sum(share for *_, share in row["worst_experts"][:2]) > 0.8, row["worst_experts"]


def test_the_config_item_names_a_changed_field_before_any_forward(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    import shutil

    golden = golden_dir("qwen3_moe")
    port = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "eps")
    edit_config(port, lambda c: c.update(rms_norm_eps=1e-3, transformers_version="4.57.1"))
    report = tmp_path / "r"
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", "--parity-report", str(report), model=port)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "moe-parity: config differs from the golden's: rms_norm_eps: 1e-06 → 0.001",
            "config: the candidate's config (*config.json) differs from the reference's * in 1 field(s) the forward*",
            "  rms_norm_eps: 1e-06 → 0.001",
            "config *failed * rms_norm_eps: 1e-06 → 0.001",
            "first divergence: config  (the candidate reads another config than the reference (rms_norm_eps*",
        ]
    )
    assert "transformers_version" not in result.stdout.str()  # metadata is not compared
    row = read_json(report / REPORT_FILE)["points"][0]
    assert (row["id"], row["component"], row["findings"]) == ("config", "config", ["rms_norm_eps: 1e-06 → 0.001"])
    assert read_json(report / "comparison_summary.json")["first_divergence"] == "config"
    # without it, the points find where the epsilon bites
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", "--no-parity-config", model=port)
    result.stdout.fnmatch_lines(["first divergence: layer_0.input_norm*"])
    assert "config differs" not in result.stdout.str()


def test_a_bf16_conversion_passes_its_weights_and_config_with_a_note(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    """A checkpoint converted to bf16 storage (an fp32 reference) is a conversion, not a bug: its weights
    are the reference's rounded to bf16, judged against that rounding; its config's dtype is not a field
    the forward reads."""
    model, golden = tiny_model("qwen3_moe"), golden_dir("qwen3_moe")

    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        t.update({k: v.to(torch.bfloat16) for k, v in t.items() if v.is_floating_point()})

    converted = edit_checkpoint(model, tmp_path / "bf16", to_bf16)
    edit_config(converted, lambda c: c.update(dtype="bfloat16"))
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", "-x", "-k", "weights or config or layer_0",
        "--parity-report", str(report), model=converted,
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "moe-parity: the candidate checkpoint is a conversion (* tensor(s) stored as BF16, the reference's as F32*",
            "layer_0.weights *passed * a conversion: * tensor(s) stored as BF16*",
            "first divergence: none",
        ]
    )
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    assert rows["config"]["status"] == "passed" and not rows["config"]["findings"]
    assert rows["layer_0.weights"]["notes"][0].endswith(
        "judged against that rounding, each the reference's values rounded to it"
    )

    # a wrong tensor in a converted checkpoint still fails, its storage said beside it
    def broken(t: dict[str, torch.Tensor]) -> None:
        to_bf16(t)
        key = next(k for k in t if "layers.0.self_attn.q_proj.weight" in k)
        t[key] = t[key] * 2

    wrong = edit_checkpoint(model, tmp_path / "wrong", broken)
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-x", model=wrong)
    result.stdout.fnmatch_lines(["*q_proj.weight: scaled by 2* (* tensor(s) stored as BF16, the reference's as F32)*"])


def test_report_prints_one_block_to_paste_with_the_culprit(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers import cli

    from pytest_moe_parity.report.block import BEGIN, END

    golden = golden_dir("qwen3_moe")
    port = edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "remap", _down_projections_swapped(1, 3, 5))
    report, repro = tmp_path / "r", tmp_path / "repro"
    run_parity(
        pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, "-k", "layer_1.experts", "--parity-drill",
        "layer_1.experts", "--parity-repro", str(repro), "--parity-report", str(report), model=port,
    )  # fmt: skip
    code, out, _ = cli(capsys, "report", report)
    assert code == 0, out
    lines = out.splitlines()
    block = lines[lines.index(BEGIN) + 1 : lines.index(END)]
    fingerprint = read_json(report / REPORT_FILE)["golden_fingerprint"]
    assert block[0].startswith("moe-parity 0.1.0, torch ") and "transformers " in block[0]
    assert block[1] == f"golden: {golden} (qwen3_moe, fingerprint {fingerprint})"
    assert block[2] == f"candidate: {port} (--model) on --hw cpu in bfloat16, isolated mode; --hw-option: none"
    assert "first divergence: layer_1.experts" in block and "  out.rel_l2 0.8897 (limit <= 0.04)" in block, block
    assert "drill layer_1.experts: culprit down_proj in experts 3, 5, substituting them recovers 100%" in block, block
    assert any("it holds the reference's down_proj[5] (expert 5's)" in line for line in block), block
    repro_line = next(line for line in block if line.startswith("  repro: "))
    assert Path(repro_line.removeprefix("  repro: ")).is_file()
    summary = read_json(report / "comparison_summary.json")["bug_report"]
    assert (
        summary["drill"]["culprit"] == "expert[3].down_proj" and summary["golden"]["golden_fingerprint"] == fingerprint
    )
    assert summary["first_divergence"]["failing"][1] == {
        "tensor": "out", "check": "rel_l2", "value": pytest.approx(0.8897, abs=1e-3), "limit": 0.04, "op": "<="
    }  # fmt: skip


def test_the_commands_a_drill_suggests_run_as_printed(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    import shlex
    import shutil
    import sys

    port = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "eps")
    edit_config(port, lambda c: c.update(rms_norm_eps=1e-3))
    golden = golden_dir("qwen3_moe")
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, "--no-parity-config", "--parity-drill", "auto", "-x",
        model=port,
    )  # fmt: skip
    said = next(line for line in result.outlines if line.startswith("collect these ops as items: "))
    command = said.removeprefix("collect these ops as items: ")
    assert command == shlex.join(
        ["pytest", "--golden-dir", str(golden), "--hw", "cpu", "--model", str(port), "--dtype", "bfloat16",
         "--parity-drill", "layer_0.input_norm", "-k", "layer_0.input_norm"]
    )  # fmt: skip
    rerun = pytester.run(sys.executable, "-m", *shlex.split(command), "-p", "no:cacheprovider")
    assert rerun.ret == 1, rerun.stdout.str()
    rerun.stdout.fnmatch_lines(["drill layer_0.input_norm: * culprit add*", "FAILED *layer_0.input_norm::add - *"])


def test_chain_failures_a_point_inherits_are_folded_under_the_one_that_introduced_them(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    import shutil

    golden = golden_dir("qwen3_moe", noise="bfloat16")
    port = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "eps")
    edit_config(port, lambda c: c.update(rms_norm_eps=1e-3))
    report = tmp_path / "r"
    result = run_parity(
        pytester, golden, "--dtype", "bfloat16", NO_WEIGHTS, "--no-parity-config", "--parity-mode", "both",
        "--parity-report", str(report), model=port,
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "layer_0.router: inherited from layer_0.input_norm, which failed first on the golden's inputs",
            "  isolated (golden inputs): passed (rel_l2 *)",
            "  chain (its own inputs): failed (rel_l2 *, noise ratio *): *",
            "layer_0.input_norm *failed * introduced here; failed out.cosine*",
            "layer_0.router *failed * inherited from layer_0.input_norm (passes on the golden's inputs)",
            "legend: noise R: the point's rel_l2 over the reference's own error*",
            "legend: chain rel, chain R: the same figures on the candidate's own inputs*",
            "first divergence: layer_0.input_norm*",
            "inherited: * points fail only on their own inputs after layer_0.input_norm (folded under it*",
        ]
    )
    rows = {r["id"]: r for r in read_json(report / REPORT_FILE)["points"]}
    inherited = {pid for pid, r in rows.items() if r.get("inherited")}
    # each passes on the golden's inputs, and fails on its own
    assert inherited and all(rows[p]["verdicts"] == {"isolated": "passed", "chain": "failed"} for p in inherited)
    assert {"layer_0.router", "logits"} <= inherited and "layer_0.input_norm" not in inherited
    assert {rows[p]["inherited"] for p in inherited} == {"layer_0.input_norm"}


def test_custom_tests_against_the_golden_s_own_model_in_its_dtype_are_warned(
    pytester: pytest.Pytester, golden_dir
) -> None:
    pytester.makepyfile(test_custom="def test_x(candidate):\n    assert candidate.dtype is not None\n")
    result = run_parity(pytester, golden_dir("olmoe"), "test_custom.py", "-k", "test_x", subprocess=True)
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*the candidate is the golden's own model in the golden's dtype (float32)*"])
    result = run_parity(
        pytester, golden_dir("olmoe"), "test_custom.py", "-k", "test_x", "--dtype", "bfloat16", subprocess=True
    )
    result.assert_outcomes(passed=1)
    assert "compare the reference with itself" not in result.stdout.str()


def test_weight_items_left_out_for_want_of_the_reference_are_said(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    """Weight items need the golden's model on this machine: where it is not, the header says so
    (a run would otherwise just have none)."""
    import shutil

    golden = shutil.copytree(golden_dir("qwen3_moe"), tmp_path / "golden")
    manifest = golden / "manifest.json"
    data = json.loads(manifest.read_text())
    data["model"].pop("path_relative", None)
    data["model"]["path"] = str(tmp_path / "elsewhere")
    manifest.write_text(json.dumps(data))
    port = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "port")
    result = run_parity(pytester, golden, "--dtype", "bfloat16", "-k", "embedding", model=port)
    result.stdout.fnmatch_lines(
        ["moe-parity: no weight items: the golden's model is not on this machine (*elsewhere)*"]
    )


def test_failing_verdicts_and_rows_are_red_where_the_terminal_shows_colour(
    pytester: pytest.Pytester, unrenormalised: tuple[Path, Path]
) -> None:
    golden, port = unrenormalised
    args = ("--dtype", "bfloat16", "--no-parity-config", "-x", "-k", "layer_0.router")
    result = run_parity(pytester, golden, *args, "--color=yes", model=port)
    out = result.stdout.str()
    assert "weights  rel_l2                  0.6987       <= 0.04  \x1b[31;1mFAIL\x1b[0m" in out, out
    assert any("layer_0.router" in line and "failed" in line and "\x1b[31m" in line for line in out.splitlines())
    plain = run_parity(pytester, golden, *args, "--color=no", model=port).stdout.str()
    assert "\x1b[" not in plain and "<= 0.04  FAIL" in plain


def test_the_run_says_which_inputs_came_from_the_golden(pytester: pytest.Pytester, golden_dir) -> None:
    """A backend fed the golden's masks and positions runs a port's own builders only in a module that
    makes them: the run says so, and says where the candidate builds its own (a chained whole-model run)."""
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    isolated = run_parity(pytester, golden, "--dtype", "bfloat16", "-k", "embedding")
    isolated.stdout.fnmatch_lines(
        ["moe-parity: inputs: each point on the golden's recorded call*builders run only in a module*"]
    )
    chained = run_parity(pytester, golden, "--dtype", "bfloat16", "-k", "embedding", "--parity-mode", "chain")
    chained.stdout.fnmatch_lines(
        ["moe-parity: inputs: chained, the candidate's own whole-model run on the golden's input ids (its own masks*"]
    )


def test_the_tok_excluded_legend_names_the_router_that_flipped_them(
    pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path: Path
) -> None:
    """Layer 0 has no earlier layer: its moe and output leave out the tokens its own router sent to other
    experts, and the legend says so; a chained run past layer 0 leaves out those an earlier layer's
    router flipped too, and its legend says that."""
    golden = golden_dir("qwen3_moe", noise="bfloat16")
    port = edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "port", permute_router_rows(0))
    args = ("--dtype", "bfloat16", NO_WEIGHTS, "--no-parity-config")
    result = run_parity(pytester, golden, *args, "-k", "layer_0 and not step_", model=port)
    result.stdout.fnmatch_lines(
        [
            "layer_0.moe *passed * tok excluded*",
            "legend: tok excluded: tokens whose top-k experts the candidate chose unlike the golden at the point's "
            "own layer's router, left out of its verdict (they follow other experts; that router judges them)",
        ]
    )
    assert "earlier layer" not in result.stdout.str()
    chained = run_parity(pytester, golden, *args, "--parity-mode", "chain", "-k", "layer_1 and not step_", model=port)
    chained.stdout.fnmatch_lines(
        [
            "layer_1.moe * tok excluded*",
            "legend: tok excluded: tokens whose top-k experts the candidate chose unlike the golden at the point's "
            "own layer's router or, chained, at an earlier layer's, left out of the verdict from there on*",
        ]
    )
