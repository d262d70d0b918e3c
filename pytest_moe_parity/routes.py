"""`moe-parity routes`: an engine's routed-experts trace against the golden's routing, without dumping
a tensor. A trace holds the expert ids each token was routed to, `(tokens, moe_layers, top_k)` integers,
as vLLM, SGLang and TensorRT-LLM export them for routing replay; its tokens are the golden's real tokens
(each row's, row after row, no padding), its layers the golden's MoE layers in order. Each layer's top-k
sets are judged as the router point judges them: a disagreement within the rounding of the golden's
scores in the engine's dtype is a tie, the others are real flips, weighed by the routing weight the
golden gave the experts they lost; a layer fails where its real flips exceed the router's
`max_flip_share` (or, where the golden holds the reference's own run in that dtype, `noise_factor` times
the share of real flips that run had: an engine's routing follows its own whole run). `--write` writes
the golden's routing as a trace instead, for an engine to replay.

Formats, by the file's suffix: `.npy` (read without pickle), `.safetensors` (one tensor, or the tensor
`routed_experts`), `.pt` (a tensor, read with `weights_only=True`), `.json` (nested lists, or
`{"routed_experts": ...}`)."""

from __future__ import annotations

import ast
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .dtypes import dtype_name, json_safe
from .errors import BadInput
from .golden import GoldenStore
from .judge.routing import RoutingMetrics, SelectionRule, compare_routing, router_triple, routing_view
from .judge.tolerances import resolve
from .points import ROUTER, Point
from .words import counted, noun

KEY = "routed_experts"  # the tensor a .safetensors or .json trace holds, where it holds several
SUFFIXES = (".npy", ".safetensors", ".pt", ".json")
_NPY_TYPES = {"i1": torch.int8, "u1": torch.uint8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64}


class TraceError(BadInput, ValueError):
    """A trace that cannot be read or does not fit the golden: one sentence saying what to do."""


# -- reading and writing traces ---------------------------------------------------------------------------


def read_trace(path: Path) -> torch.Tensor:
    """A routed-experts trace as int64 [tokens, moe_layers, top_k]."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path} is not a file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            ids = _read_npy(path)
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            ids = tensors[KEY] if KEY in tensors else (next(iter(tensors.values())) if len(tensors) == 1 else None)
            if ids is None:
                raise TraceError(f"{path} holds {len(tensors)} tensors and none is named {KEY!r}")
        elif suffix == ".pt":
            ids = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(ids, dict) and KEY in ids:
                ids = ids[KEY]
        elif suffix == ".json":
            data = json.loads(path.read_text())
            ids = torch.tensor(data[KEY] if isinstance(data, dict) else data)
        else:
            raise TraceError(f"{path}: a trace is one of {', '.join(SUFFIXES)} (by its suffix)")
    except TraceError:
        raise
    except Exception as exc:  # a file of another kind, truncated, or lists of unequal lengths
        raise TraceError(f"{path} cannot be read as a routed-experts trace: {exc}") from None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 3:
        shape = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TraceError(f"{path} holds {shape}, not expert ids [tokens, moe_layers, top_k]")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TraceError(f"{path} holds {dtype_name(ids.dtype)} values, not integer expert ids")
    return ids.to(torch.int64)


def write_trace(path: Path, ids: torch.Tensor) -> None:
    """Write expert ids [tokens, moe_layers, top_k] as a trace, in the format of `path`'s suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    ids = ids.to(torch.int32).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".npy":
        header = repr({"descr": "<i4", "fortran_order": False, "shape": tuple(ids.shape)})
        header += " " * (63 - (len(header) + 10) % 64) + "\n"
        data = ids.numpy().tobytes()  # little-endian int32, C order
        path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + data)
    elif suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({KEY: ids}, str(path), metadata={"format": "pt"})
    elif suffix == ".pt":
        torch.save(ids, path)
    elif suffix == ".json":
        path.write_text(json.dumps({KEY: ids.tolist()}))
    else:
        raise TraceError(f"{path}: a trace is written as one of {', '.join(SUFFIXES)} (by its suffix)")


def _read_npy(path: Path) -> torch.Tensor:
    """An integer .npy array (format 1.x-3.x, C order), without numpy or pickle."""
    raw = path.read_bytes()
    if raw[:6] != b"\x93NUMPY":
        raise TraceError(f"{path} is not a .npy file")
    major = raw[6]
    size_bytes = 2 if major == 1 else 4
    (length,) = struct.unpack("<H" if size_bytes == 2 else "<I", raw[8 : 8 + size_bytes])
    start = 8 + size_bytes
    header = ast.literal_eval(raw[start : start + length].decode("latin1"))
    descr, shape = header.get("descr", ""), tuple(header.get("shape", ()))
    dtype = _NPY_TYPES.get(descr.lstrip("<|=").lstrip(">"))
    if dtype is None or descr.startswith(">") or header.get("fortran_order"):
        order = "Fortran" if header.get("fortran_order") else "C"
        raise TraceError(f"{path} holds {descr} values in {order} order: expected integer expert ids in C order")
    data = bytearray(raw[start + length :])
    count = 1
    for n in shape:
        count *= n
    tensor = torch.frombuffer(data, dtype=dtype, count=count) if count else torch.zeros(0, dtype=dtype)
    return tensor.reshape(shape)


# -- the golden's routing ---------------------------------------------------------------------------------


def golden_routers(store: GoldenStore) -> list[Point]:
    """The golden's prefill routers in forward order: the MoE layers a trace holds."""
    return [p for p in store.points if p.component == ROUTER and p.step is None]


def real_tokens(store: GoldenStore) -> torch.Tensor | None:
    """The indices of the golden's real tokens over its rows (row-major); None: every token is real."""
    padding = store.padding(golden_routers(store)[0]) if store.padded else None
    if not padding:
        return None
    keep = torch.ones(padding[1], dtype=torch.bool)
    keep[padding[0]] = False
    return keep.nonzero().flatten()


def golden_trace(store: GoldenStore) -> torch.Tensor:
    """The golden's own routing as a trace [real tokens, moe_layers, top_k]."""
    keep = real_tokens(store)
    layers = []
    for router in golden_routers(store):
        ids = _routing(store, router)[0][2]
        ids = ids.reshape(-1, ids.shape[-1])
        layers.append(ids[keep] if keep is not None else ids)
    return torch.stack(layers, dim=1)


def _routing(store: GoldenStore, router: Point) -> tuple[tuple, Any]:
    """The golden router's (logits, weights, top-k ids) and its score-correction bias, read once."""
    record = store.load(router)
    out = routing_view(record.output)
    if not router_triple(out):
        raise TraceError(f"{router.id}: the golden's router gives no (logits, weights, top-k ids)")
    return out, record.extras.get("score_bias")


# -- judging a trace --------------------------------------------------------------------------------------


@dataclass
class LayerRoutes:
    """One MoE layer of a trace against the golden's router at that layer."""

    router: str
    layer: int | None
    routing: RoutingMetrics
    limit: float  # the largest share of real flips that passes
    passed: bool

    def to_json(self) -> dict[str, Any]:
        return {"router": self.router, "layer": self.layer, "passed": self.passed, "limit": self.limit,
                "routing": self.routing.to_dict()}  # fmt: skip


@dataclass
class RoutesResult:
    trace: str
    dtype: str
    tokens: int
    layers: list[LayerRoutes] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> LayerRoutes | None:
        return next((layer for layer in self.layers if not layer.passed), None)

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return json_safe({
            "trace": self.trace, "dtype": self.dtype, "tokens": self.tokens, "notes": self.notes,
            "first_divergence": first.router if first is not None else None,
            "layers": [layer.to_json() for layer in self.layers],
        })  # fmt: skip


def judge_routes(store: GoldenStore, trace: torch.Tensor, dtype: torch.dtype, source: str = "trace") -> RoutesResult:
    """Each MoE layer of `trace` [tokens, moe_layers, top_k] against the golden's routing (module
    docstring); TraceError where the trace does not fit the golden."""
    if store.captured_tokens is not None:
        raise TraceError("this golden keeps some tokens' routing only (--capture-tokens): record it without")
    routers = golden_routers(store)
    if not routers:
        raise TraceError("the golden has no router: it records no MoE layer")
    keep = real_tokens(store)
    first = _routing(store, routers[0])
    first_ids = first[0][2]
    tokens = first_ids.reshape(-1, first_ids.shape[-1]).shape[0] if keep is None else keep.numel()
    k = first_ids.shape[-1]
    notes = _fit(store, trace, routers, tokens, k)
    result = RoutesResult(source, dtype_name(dtype), tokens, notes=notes)
    unsteered = store.unsteered_noise(dtype) if store.has_noise(dtype, "chain") else None
    for index, router in enumerate(routers):
        (g_logits, g_weights, g_ids), bias = _routing(store, router) if index else first
        experts = g_logits.shape[-1]
        ids = trace[:tokens, index, :]
        if int(ids.min()) < 0 or int(ids.max()) >= experts:
            raise TraceError(
                f"the trace routes a token of MoE layer {index} ({router.id}) to expert {int(ids.max())} or "
                f"{int(ids.min())}: the model has experts 0-{experts - 1}"
            )
        tol, _ = resolve(router.id, ROUTER, dtype)
        rule = SelectionRule.of(router, dtype, tol.tie_factor, store.config)
        scores, tie = rule.scores(g_logits, bias)
        g_ids, g_weights = g_ids.reshape(-1, k), g_weights.reshape(-1, g_weights.shape[-1])
        if keep is not None:
            scores, tie, g_ids, g_weights = scores[keep], tie[keep], g_ids[keep], g_weights[keep]
        metrics = compare_routing(scores, g_ids, ids, tolerance=tie)
        metrics.weigh(g_ids, g_weights)
        limit = tol.max_flip_share
        reference = store.noise(dtype, unsteered, router.id) if unsteered else None
        if reference:  # the reference's own whole run in this dtype flipped as many
            limit = max(limit, tol.noise_factor * float(reference.get("top_k", {}).get("flip_share", 0.0)))
        result.layers.append(LayerRoutes(router.id, router.layer, metrics, limit, metrics.flip_share <= limit))
    return result


def _fit(store: GoldenStore, trace: torch.Tensor, routers: list[Point], tokens: int, k: int) -> list[str]:
    """Whether the trace's shape fits the golden (TraceError saying how not), and what is said of it."""
    count, layers, top_k = trace.shape
    if layers != len(routers):
        recorded = ", ".join(str(r.layer) for r in routers)
        sliced = " (the golden is a slice: record every layer, or cut the trace to them)" if "layers" in (
            store.manifest["record"]) else ""  # fmt: skip
        raise TraceError(
            f"the trace has {counted(layers, 'MoE layer')}, the golden records {len(routers)} "
            f"({noun(len(routers), 'layer')} {recorded}){sliced}"
        )
    if top_k != k:
        raise TraceError(
            f"the trace routes each token to {counted(top_k, 'expert')}, the golden's router to {k} (top_k)"
        )
    if count < tokens or (count > tokens and store.sequences > 1):
        rows = f" over its {store.sequences} rows, padding left out" if store.sequences > 1 else ""
        raise TraceError(
            f"the trace has {counted(count, 'token')}, the golden {counted(tokens, 'real token')}{rows}: trace the "
            "golden's prompt (moe-parity show GOLDEN --inputs) from its first token"
        )
    if count > tokens:
        return [
            f"the trace's last {counted(count - tokens, 'token')} (past the golden's prompt) "
            f"{'is' if count - tokens == 1 else 'are'} not judged"
        ]
    return []


# the table's columns: (header, width, what it is), each figure under its own header
COLUMNS = (
    ("agree", 7, "the share of tokens whose top-k set is the golden's"),
    ("flips", 6, "tokens routed to other experts beyond the rounding of the golden's scores"),
    ("ties", 5, "those within it (forgiven)"),
    ("flip share", 11, "flips over tokens, what the verdict judges"),
    ("share limit", 12, "the largest flip share that passes"),
    ("flip weight", 12, "the golden's routing weight the flipped experts carried"),
)


def routes_lines(result: RoutesResult) -> list[str]:
    """The per-layer table (each figure in its own column, `COLUMNS`), what its columns are, and the
    closing line."""
    head = "".join(f" {name:>{width}}" for name, width, _ in COLUMNS)
    lines = [
        f"routes: {result.trace} against the golden's routing: {counted(result.tokens, 'token')}, "
        f"{counted(len(result.layers), 'MoE layer')}, ties within {result.dtype} rounding of the golden's scores "
        "forgiven",
        f"  {'router':<22}{head}  verdict",
    ]
    for layer in result.layers:
        m = layer.routing
        weight = f"{m.flipped_weight:.1%}" if m.flipped_weight is not None else "-"
        figures = (f"{m.set_agreement:.1%}", len(m.flips), len(m.ties), f"{m.flip_share:.1%}", f"{layer.limit:.1%}",
                   weight)  # fmt: skip
        cells = "".join(f" {figure:>{width}}" for figure, (_, width, _) in zip(figures, COLUMNS, strict=True))
        lines.append(f"  {layer.router:<22}{cells}  {'pass' if layer.passed else 'FAIL'}")
    lines.append("  columns: " + "; ".join(f"{name}: {what}" for name, _, what in COLUMNS))
    lines += [f"  note: {note}" for note in result.notes]
    first = result.first_divergence
    if first is None:
        lines.append("first divergence: none (every layer routes as the golden, up to near ties)")
    else:
        m = first.routing
        lines.append(
            f"first divergence: {first.router}: {len(m.flips)} of {m.num_tokens} tokens routed to other experts "
            f"({m.flip_share:.1%} > {first.limit:.1%})" + (f"; {m.weight_words()}" if m.weight_words() else "")
        )
    return lines
