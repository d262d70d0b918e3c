"""Candidates dumped elsewhere: `moe-parity compare` and `pytest --hw dump` on dumps written from a
candidate checkpoint, by module path, by point id, through a map file, and as `.pt` files."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest
import torch
from helpers import cli, read_json, run_parity, session, usage_error
from safetensors.torch import save_file

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.points import LAYER_COMPONENTS, MODEL_HEAD, MODEL_TAIL
from pytest_moe_parity.report.files import REPORT_FILE, SUMMARY_FILE

pytestmark = pytest.mark.usefixtures("_import_everything_once")


def write_dump(golden: Path, model: Path, out: Path, *, name=lambda p: p.module, fmt="safetensors", skip=()):
    """What a port's own hooks would dump: every point's output on the golden inputs."""
    run = session(golden, model, dtype="bfloat16")
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for point in run.points:
        if point.id in skip:
            continue
        output = run.prepare(point).candidate.output
        leaves = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
        key = name(point)
        if fmt == "pt":
            torch.save(tuple(leaves) if len(leaves) > 1 else leaves[0], out / f"{key}.pt")
        elif len(leaves) == 1:
            tensors[key] = leaves[0].contiguous()
        else:
            tensors.update({f"{key}.{i}": t.contiguous() for i, t in enumerate(leaves)})
    if tensors:
        save_file(tensors, str(out / "dump.safetensors"))
    return out


def compare(capsys, *argv) -> tuple[int, str, str]:
    return cli(capsys, "compare", *argv)


def test_healthy_dump_passes(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("qwen2_moe")
    dump = write_dump(golden, tiny_model("qwen2_moe"), tmp_path / "dump")
    code, out, err = compare(capsys, golden, dump, "--dtype", "bfloat16", "--report", tmp_path / "r")
    assert code == 0, out + err
    n = len(GoldenStore(golden).point_ids)
    assert f"{n} points: {n} passed, 0 failed, 0 errors; reports in {tmp_path / 'r'}" in out
    assert "first divergence: none" in out
    summary = json.loads((tmp_path / "r" / SUMMARY_FILE).read_text())
    assert summary["first_divergence"] is None and summary["dtype"] == "bfloat16"
    rows = {r["id"]: r for r in json.loads((tmp_path / "r" / REPORT_FILE).read_text())["points"]}
    # what a dump can say it ran: the tensor the point was read from, and its dtype
    assert rows["layer_0.moe"]["ran"] == {"dumped": "model.layers.0.mlp", "output": "bfloat16"}


def test_faulty_dump_names_the_first_divergence(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), tmp_path / "c", faults.swap_gate_up(2))
    dump = write_dump(golden, candidate, tmp_path / "dump")
    code, out, _ = compare(capsys, golden, dump, "--dtype", "bfloat16")
    assert code == 1
    assert "first divergence: layer_2.experts" in out


def test_map_file_and_pt_dumps(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("olmoe")
    names = {"attention": "attn_out", "moe": "moe_out", "router": "gate"}

    def rename(point):
        return f"decoder.{point.layer}.{names[point.component]}" if point.component in names else point.id

    dump = write_dump(golden, tiny_model("olmoe"), tmp_path / "dump", name=rename, fmt="pt", skip={"rotary"})
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({f"layer_{{layer}}.{c}": f"decoder.{{layer}}.{n}" for c, n in names.items()}))
    code, out, _ = compare(capsys, golden, dump, "--map", mapping, "--dtype", "bfloat16")
    n = len(GoldenStore(golden).point_ids)
    assert code == 0 and f"{n} points: {n - 1} passed, 0 failed, 0 errors, 1 skipped" in out
    code, out, _ = compare(
        capsys, golden, dump, "--dtype", "bfloat16"
    )  # without the map, the 12 renamed points are missing
    assert code == 0 and f"{n} points: {n - 13} passed, 0 failed, 0 errors, 13 skipped" in out  # and rotary


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda tmp: (tmp / "nope", []), "CANDIDATE_DIR .*nope does not exist"),
        (lambda tmp: (tmp, []), "holds no .safetensors or .pt files"),
        (lambda tmp: (_one_tensor(tmp, "unrelated"), []), "no dumped tensor .* matches a point"),
        (lambda tmp: (_one_tensor(tmp, "x"), ["--map", _write(tmp / "m.json", "{not json")]), "is not valid JSON"),
        (lambda tmp: (_one_tensor(tmp, "x"), ["--map", _write(tmp / "m.json", "[1, 2]")]), "must be a JSON object"),
        (lambda tmp: (_one_tensor(tmp, "x"), ["--dtype", "int8"]), "not a floating-point torch dtype"),
        (lambda tmp: (_one_tensor(tmp, "x"), ["--tol", "cosine"]), "malformed tolerance"),
    ],
)
def test_bad_compare_input(setup, message, tmp_path: Path, golden_dir, capsys) -> None:
    import re

    dump, extra = setup(tmp_path)
    code, _, err = compare(capsys, golden_dir("olmoe"), dump, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize("content", ["pickle", "garbage", "dict"])
def test_pt_files_are_never_unpickled(content: str, tmp_path: Path, pytester, golden_dir, capsys) -> None:
    """A `.pt` file that is not tensors is one line naming it before anything runs (exit 2, pytest's 4),
    never torch's text with its advice to pass weights_only=False, nor a warning."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "d" / "embedding.pt"
    path.parent.mkdir()
    if content == "dict":
        torch.save({"a": torch.zeros(2)}, path)
    else:
        path.write_bytes(pickle.dumps(Evil()) if content == "pickle" else b"not a file torch.save wrote")
    save_file({"logits": torch.zeros(2)}, str(tmp_path / "d" / "rest.safetensors"))
    code, out, err = compare(capsys, golden_dir("olmoe"), path.parent)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pwned" not in out + err, err
    said = "holds a dict, not a tensor" if content == "dict" else "cannot be read as tensors: torch.load(weights_only"
    assert f"{path} {said}" in err and "weights_only=False" not in err and "Warning" not in err
    result = run_parity(pytester, golden_dir("olmoe"), "--hw", "dump", model=path.parent)
    usage_error(result, f"--hw dump: {path} {said}")
    assert "weights_only=False" not in result.stderr.str() + result.stdout.str()


def test_compare_on_a_bad_golden(tmp_path: Path, capsys) -> None:
    code, _, err = compare(capsys, tmp_path, tmp_path)
    assert code == 2 and "manifest.json is missing" in err


def _one_tensor(directory: Path, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.zeros(2)}, str(directory / "d.safetensors"))
    return directory


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_pytest_hw_dump_prints_what_compare_prints(
    xdist, pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model, capsys
) -> None:
    """One session object behind both: same defaults (the dump's dtype), same rows, same closing lines."""
    golden = golden_dir("minimax_m2")
    candidate = faults.edit_checkpoint(tiny_model("minimax_m2"), tmp_path / "c", faults.scale("o_proj", 1, 1.5))
    dump = write_dump(golden, candidate, tmp_path / "dump", skip={"logits"})
    n = len(GoldenStore(golden).point_ids)
    report = tmp_path / "report"
    result = run_parity(
        pytester,
        golden,
        "--hw",
        "dump",
        "--dtype",
        "bfloat16",
        "-rs",
        "--parity-report",
        str(report),
        *xdist,
        model=dump,
    )
    result.assert_outcomes(passed=n - 3, failed=2, skipped=1)  # the attention and the whole layer
    summary = read_json(report / SUMMARY_FILE)
    assert (summary["skipped"], summary["failed"], summary["dtype"]) == (1, 2, "bfloat16")
    assert summary["first_divergence"] == "layer_1.attention"
    result.stdout.fnmatch_lines(["*logits is not in the dump*"])
    code, out, _ = compare(capsys, golden, dump, "--dtype", "bfloat16", "--report", tmp_path / "cli-report")
    assert code == 1
    # counts, first divergence (no backend errors), what ran, what was compared in which dtype, what was drawn
    closing = out.strip().splitlines()[-5:]
    plugin_lines = result.stdout.str().splitlines()
    start = plugin_lines.index(next(line for line in plugin_lines if line.startswith(f"{n} points:")))
    assert [line.split("; reports in")[0] for line in plugin_lines[start : start + 4]] == [
        line.split("; reports in")[0] for line in closing[:4]
    ]
    assert closing[2].startswith("ran: output bfloat16 (")
    assert (
        closing[3]
        == f"compared {n - 1} of {n} points, candidate dtype bfloat16 (from --dtype); not in the dump: logits"
    )
    assert plugin_lines[start + 4].startswith(f"plots in {report}: heatmap.png")
    assert closing[4].startswith(f"plots in {tmp_path / 'cli-report'}: heatmap.png")
    cli_rows = read_json(tmp_path / "cli-report" / REPORT_FILE)["points"]
    plugin_rows = read_json(report / REPORT_FILE)["points"]
    assert [(r["id"], r["status"]) for r in cli_rows] == [(r["id"], r["status"]) for r in plugin_rows]


def test_dump_needs_a_location_and_takes_its_map_as_an_option(
    pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model
) -> None:
    golden = golden_dir("olmoe")
    usage = pytester.runpytest("--golden-dir", str(golden), "--hw", "dump")
    usage_error(usage, "--hw dump needs the candidate's location: pass --model DIR")
    dump = write_dump(golden, tiny_model("olmoe"), tmp_path / "dump", name=lambda p: f"x.{p.id}")
    mapping = tmp_path / "map.json"
    templates = {f"layer_{{layer}}.{c}": f"x.layer_{{layer}}.{c}" for c in LAYER_COMPONENTS}
    mapping.write_text(json.dumps({**templates, **{c: f"x.{c}" for c in MODEL_HEAD + MODEL_TAIL}}))
    n = len(GoldenStore(golden).point_ids)
    for option in (["--hw-option", f"map={mapping}"], ["--parity-map", str(mapping)]):
        run_parity(pytester, golden, "--hw", "dump", "--dtype", "bfloat16", *option, model=dump).assert_outcomes(
            passed=n
        )
    # without the map no point can be found: a usage error naming what was tried and what is there
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", model=dump),
        "matches a point of the golden (looked for embedding as embedding, model.embed_tokens; "
        "the dump's nearest names: x.embedding",
    )
    usage_error(
        run_parity(pytester, golden, "--hw", "dump", "--hw-option", "device=cuda", model=dump),
        "--hw-option device=cuda: the dump backend has no option 'device'; its options: map",
    )


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_dump_under_the_port_s_own_names_needs_its_map(fmt: str, tmp_path: Path, golden_dir, tiny_model, capsys):
    """A forgotten map file: the dump's names mostly match no point, so the run is a usage error that
    lists what matched nothing and points at the map, never "compared 2 of 32 points", exit 0."""
    golden = golden_dir("qwen3_moe")
    dump = write_dump(
        golden, tiny_model("qwen3_moe"), tmp_path / "dump", fmt=fmt,
        name=lambda p: f"decoder.{p.layer}.{p.component}_out" if p.layer is not None else p.id,
    )  # fmt: skip
    code, out, err = compare(capsys, golden, dump)
    assert code == 2 and len(err.strip().splitlines()) == 1, out + err
    prefill = len(GoldenStore(golden).point_ids)
    assert f"matches 4 of the golden's {prefill} prefill points" in err
    assert "dumped tensors match no point (decoder.0.attention_out" in err
    assert "no tensor was found for layer_0.input_norm, layer_0.attention" in err
    assert 'pass a map file of point ids to dumped names (--map FILE, --parity-map FILE), e.g. {"layer_{layer}' in err
    mapping = tmp_path / "map.json"
    components = {p.component for p in GoldenStore(golden).points if p.layer is not None}
    mapping.write_text(json.dumps({f"layer_{{layer}}.{c}": f"decoder.{{layer}}.{c}_out" for c in components}))
    code, out, err = compare(capsys, golden, dump, "--map", mapping)
    assert code == 0 and f"{prefill} points: {prefill} passed" in out, out + err


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_the_dump_s_own_dtype_is_the_candidate_s(fmt: str, tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    """Without --dtype, a dump whose floating tensors are all bf16 is a bf16 candidate (every file is
    looked at, routers aside: their weights are float32 in a bf16 transformers model); one output in
    float32 among them is one line asking for --dtype."""
    golden = golden_dir("mixtral")
    dump = write_dump(golden, tiny_model("mixtral"), tmp_path / "dump", fmt=fmt)
    code, out, err = compare(capsys, golden, dump)
    n = len(GoldenStore(golden).point_ids)
    assert code == 0 and f"{n} points: {n} passed" in out, out + err
    outputs = len([p for p in GoldenStore(golden).points if p.component != "router"])
    assert f"candidate dtype bfloat16 (from all {outputs} dumped outputs but the routers' are bfloat16)" in out
    if fmt == "pt":
        torch.save(torch.zeros(2, dtype=torch.float32), dump / "layer_3.attention.pt")
    else:
        save_file({"layer_3.attention": torch.zeros(2)}, str(dump / "extra.safetensors"))
    code, _, err = compare(capsys, golden, dump)
    assert code == 2 and len(err.strip().splitlines()) == 1
    several = f"are in several dtypes ({outputs - 1} bfloat16, 1 float32 (layer_3.attention)): pass --dtype with the"
    assert several in err, err
    code, out, _ = compare(capsys, golden, dump, "--dtype", "bfloat16")  # the point id is looked for first
    assert code == 1 and "first divergence: layer_3.attention" in out
