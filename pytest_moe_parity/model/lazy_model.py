"""A candidate transformers model whose weights are read per layer on demand: the skeleton lives
on the meta device, and asking for a module reads only that layer's tensors from the sharded
safetensors checkpoint (through its index), converted to the model's layout as transformers
converts them (e.g. per-expert hub tensors fused into 3-D expert weights). Evicted layers go back
to the meta device and give their memory back, so a run over every layer of a big model holds
about what a run over one layer holds. Given the run's plan (the modules it will ask for, in
order), the next unit is read in a background thread while the current one runs."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..host import HeldThreads, malloc_trim
from ..points import layer_group
from .checkpoint import SIZES, Shards, read_tensors, weight_map
from .conversion import fused, model_names
from .quant import Dequantizer, layout
from .quant_check import check_tensors

# transformers' switch from its threaded tensor materialisation to one thread.
SYNC_LOAD_VARIABLE = "HF_DEACTIVATE_ASYNC_LOAD"

# A unit of loading: a decoder layer (its number) or a model-level module (its dotted path).
Unit = int | str


@dataclass
class ReadStats:
    """What was read from the checkpoint, for tests and benchmarks."""

    keys: list[str] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    bytes: int = 0


def own_memory(module: nn.Module) -> None:
    """Copy into the process's own memory every CPU parameter and buffer that is still a view of a
    memory-mapped checkpoint file: safetensors reads without copying, and a tensor that needed no
    conversion stays such a view. While one lives, its whole shard stays mapped, and every page of
    it ever read (the experts, during their conversion) counts in RSS: about the checkpoint again."""
    for sub in module.modules():
        for slots in (sub._parameters, sub._buffers):
            for t in slots.values():
                if t is not None and t.device.type == "cpu" and not t.untyped_storage().resizable():
                    t.data = t.data.clone()


def _rss_bytes() -> int | None:
    """This process's resident set size (Linux), or None."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# accelerate's `init_empty_weights` patches torch's `Module.register_parameter` for every thread while a
# model is built on the meta device: a unit read in the background meanwhile (the drill builds the
# reference's model while the candidate reads its next layer ahead) would have its weights registered
# on meta. Building a model and reading weights into one never overlap.
_META_BUILD = threading.Lock()


class _UnitStateDict(dict):
    """The model's state dict as transformers' loader reads it while one unit's weights load: the unit's
    own entries, and any other name answered from the module it names (as the whole model's state
    dict would answer it), never by walking every module of every layer. The loader builds the whole
    model's state dict at each call, a walk of the whole skeleton for each layer read."""

    def __init__(self, model: nn.Module, path: str):
        super().__init__(model.get_submodule(path).state_dict(prefix=f"{path}."))
        self._model, self._prefix = model, f"{path}."
        self._whole: dict[str, Any] | None = None

    def _lookup(self, name: str) -> Any:
        if name.startswith(self._prefix):  # the unit's own: complete above
            return None
        module_path, _, leaf = name.rpartition(".")
        if leaf == "_extra_state":  # a module's own state, rare: the whole state dict's answer
            if self._whole is None:
                self._whole = self._model.state_dict()
            return self._whole.get(name)
        try:
            module = self._model.get_submodule(module_path)
        except AttributeError:
            return None
        if leaf in module._parameters and module._parameters[leaf] is not None:
            return module._parameters[leaf].detach()
        if module._buffers.get(leaf) is not None and leaf not in module._non_persistent_buffers_set:
            return module._buffers[leaf].detach()
        return None

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or (isinstance(name, str) and self._lookup(name) is not None)

    def get(self, name: str, default: Any = None) -> Any:
        if super().__contains__(name):
            return super().__getitem__(name)
        found = self._lookup(name)
        return default if found is None else found

    def __missing__(self, name: str) -> Any:
        found = self._lookup(name)
        if found is None:
            raise KeyError(name)
        return found


class _UnitView:
    """The model, as transformers' loader sees it while the weights of the unit at `path` load: its
    state dict and buffers the unit's (`_UnitStateDict`), everything else the model's own."""

    def __init__(self, model: nn.Module, path: str):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _UnitStateDict(self._model, self._path)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:
        return self._model.get_submodule(self._path).named_buffers(prefix=self._path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)


class LazyModel:
    """A transformers causal LM built on the meta device; `module(path)` materialises the weights
    of the unit (decoder layer or model-level module) that contains `path`, once."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
        config=None,
        max_layers: int | None = 2,
        weights: dict[str, str] | None = None,
        fit_threads: bool = True,
    ):
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self.config = config or AutoConfig.from_pretrained(self.model_dir, trust_remote_code=trust_remote_code)
        # A quantized checkpoint: its weights dequantized as each unit is read; the model itself is
        # built unquantized (the config's quantization_config names the layout, not the modules)
        quant = layout(self.config, str(self.model_dir))
        self.dequantizer = Dequantizer(quant, str(self.model_dir)) if quant is not None else None
        if quant is not None:
            self.config = copy.copy(self.config)
            with contextlib.suppress(AttributeError):
                del self.config.quantization_config
        self.weight_map = weights if weights is not None else weight_map(self.model_dir)
        if quant is not None:  # every quantized weight has a scale of its shape, before anything is read
            check_tensors(read_tensors(self.model_dir), quant, str(self.model_dir))
        self.stats = ReadStats()
        # called with each unit's module and path once its weights are read (an emulated quantization's)
        self.on_load: list[Any] = []
        self.model = self._build(trust_remote_code)
        from .archs import layers_path

        self._layers_path = layers_path(self.model, self.config)
        layers_name = self._layers_path.rsplit(".", 1)[-1]
        self._layer_re = re.compile(rf"(?:^|\.){re.escape(layers_name)}\.(\d+)\.")
        self._conversion: list[Any] | None = None  # `_mapping`
        self._names: Any = None  # `model_name`
        self._group_keys()
        self._loaded: list[Unit] = []  # loaded units; decoder layers in least recently used order
        # decoder layers held at once (None: every one, never evicted)
        self.max_layers = self.num_layers if max_layers is None else max(1, max_layers)
        self.evicted: list[str] = []
        self._returned_at: int | None = None  # resident bytes after the last give-back
        # Read-ahead: the units the run will ask for, in order; the one being read in the background.
        self._plan: list[Unit] = []
        self._cursor = 0
        self._ahead: tuple[Unit, Future] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._set_sync_load = False  # whether this model set SYNC_LOAD_VARIABLE (and unsets it on close)
        # The intra-op threads of the forwards while a unit is read in the background: torch's own less
        # one (`_fit_threads`), the calling thread's setting put back on close. `fit_threads=False`: the
        # caller holds them where it set them (`--hw-option threads`, set by the backend that runs).
        self._fit = fit_threads
        self._threads = HeldThreads()  # held once reading ahead starts: its `before` is the forwards' own
        # One reader at a time; `_loaded` and eviction under `_state`, so that asking for a loaded
        # unit never waits for the background read.
        self._loading = threading.RLock()
        self._state = threading.RLock()

    def _build(self, trust_remote_code: bool) -> Any:
        """The model on the meta device: parameters on meta, buffers (rotary inv_freq, ...) real, on
        this model's device: they are computed, not loaded. (Initialising parameters that stay on meta
        costs ~0.4 s for 48 layers and gives nothing.)"""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with _META_BUILD, init_empty_weights(include_buffers=False), _no_init_weights():
            model = AutoModelForCausalLM.from_config(
                self.config, attn_implementation="eager", dtype=self.dtype, trust_remote_code=trust_remote_code
            )
        model.config._experts_implementation = "eager"
        model = model.eval()
        if self.device.type != "cpu":
            for module in model.modules():
                for name, buf in list(module._buffers.items()):
                    if buf is not None:
                        module._buffers[name] = buf.to(self.device)
        return model

    def _group_keys(self) -> None:
        """Checkpoint keys by decoder layer (None: model-level), grouped once rather than per load. A key
        outside the layers by its checkpoint name is placed by the model's name of it (a hub checkpoint
        may name a module otherwise, `model.word_embeddings`, or its layers, as the conversion renames)."""
        self._keys_by_layer: dict[int | None, list[str]] = {}
        self._model_level_names: dict[str, str] = {}
        renamed = None
        for key in self.weight_map:
            layer = self.layer_of(key)
            if layer is None:
                renamed = renamed or self._model_names()
                name = renamed(key)
                layer = self.layer_of(name)
                if layer is None:
                    self._model_level_names[key] = name
            self._keys_by_layer.setdefault(layer, []).append(key)

    # -- which checkpoint keys belong to which unit ----------------------------------------------
    def _mapping(self) -> list[Any] | None:
        """transformers' conversion mapping of the model, with `conversion.fused`'s one-copy experts:
        made once (it costs ~10 ms a call) and only read, by the key grouping and every read; None where
        this transformers has none (4.x)."""
        if self._conversion is None:
            try:
                from transformers.conversion_mapping import get_model_conversion_mapping
            except ImportError:
                return None
            self._conversion = fused(get_model_conversion_mapping(self.model))
        return self._conversion

    def _model_names(self) -> Any:
        """The model's name of a checkpoint key (`conversion.model_names`); the key itself where this
        transformers has no conversion mapping (4.x: keys are the model's names)."""
        mapping = self._mapping()
        return (lambda key: key) if mapping is None else model_names(mapping, set(self.model.state_dict()))

    def model_name(self, key: str) -> str:
        """The model's name of a checkpoint key: a per-expert key's is its fused parameter's."""
        if self._names is None:
            self._names = self._model_names()
        return self._names(key)

    def layer_of(self, key_or_path: str) -> int | None:
        """The decoder layer a checkpoint key or module path belongs to (None: model-level)."""
        m = self._layer_re.search(key_or_path + ".")
        return int(m.group(1)) if m else None

    def _unit(self, path: str) -> Unit:
        layer = self.layer_of(path)
        return path if layer is None else layer

    def _keys_for(self, unit: Unit) -> list[str]:
        if isinstance(unit, int):
            return list(self._keys_by_layer.get(unit, []))
        # A model-level module: its own keys, with or without the base-model prefix.
        short = unit.split(".", 1)[1] if "." in unit else unit
        return [
            k
            for k in self._keys_by_layer.get(None, [])
            if self._model_level_names.get(k, k).startswith((unit + ".", short + "."))
        ]

    def unit_path(self, unit: Unit) -> str:
        """The module path of a unit (a decoder layer's number, or a model-level module's path)."""
        return f"{self._layers_path}.{unit}" if isinstance(unit, int) else unit

    def model_level_paths(self) -> list[str]:
        """The modules outside the decoder layers that hold parameters of their own."""
        return [n for n, m in self.model.named_modules() if n and m._parameters and self.layer_of(n) is None]

    @property
    def num_layers(self) -> int:
        return len(self.model.get_submodule(self._layers_path))

    def unit_bytes(self, unit: Unit) -> int:
        """The bytes a unit's parameters and buffers take once loaded (in the model's dtypes)."""
        module = self._unit_module(unit)
        return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

    def _unit_module(self, unit: Unit) -> nn.Module:
        return self.model.get_submodule(self.unit_path(unit))

    @staticmethod
    def _unit_name(unit: Unit) -> str:
        return layer_group(unit) if isinstance(unit, int) else unit

    # -- loading --------------------------------------------------------------------------------
    def module(self, path: str) -> nn.Module:
        """The submodule at `path`, with the weights of its unit loaded."""
        self.ensure(self._unit(path))
        return self.model.get_submodule(path)

    def ensure(self, unit: Unit) -> None:
        self._join(unit)
        if not self._touch(unit):
            with self._loading:  # after a background read in flight
                if not self._touch(unit):
                    if isinstance(unit, int):
                        with self._state:
                            self._evict(keep=self.max_layers - 1)
                    self._load(unit)
        self._read_ahead(unit)
        self._fit_threads()

    def _touch(self, unit: Unit) -> bool:
        """Whether the unit is loaded (a decoder layer becomes the most recently used)."""
        with self._state:
            if unit not in self._loaded:
                return False
            if isinstance(unit, int):
                self._loaded.remove(unit)
                self._loaded.append(unit)
            return True

    def _load(self, unit: Unit) -> None:
        keys = self._keys_for(unit)
        target = self._unit_module(unit)
        if keys:
            self._load_keys(keys)
            for hook in self.on_load:
                hook(target, self.unit_path(unit))
            own_memory(target)
            if len(self._loaded) < self.max_layers:  # no eviction will give the conversion's temporaries back
                malloc_trim()
        self._tie_if_needed(target)
        missing = [n for n, p in target.named_parameters() if p.device.type == "meta"]
        if missing:
            raise CheckpointError(
                f"{self.model_dir} lacks weights for {self._unit_name(unit)}: {', '.join(missing[:4])}"
                + (" ..." if len(missing) > 4 else "")
            )
        with self._state:
            self._loaded.append(unit)

    # -- read-ahead -----------------------------------------------------------------------------
    def plan(self, paths: list[str]) -> None:
        """The module paths the run will ask for, in order: each unit's successor in the plan is
        read in a background thread while the unit runs (with `max_layers` >= 2: the layer before
        makes room for it, so the run still holds `max_layers` layers)."""
        units: list[Unit] = []
        for path in paths:
            unit = self._unit(path)
            if not units or units[-1] != unit:
                units.append(unit)
        self._plan, self._cursor = units, 0

    def _read_ahead(self, unit: Unit) -> None:
        if self._ahead is not None and self._ahead[1].done() and self._ahead[0] != unit:
            self._ahead = None  # read, but not asked for (yet): it stays loaded, or is read again
        if self.max_layers < 2 or self._ahead is not None or not self._plan:
            return
        # Where the run is in its plan: the unit's next occurrence from the cursor on (else from the
        # start: a chained run's whole forward went through the plan before the isolated points).
        try:
            at = self._plan.index(unit, self._cursor)
        except ValueError:
            if unit not in self._plan:
                return
            at = self._plan.index(unit)
        self._cursor = at
        nxt = self._plan[at + 1] if at + 1 < len(self._plan) else None
        if nxt is None or nxt in self._loaded:
            return
        if self._pool is None:
            self._load_on_one_thread()
            if self._fit:
                self._threads.hold()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-parity-read-ahead")
        self._ahead = (nxt, self._pool.submit(self._load_ahead, nxt, unit))

    def _load_on_one_thread(self) -> None:
        """transformers materialises a load's tensors on a pool of its own threads (up to 4), unless
        HF_DEACTIVATE_ASYNC_LOAD is set; it reads the variable at each load. A read in the background
        must leave the cores to the forwards, so once reading ahead starts, loads run on the reading
        thread until `close()` (a value the user set is left as it is). Measured on 2 cores, 48
        Mixtral-style layers: loads alone 2.0 s instead of 2.2-2.5 s, the replay ~5% faster."""
        if SYNC_LOAD_VARIABLE not in os.environ:
            os.environ[SYNC_LOAD_VARIABLE] = "1"
            self._set_sync_load = True

    def _fit_threads(self) -> None:
        """Unless `fit_threads` is False: while the next unit is read in the background, the forwards
        take torch's threads less one (the reader has a core of its own), and all of them once it is
        read. Measured on 2 cores, 48 Mixtral-style layers in bf16 (a read takes ~90 ms of a layer's
        ~190): both cores to the forwards throughout, the run is ~0.6 s longer (of ~9 s after
        imports) than with one core each; one core each throughout, ~0.3 s longer than fitted."""
        base = self._threads.before
        if base is None:
            return
        reading = self._ahead is not None and not self._ahead[1].done()
        self._threads.set(max(1, base - 1) if reading else base)

    def _load_ahead(self, unit: Unit, current: Unit) -> None:
        with self._loading:
            with self._state:
                if unit in self._loaded:
                    return
                if isinstance(unit, int):  # room for it, never at the expense of the unit now running
                    self._evict(keep=self.max_layers - 1, spare=current)
            self._load(unit)

    def _join(self, unit: Unit | None = None) -> None:
        """Wait for the background read (of `unit`, or any); its failure is `unit`'s own."""
        if self._ahead is None or (unit is not None and self._ahead[0] != unit):
            return
        _, future = self._ahead
        self._ahead = None
        future.result()

    def _evict(self, keep: int, spare: Unit | None = None) -> None:
        """Put the least recently used layers' parameters back on the meta device, so a run over
        every layer of a huge model holds `max_layers` layers in memory, not the model."""
        layers = [u for u in self._loaded if isinstance(u, int) and u != spare]
        keep -= isinstance(spare, int) and spare in self._loaded
        if len(layers) <= max(keep, 0):
            return
        freed = 0
        for unit in layers[: len(layers) - max(keep, 0)]:
            for module in self._unit_module(unit).modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        freed += p.numel() * p.element_size()
                        module._parameters[name] = nn.Parameter(
                            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                        )
            self._loaded.remove(unit)
            self.evicted.append(self._unit_name(unit))
        self._give_back(freed)

    def _give_back(self, freed: int) -> None:
        """Return freed heap pages to the OS once the process holds more than a layer's worth
        beyond what it held after the last return: every return costs page faults on the next
        load, never returning lets the heap grow by a layer's temporaries at each load."""
        rss = _rss_bytes()
        if rss is None or self._returned_at is None or rss - self._returned_at > freed:
            malloc_trim()
            self._returned_at = _rss_bytes()

    def _tie_if_needed(self, target: nn.Module) -> None:
        """lm_head tied to the embedding: load the embedding and share its weight."""
        out_emb = self.model.get_output_embeddings()
        if target is not out_emb or not getattr(self.config, "tie_word_embeddings", False):
            return
        if out_emb.weight.device.type != "meta":
            return
        in_emb = self.model.get_input_embeddings()
        emb_path = next(n for n, m in self.model.named_modules() if m is in_emb)
        self.ensure(emb_path)
        out_emb.weight = in_emb.weight

    def _load_keys(self, keys: list[str]) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        with Shards(self.model_dir) as shards:
            state: dict[str, Any] = {}
            for key in keys:
                file = self.weight_map[key]
                sl = shards.handle(file).get_slice(key)
                state[key] = sl
                self.stats.files.add(file)
                self.stats.keys.append(key)
                self.stats.bytes += _numel(sl.get_shape()) * SIZES.get(sl.get_dtype(), 1)
            if self.dequantizer is not None:  # this unit's weights alone, dequantized into the run's dtype
                state = self.dequantizer.dequantize(state, self.dtype)
            config = LoadStateDictConfig(
                dtype=self.dtype,
                dtype_plan=self.model._get_dtype_plan(self.dtype),
                device_map={"": self.device},
                weight_mapping=self._mapping(),
            )
            layers = {self.layer_of(k) for k in keys}  # one decoder layer's keys: the loader sees that layer
            target = (
                _UnitView(self.model, self.unit_path(layers.pop())) if layers != {None} and len(layers) == 1 else None
            )
            with _META_BUILD:
                convert_and_load_state_dict_in_model(target or self.model, state, config)
            state.clear()

    @contextlib.contextmanager
    def streaming(self):
        """A whole-model forward inside this context loads each unit just before it runs (and,
        as layers come and go, holds `max_layers` decoder layers at a time): what a chained run
        of the candidate needs, in the memory of a few layers."""
        layers = self.model.get_submodule(self._layers_path)
        handles = [layer.register_forward_pre_hook(lambda m, a, i=i: self.ensure(i)) for i, layer in enumerate(layers)]
        for unit in self.model_level_paths():
            module = self.model.get_submodule(unit)
            handles.append(module.register_forward_pre_hook(lambda m, a, u=unit: self.ensure(u)))
        embedding = self._input_embedding_path()
        if embedding is not None:  # read before the model's forward: it may ask where the weights are first
            handles.append(self.model.register_forward_pre_hook(lambda m, a: self.ensure(embedding)))
        try:
            yield self.model
        finally:
            for h in handles:
                h.remove()

    def _input_embedding_path(self) -> str | None:
        """The unit of the input embedding, which a model's forward may read from before calling it
        (Llama 4 sends the input ids to `embed_tokens.weight.device`: on meta, before its read)."""
        try:
            embedding = self.model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return None
        path = next((n for n, m in self.model.named_modules() if m is embedding), None)
        return path if path in self.model_level_paths() else None

    @property
    def loaded_units(self) -> set[str]:
        return {self._unit_name(u) for u in self._loaded}

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a read-ahead's failure belongs to a point never run
            self._join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._set_sync_load:
            os.environ.pop(SYNC_LOAD_VARIABLE, None)
            self._set_sync_load = False
        self._threads.restore()
        with self._state:
            self._evict(keep=0)


def _no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' switch that skips `init_weights` (where this transformers has it)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
