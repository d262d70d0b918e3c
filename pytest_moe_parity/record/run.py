"""`moe-parity golden`: load the reference model, run the prompt once with every capture point
hooked, and write the golden directory layer by layer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..compat import versions
from ..dtypes import dtype_name, parse_dtype
from ..errors import ArchError, BadInput, CheckpointError, GoldenError, ParityError, RecordError, upstream_frame
from ..golden import GoldenWriter, Recorded
from ..golden.spec import parse_token_spec
from ..host import gib, malloc_trim, map_large_allocations
from ..model.archs import plan_points
from ..model.attention import DEFAULT_BUDGET_MIB, attention_heads, attention_within, score_bytes
from ..model.checkpoint import safetensors_files
from ..model.lazy_model import LazyModel
from ..points import Point, describe_layers, layers_option
from .audit import Shape, check_context, parse_memory
from .capture import GoldenRecorder, SliceDone
from .decode import DecodePlan, decode_cache, parse_positions, record_decode
from .dispatch import dispatch_by_unit
from .memory import memory_line, peaks
from .prompts import Batch, make_batch, read_prompts
from .reference import (
    LoadedReference,
    first_line,
    has_tokenizer,
    load_checked_config,
    load_model,
    native_ran,
    reader,
    reference_quant,
    tokenizer_of,
)

DEFAULT_SEQ_LEN = 16
# Config keys that say nothing about the numbers a model computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}


@dataclass
class RecordResult:
    out: Path
    points: int
    bytes: int
    seconds: float
    skipped: list[str]
    notes: list[str]
    decode: str = ""  # the decode steps recorded, in words (`3 decode steps (positions 511-513)`)


def config_dict(config) -> dict[str, Any]:
    d = config.to_dict()
    return {k: v for k, v in sorted(d.items()) if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}


def config_hash(config) -> str:
    text = json.dumps(config_dict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def resolve_input_ids(
    model_dir: Path,
    config,
    *,
    prompt: str | None,
    input_ids: Sequence[int] | None,
    seq_len: int | None,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> list[int]:
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if prompt is not None and input_ids is not None:
        raise BadInput("pass either --prompt or --input-ids, not both")
    if seq_len is not None and seq_len < 1:
        raise BadInput(f"--seq-len must be at least 1, got {seq_len}")
    if prompt is not None:
        if not has_tokenizer(model_dir):
            raise BadInput(
                f"--prompt needs a tokenizer, and {model_dir} has none; pass --input-ids or --seq-len instead"
            )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        ids = list(tok(prompt)["input_ids"])
        if seq_len is not None:
            ids = ids[:seq_len]
        if not ids:
            raise BadInput("--prompt tokenizes to nothing; give a longer prompt")
    elif input_ids is not None:
        ids = list(input_ids)
        if not ids:
            raise BadInput("--input-ids is empty")
    else:
        n = seq_len or DEFAULT_SEQ_LEN
        gen = torch.Generator().manual_seed(seed)
        # Stay clear of the low ids, where tiny and real vocabularies keep their special tokens.
        low = min(4, max(vocab - 1, 0))
        ids = torch.randint(low, max(vocab, low + 1), (n,), generator=gen).tolist()
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise BadInput(f"input ids {bad[:5]} are outside the vocabulary of {vocab} tokens")
    return ids


def parse_max_memory(spec: str | None) -> dict[Any, int] | None:
    """`40GB` (every GPU) or `0:60GB,1:40GB,cpu:200GB` -> bytes per accelerate device (GPUs by
    index); BadInput for a size that does not parse or a GPU that is not visible."""
    if not spec:
        return None
    caps = parse_memory(spec, gpus=torch.cuda.device_count())
    return {int(device) if device.isdigit() else device: size for device, size in caps.items()}


def load_reference(
    model_dir: Path,
    config: Any,
    *,
    dtype: torch.dtype,
    device: str | None,
    device_map: str | None,
    max_memory: dict | None,
    offload_folder: Path | None,
    stream: bool,
    trust_remote_code: bool,
    native: bool = False,
) -> LoadedReference:
    """The reference model, read as `reader` says. One unit at a time, the host holds the weights
    it keeps and one unit in flight; `from_pretrained` maps every shard and holds its pages while it
    converts (about the checkpoint again at its peak, and with disk offload, whatever the caps).
    `reader` and `load_model` are this module's names of `reference`'s (a test replaces them here)."""
    how = reader(model_dir, config, device_map, stream, native=native)
    placing = dict(dtype=dtype, device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    if how == "from_pretrained":
        model = load_model(model_dir, device=device, trust_remote_code=trust_remote_code, **placing)
        if native:
            native_ran(model)
        return LoadedReference(model, how)
    try:
        if how == "placed":
            return LoadedReference(
                dispatch_by_unit(model_dir, config, trust_remote_code=trust_remote_code, **placing), how
            )
        lazy = LazyModel(
            model_dir,
            dtype=dtype,
            device=device or "cpu",
            trust_remote_code=trust_remote_code,
            config=config,
            max_layers=2 if stream else None,
        )
    except CheckpointError as exc:
        raise BadInput(str(exc)) from None
    except (OSError, ValueError, KeyError) as exc:
        raise BadInput(f"cannot build {model_dir} as a causal LM: {first_line(exc)}") from None
    return LoadedReference(lazy.model, how, lazy)


@contextlib.contextmanager
def golden_writer(out: Path, overwrite: bool) -> Iterator[GoldenWriter]:
    """The golden's writer, its directory prepared; what a failed recording wrote is removed (and
    the directory, where this run created it), so nothing half-written is left behind."""
    writer = GoldenWriter(out, overwrite=overwrite)
    try:
        writer.prepare()
    except GoldenError as exc:
        raise BadInput(str(exc)) from None
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(device_map: str | None) -> None:
    """`--device-map`: one of accelerate's strategies, or one device for the whole model."""
    if not device_map or device_map in DEVICE_MAPS:
        return
    try:
        torch.device(device_map)
    except RuntimeError:
        raise BadInput(
            f"--device-map {device_map!r} is neither a placement ({', '.join(DEVICE_MAPS)}) nor a device (cpu, cuda:0)"
        ) from None


@contextlib.contextmanager
def offload_dir(folder: Path | str | None, out: Path, model_dir: Path) -> Iterator[Path | None]:
    """`--offload-folder`, checked writable before anything is loaded; a folder this run creates is
    removed when the recording ends (the offloaded weights are a copy of the checkpoint)."""
    if folder is None:
        yield None
        return
    folder = Path(folder)
    resolved = folder.resolve()
    for other, flag in ((out.resolve(), "--out"), (model_dir.resolve(), "--model")):
        if resolved == other or other in resolved.parents:
            raise BadInput(f"--offload-folder {folder} is inside {flag} {other}; choose a folder of its own")
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"--offload-folder {folder} exists and is not a directory; choose another folder")
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise BadInput(f"--offload-folder {folder} is not writable ({reason}); choose another folder") from None
    try:
        yield folder
    finally:
        if created:
            shutil.rmtree(folder, ignore_errors=True)


def layer_slice(text: str | None, n_layers: int | None) -> list[int] | None:
    """`--layers 10-20` (or 1,17,20-29): the decoder layers to record, checked against the model's."""
    layers = layers_option(text, "--layers", BadInput)
    if layers is None:
        return None
    if n_layers is not None and layers[-1] >= n_layers:
        raise BadInput(f"--layers {text}: the model has {n_layers} decoder layers (0-{n_layers - 1})")
    return layers


def sliced(points: list[Point], layers: list[int] | None) -> list[Point]:
    """The points of a slice: its layers' points, the model-level points before the first layer
    (embedding, rotary) when the slice starts at layer 0, and those after the last layer (final
    norm, logits) when it ends at the model's last layer, so that slices that cover every layer
    cover every point."""
    if layers is None:
        return points
    numbered = [p for p in points if p.layer is not None]
    if not numbered:
        return points
    first = min(p.order for p in numbered)
    last = max(p.order for p in numbered)
    top = max(p.layer for p in numbered)
    wanted = set(layers)

    def kept(p: Point) -> bool:
        if p.layer is not None:
            return p.layer in wanted
        return (p.order < first and 0 in wanted) or (p.order > last and top in wanted)

    return [p for p in points if kept(p)]


@dataclass
class GoldenRequest:
    """A golden to record, as `moe-parity golden` is asked for it (with `decode_steps`, also that many
    greedy decode steps with a KV cache after the prefill). `check()` says in one sentence what the
    user must fix (BadInput) before anything is loaded; `record()` writes the golden."""

    model_dir: Path
    out: Path
    prompt: str | None = None
    input_ids: Sequence[int] | None = None
    seq_len: int | None = None
    dtype: str = "float32"
    device: str | None = "cpu"
    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: Path | str | None = None
    layers: str | None = None
    stream: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False
    decode_steps: int = 0
    decode_at: str | Sequence[int] | None = None  # absolute positions whose decode steps are recorded
    prompts: Path | str | None = None  # a prompts file: several prompts recorded as one padded batch
    padding_side: str = "right"
    pad_to: int | None = None
    batch_size: int | None = None
    capture_tokens: str | None = None  # the token positions kept of every prefill point's output
    reference_quant: str | None = None  # a quantized checkpoint: dequant (default) or native (`reference_quant`)
    # The most bytes eager attention's score arrays may hold at once (float32): a longer prompt runs
    # eager attention a block of query rows at a time (`model.attention`); 0 runs it whole.
    attention_budget_mb: float = DEFAULT_BUDGET_MIB

    def __post_init__(self) -> None:
        self.model_dir, self.out = Path(self.model_dir), Path(self.out)

    def check(self) -> CheckedRequest:
        """What the request means, checked: BadInput for anything the user must fix."""
        model_dir = self.model_dir
        try:
            torch_dtype = parse_dtype(self.dtype)
        except ValueError:
            raise BadInput(f"--dtype {self.dtype!r} is not a torch dtype (e.g. float32, bfloat16)") from None
        config = load_checked_config(model_dir, trust_remote_code=self.trust_remote_code)
        positions = parse_positions(self.decode_at)
        if self.prompts is not None:
            return self._check_batch(torch_dtype, config, positions)
        if self.pad_to is not None or self.batch_size is not None:
            raise BadInput("--pad-to and --batch-size shape a batch of --prompts FILE; add --prompts")
        seq_len = self.seq_len
        if positions and seq_len is None and self.prompt is None and self.input_ids is None:
            seq_len = positions[0]  # the prefill sized so that the first step lands there
            if seq_len < 1:
                raise BadInput("--decode-at 0: a decode step follows at least one prompt token; start at 1")
        ids = resolve_input_ids(
            model_dir,
            config,
            prompt=self.prompt,
            input_ids=self.input_ids,
            seq_len=seq_len,
            trust_remote_code=self.trust_remote_code,
        )
        return self._checked(torch_dtype, config, ids, positions)

    def _check_batch(self, torch_dtype: torch.dtype, config: Any, positions: list[int]) -> CheckedRequest:
        """`--prompts FILE`: the prompts read, tokenized and padded into one batch."""
        if self.prompt is not None or self.input_ids is not None:
            raise BadInput("pass either --prompts or --prompt / --input-ids, not both")
        prompts = read_prompts(self.prompts)
        tokenize, pad_id = None, None
        if any(p.text is not None for p in prompts):
            tokenize, pad_id = tokenizer_of(self.model_dir, trust_remote_code=self.trust_remote_code)
        pad_id = pad_id if pad_id is not None else getattr(config, "pad_token_id", None)
        batch = make_batch(
            prompts,
            tokenize,
            vocab=int(getattr(config, "vocab_size", 0) or 0),
            pad_id=int(pad_id) if isinstance(pad_id, int) else 0,
            padding_side=self.padding_side,
            pad_to=self.pad_to,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
        )
        if (batch.rows > 1 or batch.padded) and positions:
            shape = f"a batch of {batch.rows} rows" if batch.rows > 1 else "a padded prompt"
            raise BadInput(
                f"--decode-at names positions of one unpadded prompt, and --prompts gives {shape} (each row decodes "
                "at its own position): record the batch with --decode-steps N, or one prompt with --decode-at"
            )
        return self._checked(torch_dtype, config, batch.input_ids[0], positions, batch)

    def _checked(
        self, torch_dtype: torch.dtype, config: Any, ids: list[int], positions: list[int], batch: Batch | None = None
    ) -> CheckedRequest:
        model_dir = self.model_dir
        context = getattr(config, "max_position_embeddings", None)
        decode = DecodePlan.make(len(ids), self.decode_steps, positions, context)
        check_context(context, len(ids), decode.run)
        kept = None
        if self.capture_tokens is not None:
            try:
                kept = parse_token_spec(self.capture_tokens, len(ids))
            except ValueError as exc:
                raise BadInput(f"--capture-tokens {self.capture_tokens}: {exc}") from None
        if not self.attention_budget_mb >= 0:
            raise BadInput(
                f"--attention-budget {self.attention_budget_mb:g}: give the MiB attention's scores may hold, 0 or more"
            )
        if self.out.resolve() == model_dir.resolve():
            raise BadInput("--out must not be the model directory")
        wanted_layers = layer_slice(self.layers, getattr(config, "num_hidden_layers", None))
        has_bin = any(model_dir.glob("pytorch_model*.bin"))
        if not has_bin:  # else transformers reads them (weights_only)
            try:
                safetensors_files(model_dir, "point --model at a checkpoint with its weights")
            except CheckpointError as exc:
                raise BadInput(str(exc)) from None
        max_memory = parse_max_memory(self.max_memory)
        check_device_map(self.device_map)
        if self.stream and (self.device_map or max_memory or self.offload_folder is not None):
            raise BadInput(
                "--stream loads one decoder layer at a time on one --device; it does not combine with "
                "--device-map, --max-memory or --offload-folder"
            )
        if self.stream and has_bin and not any(model_dir.glob("*.safetensors")):
            raise BadInput(f"--stream reads safetensors checkpoints, and {model_dir} holds pytorch_model*.bin files")
        quant = reference_quant(model_dir, config, self.reference_quant, self.device, torch_dtype)
        if quant is not None and quant["reference"] == "native" and (self.stream or self.device_map):
            raise BadInput(
                "--reference-quant native loads the model through transformers' quantizer, whole, on one --device; "
                "it does not combine with --stream or --device-map"
            )
        return CheckedRequest(self, torch_dtype, config, ids, wanted_layers, max_memory, decode, batch, kept, quant)

    def record(self, progress: Callable[[str], None] | None = None) -> RecordResult:
        """Record the golden directory; `progress` is told each step in one line."""
        return _GoldenRun(self.check(), progress or (lambda msg: None)).run()


@dataclass
class CheckedRequest:
    """A request with its inputs resolved: the dtype, the model's config, the prompt's token ids, the
    layers of a slice (None: every layer) and the memory cap per device."""

    request: GoldenRequest
    dtype: torch.dtype
    config: Any
    ids: list[int]
    layers: list[int] | None
    max_memory: dict[Any, int] | None
    decode: DecodePlan
    batch: Batch | None = None  # --prompts: the padded batch (`ids` is its first row)
    kept: list[int] | None = None  # --capture-tokens: the positions kept of the prefill's outputs
    quant: dict[str, Any] | None = None  # a quantized checkpoint: its layout and how the reference ran it

    @property
    def token_slice(self) -> tuple[int, int, list[int]] | None:
        """(rows, tokens, positions kept) for the recorder, with --capture-tokens."""
        if self.kept is None:
            return None
        return (self.batch.rows if self.batch is not None else 1), len(self.ids), self.kept

    def inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The prefill's inputs: the prompt's ids, or the batch's ids, attention mask and positions."""
        if self.batch is not None:
            return self.batch.tensors(device)
        return {"input_ids": torch.tensor([self.ids], dtype=torch.long, device=device)}

    def manifest_inputs(self, prompt: str | None) -> dict[str, Any]:
        if self.batch is None:
            return {"input_ids": [self.ids], "prompt": prompt, "seq_len": len(self.ids)}
        return {**self.batch.manifest(), "prompt": None, "seq_len": self.batch.length}

    @property
    def tokens(self) -> str:
        kept = f" ({len(self.kept)} kept: --capture-tokens)" if self.kept is not None else ""
        if self.batch is None:
            return f"{len(self.ids)} tokens{kept}"
        side = f", padded {self.batch.padding_side}" if self.batch.padded else ""
        return f"{self.batch.rows} rows of {self.batch.length} tokens{side}{kept}"

    def manifest(self, facts: RunFacts) -> dict[str, Any]:
        """The golden's manifest: what was asked (this request) and what the recording found and did."""
        req = self.request
        model_dir, out = req.model_dir.resolve(), req.out.resolve()
        offload = facts.where["offload"]
        return {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": {
                "path": str(model_dir),
                # lets a golden and its model move together (e.g. the bundled demo in fixtures/)
                "path_relative": os.path.relpath(model_dir, out),
                "model_type": facts.plan.model_type,
                "architectures": list(getattr(self.config, "architectures", None) or []),
                "config_hash": config_hash(facts.config),
                "config": json.loads(json.dumps(config_dict(facts.config), default=str)),
                "num_hidden_layers": facts.n_layers,
            },
            "inputs": self.manifest_inputs(req.prompt),
            **({"quantization": self.quant} if self.quant is not None else {}),
            **(
                {"capture_tokens": {"spec": req.capture_tokens, "positions": self.kept}}
                if self.kept is not None
                else {}
            ),
            **({"decode": facts.decode} if facts.decode else {}),
            "record": {
                "dtype": dtype_name(self.dtype),
                "device": req.device if not facts.where["device_map"] else None,
                "device_map": facts.where["device_map"],
                "max_memory": req.max_memory,
                "offload_folder": str(offload) if offload is not None else None,
                "devices": sorted(facts.where["placed"]),
                "placement": facts.where["placed"],
                "loading": facts.where["loading"],
                **({"layers": facts.slice_layers} if self.layers is not None else {}),
                "attn_implementation": "eager",
                **({"attention_query_rows": facts.attention_rows} if facts.attention_rows else {}),
                "experts_implementation": "eager",
                "use_cache": False,
                "argv": sys.argv[1:],
            },
            "arch": {"source": facts.plan.source, "skipped_points": facts.skipped, "notes": facts.plan.notes},
            "versions": versions(golden=True),
            "stats": facts.stats,
        }


@dataclass
class RunFacts:
    """What a recording found and did, for its manifest (`CheckedRequest.manifest`): the model's config
    as loaded, its plan of points, its decoder layers and those recorded, the points the forward never
    called, the decode steps' record, where the weights were placed and how read, the run's figures,
    and the query rows per block of attention (None: whole)."""

    config: Any
    plan: Any
    n_layers: int
    slice_layers: list[int]
    skipped: list[str]
    decode: dict[str, Any] | None
    where: dict[str, Any]
    stats: dict[str, Any]
    attention_rows: int | None


class _GoldenRun:
    """One recording: the reference loaded, the prefill's points and the decode steps written group by
    group, then the manifest (written last, so a golden without one is known to be incomplete)."""

    def __init__(self, checked: CheckedRequest, say: Callable[[str], None]) -> None:
        self.checked = checked
        self.request = checked.request
        self.say = say
        self.started = time.perf_counter()
        self.layers_done = 0

    def run(self) -> RecordResult:
        req, checked = self.request, self.checked
        map_large_allocations()  # the peak is then what the recording holds, not what the heap kept
        with (
            offload_dir(req.offload_folder, req.out, req.model_dir) as offload,
            golden_writer(req.out, req.overwrite) as writer,
        ):
            self.writer = writer
            device_map = req.device_map
            if (checked.max_memory or offload) and not device_map:
                device_map = "auto"  # a memory cap or an offload folder only means something to accelerate's placement
            load_started = time.perf_counter()
            ref = load_reference(
                req.model_dir,
                checked.config,
                dtype=checked.dtype,
                device=req.device,
                device_map=device_map,
                max_memory=checked.max_memory,
                offload_folder=offload,
                stream=req.stream,
                trust_remote_code=req.trust_remote_code,
                native=bool(checked.quant and checked.quant["reference"] == "native"),
            )
            try:
                plan = plan_points(ref.model)
            except ArchError as exc:
                raise BadInput(str(exc)) from None
            if checked.decode.run:
                decode_cache(ref.model)  # before anything is written
            for note in plan.notes:
                self.say(f"note: {note}")
            points = sliced(plan.points, checked.layers)
            self.n_layers = len({p.layer for p in plan.points if p.layer is not None})
            self.slice_layers = sorted({p.layer for p in points if p.layer is not None})
            self.say(self._opening_line(plan, points))
            size = self._size_line(points)
            if size:
                self.say(size)
            placed = ref.placement()
            self.say(ref.placement_line(placed))
            load_seconds = time.perf_counter() - load_started
            forward_started = time.perf_counter()
            skipped, decode = self._forward_or_say(ref, points)
            peak = peaks(placed)
            self.say(memory_line(peak))
            stats = {
                "seconds": round(time.perf_counter() - self.started, 3),
                "load_seconds": round(load_seconds, 3),
                "record_seconds": round(time.perf_counter() - forward_started, 3),
                "bytes": writer.bytes_written,
                "peak_memory_bytes": peak,
                "host_weight_bytes": ref.host_weight_bytes(placed),
            }
            where = {"device_map": device_map, "offload": offload, "placed": placed, "loading": ref.loading}
            facts = RunFacts(ref.model.config, plan, self.n_layers, self.slice_layers, skipped, decode, where, stats,
                             self.attention_rows)  # fmt: skip
            writer.finish(checked.manifest(facts))
            seconds = time.perf_counter() - self.started
            steps = checked.decode.describe() if checked.decode.run else ""
            return RecordResult(req.out, len(writer.points), writer.bytes_written, seconds, skipped, plan.notes, steps)

    def _opening_line(self, plan: Any, points: list[Point]) -> str:
        req, checked = self.request, self.checked
        n_layers = self.n_layers
        what = (
            f"{n_layers} layers"
            if checked.layers is None
            else f"layers {describe_layers(self.slice_layers)} of {n_layers}"
        )
        decode = checked.decode
        then = f", then {decode.describe()} of {len(points)} points each" if decode.run else ""
        return (
            f"recording {req.model_dir} ({plan.model_type}, {what}, {len(points)} points, "
            f"{checked.tokens}, {dtype_name(checked.dtype)}{then}) -> {req.out}"
        )

    def _size_line(self, points: list[Point]) -> str | None:
        """What the prefill's captures will take, before the forward runs: `moe-parity estimate`'s
        figures for this many tokens and rows (None where the config lacks a size they need)."""
        checked = self.checked
        config = checked.config.to_dict()
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        try:
            shape = Shape.from_config(text)
        except BadInput:
            return None
        rows = checked.batch.rows if checked.batch is not None else 1
        tokens = len(checked.ids)
        per_layer = shape.capture(tokens) * rows
        model_level = any(p.layer is None for p in points)
        total = per_layer * len(self.slice_layers) + (shape.model_level_capture(tokens) * rows if model_level else 0)
        return (
            f"captures: about {gib(per_layer)} per decoder layer, {gib(total)} for the prefill "
            f"(as `moe-parity estimate --seq-len {tokens}` counts them, float32)"
        )

    def _on_group(self, group: str, records: list[Recorded]) -> None:
        """Write a finished group (a layer's points, or a model-level point) and say so."""
        writer = self.writer
        size = writer.write_group(group, records)
        malloc_trim()  # the group's captures and the layer's temporaries go back to the OS, not to a growing heap
        if records[0].point.layer is not None and records[0].point.step is None:
            self.layers_done += 1
            self.say(
                f"  {group}: {len(records)} points, {size / 1e6:.2f} MB "
                f"[{self.layers_done}/{len(self.slice_layers)} layers, {writer.bytes_written / 1e6:.1f} MB written, "
                f"{time.perf_counter() - self.started:.1f}s]"
            )

    def _forward_or_say(self, ref: LoadedReference, points: list[Point]) -> tuple[list[str], dict[str, Any] | None]:
        """`_forward`; where the model's own code raises (a config it cannot run), one sentence that
        names its line (an error raised in this package's code stays as it is: its traceback)."""
        try:
            return self._forward(ref, points)
        except ParityError:
            raise
        except Exception as exc:
            where = upstream_frame(exc)
            if where is None:
                raise
            file, line, function = where
            raise RecordError(
                f"the reference model raised {type(exc).__name__} in its own code ({file}:{line}, in {function}: "
                f"{exc}); {self.request.model_dir} does not run as configured: check that transformers runs it "
                "(AutoModelForCausalLM.from_pretrained, then a forward) before recording"
            ) from exc

    def _forward(self, ref: LoadedReference, points: list[Point]) -> tuple[list[str], dict[str, Any] | None]:
        """The prefill with every point hooked, then the decode steps: (points never called, the
        decode steps' record or None)."""
        model = ref.model
        inputs = self.checked.inputs(ref.input_device)
        # A slice that ends before the model's last layer needs no more of the forward (a decode step
        # needs the logits).
        decode = self.checked.decode
        sliced_prefill = self.checked.layers is not None and not decode.run and points[-1].layer is not None
        stop_after = points[-1].group if sliced_prefill else None
        with ref.running(), torch.no_grad(), self._attention(model, inputs["input_ids"].shape):
            padding = self.checked.batch.attention_mask if self.checked.batch is not None else None
            tokens = self.checked.token_slice
            with GoldenRecorder(model, points, self._on_group, stop_after, padding, tokens) as rec:
                try:
                    model(**inputs, use_cache=False)
                except SliceDone:
                    self.say(f"note: the slice ends at {stop_after}; the rest of the forward was not run")
                skipped = rec.finish()
            for pid in skipped:
                self.say(f"note: point {pid} was never called by the forward pass; not recorded")
            if not decode.run:
                return skipped, None
            written = lambda: self.writer.bytes_written  # noqa: E731
            pad_id = self.checked.batch.pad_id if self.checked.batch is not None else None
            return skipped, record_decode(
                model, points, inputs, decode, self._on_group, self.say, written, pad_id=pad_id
            )

    def _attention(self, model: Any, shape: torch.Size) -> contextlib.AbstractContextManager:
        """Eager attention whole, or a block of query rows at a time where a prompt's score arrays
        would exceed --attention-budget (and said so, with the rows per block)."""
        rows, tokens = shape
        mib = self.request.attention_budget_mb
        context, self.attention_rows = attention_within(model, tokens, rows, mib)
        if self.attention_rows is not None:
            whole = score_bytes(attention_heads(model.config), tokens, rows)
            self.say(
                f"attention: eager, {self.attention_rows} query rows at a time (whole, its score arrays would hold "
                f"{gib(whole)} per layer at {tokens} tokens; --attention-budget {mib:g} MiB)"
            )
        return context


def record_golden(
    model_dir: Path | str, out: Path | str, *, progress: Callable[[str], None] | None = None, **options: Any
) -> RecordResult:
    """Record a golden directory: `GoldenRequest(model_dir, out, **options).record(progress)`."""
    return GoldenRequest(Path(model_dir), Path(out), **options).record(progress)
