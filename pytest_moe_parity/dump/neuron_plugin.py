"""The vLLM Neuron plugin's tensor captures, read as candidates of the dump backend.

The plugin (vllm-project/vllm-neuron, `vllm_neuron/accuracy/tensor_capture.py`: `ModelCapture` hooks the
named modules and `CaptureWriter.write` saves each forward pass through `tensor_io.write`) writes:

    CAPTURE_DIR/[SUBDIRECTORY/]dp{dp_rank}/
        prefill_s{len(positions)}_{counter}/          one forward pass (a prefill: its token bucket)
            model.layers.0.self_attn/rank{tp_rank}.pt  the module's first output on this TP rank
            prefill_s{len(positions)}_{counter}_meta.json   {"req_ids": [...], "positions": [...], "dp_rank": N}
        decode_b{len(positions)}_{counter}/ ...         one decode pass (its batch bucket)

Names are the model's module paths (the plugin compares the HF and Neuron captures by name, so they are
the transformers paths the golden's points have). A pass holds the tokens of its scheduled requests
flattened (`[tokens, ...]`, each request's positions a run that counts up, the bucket's padding after
them), or, for an HF run, `[1, seq, ...]`; each TP rank's file holds that rank's piece.

Read here as the golden's layout: the requests (in the natural order of their ids) are the golden's
prompts, a request's prefill passes (chunked or not) give its prompt's positions and its decode pass at
position P + k - 1 gives decode step k (P: the prompt's length); the ranks of one pass are joined by
what their shapes say against the golden's: equal and whole (replicated: rank 0's, checked equal to the
others'), the last dimension split (column or vocabulary parallel: concatenated along it), or the
tokens split (sequence parallel: concatenated along them)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..dtypes import dtype_name
from ..errors import BackendError, PointUnavailable
from ..points import step_prefix

PASS_RE = re.compile(r"^(prefill_s|decode_b)(\d+)_(\d+)$")
_DP_RE = re.compile(r"^dp(\d+)$")
_RANK_RE = re.compile(r"^rank(\d+)\.pt$")
_STEP_RE = re.compile(r"^step_(\d+)\.(.+)$")
WRITER = "vLLM Neuron plugin's CaptureWriter (vllm_neuron/accuracy/tensor_capture.py)"


class PluginCaptureError(BackendError):
    """The capture directory is unusable, or is not a capture of the golden's model and prompts."""


@dataclass(frozen=True)
class Layout:
    """What the golden holds, that a capture's tensors are fitted to: its prompts (rows), their length,
    the decode steps it recorded, and each module's prefill output shape (its first tensor)."""

    batch: int
    seq: int
    steps: tuple[int, ...]
    shapes: dict[str, tuple[int, ...]]
    padded: bool = False  # prompts of unequal length, padded to one

    def rest(self, module: str) -> tuple[int, ...]:
        """The dimensions of one token of `module`'s output (after `[batch, seq]`, or `[batch * seq]`)."""
        shape = self.shapes[module]
        return shape[2:] if shape[:2] == (self.batch, self.seq) else shape[1:]

    def flat(self, module: str) -> bool:
        return self.shapes[module][:2] != (self.batch, self.seq)


@dataclass
class Pass:
    """One forward pass of one DP replica: its scheduler metadata and its files per module and rank."""

    dp: int
    name: str
    prefill: bool
    req_ids: list[str]
    positions: list[int]
    files: dict[str, dict[int, Path]] = field(default_factory=dict)

    def segments(self) -> list[tuple[int, int]]:
        """Each scheduled request's rows (start, stop), in `req_ids` order: the runs of positions that count
        up by one; what follows them is the bucket's padding."""
        runs: list[tuple[int, int]] = []
        for i, p in enumerate(self.positions):
            if i == 0 or p != self.positions[i - 1] + 1:
                runs.append((i, i + 1))
            else:
                runs[-1] = (runs[-1][0], i + 1)
        return runs[: len(self.req_ids)] if self.prefill else [(i, i + 1) for i in range(len(self.req_ids))]


def _replicas(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if p.is_dir() and _DP_RE.match(p.name)), key=lambda p: p.name)


def capture_root(root: Path) -> Path | None:
    """Where the `dp{N}` replicas of a plugin capture are: `root`, or its `target` (ModelCapture's
    `subdirectory`) or only subdirectory holding them; None where `root` is no plugin capture."""
    if not root.is_dir():
        return None
    if _replicas(root):
        return root
    subs = [p for p in root.iterdir() if p.is_dir() and _replicas(p)]
    named = [p for p in subs if p.name == "target"]
    return (named or subs)[0] if len(named or subs) == 1 else None


def is_plugin_capture(root: Path) -> bool:
    top = capture_root(root)
    return top is not None and any(PASS_RE.match(d.name) and d.is_dir() for dp in _replicas(top) for d in dp.iterdir())


def _read_pass(dp: int, directory: Path) -> Pass:
    m = PASS_RE.match(directory.name)
    assert m is not None
    meta = directory / f"{directory.name}_meta.json"
    try:
        raw = json.loads(meta.read_text())
        req_ids, positions = [str(r) for r in raw["req_ids"]], [int(p) for p in raw["positions"]]
    except FileNotFoundError:
        raise PluginCaptureError(f"{directory}: its metadata {meta.name} is missing (the {WRITER} writes it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise PluginCaptureError(f"{meta} is not the plugin's pass metadata (req_ids, positions): {exc}") from None
    if len(positions) != int(m.group(2)):
        raise PluginCaptureError(
            f"{directory.name}: its name says {m.group(2)} positions, its metadata holds {len(positions)}"
        )
    found = Pass(dp, directory.name, m.group(1) == "prefill_s", req_ids, positions)
    for module in sorted(p for p in directory.iterdir() if p.is_dir()):
        ranks = {int(r.group(1)): f for f in module.iterdir() if (r := _RANK_RE.match(f.name))}
        if ranks:
            found.files[module.name] = ranks
    return found


def module_of(name: str) -> str:
    """A dumped name's module: `step_2.model.layers.0.mlp` -> `model.layers.0.mlp`."""
    m = _STEP_RE.match(name)
    return m.group(2) if m else name


def _natural(text: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _load(path: Path) -> torch.Tensor:
    """A rank's tensor, memory-mapped and read with `weights_only=True` (as the dump's `.pt` files are)."""
    import pickle

    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        raise PluginCaptureError(
            f"{path} cannot be read as a tensor with torch.load(weights_only=True) ({type(exc).__name__}): the "
            f"{WRITER} saves each rank's tensor with torch.save"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise PluginCaptureError(f"{path} holds a {type(value).__name__}: the plugin saves one tensor per rank")
    return value


def _mismatch(where: str, shapes: list[torch.Size], module: str, rest: tuple[int, ...]) -> PluginCaptureError:
    pieces = ", ".join(str(list(s)) for s in shapes[:4]) + (" ..." if len(shapes) > 4 else "")
    return PluginCaptureError(
        f"{where}: the capture's {len(shapes)} rank piece{'s' if len(shapes) > 1 else ''} ({pieces}) do not make the "
        f"golden's {module}, {list(rest)} per token, whole, split or sequence-parallel: a capture of another model? "
        "(pass --model the capture of the golden's checkpoint)"
    )


def join_of(shapes: list[torch.Size], rest: tuple[int, ...], bucket: int) -> tuple[str, int] | None:
    """How one pass's rank pieces make the whole, from their shapes and the golden's per-token `rest`:
    (`one` | `replicated` | `columns` | `tokens`, the number of token dimensions in front: 1 for the
    flattened `[tokens, ...]`, 2 for `[batch, seq, ...]`); None where they cannot."""
    lead = len(shapes[0]) - len(rest)
    if lead not in (1, 2) or any(len(s) != len(shapes[0]) for s in shapes):
        return None
    heads, tails = [tuple(s[:lead]) for s in shapes], [tuple(s[lead:]) for s in shapes]
    if len(shapes) == 1:
        return ("one", lead) if tails[0] == rest else None
    if all(t == rest for t in tails):
        tokens = [int(torch.Size(h).numel()) for h in heads]
        if len(set(heads)) == 1 and tokens[0] * len(shapes) != bucket:
            return "replicated", lead
        if sum(tokens) == bucket and all(h[:-1] == heads[0][:-1] for h in heads):
            return "tokens", lead
        return None
    if len(set(heads)) == 1 and all(t[:-1] == rest[:-1] for t in tails) and sum(t[-1] for t in tails) == rest[-1]:
        return "columns", lead
    return None


class PluginCapture:
    """A plugin capture directory as the golden's prompts: `names` (module paths, `step_k.` before a decode
    step's) and `tensor(name)`, the reconstructed output in the golden's layout, read on demand."""

    def __init__(self, root: Path, layout: Layout):
        top = capture_root(root)
        assert top is not None
        if layout.padded:
            raise PluginCaptureError(
                "the golden's batch holds padding (prompts of unequal length), and a vLLM Neuron plugin capture runs "
                "each prompt unpadded: record a golden of prompts of one length (or one per prompt)"
            )
        self.root, self.top, self.layout = root, top, layout
        self.passes = [
            _read_pass(int(m.group(1)), d)
            for dp in _replicas(top)
            if (m := _DP_RE.match(dp.name))
            for d in sorted(dp.iterdir(), key=lambda d: _natural(d.name))
            if d.is_dir() and PASS_RE.match(d.name)
        ]
        known = set(layout.shapes)
        captured = {m for p in self.passes for m in p.files}
        self.modules = sorted(captured & known, key=_natural)
        self.ignored = sorted(captured - known, key=_natural)
        if not self.modules or (self.ignored and len(self.modules) * 2 < len(known)):
            theirs = ", ".join(self.ignored[:3]) + (" ..." if len(self.ignored) > 3 else "")
            ours = ", ".join(sorted(known, key=_natural)[:3])
            raise PluginCaptureError(
                f"the vLLM Neuron plugin capture {root} holds {len(self.modules)} of the golden's {len(known)} modules "
                f"and {len(self.ignored)} that are no module of the golden's model ({theirs}; the golden's are {ours} "
                "...): a capture of another model?"
            )
        self.requests = self._requests()
        self._joins: dict[tuple[int, str, str], tuple[str, int]] = {}
        self.dtypes: dict[str, str] = {}
        self.tp = max(len(r) for p in self.passes for r in p.files.values())
        self._check_shapes()
        self.names = [m for m in self.modules if self._prefill_parts(m) is not None]
        self.names += [step_prefix(k) + m for k in layout.steps for m in self.modules if self._decode_part(k, m)]

    def _requests(self) -> list[str]:
        reqs = sorted({r for p in self.passes for r in p.req_ids}, key=_natural)
        if len(reqs) < self.layout.batch:
            raise PluginCaptureError(
                f"the vLLM Neuron plugin capture {self.root} holds {len(reqs)} request{'s' if len(reqs) != 1 else ''}"
                f" ({', '.join(reqs[:4]) or 'none'}), the golden {self.layout.batch} prompts: capture the golden's "
                "prompts, one request each"
            )
        for b, rid in enumerate(reqs[: self.layout.batch]):
            covered = sorted(p.positions[i] for p, s in self._parts(rid) for i in range(s[0], s[1]))
            if covered != list(range(self.layout.seq)):
                said = f"{covered[0]}-{covered[-1]} ({len(covered)} tokens)" if covered else "nothing"
                raise PluginCaptureError(
                    f"request {rid} of the vLLM Neuron plugin capture {self.root} (the golden's prompt {b}) prefills "
                    f"positions {said}, the golden's prompt is {self.layout.seq} tokens (0-{self.layout.seq - 1}): a "
                    "capture of other prompts, or with a cached prefix (capture with prefix caching off)"
                )
        return reqs[: self.layout.batch]

    def _parts(self, rid: str) -> list[tuple[Pass, tuple[int, int]]]:
        """A request's prefill rows in each prefill pass that holds them (chunked prefill: several), in order."""
        parts = [(p, p.segments()[p.req_ids.index(rid)]) for p in self.passes if p.prefill and rid in p.req_ids]
        parts = [(p, s) for p, s in parts if s[1] <= len(p.positions)]
        return sorted(parts, key=lambda ps: ps[0].positions[ps[1][0]])

    def _prefill_parts(self, module: str) -> list[list[tuple[Pass, tuple[int, int]]]] | None:
        parts = [self._parts(rid) for rid in self.requests]
        return parts if all(module in p.files for rows in parts for p, _ in rows) else None

    def _decode_part(self, step: int, module: str) -> list[tuple[Pass, int]] | None:
        """Each request's decode pass at decode step `step` (position P + step - 1) and its index in it."""
        position = self.layout.seq + step - 1
        found = []
        for rid in self.requests:
            hit = next(
                (
                    (p, i)
                    for p in self.passes
                    if not p.prefill and rid in p.req_ids and module in p.files
                    for i in [p.req_ids.index(rid)]
                    if (max(p.positions) if len(p.req_ids) == 1 else p.positions[i]) == position
                ),
                None,
            )
            if hit is None:
                return None
            found.append(hit)
        return found

    def _check_shapes(self) -> None:
        """Every pass's pieces of every module the golden has, joined by their shapes (read from the files'
        headers, memory-mapped): another model's capture is one line here, not a run of failures."""
        for p in self.passes:
            for module in self.modules:
                ranks = p.files.get(module)
                if ranks is None:
                    continue
                order = sorted(ranks)
                if order != list(range(len(order))):
                    missing = next(r for r in range(len(order) + 1) if r not in ranks)
                    raise PluginCaptureError(f"{p.name}/{module}: TP rank {missing} of {max(order) + 1} is missing")
                pieces = [_load(ranks[r]) for r in order]
                rest = self.layout.rest(module)
                joined = join_of([t.shape for t in pieces], rest, len(p.positions))
                if joined is None:
                    raise _mismatch(f"dp{p.dp}/{p.name}/{module}", [t.shape for t in pieces], module, rest)
                self._joins[p.dp, p.name, module] = joined
                if pieces[0].is_floating_point():
                    self.dtypes.setdefault(module, dtype_name(pieces[0].dtype))

    # -- reading -----------------------------------------------------------------------------------
    def _whole(self, p: Pass, module: str) -> tuple[torch.Tensor, int]:
        ranks = p.files[module]
        pieces = [_load(ranks[r]) for r in sorted(ranks)]
        how, lead = self._joins[p.dp, p.name, module]
        if how == "replicated":
            other = next((r for r, t in enumerate(pieces[1:], 1) if not torch.equal(t, pieces[0])), None)
            if other is not None:
                raise PointUnavailable(
                    f"{module} in {p.name}: TP rank {other} holds other values than rank 0 in the whole shape "
                    "(partial sums before an all-reduce?): not comparable; capture the module after its reduction"
                )
            return pieces[0], lead
        if how == "one":
            return pieces[0], lead
        return torch.cat(pieces, dim=-1 if how == "columns" else lead - 1), lead

    def _request_rows(self, p: Pass, module: str, index: int) -> torch.Tensor:
        """One request's rows of `module` in pass `p`, `[tokens, *rest]`."""
        t, lead = self._whole(p, module)
        if lead == 2 and t.shape[0] == 1:
            t = t[0]
        elif lead == 2:  # an HF batch: a row per request
            t = t[index]
            return t[: p.segments()[index][1] - p.segments()[index][0]] if p.prefill else t[-1:]
        if not p.prefill:
            if t.shape[0] == len(p.positions):
                row = max(range(len(p.positions)), key=p.positions.__getitem__) if len(p.req_ids) == 1 else index
                return t[row : row + 1]
            return t[-1:] if len(p.req_ids) == 1 else t[index : index + 1]  # an HF run's whole recomputed sequence
        start, stop = p.segments()[index]
        if t.shape[0] == len(p.req_ids) < len(p.positions):
            raise PointUnavailable(
                f"{module} in {p.name} holds one row per request (each one's last position, as vLLM computes the "
                "logits of a prefill): the prompt's other positions are not in the capture; its decode steps are "
                "compared"
            )
        if t.shape[0] < stop:
            raise PointUnavailable(f"{module} in {p.name} holds {t.shape[0]} rows, its positions {len(p.positions)}")
        return t[start:stop]

    def tensor(self, name: str) -> torch.Tensor:
        """The output under `name` as the golden's: `[batch, seq, ...]` (or `[batch * seq, ...]`) for the
        prefill, `[batch, 1, ...]` (or `[batch, ...]`) for a decode step."""
        m = _STEP_RE.match(name)
        step, module = (int(m.group(1)), m.group(2)) if m else (None, name)
        if step is None:
            parts = self._prefill_parts(module)
            assert parts is not None
            rows = [torch.cat([self._request_rows(p, module, p.req_ids.index(rid)) for p, _ in got]) for rid, got in
                    zip(self.requests, parts, strict=True)]  # fmt: skip
        else:
            found = self._decode_part(step, module)
            assert found is not None
            rows = [self._request_rows(p, module, i) for p, i in found]
        whole = torch.stack(rows)
        return whole.flatten(0, 1) if self.layout.flat(module) else whole

    def describe(self) -> str:
        dps = len({p.dp for p in self.passes})
        prefills = sum(p.prefill for p in self.passes)
        line = (
            f"vLLM Neuron plugin capture: {len(self.requests)} request{'s' if len(self.requests) > 1 else ''} as "
            f"the golden's prompts, {prefills} prefill and {len(self.passes) - prefills} decode passes, TP {self.tp}"
            + (f", DP {dps}" if dps > 1 else "")
        )
        if self.ignored:
            line += f"; {len(self.ignored)} captured modules are no point's ({', '.join(self.ignored[:3])} ...)"
        return line
