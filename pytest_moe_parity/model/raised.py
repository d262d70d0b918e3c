"""Some of a module's ops raised to float32, the rest left as the candidate runs them: the precision
search's knob (`replay.precision`).

A unit is an op group inside one submodule: `(path, group)`, the submodule's path below the point's
module ("" for the module itself) and the group its ATen ops fall in (`GROUPS`: `matmul` for
projections and attention's products, `score` for softmax, sigmoid and top-k, `variance` for a
norm's mean of squares and its root, `activation`, and `elementwise` for the other arithmetic).
Ops that only move data (views, copies, casts, indexing, concatenation) belong to no unit.

Two lanes run side by side. The *natural* lane is the candidate's own run: every tensor the Python
code sees is the one it would see, in the dtype it would have, so its control flow and its casts do
not change. Beside a natural tensor, the *wide* lane may hold its float32 value: the point's inputs
(the golden's float32 values), the module's parameters (read again from the checkpoint in float32),
and the outputs of raised ops. A raised op runs on the wide values of its inputs (or its natural
inputs widened) in float32, and its natural output is that result rounded to the natural dtype, so
the next raised op starts from the unrounded value and an op that is not raised sees what the
candidate's storage would hold. An op that moves data carries the wide lane along; an op that is
not raised drops it (it computes in the candidate's precision)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

Unit = tuple[str, str]  # (submodule path below the point's module, op group)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


GROUPS: dict[str, frozenset[str]] = {
    "matmul": _names(
        "mm addmm bmm baddbmm matmul linear dot _grouped_mm einsum convolution "
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention "
        "_scaled_dot_product_flash_attention scaled_dot_product_attention"
    ),
    "score": _names("_softmax softmax _log_softmax log_softmax sigmoid topk sort argsort"),
    "variance": _names("pow mean var var_mean rsqrt sqrt native_layer_norm _fused_rms_norm rms_norm"),
    "activation": _names("silu gelu relu tanh elu softplus"),
}
# ops that move or copy values without rounding them: no unit; they carry the wide lane along
MOVES = _names(
    "view _unsafe_view reshape expand permute transpose t squeeze unsqueeze slice select index "
    "index_select gather cat stack split split_with_sizes unbind chunk clone contiguous _to_copy "
    "alias detach narrow flatten unflatten repeat repeat_interleave roll flip as_strided lift_fresh "
    "masked_select take_along_dim expand_as view_as movedim _reshape_alias new_empty empty_like "
    "zeros_like ones_like where masked_fill index_put scatter tril triu"
)
# ops that make no arithmetic at all (comparisons, fills, index bookkeeping): no unit either
NOT_ARITHMETIC = _names(
    "eq ne lt le gt ge arange zeros ones full fill_ zero_ copy_ empty new_zeros new_ones "
    "new_full nonzero argmax argmin max min amax amin scatter_ one_hot logical_and logical_or "
    "logical_not bitwise_and bitwise_or bitwise_not isinf isnan any all _local_scalar_dense sym_size "
    "item masked_fill_ index_put_ bincount histc"
)


def op_group(name: str) -> str | None:
    """The group of an ATen op by its packet's name (None: it moves data or makes no arithmetic)."""
    base = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name
    if base in MOVES or name in MOVES or base in NOT_ARITHMETIC or name in NOT_ARITHMETIC:
        return None
    for group, names in GROUPS.items():
        if base in names:
            return group
    return "elementwise"


def unit_name(unit: Unit) -> str:
    """`q_proj:matmul`, or `score` for an op group of the point's module itself."""
    path, group = unit
    return f"{path}:{group}" if path else group


class Raised(TorchDispatchMode):
    """The dispatch mode that runs `raised` units in float32 (see the module docstring). `paths`: each
    submodule's path below the point's module, by id; `wide`: the wide lane, a natural tensor's id ->
    its float32 value (seeded with the inputs' and parameters'). `seen` collects every unit that ran,
    in forward order (the census)."""

    def __init__(self, paths: dict[int, str], raised: set[Unit], pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.paths, self.raised = paths, raised
        self.wide: dict[int, torch.Tensor] = {}
        self._natural: dict[int, torch.Tensor] = {}  # the natural tensors the lane is keyed by, alive while it runs
        for natural, wide in pairs:
            self._remember(natural, wide)
        self.stack: list[str] = []
        self.seen: list[Unit] = []

    def _where(self) -> str:
        return self.stack[-1] if self.stack else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        group = op_group(name)
        flat, _ = tree_flatten((args, kwargs))
        has_wide = any(isinstance(t, torch.Tensor) and id(t) in self.wide for t in flat)
        if group is None:
            out = func(*args, **kwargs)
            self._forget_written(func, args, kwargs)
            if has_wide and name in MOVES:
                self._carry(func, args, kwargs, out)
            return out
        unit = (self._where(), group)
        if unit not in self.seen:
            self.seen.append(unit)
        if unit not in self.raised:
            out = func(*args, **kwargs)
            self._forget_written(func, args, kwargs)  # computed in the candidate's precision: no wide value
            return out
        copy = func._schema.is_mutable  # an op that writes its input: never into the natural tensor
        wide_out = func(*self._widen(args, copy), **self._widen(kwargs, copy))
        out = func(*args, **kwargs)  # the natural lane: its shapes and dtypes, its values replaced
        if copy:
            self._forget_written(func, args, kwargs)  # and the tensors that share its storage
        self._round_into(out, wide_out)
        return out

    def _forget_written(self, func: Any, args: Any, kwargs: Any) -> None:
        """An op that wrote into a tensor: the wide values of it and of every tensor sharing its
        storage (a view's base, the base's other views) are stale."""
        if not func._schema.is_mutable:
            return
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, torch.Tensor):
                    self._forget_storage(value)

    def _forget_storage(self, written: torch.Tensor) -> None:
        ptr = _storage(written)
        for key in [k for k, t in self._natural.items() if t is written or _storage(t) == ptr]:
            self.wide.pop(key, None)
            self._natural.pop(key, None)

    def _widen(self, obj: Any, copy: bool = False) -> Any:
        def widen(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if id(x) in self.wide:
                    return self.wide[id(x)]
                if x.is_floating_point() and x.dtype != torch.float64:
                    return x.to(torch.float32, copy=copy)
                return x.clone() if copy else x
            if isinstance(x, torch.dtype) and x.is_floating_point and x != torch.float64:
                return torch.float32  # a cast to a narrower dtype, raised: kept wide
            return x

        return tree_map(widen, obj)

    def _pairs(self, out: Any, wide_out: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        natural, _ = tree_flatten(out)
        wide, _ = tree_flatten(wide_out)
        for n, w in zip(natural, wide, strict=False):
            if isinstance(n, torch.Tensor) and isinstance(w, torch.Tensor) and n.shape == w.shape:
                yield n, w

    def _round_into(self, out: Any, wide_out: Any) -> None:
        with torch.no_grad():
            for n, w in self._pairs(out, wide_out):
                n.copy_(w)  # rounded to the natural dtype (indices: the wide lane's choice)
                if n.is_floating_point():
                    self._remember(n, w)

    def _carry(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """A data move of a tensor with a wide value: the same move of the wide values."""
        try:
            wide_out = func(*self._widen(args), **self._widen(kwargs))
        except RuntimeError:  # a move the wide lane cannot make (a dtype it fixes): the lane ends here
            return
        for n, w in self._pairs(out, wide_out):
            if n.is_floating_point() and w.is_floating_point():
                self._remember(n, w)

    def _remember(self, natural: torch.Tensor, wide: torch.Tensor) -> None:
        self._natural[id(natural)] = natural
        self.wide[id(natural)] = wide.float() if wide.dtype != torch.float32 else wide


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage: none shared
        return None


@contextmanager
def raised_ops(
    module: nn.Module, raised: set[Unit], pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[Raised]:
    """Inside: `module`'s ops of the `raised` units run in float32 (`Raised`), the wide lane seeded
    with `pairs` (a natural tensor, its float32 value); the mode's `seen` says which units ran."""
    paths = {id(m): path for path, m in module.named_modules()}
    mode = Raised(paths, set(raised), pairs)

    def enter(m: nn.Module, *_: Any) -> None:
        if id(m) in paths:
            mode.stack.append(paths[id(m)])

    def leave(m: nn.Module, *_: Any) -> None:
        if id(m) in paths and mode.stack:
            mode.stack.pop()

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        with mode:
            yield mode
    finally:
        for handle in handles:
            handle.remove()
