"""Across transformers versions: the package runs under transformers 4.57 (the Neuron SDK's, which
NxDI pins) and 5.x. A checkpoint's config.json written by one is read by the other with the
spellings it expects, so a golden recorded under transformers 5 replays on a 4.57 host.

What differs in config.json (the rest of the configs is read alike):
- transformers 5 writes the rotary settings as `rope_parameters` ({"rope_theta", "rope_type", ...});
  4.57 reads `rope_theta` and `rope_scaling` and, without them, takes its class's default theta
  (Mixtral's 1e6 where the checkpoint says 1e4: every attention point off);
- transformers 5 writes some counts under their attribute-map names (Qwen3-MoE's experts as
  `num_local_experts`); 4.57's class takes the old name and, without it, its default (128 experts);
- transformers 5 writes a nested sub-config (DBRX's `attn_config`, `ffn_config`) with every generic
  config field (`id2label`, `return_dict`, ...), which 4.57's sub-config classes refuse: they are read
  with the fields their class takes."""

from __future__ import annotations

import inspect
import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

from . import __version__

VERSION = version("transformers")  # read without importing transformers (the CLI starts fast)
MAJOR = int(VERSION.split(".")[0])


def versions(*, golden: bool = False) -> dict[str, str]:
    """What a bug report needs to reproduce a run: this package's, torch's and transformers' versions,
    Python's and the platform's (read without importing torch). `golden`: as a golden's manifest holds
    them (its format): this package's under its import name, torch's, transformers' and safetensors'
    as their modules give them, and Python's."""
    import platform
    from importlib.metadata import PackageNotFoundError

    if golden:
        import safetensors
        import torch
        import transformers

        return {
            "pytest_moe_parity": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
        }

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {
        "moe-parity": installed("pytest-moe-parity"),
        "torch": installed("torch"),
        "transformers": VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


# transformers 5's spelling -> the one 4.57's config classes take, where a class takes only the latter
RENAMED = {"num_local_experts": "num_experts"}


def needs_transformers_5() -> str:
    """The sentence for what runs transformers' own modules where transformers 4 is installed."""
    return (
        "this runs transformers' own modules of the golden's architecture, as transformers 5 lays them out "
        f"(fused experts: its points and names); this environment has transformers {VERSION}, the Neuron SDK's "
        "(NxDI pins 4.57): run it where transformers>=5 is installed, or compare on this stack with --hw nxdi "
        "or --hw dump"
    )


def legacy_rope(written: dict[str, Any]) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` (None for the default rotary) from a config's
    `rope_parameters`, where it has them and not the old names; {} otherwise."""
    rope = written.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if written.get("rope_scaling") is None:
        kind = rope.get("rope_type", rope.get("type", "default"))
        out["rope_scaling"] = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def config_overrides(written: dict[str, Any], config_class: type) -> dict[str, Any]:
    """What a config written by transformers 5 needs passed to `config_class` (this process's
    transformers) to mean the same: nothing under transformers 5."""
    if MAJOR >= 5:
        return {}
    takes = set(inspect.signature(config_class.__init__).parameters)
    out = legacy_rope(written)
    for new, old in RENAMED.items():
        if new in written and old in takes and new not in takes and old not in written:
            out[old] = written[new]
    return out


def sub_configs(written: dict[str, Any], config_class: type) -> dict[str, Any]:
    """A config's nested sub-configs (`config_class.sub_configs`) as 4.57's classes take them: the
    fields each class's signature names (transformers 5 writes every generic field in them too)."""
    out: dict[str, Any] = {}
    for key, sub in (getattr(config_class, "sub_configs", None) or {}).items():
        value = written.get(key)
        if not isinstance(value, dict) or not isinstance(sub, type):
            continue
        takes = set(inspect.signature(sub.__init__).parameters) - {"self", "kwargs"}
        if any(k not in takes and k != "model_type" for k in value):
            out[key] = {k: v for k, v in value.items() if k in takes}
    return out


def load_config(model_dir: Path | str, **kwargs: Any) -> Any:
    """`AutoConfig.from_pretrained(model_dir)`, read as the transformers that wrote it meant."""
    from transformers import AutoConfig

    written = json.loads((Path(model_dir) / "config.json").read_text())
    if MAJOR < 5:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = written.get("model_type")
        config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None  # noqa: SIM401 (lazy: no .get)
        nested = sub_configs(written, config_class) if config_class is not None else {}
        if nested:  # 4.57's sub-config classes refuse the fields transformers 5 writes in them
            config = config_class.from_dict({**written, **nested, **config_overrides(written, config_class)}, **kwargs)
            config._name_or_path = str(model_dir)
            return config
    config = AutoConfig.from_pretrained(model_dir, **kwargs)
    overrides = config_overrides(written, type(config))
    if overrides:
        config = AutoConfig.from_pretrained(model_dir, **kwargs, **overrides)
    return config
