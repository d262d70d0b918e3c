"""The golden store: round trip, lazy per-layer reads, and every way a golden directory can be bad."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import pytest_moe_parity.golden.store as golden_mod
from pytest_moe_parity.golden import MANIFEST, SCHEMA_VERSION, GoldenError, GoldenStore, GoldenWriter
from pytest_moe_parity.golden.spec import Flattener
from pytest_moe_parity.golden.writer import Recorded
from pytest_moe_parity.points import Point


def _record(pid: str, layer: int | None, tensors: dict[str, torch.Tensor]) -> Recorded:
    point = Point.parse(pid, module=f"m.{pid}", order=layer or 0)
    fl = Flattener(lambda t: None)
    args = [fl.flatten(tensors["x"], f"{pid}/args.0")]
    kwargs = {
        "scale": fl.flatten(2.5, "s"),
        "flag": fl.flatten(True, "f"),
        "pair": fl.flatten((tensors["x"], None), "p"),
    }
    out = fl.flatten((tensors["y"], tensors["i"]), f"{pid}/out")
    return Recorded(point, args, kwargs, out, tensors=dict(fl.tensors))


def test_round_trip(tmp_path: Path) -> None:
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    y = torch.randn(2, 3)
    i = torch.tensor([[1, 2]], dtype=torch.int64)
    writer = GoldenWriter(tmp_path / "g")
    writer.prepare()
    writer.write_group("layer_0", [_record("layer_0.attention", 0, {"x": x, "y": y, "i": i})])
    writer.finish({"model": {"model_type": "toy"}})
    store = GoldenStore(tmp_path / "g")
    rec = store.load("layer_0.attention")
    assert torch.equal(rec.args[0], x) and rec.args[0].dtype == torch.bfloat16
    assert rec.kwargs["scale"] == 2.5 and rec.kwargs["flag"] is True
    # the same tensor object is stored once and comes back under both uses
    assert torch.equal(rec.kwargs["pair"][0], x) and rec.kwargs["pair"][1] is None
    assert len(store.entry(rec.point)["tensors"]) == 3
    assert torch.equal(rec.output[0], y) and torch.equal(rec.output[1], i)
    manifest = json.loads((tmp_path / "g" / MANIFEST).read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["complete"] is True
    entry = manifest["points"][0]
    assert entry["file"] == "layer_0.safetensors" and len(entry["sha256"]) == 64
    assert entry["tensors"]["layer_0.attention/args.0"] == {"shape": [2, 3], "dtype": "bfloat16"}


def test_one_point_of_a_48_layer_golden_opens_only_its_layer(golden_dir, monkeypatch) -> None:
    root = golden_dir("mixtral", layers=48)
    opened: list[str] = []
    real_safe_open = golden_mod.safe_open
    real_sha = golden_mod.sha256_file

    def spy_open(path, *a, **k):
        opened.append(Path(path).name)
        return real_safe_open(path, *a, **k)

    def spy_sha(path, *a, **k):
        opened.append(Path(path).name)
        return real_sha(path, *a, **k)

    monkeypatch.setattr(golden_mod, "safe_open", spy_open)
    monkeypatch.setattr(golden_mod, "sha256_file", spy_sha)
    store = GoldenStore(root)
    assert len([p for p in store.points if p.component == "output"]) == 48
    assert opened == []  # opening the store reads the manifest only
    rec = store.load("layer_17.experts")
    assert rec.args[0].shape == (16, 64)
    assert set(opened) == {"layer_17.safetensors"}
    assert list(store.opened_files) == ["layer_17.safetensors"]


@pytest.fixture
def golden_copy(golden_dir, tmp_path: Path) -> Path:
    dst = tmp_path / "golden"
    shutil.copytree(golden_dir("olmoe"), dst)
    return dst


def _edit_manifest(root: Path, fn) -> None:
    path = root / MANIFEST
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(GoldenError, match="does not exist"):
        GoldenStore(tmp_path / "nope")


def test_directory_without_manifest_is_never_a_golden(golden_copy: Path) -> None:
    (golden_copy / MANIFEST).unlink()
    with pytest.raises(GoldenError, match=r"manifest.json is missing.*did not finish"):
        GoldenStore(golden_copy)


def test_truncated_manifest_names_the_file(golden_copy: Path) -> None:
    path = golden_copy / MANIFEST
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(GoldenError, match=r"manifest.json is corrupted or truncated"):
        GoldenStore(golden_copy)


def test_newer_schema_is_refused(golden_copy: Path) -> None:
    _edit_manifest(golden_copy, lambda m: m.update(schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(GoldenError, match=r"schema version 2, newer than the supported 1; upgrade"):
        GoldenStore(golden_copy)


def test_incomplete_flag_is_refused(golden_copy: Path) -> None:
    _edit_manifest(golden_copy, lambda m: m.update(complete=False))
    with pytest.raises(GoldenError, match="complete"):
        GoldenStore(golden_copy)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_manifest_naming_a_file_outside_is_refused(golden_copy: Path, name: str) -> None:
    def edit(m):
        m["files"][name] = {"sha256": "0" * 64, "bytes": 1}
        m["points"][3]["file"] = name

    _edit_manifest(golden_copy, edit)
    with pytest.raises(GoldenError, match="outside the golden directory"):
        GoldenStore(golden_copy)


def test_truncated_layer_file_names_the_file(golden_copy: Path) -> None:
    path = golden_copy / "layer_2.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    store = GoldenStore(golden_copy)
    store.load("layer_1.attention")  # other layers are unaffected
    with pytest.raises(GoldenError, match=r"layer_2.safetensors does not match its sha256"):
        store.load("layer_2.attention")
    unverified = GoldenStore(golden_copy, verify=False)
    with pytest.raises(GoldenError, match=r"layer_2.safetensors cannot be read as safetensors"):
        unverified.load("layer_2.attention")


def test_planned_files_are_checked_ahead_and_a_mismatch_is_said_at_their_read(golden_copy: Path, monkeypatch) -> None:
    """`plan` computes the planned files' sha256s in a background thread, once each; a file that does not
    match is said where it was said before: at its first read, and the other layers read as they did."""
    hashed: list[str] = []
    real_sha = golden_mod.sha256_file

    def spy_sha(path, *a, **k):
        hashed.append(Path(path).name)
        return real_sha(path, *a, **k)

    monkeypatch.setattr(golden_mod, "sha256_file", spy_sha)
    path = golden_copy / "layer_2.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    store = GoldenStore(golden_copy)
    layers = [p for p in store.points if p.layer in (1, 2)]
    store.plan(layers)
    store.plan(layers)  # planned twice: each file still hashed once
    store.load("layer_1.attention")
    with pytest.raises(GoldenError, match=r"layer_2.safetensors does not match its sha256"):
        store.load("layer_2.attention")
    store.close()
    assert sorted(hashed) == ["layer_1.safetensors", "layer_2.safetensors"]
    assert list(store.opened_files) == ["layer_1.safetensors"]  # layer_2 failed its check before its read
    unverified = GoldenStore(golden_copy, verify=False)
    unverified.plan(layers)  # nothing to check ahead
    assert unverified._hasher is None


def test_replaced_file_fails_its_sha256(golden_copy: Path) -> None:
    shutil.copy(golden_copy / "layer_1.safetensors", golden_copy / "layer_0.safetensors")
    with pytest.raises(GoldenError, match=r"layer_0.safetensors does not match its sha256"):
        GoldenStore(golden_copy).load("layer_0.output")


def test_missing_layer_file(golden_copy: Path) -> None:
    (golden_copy / "layer_3.safetensors").unlink()
    with pytest.raises(GoldenError, match=r"layer_3.safetensors is missing"):
        GoldenStore(golden_copy).load("layer_3.moe")


def test_garbage_safetensors_header(golden_copy: Path) -> None:
    path = golden_copy / "final_norm.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(GoldenError, match=r"final_norm.safetensors cannot be read as safetensors"):
        GoldenStore(golden_copy, verify=False).load("final_norm")


def test_unknown_point(golden_dir) -> None:
    with pytest.raises(GoldenError, match=r"no point 'layer_99\.router'"):
        GoldenStore(golden_dir("olmoe")).load("layer_99.router")


def test_writer_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(GoldenError, match="not empty; pass --overwrite"):
        GoldenWriter(tmp_path).prepare()
    with pytest.raises(GoldenError, match="not part of a golden recording"):
        GoldenWriter(tmp_path, overwrite=True).prepare()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_overwrite_clears_an_old_golden(golden_copy: Path) -> None:
    writer = GoldenWriter(golden_copy, overwrite=True)
    writer.prepare()
    assert list(golden_copy.iterdir()) == []


def test_a_point_listed_twice_is_refused(golden_copy: Path) -> None:
    _edit_manifest(golden_copy, lambda m: m["points"].insert(5, dict(m["points"][3])))
    pid = json.loads((golden_copy / MANIFEST).read_text())["points"][3]["id"]
    with pytest.raises(GoldenError, match=rf"manifest.json lists point {pid} twice: the manifest was edited"):
        GoldenStore(golden_copy)


@pytest.mark.parametrize("lie", ["dtype", "shape"])
def test_a_manifest_that_lies_about_a_tensor_is_refused_verify_included(lie: str, golden_copy: Path, capsys) -> None:
    """The sha256s hold (the files are as recorded) while the manifest says another dtype or shape:
    `show --verify` and the point's read both refuse it, naming the tensor."""
    from pytest_moe_parity.cli import main

    entry = json.loads((golden_copy / MANIFEST).read_text())["points"][3]
    key = next(iter(entry["tensors"]))
    said = "bfloat16" if lie == "dtype" else entry["tensors"][key]["dtype"]

    def edit(m):
        spec = m["points"][3]["tensors"][key]
        if lie == "dtype":
            spec["dtype"] = "bfloat16"
        else:
            spec["shape"] = [*spec["shape"][:-1], spec["shape"][-1] + 1]

    _edit_manifest(golden_copy, edit)
    message = rf"{entry['id']}'s tensor {key} is float32 \[.*\] in its file, but the manifest says {said} \[.*record"
    with pytest.raises(GoldenError, match=message):
        GoldenStore(golden_copy).load(entry["id"])
    assert main(["show", str(golden_copy), "--verify"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "but the manifest says" in err
