"""A small local lm-eval task and a tiny reference and faulty candidate for it, written offline (no
hub): what tests/test_lm_eval.py runs lm-eval on, and what wrote fixtures/lm_eval/ (see its README).

`write_all(DIR)` writes DIR/ref (a tiny Qwen3-MoE with a word-level tokenizer of the task's words),
DIR/cand (the same checkpoint with layer 1's o_proj scaled x4: its first divergence is
layer_1.attention), DIR/tiny_mc.yaml and DIR/tiny_mc.jsonl (16 four-way multiple-choice documents), and
DIR/tiny_gen.yaml (the same documents as a generation task scored by exact_match)."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

TASK = "tiny_mc"
FAULT_POINT = "layer_1.attention"
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "bird"]
WORDS += ["rain", "snow", "wind", "fire", "stone", "river", "hill", "road", "door", "book"]


def write_task(out: Path, docs: int = 16) -> Path:
    """The task YAML (a json dataset from a local file: lm-eval reads it without the hub) and its data."""
    rng = random.Random(0)
    lines = []
    for _ in range(docs):
        question = " ".join(rng.choice(WORDS) for _ in range(5))
        lines.append({"question": question, "choices": rng.sample(WORDS, 4), "answer": rng.randrange(4)})
    data = out / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in lines))
    yaml = out / f"{TASK}.yaml"
    yaml.write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {out / 'datasets-cache'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Q: {{question}} A:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    # the same documents as a generation task (the right choice's word, greedy, two tokens at most)
    gen = (
        yaml.read_text()
        .replace(f"task: {TASK}", "task: tiny_gen")
        .replace("output_type: multiple_choice", "output_type: generate_until")
    )
    gen = gen.replace('doc_to_choice: "{{choices}}"\ndoc_to_target: answer', 'doc_to_target: "{{choices[answer]}}"')
    gen = gen.replace("metric: acc", "metric: exact_match") + (
        'generation_kwargs:\n  until: ["[EOS]"]\n  max_gen_toks: 2\n  do_sample: false\n'
    )
    (out / "tiny_gen.yaml").write_text(gen)
    return yaml


def with_task_tokenizer(model: Path, dst: Path) -> Path:
    """A copy of a tiny checkpoint with a word-level tokenizer of the task's words (BOS 1, EOS 2, PAD 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model, dst)
    vocab = {
        "[UNK]": 0,
        "[BOS]": 1,
        "[EOS]": 2,
        "[PAD]": 3,
        "Q:": 4,
        "A:": 5,
        **{w: i + 6 for i, w in enumerate(WORDS)},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]"
    ).save_pretrained(dst)
    return dst


def write_models(tiny: Path, out: Path) -> tuple[Path, Path]:
    """DIR/ref (the tiny checkpoint `tiny` with the task's tokenizer) and DIR/cand (its faulty copy)."""
    import faults

    ref = with_task_tokenizer(tiny, out / "ref")
    cand = faults.edit_checkpoint(ref, out / "cand", faults.scale("o_proj", 1, 4.0))
    return ref, cand


def write_all(out: Path) -> None:
    from pytest_moe_parity.record.tiny import write_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    write_task(out)
    write_models(write_tiny_model("qwen3_moe", out / "tiny", layers=2), out)


if __name__ == "__main__":  # python tests/lm_eval_task.py DIR
    sys.path.insert(0, str(Path(__file__).parent))
    write_all(Path(sys.argv[1]))
