"""Candidates from other frameworks: NxDI tensor-capture directories (written here with NxDI's file
names, metadata and module names from a tiny model's own outputs: a port of the naming, not NxDI),
tensors dumped per rank and gathered, and the dump contract (dtype, coverage, unusable outputs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import faults
import pytest
import torch
from helpers import cli, read_json, run_parity, session, usage_error
from safetensors.torch import save_file

from pytest_moe_parity.dump.nxdi_capture import load_table
from pytest_moe_parity.dump.reader import DumpDir, DumpError, fit
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")

BUCKET = 24  # NxDI pads the context to its bucket: more positions than the golden's 16


def _first(output):
    return next(t for t in (output if isinstance(output, tuple | list) else (output,)) if isinstance(t, torch.Tensor))


def write_capture(golden: Path, model: Path, out: Path, *, arch: str, bucket: int = BUCKET, drop=()) -> Path:
    """What NxDI's tensor_capture_hook writes for the table's modules: one tensor per module (its
    first output; a router's logits), the context encoding padded to `bucket` positions, token
    generation steps after it, bf16, with capture_metadata.json."""
    table = load_table(arch)
    assert table is not None
    run = session(golden, model, dtype="bfloat16")
    out.mkdir(parents=True)
    metadata: dict[str, dict] = {}
    for point in run.points:
        base = point.id.split(".", 1)[1] if point.step is not None else point.id
        key = re.sub(r"layer_\d+\.", "layer_{layer}.", base)
        if key not in table.modules or point.id in drop:
            continue
        module = table.modules[key][0].format(layer=point.layer)
        tensor = _first(run.prepare(point).candidate.output).to(torch.bfloat16)
        if point.step is None:  # pad the positions, as a bucket does (garbage after the tokens)
            dim = 0 if tensor.dim() == 2 else 1
            pad = list(tensor.shape)
            pad[dim] = bucket - pad[dim]
            tensor = torch.cat([tensor, torch.full(pad, 7.0, dtype=tensor.dtype)], dim=dim)
        step = 1 if point.step is None else point.step + 1
        phase = "cte" if step == 1 else "tkg"
        name = f"captured_tensors_{phase}_step_{step}_module_{module}_output.pt"
        torch.save(tensor.contiguous(), out / name)
        metadata[name] = {
            "step": step,
            "phase": phase,
            "tensor_type": "output",
            "tensor_shape": list(tensor.shape),
            "tensor_dtype": str(tensor.dtype),
            "module_name": module,
        }
    (out / "capture_metadata.json").write_text(json.dumps({"capture_session": {"version": "1.0"}, "tensors": metadata}))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_clean_capture_passes_with_what_nxdi_cannot_give_skipped(
    arch: str, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    golden = golden_dir(arch, decode=2)
    capture = write_capture(golden, tiny_model(arch), tmp_path / "capture", arch=arch)
    code, out, err = cli(capsys, "compare", golden, capture, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 0, out + err
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    skipped = {pid for pid, r in rows.items() if r["status"] == "skipped"}
    steps = ("", "step_1.", "step_2.")
    assert skipped == {f"{s}{p}" for s in steps for p in ("rotary", "logits")}
    assert all(r["status"] == "passed" for pid, r in rows.items() if pid not in skipped)
    assert "NxDI computes the rotary embedding inside each attention module" in rows["rotary"]["reason"]
    # the prefill came padded to the bucket; decode steps came from token generation (steps 2, 3)
    assert any("the first 16 of 24 positions" in n for n in rows["layer_1.moe"]["notes"])
    assert rows["step_2.layer_1.moe"]["status"] == "passed" and not any(
        "positions" in n for n in rows["step_2.layer_1.moe"]["notes"]
    )
    assert any("logits only" in n for n in rows["layer_0.router"]["notes"])
    n = len(rows)
    assert f"compared {n - 6} of {n} points, candidate dtype bfloat16 (from --dtype); not in the dump: rotary" in out


def test_a_faulted_port_fails_first_where_the_fault_is(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("qwen3_moe", decode=1)
    candidate = faults.edit_checkpoint(tiny_model("qwen3_moe"), tmp_path / "c", faults.swap_gate_up(2))
    capture = write_capture(golden, candidate, tmp_path / "capture", arch="qwen3_moe")
    code, out, _ = cli(capsys, "compare", golden, capture, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 1
    assert "first divergence: layer_2.experts" in out
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows["step_1.layer_2.experts"]["status"] == "failed"  # the decode step has it too
    assert all(rows[f"layer_{i}.output"]["status"] == "passed" for i in (0, 1))


def test_a_deepseek_v3_capture_maps_its_dense_moe_and_shared_expert_points(
    tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    """The shipped DeepSeek-V3 map: a clean capture passes every point it names (the dense first layer's
    MLP, the grouped sigmoid router's logits, the experts, the shared experts, the MoE block), rotary
    and logits skipped with why; the experts' gate and up swapped in layer 2 fail first at its experts,
    its shared experts (another module) passing."""
    golden = golden_dir("deepseek_v3", decode=1)
    capture = write_capture(golden, tiny_model("deepseek_v3"), tmp_path / "capture", arch="deepseek_v3")
    code, out, err = cli(capsys, "compare", golden, capture, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 0, out + err
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    skipped = {pid for pid, r in rows.items() if r["status"] == "skipped"}
    assert skipped == {f"{s}{p}" for s in ("", "step_1.") for p in ("rotary", "logits")}
    assert all(r["status"] == "passed" for pid, r in rows.items() if pid not in skipped)
    assert {"layer_0.mlp", "layer_1.shared_experts", "layer_1.moe", "step_1.layer_3.router"} <= set(rows)
    assert any("logits only" in n for n in rows["layer_1.router"]["notes"])

    candidate = faults.edit_checkpoint(tiny_model("deepseek_v3"), tmp_path / "c", faults.swap_gate_up(2))
    capture = write_capture(golden, candidate, tmp_path / "faulted", arch="deepseek_v3")
    code, out, _ = cli(capsys, "compare", golden, capture, "--dtype", "bfloat16", "--report", tmp_path / "f")
    assert code == 1 and "first divergence: layer_2.experts" in out
    rows = {r["id"]: r for r in read_json(tmp_path / "f" / REPORT_FILE)["points"]}
    assert rows["layer_2.shared_experts"]["status"] == "passed" and rows["layer_1.output"]["status"] == "passed"


def test_the_capture_runs_under_pytest_too(pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model) -> None:
    golden = golden_dir("mixtral")
    capture = write_capture(golden, tiny_model("mixtral"), tmp_path / "capture", arch="mixtral")
    n = len(GoldenStore(golden).point_ids)
    result = run_parity(pytester, golden, "--hw", "dump", "--dtype", "bfloat16", "-rs", model=capture)
    result.assert_outcomes(passed=n - 2, skipped=2)
    result.stdout.fnmatch_lines(["*logits: not in the NxDI capture: under on-device sampling*"])


def _placeholder(capture: Path, name: str, metadata: bool = True) -> None:
    """NxDI's fallback where it found no tensor for a module (`_find_first_captured_tensor_for_module`)."""
    torch.save(torch.zeros(1, dtype=torch.bfloat16), capture / name)
    meta_file = capture / "capture_metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["tensors"][name].update(tensor_shape=[1], tensor_dtype="torch.bfloat16")
    meta_file.write_text(json.dumps(meta))
    if not metadata:
        meta_file.unlink()


@pytest.mark.parametrize("metadata", [True, False])
def test_nxdi_s_placeholder_for_a_module_it_captured_nothing_from_is_said(
    metadata: bool, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    """A module NxDI captured nothing from (a name it did not find) comes as its placeholder,
    `zeros(1)` in bfloat16: that point is left out and says why, not failed as a wrong shape with
    a misleading cause; a capture of placeholders only is one line, exit 2."""
    golden = golden_dir("qwen3_moe")
    capture = write_capture(golden, tiny_model("qwen3_moe"), tmp_path / "capture", arch="qwen3_moe")
    _placeholder(capture, "captured_tensors_cte_step_1_module_layers.1.mlp_output.pt", metadata)
    code, out, err = cli(capsys, "compare", golden, capture, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 0, out + err
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert rows["layer_1.moe"]["status"] == "skipped"
    assert rows["layer_1.moe"]["reason"].startswith(
        "layer_1.moe: not in the NxDI capture: NxDI wrote its placeholder (zeros(1), bfloat16) for layers.1.mlp: "
        "it captured nothing there"
    )
    assert {pid for pid, r in rows.items() if r["status"] == "skipped"} == {"rotary", "logits", "layer_1.moe"}
    assert all(r["status"] == "passed" for pid, r in rows.items() if pid not in ("rotary", "logits", "layer_1.moe"))

    for name in [f.name for f in capture.glob("captured_tensors_*.pt")]:
        torch.save(torch.zeros(1, dtype=torch.bfloat16), capture / name)
    (capture / "capture_metadata.json").unlink(missing_ok=True)
    code, _, err = cli(capsys, "compare", golden, capture)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        "holds only NxDI's placeholders (zeros(1), bfloat16), for embed_tokens, layers.0, layers.0.input_layernorm ..."
        in err
    )
    assert "nothing was captured; NxDI returns captured tensors only with on-device sampling" in err


def test_a_capture_names_its_problems_in_one_line(
    pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    golden = golden_dir("qwen3_moe")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "capture_metadata.json").write_text(json.dumps({"capture_session": {}, "tensors": {}}))
    code, _, err = cli(capsys, "compare", golden, empty)
    assert code == 2 and "holds no captured module output: NxDI returns captured tensors only with on-device" in err
    usage_error(run_parity(pytester, golden, "--hw", "dump", model=empty), "output_logits=True")
    capsys.readouterr()

    capture = write_capture(golden, tiny_model("qwen3_moe"), tmp_path / "capture", arch="qwen3_moe")
    torch.save(torch.zeros(1, BUCKET, 64), capture / "captured_tensors_cte_step_1_module_layers.0.self_attn_output.pt")
    code, _, err = cli(capsys, "compare", golden, capture)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds modules that neither the qwen3_moe table nor the map file names: layers.0.self_attn;" in err

    mapping = tmp_path / "map.json"  # the user's map names it: now a point reads it (and fails: cos cache)
    mapping.write_text(json.dumps({"layer_{layer}.attention": "layers.{layer}.self_attn"}))
    code, out, _ = cli(capsys, "compare", golden, capture, "--map", mapping, "--dtype", "bfloat16")
    assert code == 1 and "first divergence: layer_0.attention" in out

    other = golden_dir("olmoe")  # no NxDI table for its architecture
    code, _, err = cli(capsys, "compare", other, capture)
    assert (
        code == 2
        and "there is no NxDI module table for olmoe (tables: deepseek_v3, minimax_m2, mixtral, qwen3_moe)" in err
    )


def _put(tensors: dict[str, torch.Tensor], name: str, output) -> None:
    """A point's output as a dump holds it: NAME, or NAME.0, NAME.1, ... for several tensors."""
    found = [t for t in (output if isinstance(output, tuple | list) else (output,)) if isinstance(t, torch.Tensor)]
    tensors.update(
        {name: found[0].contiguous()}
        if len(found) == 1
        else {f"{name}.{i}": t.contiguous() for i, t in enumerate(found)}
    )


def _rank_dump(golden: Path, model: Path, out: Path, ranks: int, *, sharded: dict[str, int], swap: str | None = None):
    """A dump written per rank, as a TP run writes it: the points in `sharded` split along their
    dimension (rank r holds piece r; with `swap`, rank 1 holds rank 0's piece of that point), the
    decoder layers' outputs whole on every rank (replicated), the rest once."""
    run = session(golden, model, dtype="bfloat16")
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks)]
    whole: dict[str, torch.Tensor] = {}
    for point in run.points:
        output = run.prepare(point).candidate.output
        if point.id in sharded:
            pieces = list(_first(output).chunk(ranks, dim=sharded[point.id]))
            if point.id == swap:
                pieces[1] = pieces[0]
            for r in range(ranks):
                per_rank[r][point.id] = pieces[r].contiguous()
        elif point.component == "output":
            for r in range(ranks):
                _put(per_rank[r], point.id, output)
        else:
            _put(whole, point.id, output)
    out.mkdir(parents=True)
    save_file(whole, str(out / "dump.safetensors"))
    for r, tensors in enumerate(per_rank):
        (out / f"rank{r}").mkdir()
        save_file(tensors, str(out / f"rank{r}" / "dump.safetensors"))
    return out


def test_rank_pieces_are_gathered_and_a_misplaced_slice_fails_there(tmp_path: Path, golden_dir, tiny_model, capsys):
    golden = golden_dir("qwen3_moe")
    model = tiny_model("qwen3_moe")
    sharded = {"layer_1.attention": -1, "layer_2.moe": -1}
    mapping = tmp_path / "map.json"
    entries = {pid: {"name": pid, "concat_dim": dim, "ranks": 4} for pid, dim in sharded.items()}
    replicated = {"layer_{layer}.output": {"name": "layer_{layer}.output", "concat_dim": None, "ranks": 4}}
    mapping.write_text(json.dumps({**entries, **replicated}))
    clean = _rank_dump(golden, model, tmp_path / "clean", 4, sharded=sharded)
    code, out, err = cli(capsys, "compare", golden, clean, "--map", mapping, "--dtype", "bfloat16")
    assert code == 0, out + err

    bad = _rank_dump(golden, model, tmp_path / "bad", 4, sharded=sharded, swap="layer_2.moe")
    code, out, _ = cli(capsys, "compare", golden, bad, "--map", mapping, "--dtype", "bfloat16")
    assert code == 1 and "first divergence: layer_2.moe" in out

    import shutil

    shutil.rmtree(clean / "rank3")  # a rank missing: an error of each point gathered from it
    code, out, _ = cli(capsys, "compare", golden, clean, "--map", mapping, "--dtype", "bfloat16")
    assert code == 1
    assert "first at layer_0.output: layer_0.output: rank 3 of 4 of layer_0.output is missing" in out

    code, out, _ = cli(capsys, "compare", golden, bad, "--dtype", "bfloat16")  # per-rank pieces, no map
    assert "first at layer_0.output: layer_0.output: the dump holds layer_0.output per rank (ranks 0-3): say how" in out


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"layer_{layer}.atention": "x"}, "'layer_{layer}.atention' is not a point id"),
        ({"logits": {"name": "x", "dim": 0}}, "entry 'logits': unknown key 'dim' (keys: name, concat_dim, ranks)"),
        ({"logits": {"name": "x", "concat_dim": -1, "ranks": 0}}, '"ranks" must be a whole number of ranks'),
        ({"logits": {"name": "x", "concat_dim": -1}}, '"concat_dim" needs "ranks"'),
        ({"logits": 3}, "a name, a list of names or"),
    ],
)
def test_bad_map_entries(entry, message, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    save_file({"x": torch.zeros(1)}, str(tmp_path / "d" / "x.safetensors"))
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps(entry))
    with pytest.raises(DumpError) as err:
        DumpDir(tmp_path / "d", mapping)
    assert message in str(err.value)


def test_the_dtype_is_given_or_the_dumped_outputs_never_guessed(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    """float32 logits among a bf16 dump do not decide the dtype (they sorted first): the outputs the
    points find do, every one of them; a --dtype unlike the dump's gets a closing line that says what
    the dump holds."""
    golden = golden_dir("mixtral")
    run = session(golden, tiny_model("mixtral"), dtype="bfloat16")
    tensors = {"a_logits": torch.zeros(2, dtype=torch.float32)}
    for point in run.points:
        tensors[point.id] = _first(run.prepare(point).candidate.output).contiguous()
    (tmp_path / "d").mkdir()
    save_file(tensors, str(tmp_path / "d" / "dump.safetensors"))
    code, out, _ = cli(capsys, "compare", golden, tmp_path / "d")
    n = len(run.points)
    outputs = len([p for p in run.points if p.component != "router"])
    assert code == 1 and "first divergence: rotary" in out  # only the first of (cos, sin) was dumped
    assert f"compared {n} of {n} points, candidate dtype bfloat16 (from all {outputs} dumped outputs" in out
    code, out, _ = cli(capsys, "compare", golden, tmp_path / "d", "--dtype", "float32")
    assert code == 1
    assert (
        f"compared {n} of {n} points, candidate dtype float32 (from --dtype); {n} of {n + 1} dumped "
        "tensors are bfloat16: pass --dtype bfloat16 if the candidate computed in it" in out
    )


def test_a_selection_the_dump_lacks_fails_and_says_so(pytester: pytest.Pytester, tmp_path: Path, golden_dir):
    golden = golden_dir("olmoe")
    (tmp_path / "d").mkdir()
    save_file({"embedding": torch.zeros(1, 16, 64)}, str(tmp_path / "d" / "x.safetensors"))
    result = run_parity(pytester, golden, "--hw", "dump", "-k", "layer_1", model=tmp_path / "d")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*no point was compared: the dump backend gave none of the * selected points*"])


def test_router_outputs_in_nxdi_shape_and_unusable_ones(
    pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    golden = golden_dir("qwen3_moe")
    run = session(golden, tiny_model("qwen3_moe"), dtype="bfloat16")
    nxdi, broken = {}, {}
    for point in run.points:
        output = run.prepare(point).candidate.output
        if point.component == "router":  # (logits, full softmax affinities [T, E], top-k ids)
            logits, _, ids = output[:3]
            parts = [logits, torch.softmax(logits.float(), -1).to(logits.dtype), ids]
            nxdi.update({f"{point.id}.{i}": t.contiguous() for i, t in enumerate(parts)})
            bad = [logits, parts[1][:, :3], ids]  # weights of a shape nothing can use
            broken.update({f"{point.id}.{i}": t.contiguous() for i, t in enumerate(bad)})
        else:
            _put(nxdi, point.id, output)
            _put(broken, point.id, output)
    for name, tensors in (("nxdi", nxdi), ("broken", broken)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "d.safetensors"))
    code, out, err = cli(
        capsys, "compare", golden, tmp_path / "nxdi", "--dtype", "bfloat16", "--report", tmp_path / "r"
    )
    assert code == 0, out + err
    rows = {r["id"]: r for r in read_json(tmp_path / "r" / REPORT_FILE)["points"]}
    assert any("every expert's affinity [T, E]" in n for n in rows["layer_0.router"]["notes"])

    code, out, _ = cli(capsys, "compare", golden, tmp_path / "broken", "--dtype", "bfloat16")
    assert code == 1 and "Traceback" not in out
    assert "backend errors: 4, first at layer_0.router: layer_0.router: the candidate's output ([16, 8], [16, 3]" in out
    result = run_parity(
        pytester, golden, "--hw", "dump", "--dtype", "bfloat16", "-k", "router", model=tmp_path / "broken"
    )
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*layer_0.router: the candidate's output * cannot be judged against the golden's*"])
    assert "Traceback" not in result.stdout.str()


def test_fit_trims_buckets_and_reshapes_only_what_is_layout() -> None:
    golden = torch.Size([2, 4, 3])
    padded = torch.arange(2 * 6 * 3.0).reshape(2, 6, 3)
    out, note = fit(padded, golden, batch=2, seq=4)
    assert torch.equal(out, padded[:, :4]) and "first 4 of 6 positions" in note
    flat = padded.reshape(12, 3)  # [batch * bucket, hidden] tokens
    out, _ = fit(flat, torch.Size([8, 3]), batch=2, seq=4)
    assert torch.equal(out, padded[:, :4].reshape(8, 3))
    out, note = fit(padded[:, :4].reshape(8, 3), golden, batch=2, seq=4)
    assert out.shape == golden and "reshaped" in note
    wrong = torch.zeros(2, 4, 5)
    out, note = fit(wrong, golden, batch=2, seq=4)
    assert out is wrong and note is None  # another hidden size: left for the verdict's shape check


def test_fit_keeps_the_last_positions_of_a_bucket_padded_on_the_left() -> None:
    """Prompts padded on the left (NxDI's padding_side="left" takes them left-padded to the bucket):
    the bucket's padding is at the start, and the last positions are the golden's."""
    golden = torch.Size([2, 4, 3])
    padded = torch.arange(2 * 6 * 3.0).reshape(2, 6, 3)
    out, note = fit(padded, golden, batch=2, seq=4, left=True)
    assert (
        torch.equal(out, padded[:, 2:]) and note == "the last 4 of 6 positions (bucket padding at the start left out)"
    )
    out, _ = fit(padded.reshape(12, 3), torch.Size([8, 3]), batch=2, seq=4, left=True)
    assert torch.equal(out, padded[:, 2:].reshape(8, 3))


def test_fit_leaves_out_a_batch_padded_to_its_compiled_size() -> None:
    golden = torch.Size([3, 4, 2])  # three prompts of 4 positions
    compiled = torch.arange(8 * 6 * 2.0).reshape(8, 6, 2)  # batch 8, bucket 6
    out, note = fit(compiled, golden, batch=3, seq=4)
    assert torch.equal(out, compiled[:3, :4])
    assert note == (
        "the first 4 of 6 positions (bucket padding left out); "
        "the first 3 of 8 rows (the batch's padding rows left out)"
    )
    flat = compiled[:, :4].reshape(32, 2)  # [compiled batch * positions, hidden] tokens
    out, note = fit(flat, torch.Size([12, 2]), batch=3, seq=4)
    assert torch.equal(out, compiled[:3, :4].reshape(12, 2)) and "first 3 of 8 rows" in note
    assert fit(torch.zeros(2, 4, 2), golden, batch=3, seq=4)[1] is None  # fewer rows: the shape check says so
