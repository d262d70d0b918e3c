"""`moe-parity scan`: prompts ranked by how far a candidate's next tokens leave the reference's, and
goldens recorded for the worst."""

from __future__ import annotations

import json
from pathlib import Path

import faults
import pytest
from helpers import cli, read_json, with_word_tokenizer

from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.scan import builtin_prompts

# four prompts of repeated tokens (ids 200-209) and eight of other ids (below 200, none repeated)
REPEATS = [[200] * 12, [201, 202] * 6, [203] * 10, [204, 205, 206] * 4]
OTHERS = [[(13 * i + 7 * j) % 190 + 5 for j in range(8 + i)] for i in range(8)]


def _broken_on_repeats(src: Path, dst: Path) -> Path:
    """A conversion that scaled the embedding rows of ids 200-209: only prompts using them break."""

    def edit(t):
        t["model.embed_tokens.weight"][200:210] *= 4.0

    return faults.edit_checkpoint(src, dst, edit)


def _prompts(path: Path) -> Path:
    rows = [*OTHERS[:4], *REPEATS[:2], *OTHERS[4:], *REPEATS[2:]]  # the repeats in the middle and at the end
    path.write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
    return path


def test_a_candidate_broken_on_repeated_tokens_ranks_those_prompts_first_and_records_them(
    tmp_path: Path, tiny_model, capsys
) -> None:
    model = tiny_model("qwen3_moe")
    candidate = _broken_on_repeats(model, tmp_path / "candidate")
    out, report = tmp_path / "worst", tmp_path / "scan.json"
    code, stdout, err = cli(capsys, "scan", "--model", model, "--candidate", candidate, "--prompts",
                          _prompts(tmp_path / "p.jsonl"), "--new-tokens", "3", "--batch-size", "5", "--json", report,
                          "--record-worst", "4", "--out", out)  # fmt: skip
    assert code == 1, stdout + err
    results = read_json(report)["prompts"]
    assert len(results) == 12
    repeated = {"prompt_4", "prompt_5", "prompt_10", "prompt_11"}
    assert {r["name"] for r in results[:4]} == repeated and all(r["beyond"] for r in results[:4])
    assert not any(r["beyond"] for r in results[4:])
    assert all(r["noise_ratio"] > 10 for r in results[:4]) and all(r["noise_ratio"] < 1.5 for r in results[4:])
    assert "scan: 4 of 12 prompts beyond tolerance; worst: prompt_" in stdout
    goldens = sorted(out.iterdir())
    assert [g.name.split("_", 1)[1] for g in goldens] == [r["name"] for r in results[:4]]
    for golden, r in zip(goldens, results[:4], strict=True):
        ids = GoldenStore(golden).manifest["inputs"]["input_ids"][0]
        end = r["first_difference"] + 1 if r["first_difference"] is not None else len(r["tokens"])
        assert ids == r["tokens"][:end] and r["golden"] == str(golden)
        assert ids[: r["prompt_tokens"]] in [p[: len(ids)] for p in REPEATS]


def test_a_backend_s_whole_model_run_is_a_scan_candidate(tmp_path: Path, tiny_model, capsys) -> None:
    """`--hw cpu` runs the candidate through the backend's own whole-model run (`run_model`, its layers
    read as they run): the same prompts rank first, beyond tolerance, as with --candidate alone."""
    model = tiny_model("qwen3_moe")
    candidate = _broken_on_repeats(model, tmp_path / "candidate")
    code, stdout, err = cli(capsys, "scan", "--model", model, "--candidate", candidate, "--hw", "cpu", "--hw-option",
                            "max_layers=1", "--prompts", _prompts(tmp_path / "p.jsonl"), "--new-tokens", "3",
                            "--json", tmp_path / "s.json")  # fmt: skip
    assert code == 1, stdout + err
    assert f"candidate {candidate} (--hw cpu) in bfloat16" in stdout
    results = read_json(tmp_path / "s.json")["prompts"]
    assert {r["name"] for r in results[:4]} == {"prompt_4", "prompt_5", "prompt_10", "prompt_11"}
    assert all(r["beyond"] for r in results[:4]) and not any(r["beyond"] for r in results[4:])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hw", "trace"], "--hw trace has no whole-model run (its chain is points): scan runs a backend whose *"),
        (["--hw", "nowhere"], "--hw 'nowhere' is not a known backend; available: *cpu*"),
        (["--hw", "cpu", "--hw-option", "bogus=1"], "--hw-option bogus=1: the cpu backend has no option 'bogus'*"),
        (["--hw-option", "max_layers=1"], "--hw-option sets the --hw backend's options: add --hw NAME"),
        (["--logits", "DIR", "--hw", "cpu"], "--hw cpu runs the --candidate checkpoint; --write-inputs and --logits *"),
    ],
)
def test_a_scan_backend_that_cannot_run_says_so_in_one_line(
    args: list[str], message: str, tmp_path: Path, tiny_model, capsys
) -> None:
    import fnmatch

    model = tiny_model("qwen3_moe")
    candidate = [] if "--logits" in args else ["--candidate", model]
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    code, _, err = cli(capsys, "scan", "--model", model, *candidate, "--new-tokens", "2", *args)
    said = err.strip().splitlines()
    assert code == 2 and len(said) == 1 and fnmatch.fnmatch(said[0], f"moe-parity: error: {message}"), err


def test_a_clean_candidate_scans_clean_on_the_built_in_set(tmp_path: Path, tiny_model, capsys) -> None:
    """The candidate is the reference's own checkpoint in bfloat16: every flip is the reference's own
    rounding, and the noise ratio is 1."""
    model = tiny_model("qwen3_moe")
    code, stdout, _ = cli(capsys, "scan", "--model", model, "--candidate", model, "--new-tokens", "4",
                          "--json", tmp_path / "s.json", "--plot", tmp_path / "s.png")  # fmt: skip
    assert code == 0, stdout
    results = read_json(tmp_path / "s.json")["prompts"]
    kinds = {r["kind"] for r in results}
    assert {"length around 2^k", "repeated tokens", "long-range copy"} <= kinds
    assert all(not r["beyond"] and r["real_flips"] == 0 and r["noise_ratio"] == 1 for r in results)
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert stdout.strip().splitlines()[-1] == f"scan: 0 of {len(results)} prompts beyond tolerance"


def test_the_built_in_set_covers_the_usual_breaking_points() -> None:
    words = lambda text: [ord(c) % 250 + 4 for c in text]  # noqa: E731  a stand-in tokenizer
    prompts = builtin_prompts(words, vocab=256, context=512)
    kinds = {p.kind for p in prompts}
    assert kinds == {"length around 2^k", "repeated tokens", "long-range copy", "numbers", "code", "languages"}
    lengths = {len(p.ids) for p in prompts if p.kind == "length around 2^k"}
    assert {15, 16, 17, 127, 128, 129} <= lengths
    assert all(4 <= i < 256 for p in prompts for i in p.ids)
    short = builtin_prompts(None, vocab=256, context=40)  # a short context keeps only what fits
    assert max(len(p.ids) for p in short) <= 32 and "languages" not in {p.kind for p in short}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "EMPTY"], "--prompts * holds no prompt*"),
        (["--prompts", "OUTSIDE"], "prompt_0 has token ids [[]999] outside the vocabulary of 256 tokens"),
        (["--record-worst", "2"], "--record-worst K and --out DIR go together*"),
        (["--write-inputs", "NOWHERE", "--json", "s.json"], "--write-inputs only writes the sequences; *"),
        (["--new-tokens", "600"], "length_15: 15 tokens and 600 new ones reach past the model's context of 512*"),
        (["--candidate", "NOWHERE"], "model directory * does not exist"),
    ],
)
def test_bad_scan_input_says_so_in_one_line(args: list[str], message: str, tmp_path: Path, tiny_model, capsys) -> None:
    import fnmatch

    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "outside.jsonl").write_text('{"ids": [5, 999]}\n')
    swap = {"EMPTY": tmp_path / "empty.txt", "OUTSIDE": tmp_path / "outside.jsonl", "NOWHERE": tmp_path / "nowhere"}
    argv = ["scan", "--model", tiny_model("qwen3_moe"), "--candidate", tiny_model("qwen3_moe")]
    given = [swap.get(a, a) for a in args]
    if "--candidate" in args or "--write-inputs" in args:
        argv = argv[:3]
    code, _, err = cli(capsys, *argv, *given)
    said = err.strip().splitlines()
    assert code == 2 and len(said) == 1 and fnmatch.fnmatch(said[0], f"moe-parity: error: {message}"), err


def _port_writes_logits(model_dir: Path, folder: Path, *, skip: str | None = None, shape_off: bool = False) -> None:
    """A port run elsewhere: the candidate checkpoint in bfloat16 over each line of inputs.jsonl, its
    logits saved per prompt (one as .pt, the rest as safetensors)."""
    import torch
    from safetensors.torch import save_file

    from pytest_moe_parity.record.reference import load_model

    model = load_model(model_dir, dtype=torch.bfloat16, device="cpu", device_map=None, max_memory=None)
    for n, line in enumerate((folder / "inputs.jsonl").read_text().splitlines()):
        entry = json.loads(line)
        if entry["name"] == skip:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([entry["ids"]])).logits.float()
        if shape_off:
            logits = logits[:, :-1]
        if n == 0:
            torch.save(logits, folder / f"{entry['name']}.pt")  # [1, T, V]
        else:
            save_file({"logits": logits[0].contiguous()}, str(folder / f"{entry['name']}.safetensors"))


def test_logits_a_port_wrote_per_prompt_are_scanned(tmp_path: Path, tiny_model, capsys) -> None:
    """`--write-inputs DIR` writes the sequences; the port writes its logits beside them; `--logits DIR`
    judges them as a checkpoint candidate is judged."""
    model = tiny_model("qwen3_moe")
    candidate = _broken_on_repeats(model, tmp_path / "candidate")
    port = tmp_path / "port"
    code, out, err = cli(capsys, "scan", "--model", model, "--prompts", _prompts(tmp_path / "p.jsonl"),
                         "--new-tokens", "3", "--write-inputs", port)  # fmt: skip
    assert code == 0 and "12 sequences -> " in out, err
    lines = [json.loads(li) for li in (port / "inputs.jsonl").read_text().splitlines()]
    assert [len(e["ids"]) - e["prompt_tokens"] for e in lines] == [2] * 12  # new tokens - 1 are fed
    _port_writes_logits(candidate, port)
    code, out, err = cli(capsys, "scan", "--model", model, "--logits", port, "--json", tmp_path / "s.json")
    assert code == 1, out + err
    results = read_json(tmp_path / "s.json")["prompts"]
    assert {r["name"] for r in results[:4]} == {"prompt_4", "prompt_5", "prompt_10", "prompt_11"}
    assert [r["beyond"] for r in results] == [True] * 4 + [False] * 8
    assert [r["tokens"] for r in sorted(results, key=lambda r: r["name"])] == [
        e["ids"] for e in sorted(lines, key=lambda e: e["name"])
    ]


@pytest.mark.parametrize(
    ("port", "message"),
    [
        (
            "none",
            "--logits * has no inputs.jsonl: write the sequences first with `moe-parity scan --model * "
            "--write-inputs *`",
        ),
        ("missing", "--logits *: no logits for prompt_3 (prompt_3.safetensors or .pt)"),
        (
            "short",
            "--logits */prompt_0.pt holds (1, 9, 256), not logits [[]tokens, vocabulary] for prompt_0's 10 tokens*",
        ),
    ],
)
def test_logits_that_cannot_be_judged_say_so_in_one_line(
    port: str, message: str, tmp_path: Path, tiny_model, capsys
) -> None:
    import fnmatch

    model, folder = tiny_model("qwen3_moe"), tmp_path / "port"
    folder.mkdir()
    if port != "none":
        rows = [list(range(5, 13)), list(range(20, 29)), list(range(30, 35)), list(range(40, 50))]
        (tmp_path / "p.jsonl").write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
        code, _, err = cli(capsys, "scan", "--model", model, "--prompts", tmp_path / "p.jsonl", "--new-tokens", "3",
                           "--write-inputs", folder)  # fmt: skip
        assert code == 0, err
        _port_writes_logits(model, folder, skip="prompt_3" if port == "missing" else None, shape_off=port == "short")
    code, _, err = cli(capsys, "scan", "--model", model, "--logits", folder)
    said = err.strip().splitlines()
    assert code == 2 and len(said) == 1 and fnmatch.fnmatch(said[0], f"moe-parity: error: {message}"), err


def test_with_a_tokenizer_the_built_in_set_adds_numbers_code_and_languages(tmp_path: Path, tiny_model, capsys) -> None:
    model = with_word_tokenizer(tiny_model("qwen3_moe"), tmp_path / "model")
    code, out, err = cli(capsys, "scan", "--model", model, "--candidate", model, "--new-tokens", "2",
                         "--json", tmp_path / "s.json", "-q")  # fmt: skip
    assert code == 0, out + err
    results = read_json(tmp_path / "s.json")["prompts"]
    assert {"numbers", "code", "languages"} <= {r["kind"] for r in results}
    english = next(r for r in results if r["name"] == "english")
    assert english["preview"].startswith("The quick brown fox") and english["prompt_tokens"] > 5
