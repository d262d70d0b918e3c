"""What a run's output says a user has: the hint names only the causes a failure's own figures leave
open (and what a drill proved, once it has), the table and pictures show the failing tensor, the
drill prints what its culprit was given that the reference's was not, and the worst experts are the
ones that carry the error. Each on a one-line port of a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faults import edit_checkpoint, edit_config
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
            "  the culprit's op differs: argument 1: 1e-06 in the reference, 0.001 in the candidate",
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
            "  culprit: expert[[]3].down_proj introduced the divergence",
            "  the culprit's op: expert[[]3].down_proj (mm)",
            "  the culprit's op differs: its weight down_proj differs from the reference's (rel_l2 *): a weight, "
            "not a kernel, bug; it holds the reference's down_proj[[]5] (expert 5's)",
        ]
    )
    row = next(r for r in read_json(report / REPORT_FILE)["points"] if r["id"] == "layer_1.experts")
    # the two remapped experts carry the error; the healthy ones that share their tokens do not
    assert {e for e, *_ in row["worst_experts"][:2]} == {3, 5}, row["worst_experts"]
    assert sum(share for *_, share in row["worst_experts"][:2]) > 0.8, row["worst_experts"]
