"""NxDI tensor-capture directories, read as candidates of the dump backend.

NxDI's `generate(..., tensor_capture_hook=get_tensor_capture_hook(tensor_capture_save_dir=DIR))`
writes one `.pt` per captured module and generation step, with `capture_metadata.json` beside them:

    captured_tensors_cte_step_1_module_layers.0.mlp_output.pt      context encoding (the prefill)
    captured_tensors_tkg_step_2_module_layers.0.mlp_output.pt      token generation, decode step 1
    captured_tensors_{phase}_step_{N}_module_{name}_input.pt        with capture_inputs=True
    captured_tensors_{phase}_step_{N}_manual_tensor_{i}.pt          registered by hand

Module names are relative to NxDI's `NeuronBaseModel` (`layers.3.mlp`, no `model.` prefix), and NxDI
keeps one tensor per module: its first output. The names map onto points through a table per
architecture (`nxdi_maps/<model_type>.json`: data, so a team adds its model without code) that the
user's map file overrides entry by entry.

Capture returns tensors only with on-device sampling and `output_logits=True`:

    NeuronConfig(..., on_device_sampling_config=OnDeviceSamplingConfig(...), output_logits=True,
                 tensor_capture_config=TensorCaptureConfig(modules_to_capture=[...]))

Without them NxDI writes nothing and says nothing; an empty directory is an error here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendError
from ..files import read_table, table_names
from ..points import in_step

METADATA_FILE = "capture_metadata.json"
CAPTURE_RE = re.compile(
    r"^captured_tensors_(cte|tkg)_step_(\d+)_(?:module_(.+)_(output|input)|manual_tensor_(\d+))\.pt$"
)
MAPS_DIR = Path(__file__).with_name("nxdi_maps")
HOW_TO_CAPTURE = (
    "NxDI returns captured tensors only with on-device sampling and output_logits=True "
    "(NeuronConfig(on_device_sampling_config=OnDeviceSamplingConfig(...), output_logits=True, "
    "tensor_capture_config=TensorCaptureConfig(modules_to_capture=[...]))); without them it writes nothing"
)


@dataclass
class NxdiTable:
    """Point template -> NxDI module names (first found wins), notes per point, and the points
    NxDI's capture cannot give, with why."""

    model_type: str
    modules: dict[str, list[str]]
    notes: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


def available_tables() -> list[str]:
    return table_names(MAPS_DIR)


def load_table(model_type: str) -> NxdiTable | None:
    data = read_table(MAPS_DIR, model_type)
    if data is None:
        return None
    modules = {k: [v] if isinstance(v, str) else list(v) for k, v in data["modules"].items()}
    return NxdiTable(model_type, modules, dict(data.get("notes", {})), dict(data.get("unavailable", {})))


def is_capture_dir(root: Path) -> bool:
    """Whether `root` is an NxDI tensor-capture directory (its metadata file, or its file names)."""
    if (root / METADATA_FILE).is_file():
        return True
    return any(CAPTURE_RE.match(p.name) for p in root.glob("captured_tensors_*.pt"))


@dataclass
class Capture:
    """The module outputs of a capture directory: dump name -> file. The prefill (context encoding,
    step 1) keeps the module's name; token-generation step N is decode step N - 1, `step_{N-1}.NAME`."""

    root: Path
    files: dict[str, Path]
    dtypes: dict[str, str]  # dump name -> dtype from the metadata (e.g. "torch.bfloat16")
    modules: set[str]  # the captured module names, without steps
    ignored: int  # inputs and manual tensors: not point outputs
    # dump name -> module, for NxDI's placeholder (`zeros(1)` in bfloat16: a module it captured nothing
    # from, a name it did not find or capture off); not a point's output
    placeholders: dict[str, str] = field(default_factory=dict)


PLACEHOLDER = (
    "NxDI wrote its placeholder (zeros(1), bfloat16) for {module}: it captured nothing there (a name it did not "
    "find in the model, or capture not enabled in that graph); list the names it takes with "
    "list_capturable_modules_in_application"
)


def _placeholder(path: Path, meta: dict[str, Any]) -> bool:
    """Whether a capture file is NxDI's fallback for a module it found no tensor of
    (`NeuronBaseModel._find_first_captured_tensor_for_module`: `torch.zeros(1, dtype=torch.bfloat16)`),
    by its metadata, else (a file of a few bytes only) by its contents."""
    if "tensor_shape" in meta:
        return list(meta["tensor_shape"]) == [1] and "bfloat16" in str(meta.get("tensor_dtype", "bfloat16"))
    if path.stat().st_size > 4096:
        return False
    import torch

    try:
        t = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == torch.bfloat16 and not t.any()


def read_capture(root: Path) -> Capture:
    metadata: dict[str, dict] = {}
    meta_file = root / METADATA_FILE
    if meta_file.is_file():
        try:
            metadata = json.loads(meta_file.read_text()).get("tensors", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise BackendError(f"{meta_file} is not NxDI's capture metadata ({exc})") from None
    files: dict[str, Path] = {}
    dtypes: dict[str, str] = {}
    modules: set[str] = set()
    placeholders: dict[str, str] = {}
    ignored = 0
    for path in sorted(root.glob("captured_tensors_*.pt")):
        m = CAPTURE_RE.match(path.name)
        if m is None:
            continue
        phase, step, module, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if module is None or kind == "input":
            ignored += 1
            continue
        if (phase == "cte") != (step == 1):
            raise BackendError(
                f"{path.name}: NxDI writes the context encoding as step 1 and token generation after it; "
                "was this capture made with capture_indices, or renamed?"
            )
        name = in_step(module, None if step == 1 else step - 1)  # NxDI's step 1 is the prefill
        if _placeholder(path, metadata.get(path.name, {})):
            placeholders[name] = module
            continue
        files[name] = path
        modules.add(module)
        if "tensor_dtype" in metadata.get(path.name, {}):
            dtypes[name] = str(metadata[path.name]["tensor_dtype"])
    if not files and placeholders:
        some = sorted(set(placeholders.values()))
        raise BackendError(
            f"the NxDI capture {root} holds only NxDI's placeholders (zeros(1), bfloat16), for {', '.join(some[:3])}"
            f"{' ...' if len(some) > 3 else ''}: nothing was captured; {HOW_TO_CAPTURE}, and modules_to_capture takes "
            "the names list_capturable_modules_in_application gives"
        )
    if not files:
        found = f"{ignored} inputs or manual tensors only" if ignored else "no captured module output"
        raise BackendError(f"the NxDI capture {root} holds {found}: {HOW_TO_CAPTURE}")
    return Capture(root, files, dtypes, modules, ignored, placeholders)
