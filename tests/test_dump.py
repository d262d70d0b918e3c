"""Candidates dumped elsewhere: `moe-parity compare` and `pytest --hw dump` on dumps written from a
candidate checkpoint, by module path, by point id, through a map file, and as `.pt` files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import faults
import pytest
import torch
from safetensors.torch import save_file

from pytest_moe_parity.backends import BackendOptions
from pytest_moe_parity.backends.hf import TorchBackend
from pytest_moe_parity.cli import main
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import SUMMARY_FILE


def write_dump(golden: Path, model: Path, out: Path, *, name=lambda p: p["module"], fmt="safetensors", skip=()):
    """What a port's own hooks would dump: every point's output on the golden inputs."""
    store = GoldenStore(golden)
    backend = TorchBackend(BackendOptions(store, model, torch.bfloat16))
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for point in store.points:
        if point["id"] in skip:
            continue
        output = backend.run(point, store.load(point["id"])).output
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


def compare(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["compare", *map(str, argv)]))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_healthy_dump_passes(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("qwen2_moe")
    dump = write_dump(golden, tiny_model("qwen2_moe"), tmp_path / "dump")
    code, out, err = compare(capsys, golden, dump, "--report", tmp_path / "r")
    assert code == 0, out + err
    n = len(GoldenStore(golden).point_ids)
    assert f"{n} points compared: {n} passed, 0 failed; 0 not in the dump" in out
    assert "first divergence: none" in out
    summary = json.loads((tmp_path / "r" / SUMMARY_FILE).read_text())
    assert summary["first_divergence"] is None and summary["dtype"] == "bfloat16"


def test_faulty_dump_names_the_first_divergence(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("mixtral")
    candidate = faults.edit_checkpoint(tiny_model("mixtral"), tmp_path / "c", faults.swap_gate_up(2))
    dump = write_dump(golden, candidate, tmp_path / "dump")
    code, out, _ = compare(capsys, golden, dump)
    assert code == 1
    assert "first divergence: layer_2.experts" in out


def test_map_file_and_pt_dumps(tmp_path: Path, golden_dir, tiny_model, capsys) -> None:
    golden = golden_dir("olmoe")
    names = {"attention": "attn_out", "moe": "moe_out", "router": "gate"}

    def rename(point):
        comp = point["component"]
        return f"decoder.{point['layer']}.{names[comp]}" if comp in names else point["id"]

    dump = write_dump(golden, tiny_model("olmoe"), tmp_path / "dump", name=rename, fmt="pt", skip={"rotary"})
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({f"layer_{{layer}}.{c}": f"decoder.{{layer}}.{n}" for c, n in names.items()}))
    code, out, _ = compare(capsys, golden, dump, "--map", mapping)
    n = len(GoldenStore(golden).point_ids)
    assert code == 0 and f"{n - 1} passed, 0 failed; 1 not in the dump" in out
    code, out, _ = compare(capsys, golden, dump)  # without the map, the 12 renamed points are missing
    assert code == 0 and "13 not in the dump" in out  # and rotary


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda tmp: (tmp / "nope", []), "dump directory .* does not exist"),
        (lambda tmp: (tmp, []), "holds no .safetensors or .pt files"),
        (lambda tmp: (_one_tensor(tmp, "unrelated"), []), "no dumped tensor .* matched a point"),
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


def test_pt_files_are_never_unpickled(tmp_path: Path, golden_dir, capsys) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "embedding.pt").write_bytes(pickle.dumps(Evil()))
    code, out, err = compare(capsys, golden_dir("olmoe"), tmp_path)
    assert code == 2 and "cannot be loaded with weights_only=True" in err and "pwned" not in out


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


def test_pytest_hw_dump(pytester: pytest.Pytester, tmp_path: Path, golden_dir, tiny_model) -> None:
    golden = golden_dir("minimax_m2")
    dump = write_dump(golden, tiny_model("minimax_m2"), tmp_path / "dump", skip={"logits"})
    n = len(GoldenStore(golden).point_ids)
    report = tmp_path / "report"
    argv = ["--golden-dir", str(golden), "--hw", "dump", "--model", str(dump), "-rs", "--parity-report", str(report)]
    result = pytester.runpytest(*argv)
    result.assert_outcomes(passed=n - 1, skipped=1)
    summary = json.loads((report / SUMMARY_FILE).read_text())
    assert summary["skipped"] == 1 and summary["passed"] == n - 1 and summary["dtype"] == "bfloat16"
    result.stdout.fnmatch_lines(["first divergence: none", "*logits is not in the dump*"])
    usage = pytester.runpytest("--golden-dir", str(golden), "--hw", "dump")
    assert usage.ret == pytest.ExitCode.USAGE_ERROR
    assert "--hw dump needs the candidate's location: pass --model DIR" in usage.stderr.str()
