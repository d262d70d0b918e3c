"""Whose run a dump is: a writer that knows the model it ran (`moe-parity vllm-dump`) leaves `engine.json`
beside its tensors, naming the model's architecture and sizes; `--hw dump` checks them against the
golden's before reading a tensor, so a dump of another model is one sentence, not a run of failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .reader import DumpError

ENGINE_FILE = "engine.json"
# the config fields that say which model a run was of (a dump of another size fails every point)
IDENTITY = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok")  # fmt: skip


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """The identity fields a config has."""
    return {k: config[k] for k in IDENTITY if config.get(k) is not None}


def mismatch(ran: dict[str, Any], golden: dict[str, Any]) -> str | None:
    """`hidden_size 64 (the golden's 32)`: the first identity field two configs disagree on, or None."""
    for key in IDENTITY:
        if key in ran and key in golden and ran[key] != golden[key]:
            return f"{key} {ran[key]} (the golden's {golden[key]})"
    return None


def check_dump(root: Path, golden_config: dict[str, Any], model_type: str) -> None:
    """DumpError (a usage error) where the dump in `root` says it is a run of another model than the golden's."""
    path = Path(root) / ENGINE_FILE
    if not path.is_file():
        return
    try:
        ran = json.loads(path.read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DumpError(f"{path} cannot be read ({exc}); write the dump again") from None
    differ = mismatch(ran, {"model_type": model_type, **identity(golden_config)})
    if differ is not None:
        raise DumpError(
            f"the dump {root} is a run of another model than the golden's: its {differ}; "
            "compare it with a golden of the model it ran, or dump a run of the golden's model"
        )
