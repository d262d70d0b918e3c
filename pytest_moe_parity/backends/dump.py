"""`--hw dump`: a candidate dumped by another framework, or by `dump.record`, compared without running
anything. The dump's layout, its map file and NxDI captures: see `pytest_moe_parity.dump.reader`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..dtypes import dtype_name, parse_dtype
from ..dump.identity import ENGINE_FILE, check_dump
from ..dump.reader import DumpDir, DumpError, PointNotDumped, Source, fit
from ..errors import BackendError
from ..golden import GoldenRecord, GoldenStore
from ..golden.spec import spec_tensor_keys
from ..points import ROUTER, Point
from ..tree import first_tensor
from ..words import counted
from . import Backend, BackendSetup, CacheState, CandidateOutput, HwOption, plan_name
from .neuron_plugin import EXPECTED_HELP, PluginTerms, plugin_layout
from .ran import compute_dtype

# the options naming other runs' dumps: what to say where one is not given, and what its directory holds
OTHER_DUMPS = {
    "rows": ("the rows' own dumps are not given: --hw-option rows=DIR (DIR/row_0, DIR/row_1, ...)",
             "the dump of {name} run alone"),
    "plans": ("the dumps of the runs under each plan are not given: --hw-option plans=DIR (DIR/tp=1, DIR/tp=2)",
              "the dump of the run under {name}"),
}  # fmt: skip
_RANK_PART = re.compile(r"\.\d+$")  # NAME.0, NAME.1: the parts of one output


class DumpBackend(Backend):
    """`--hw dump --model DIR [--parity-map FILE]`: outputs come from the dump, or NxDI capture, in DIR."""

    name = "dump"
    needs_checkpoint = False
    chain_kind = "recorded"  # a dump of the candidate's own forward is a chained run already
    parallel_keys = ("tp", "ep")  # whatever plans the runs were dumped under (`plans=DIR`)
    options = (
        HwOption("map", "JSON map of point ids to dumped tensor names (same as --parity-map)"),
        HwOption(
            "plans",
            "with --parity-parallel A:B: a directory of the dumps of the runs under each plan, named as the plan is "
            "spelled (DIR/tp=1, DIR/tp=2,ep=2), each read as the candidate's own dump is",
        ),
        HwOption(
            "rows",
            "with --parity-batch-invariance: a directory of each row's own dump alone (DIR/row_0, DIR/row_1, ...), "
            "named as the batch's dump is",
        ),
        HwOption("expected", EXPECTED_HELP),
    )

    def __init__(self, setup: BackendSetup) -> None:
        super().__init__(setup)
        if setup.model_dir is None:
            raise BackendError("--hw dump needs the dump directory: pass --model DIR")
        check_dump(setup.model_dir, self.golden.config, self.golden.model_type)  # a run of another model: one line
        self.batch = _batch(self.golden)
        # indexes the dump (names and headers only) and reads the map file; a vLLM Neuron plugin capture
        # is read in the golden's layout
        self.layout = plugin_layout(self.golden, self.batch)
        self.dump = DumpDir(setup.model_dir, self.hw_options["map"], self.golden.model_type, self.layout)
        self.terms = PluginTerms(self, self.hw_options["expected"], self.layout)
        self.seq = int(self.golden.manifest["inputs"]["seq_len"])
        # prompts padded on the left: a bucket's padding is at the start too (NxDI's padding_side="left")
        self.left = self.golden.manifest["inputs"].get("padding_side") == "left"
        self._check_coverage()
        self._dtype_from = ""
        if setup.dtype is None:
            self.native_dtype, self._dtype_from = self._dumped_dtype()
        self._others: dict[tuple[str, str], DumpDir] = {}  # other runs' dumps (`other_dump`)

    def other_dump(self, option: str, name: str) -> DumpDir:
        """Another run's dump beside the candidate's, under `--hw-option OPTION=DIR` as DIR/NAME (a row's
        alone: `rows`, row_N; a parallel plan's: `plans`, tp=2,ep=2), indexed once; DumpError where
        it is not given or not there."""
        if (option, name) not in self._others:
            root = self.hw_options[option]
            if not root:
                raise DumpError(OTHER_DUMPS[option][0])
            where = Path(root).expanduser() / name
            if not where.is_dir():
                raise DumpError(f"{where} does not exist: put {OTHER_DUMPS[option][1].format(name=name)} there")
            self._others[option, name] = DumpDir(where, self.hw_options["map"], self.golden.model_type, self.layout)
        return self._others[option, name]

    def run_row(self, point: Point, golden: GoldenRecord, row: int) -> CandidateOutput:
        """The row's own dump of `point` (as the port ran that row alone), as it was dumped."""
        dump = self.other_dump("rows", f"row_{row}")
        found = dump.find(point)
        if found is None:
            raise PointNotDumped(f"{point.id} is not in row {row}'s dump {dump.root}")
        name, output, notes = found
        router = self.golden.router_of(point)
        routed = dump.find(router) if router is not None else None
        routing = tuple(routed[1]) if routed is not None and isinstance(routed[1], tuple | list) else None
        return CandidateOutput(output, routing, info={"dumped_as": name, "notes": notes})

    def state_dump(self, root: Path) -> DumpDir:
        """`--parity-state DIR`: the dump of the same prompt taken under another state (a KV transfer, another
        replica, after other requests), indexed once as the candidate's own is; DumpError where it is a run of
        another model, or of another prompt (its first dumped output, the embedding where both hold it, of
        another shape or other values than the candidate's: a lookup no state changes)."""
        root = Path(root).expanduser()
        if ("state", str(root)) not in self._others:
            check_dump(root, self.golden.config, self.golden.model_type)
            dump = DumpDir(root, self.hw_options["map"], self.golden.model_type, self.layout)
            _same_prompt(self.dump, dump, self.golden.points)
            self._others["state", str(root)] = dump
        return self._others["state", str(root)]

    def check_state(self, state: Any) -> None:
        self.state_dump(state)

    def run_state(self, point: Point, golden: GoldenRecord, state: Any) -> CandidateOutput:
        """The prompt's dump under another state (`state`: its directory), read as the candidate's own."""
        out = self._read(self.state_dump(state), point)
        said = state_said(Path(state).expanduser())
        out.info["state"] = f"in the dump {Path(state).expanduser()}" + (f" ({said})" if said else "")
        return out

    def _dumped_dtype(self) -> tuple[torch.dtype | None, str]:
        """The candidate's dtype when --dtype is not given: the one every dumped output the golden's
        points find is in (each one looked at, never guessed from one), routers aside (their weights
        are float32 in a bf16 transformers model and in NxDI's router alike); several are a usage error."""
        found: dict[str, list[str]] = {}
        for point in self.golden.points:
            located = self.dump.locate(point)
            if located is None or point.component == ROUTER:
                continue
            dtype = self.dump.dtype_of(located[0])
            if dtype is not None:
                found.setdefault(dtype, []).append(point.id)
        if len(found) > 1:
            counts = ", ".join(
                f"{len(ids)} {d}" + (f" ({', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''})" if i else "")
                for i, (d, ids) in enumerate(sorted(found.items(), key=lambda kv: -len(kv[1])))
            )
            raise DumpError(
                f"the dumped outputs in {self.dump.root} are in several dtypes ({counts}): pass --dtype with "
                "the one the candidate computed in"
            )
        if not found:
            return None, ""
        ((dtype, ids),) = found.items()
        return parse_dtype(dtype), f"all {len(ids)} dumped outputs but the routers' are {dtype}"

    @property
    def dtype_source(self) -> str:
        return self._dtype_from or super().dtype_source

    def _check_coverage(self) -> None:
        """A dump in which no point of the golden can be found is a mistake, not a run of skips; so is
        one whose names mostly match nothing (a forgotten map file): fewer than half the prefill's
        points found while dumped tensors match no point."""
        points = self.golden.points
        located = {p.id: self.dump.locate(p) for p in points}
        if any(found is not None for found in located.values()):
            if self.dump.capture is None:
                self._check_names(located)
            return
        first = next((p for p in points if self.dump.why_missing(p) is None), points[0])
        tried = self.dump.candidates(first)
        nearest = self.dump.nearest(tried)
        raise DumpError(
            f"no dumped tensor in {self.dump.root} matches a point of the golden (looked for {first.id} "
            f"as {', '.join(tried)}; the dump's nearest names: {', '.join(nearest) or 'none'}); "
            "pass a map file of point ids to dumped names"
        )

    def _check_names(self, located: dict[str, tuple[str, Source] | None]) -> None:
        used = {name for found in located.values() if found is not None for name in (found[0],)}
        unmatched = [
            n
            for n in self.dump.names
            if n not in used and _RANK_PART.sub("", n) not in used and not n.endswith((".cache.keys", ".cache.values"))
        ]
        prefill = [p for p in self.golden.points if p.step is None]
        missing = [p.id for p in prefill if located[p.id] is None]
        if not unmatched or len(missing) * 2 <= len(prefill):
            return
        raise DumpError(
            f"the dump {self.dump.root} matches {len(prefill) - len(missing)} of the golden's {len(prefill)} "
            f"prefill points: {len(unmatched)} dumped tensors match no point ({_some(unmatched)}) and no tensor "
            f"was found for {_some(missing)}; pass a map file of point ids to dumped names (--map FILE, "
            f'--parity-map FILE), e.g. {{"layer_{{layer}}.attention": "{_example(unmatched)}"}}'
        )

    def run(self, point: Point, golden: GoldenRecord) -> CandidateOutput:
        self.terms.check(point)
        out = self._read(self.dump, point)
        self.terms.add(point, out)
        return out

    def check_plan(self, plan: dict[str, int]) -> None:
        self.other_dump("plans", plan_name(plan))

    def run_plan(self, point: Point, golden: GoldenRecord, plan: dict[str, int]) -> CandidateOutput:
        """The dump of the run under `plan` (`plans=DIR`: DIR/tp=2,ep=2, named as the plan is spelled),
        read and fitted as the candidate's own dump is (its ranks joined by the map's layout)."""
        return self._read(self.other_dump("plans", plan_name(plan)), point)

    def _read(self, dump: DumpDir, point: Point) -> CandidateOutput:
        """`point`'s output in `dump`, fitted to the golden's layout, with its router's and its cache."""
        found = dump.find(point)
        if found is None:
            why = dump.why_missing(point)
            if why is not None:
                raise PointNotDumped(f"{point.id}: not in the NxDI capture: {why}")
            tried = ", ".join(dump.candidates(point))
            raise PointNotDumped(f"{point.id} is not in the dump {dump.root} (looked for {tried})")
        name, output, notes = found
        shape = self._golden_shape(point)
        note = None
        if isinstance(output, torch.Tensor) and shape is not None:
            output, note = fit(output, shape, self.batch, self._positions(point), self.left)
        if note:
            notes.append(f"{name}: {note}")
        routing = None
        router = self.golden.router_of(point)
        if router is not None:
            dumped = dump.find(router)
            if dumped is not None and isinstance(dumped[1], tuple | list):
                routing = tuple(dumped[1])
            elif dumped is not None:  # its logits only (a capture): the verdict picks the top k from them
                shape = self._golden_shape(router)
                logits = dumped[1]
                if shape:
                    logits = fit(logits, shape, self.batch, self._positions(point), self.left)[0]
                routing = (logits,)
        cache = _cache(dump, point, name)
        if cache is not None:
            cache = _fit_cache(cache, self._golden_cache_positions(point), notes)
        ran = {"dumped": name, **({"output": said} if (said := compute_dtype(output)) else {})}  # what a dump can say
        return CandidateOutput(output, routing, info={"dumped_as": name, "notes": notes}, cache=cache, ran=ran)

    def _golden_cache_positions(self, point: Point) -> int | None:
        """The positions the golden's KV cache holds after a decode step's attention, from the manifest."""
        spec = self.golden.entry(point)["tensors"].get(f"{point.id}/cache_after.keys")
        return int(spec["shape"][-2]) if spec and len(spec.get("shape", ())) == 4 else None

    def _positions(self, point: Point) -> int:
        """The golden's positions per sequence at `point`: the prompt's, or one at a decode step."""
        return self.seq if point.step is None else 1

    def _golden_shape(self, point: Point) -> torch.Size | None:
        """The shape of the golden's (first) output tensor, from the manifest: no tensor is read. A
        `--capture-tokens` golden's prefill outputs are the shape of every token (the dumped output is
        fitted to that; the verdict then takes the positions the golden keeps)."""
        entry = self.golden.entry(point)
        key = next(spec_tensor_keys(entry["output"]), None) if entry.get("output") else None
        if key is None:
            return None
        shape = list(entry["tensors"][key]["shape"])
        kept = self.golden.captured_tokens
        if kept is not None and point.step is None:
            if len(shape) >= 2 and shape[:2] == [self.batch, len(kept)]:
                shape[1] = self.seq
            elif shape and shape[0] == self.batch * len(kept):
                shape[0] = self.batch * self.seq
        return torch.Size(shape)

    def closing_lines(self, rows: list[dict[str, Any]]) -> list[str]:
        compared = [r for r in rows if r["status"] in ("passed", "failed")]
        dtype = dtype_name(self.dtype)
        line = f"compared {len(compared)} of {counted(len(rows), 'point')}, candidate dtype {dtype}"
        line += f" (from {self.dtype_source})"
        census = self.dump.dtype_census()
        others = {d: n for d, n in census.items() if d != dtype}
        if others and sum(others.values()) > sum(census.values()) / 2:
            dominant = max(others, key=others.get)
            line += (
                f"; {others[dominant]} of {sum(census.values())} dumped tensors are {dominant}: "
                f"pass --dtype {dominant} if the candidate computed in it"
            )
        missing = [r["id"] for r in rows if r["status"] == "skipped"]
        if missing:
            line += f"; not in the dump: {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")
        return [line, *self.terms.closing_lines(rows)]


def _cache(dump: DumpDir, point: Point, name: str) -> CacheState | None:
    """A decode step's attention: the layer's KV cache after the call, where the dump holds it
    (`NAME.cache.keys` and `.values`, as `Recorder.keep_cache` writes them)."""
    if point.step is None or point.component != "attention":
        return None
    for base in dict.fromkeys((name, point.id)):
        keys, values = f"{base}.cache.keys", f"{base}.cache.values"
        if dump.has(keys) and dump.has(values):
            return CacheState(point.layer, dump.read(keys), dump.read(values))
    return None


def _fit_cache(cache: CacheState, positions: int | None, notes: list[str]) -> CacheState:
    """A static cache dumped whole (`[B, kv_heads, max_len, D]`, preallocated and written by index, as
    NxDI's and most serving stacks' are) cut to the positions the golden's holds after the step: the
    positions past them were never written by a cache that is right (one written a position late
    leaves the last judged position empty, and fails there)."""
    keys, values = cache.keys, cache.values
    if positions is None or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (keys, values)):
        return cache
    held = keys.shape[-2]
    if held <= positions or values.shape[-2] != held:
        return cache
    notes.append(f"cache: the dump holds {held} positions (a static cache): the first {positions} judged")
    return CacheState(cache.layer, keys[:, :, :positions], values[:, :, :positions], cache.window, cache.seen)


def state_said(root: Path) -> str:
    """The state a dump was taken in, as its writer said it (`engine.json`'s `state.said`: `vllm-dump --state`)."""
    try:
        said = json.loads((root / ENGINE_FILE).read_text())["state"]["said"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return "; ".join(map(str, said)) if isinstance(said, list) else str(said)


def _same_prompt(own: DumpDir, other: DumpDir, points: list[Point]) -> None:
    """DumpError where `other` is not a dump of the prompt `own` holds: its first output both hold (the
    embedding where both do) of another shape, or an embedding of other values."""
    both = [p for p in points if p.step is None and own.locate(p) is not None and other.locate(p) is not None]
    if not both:
        raise DumpError(f"{other.root} holds no output of the golden's prefill that the candidate's dump holds")
    point = next((p for p in both if p.component == "embedding"), both[0])
    a, b = (first_tensor(d.find(point)[1]) for d in (own, other))
    if a is None or b is None:
        return
    if a.shape != b.shape:
        raise DumpError(
            f"{other.root} is a dump of another prompt: its {point.id} is {list(b.shape)}, the candidate's "
            f"{list(a.shape)}; dump the golden's prompt under the other state"
        )
    if point.component == "embedding":
        a, b = a.float(), b.float()
        # another prompt's embedding is another row of the table (rel_l2 ~1); a dtype's rounding is far below 0.1
        if float((a - b).norm()) > 0.1 * max(float(a.norm()), 1e-30):
            raise DumpError(
                f"{other.root} is a dump of another prompt: its embedding differs from the candidate's (a lookup "
                "no serving state changes); dump the golden's prompt under the other state"
            )


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _example(names: list[str]) -> str:
    """A dumped name as a map template: its first layer-like number as `{layer}`."""
    return re.sub(r"(?<=[._])\d+(?=[._]|$)", "{layer}", names[0], count=1)


def _batch(golden: GoldenStore) -> int:
    ids = golden.manifest.get("inputs", {}).get("input_ids")
    return len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else 1
