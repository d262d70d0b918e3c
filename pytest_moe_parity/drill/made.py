"""Values a candidate makes inside the call (positions from an `arange`, a causal mask, an inverse-
frequency table), where the reference is given them: compared with the golden's inputs of the same
meaning (its position ids, its attention mask) and with the reference's own tables (a rotary's
`inv_freq` buffer), the first that differs named in one sentence, with what giving the golden's value
in its place recovers of the component's error. The drill follows made values as constants (`capture`):
a bug in one shows only where it meets the call's values, or, where nothing does (a wrapper's rotary
tables), as every op after it differing; this says which made value it was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..judge.distance import rel_l2
from .capture import LAYOUT_OPS, OpGraph, OpNode, Ref

# the golden's inputs that hold positions, and masks, by their keyword in the golden's call
POSITIONS = ("position_ids", "cache_position")
MASKS = ("attention_mask",)
SAME_TABLE = 1e-5  # a table made otherwise (1 / theta ** x, theta ** -x) is the same within this
NEAR_TABLE = 0.1  # beyond this a made table is another table, not the reference's one rounded


@dataclass
class Made:
    """A made value that differs from the golden's of its meaning: the sentence, the candidate's op
    that makes it, and the golden's value in its shape (to substitute), where there is one."""

    text: str
    node: int
    value: torch.Tensor | None = None
    whose: str = "the golden's"
    dtype: str = ""  # where it was made in another dtype than the reference's: which, in words


def named_inputs(record: Any) -> dict[str, torch.Tensor]:
    """The golden call's tensors by keyword (the ones made values are compared with)."""
    return {k: v for k, v in record.kwargs.items() if isinstance(v, torch.Tensor)}


def _made(graph: OpGraph) -> list[OpNode]:
    return [n for n in graph.nodes if n.constant and isinstance(n.value, torch.Tensor)]


def _readers(graph: OpGraph, node: OpNode) -> list[OpNode]:
    """The ops that read `node`'s value, through views."""
    out, todo = [], {node.index}
    for n in graph.nodes[node.index + 1 :]:
        if any(r.kind == "op" and r.at in todo for r in n.inputs()):
            if n.kind in LAYOUT_OPS:  # a view, a copy
                todo.add(n.index)
            else:
                out.append(n)
    return out


def _as_position(graph: OpGraph, node: OpNode) -> bool:
    """An integer value read as a number (cast to a floating dtype, multiplied: a rotary's angles), not
    as an index."""
    if node.value.is_floating_point() or node.value.dtype == torch.bool:
        return False
    return any(
        r.value is not None and r.value.is_floating_point() and r.kind in ("_to_copy", "mul", "outer", "mm", "bmm")
        for r in _readers(graph, node)
    )


def _range(row: torch.Tensor) -> bool:
    return row.numel() > 0 and bool((row.diff() == 1).all())


def _positions(graph: OpGraph, name: str, golden: torch.Tensor) -> Made | None:
    width = golden.shape[-1]
    expected = golden.reshape(-1, width)[0].to(torch.long)
    for node in _made(graph):
        v = node.value
        if v.dim() == 0 or v.shape[-1] != width or not _as_position(graph, node):
            continue
        row = v.reshape(-1, width)[0].to(torch.long)
        if torch.equal(row, expected):
            continue
        if _range(row) and _range(expected):
            said = f"start at {int(row[0])}; the golden's {name} at {int(expected[0])}"
        else:
            i = int((row != expected).nonzero()[0])
            said = f"hold {int(row[i])} at index {i}; the golden's {name} {int(expected[i])}"
        value = expected.expand(v.reshape(-1, width).shape).reshape(v.shape).to(v.dtype)
        return Made(f"the candidate's positions ({node.name}), made inside the call, {said}", node.index, value)
    return None


def _mask(graph: OpGraph, name: str, golden: torch.Tensor) -> Made | None:
    if golden.dim() < 2:
        return None
    rows, keys = golden.shape[-2:]
    allowed = golden.reshape(-1, rows, keys)[0]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    for node in _made(graph):
        v = node.value
        if v.dtype != torch.bool or v.dim() < 2 or v.shape[-1] != keys or v.numel() % (rows * keys):
            continue
        if all(r.constant for r in _readers(graph, node)):  # not where it meets the call's values
            continue
        blocks = v.reshape(-1, rows, keys)
        # True where a query may see a key (`where(mask, scores, ...)`), or where it may not
        # (`masked_fill(scores, mask, ...)`): the reading that differs less is the port's
        meaning = min((allowed, ~allowed), key=lambda a: int((blocks != a).sum()))
        differ = (blocks != meaning).nonzero()
        if not len(differ):
            continue
        _, i, j = (int(x) for x in differ[0])
        lets = "lets" if bool(blocks[tuple(differ[0])]) == (meaning is allowed) else "does not let"
        value = meaning.expand(blocks.shape).reshape(v.shape)
        text = (
            f"the candidate's attention mask ({node.name}), made inside the call, {lets} query {i} see key {j}; "
            f"the golden's {name} {'does not' if lets == 'lets' else 'does'}"
        )
        return Made(text, node.index, value)
    return None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _table(graph: OpGraph, reference: OpGraph) -> Made | None:
    """A floating table made inside the call that is the reference's own table (a parameter or buffer
    of the same shape) up to a rounding, but not within float32's: the first such (an `inv_freq`
    rounded to bfloat16)."""
    made = [n for n in _made(graph) if n.value.is_floating_point()]
    if not made:
        return None
    # the tables the reference's ops read (buffers: a weight is a weight), each read once (a stored
    # reference reads its weights from the golden when first asked for)
    read = {r.at for n in reference.nodes for r in n.inputs() if r.kind == "param"}
    names = [n for n in read if n.rsplit(".", 1)[-1] not in ("weight", "bias")]
    tables = {n: t for n in sorted(names) if (t := reference.params[n]).is_floating_point() and t.dim() <= 2}
    for node in made:
        v = node.value
        for pname, table in tables.items():
            if table.shape != v.shape:
                continue
            t = table.to(v.device)
            if torch.equal(v.float(), t.float()):
                continue
            err = rel_l2(v.float(), t.float())
            if err <= SAME_TABLE or err > NEAR_TABLE:
                continue
            made_in = f" in {_dtype(v.dtype)}" if v.dtype != t.dtype else ""
            text = (
                f"the candidate's table {node.name}, made inside the call{made_in}, is the reference's {pname} "
                f"({_dtype(t.dtype)}) within {err:.2g} (rel_l2), beyond what computing it otherwise in float32 "
                f"gives ({SAME_TABLE:g})"
            )
            dtype = f"{node.name} in {_dtype(v.dtype)} (the reference's {pname}: {_dtype(t.dtype)})" if made_in else ""
            return Made(text, node.index, t, "the reference's", dtype)
    return None


def made_value(candidate: OpGraph, reference: OpGraph, inputs: dict[str, torch.Tensor]) -> Made | None:
    """The first made value of the candidate's that differs from the golden's of its meaning: its
    positions from the golden's position ids, its mask from the golden's attention mask, a table from
    the reference's own; None where all agree (or the candidate makes none)."""
    for name in POSITIONS:
        if name in inputs and not inputs[name].is_floating_point():
            found = _positions(candidate, name, inputs[name])
            if found is not None:
                return found
    for name in MASKS:
        if name in inputs:
            found = _mask(candidate, name, inputs[name])
            if found is not None:
                return found
    return _table(candidate, reference)


def made_found(d: Any, inputs: dict[str, torch.Tensor] | None) -> Made | None:
    """`made_value` for drilling `d` (an `engine.Drilling`)."""
    return made_value(d.cand, d.ref, inputs or {})


def said(d: Any, found: Made | None) -> str | None:
    """`found`'s sentence, with what giving the golden's value (the reference's table) in the
    candidate's run recovers of the component's error."""
    if found is None:
        return None
    text = found.text
    if found.value is not None:
        recovery = d.recovery({Ref("op", found.node, 0): found.value}, found.node)
        if recovery is not None:
            text += f" (giving {found.whose} in its place recovers {100 * recovery:.0f}% of the error)"
    return text
