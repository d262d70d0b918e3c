"""A candidate's quantization, emulated on a transformers model: what `moe-parity golden --noise-quant
SPEC` runs the reference under (its own error under the scheme: the quantization's noise floor) and
what `--hw cpu --hw-option quant=SPEC` runs a candidate under (a user predicting their FP8 port).

A SPEC is `WEIGHTS[+ACTIVATIONS][+kv-fp8]`:
- WEIGHTS, a scheme of `quant.WEIGHT_SCHEMES`: `fp8-block[:N|:RxC]` (e4m3, a scale per block),
  `fp8-channel`, `fp8-tensor`, `int8-channel`, `mxfp4` (e2m1, an e8m0 exponent per 32 values along the
  input dimension). Every projection of the decoder layers is replaced by its round trip through the
  scheme (`quant.fake_quant`) as its unit loads: attention, dense MLPs, shared experts and the fused
  experts' 3-D parameters (each arch's layout: `[E, out, in]`, or `[E, in, out]` where the experts
  module says `is_transposed`, as GPT-OSS's; a concatenated gate/up quantized as its two halves, as
  the hub stores them). Routers (`mlp.gate`, `shared_expert_gate`), norms, embeddings and the LM head
  stay as they are. `mxfp4` quantizes the experts alone (GPT-OSS's release).
- ACTIVATIONS, each projection's input through e4m3 (int8 for `int8-channel`), as forward pre-hooks
  on the `nn.Linear`s and on the fused experts' inputs: `dynamic-token` (a scale per token; per
  token and group of the block's columns for `fp8-block`, as DeepSeek's W8A8 kernels take it),
  `dynamic-tensor` (ONE scale over the whole input: every row of the batch, so a row's rounding
  depends on its neighbours), `static` (a fixed scale per projection: the checkpoint's `input_scale`
  / `activation_scale` where it has one, else computed from the golden's own inputs: the largest
  |input| over its prompt, over the format's largest value).
- `kv-fp8`: K and V through e4m3 with a per-layer scale: the checkpoint's `k_scale` / `v_scale`
  where it has them, else computed from the golden's own K / V as `static` does.

What it approximates (said in the floor's description where it matters):
- the experts' intermediate activation (the down projection's input) is quantized per call of each
  expert: `dynamic-tensor` there takes one scale over that expert's tokens, where a fused kernel takes
  one over every routed token;
- `kv-fp8` quantizes the outputs of `k_proj` / `v_proj` (DeepSeek's MLA: of `kv_b_proj`, one scale
  for both): K before its norm and rotary, where a cache holds it after them; and in a decode step
  judged on the golden's inputs the cached past comes from the golden, unquantized: only the new
  token's K / V pass through e4m3 (a chained run quantizes each entry as it is made).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..points import EXPERTS, ROUTER
from .quant import FP8, FP8_MAX, INT8_MAX, MX_GROUP, WEIGHT_SCHEMES, fake_quant, parse_weight_scheme

ACTIVATIONS = ("dynamic-token", "dynamic-tensor", "static")
KV = "kv-fp8"
KEY_PREFIX = "quant:"  # a quantization floor's key among the golden's noise floors
# the relative step of each format (its epsilon): a floor must be recorded in a dtype that resolves it
FORMAT_EPS = {"fp8": 2.0**-3, "int8": 1.0 / INT8_MAX, "mxfp4": 2.0**-1}
# a dtype resolves a format when its own epsilon is at least this many times finer (3 bits)
RESOLVES = 8.0
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class QuantSpec:
    """A parsed `--noise-quant` / `--hw-option quant=` value."""

    weights: str  # a scheme of WEIGHT_SCHEMES
    block: tuple[int, int] | None = None
    activations: str | None = None  # one of ACTIVATIONS; None: weight-only
    kv: bool = False

    @property
    def weights_name(self) -> str:
        if self.weights == "fp8-block" and self.block:
            b0, b1 = self.block
            return f"fp8-block:{b0}" if b0 == b1 else f"fp8-block:{b0}x{b1}"
        return self.weights

    @property
    def name(self) -> str:
        """The spec as options spell it, its parts in order: `fp8-block:128+dynamic-token+kv-fp8`."""
        return "+".join([self.weights_name, *filter(None, [self.activations]), *([KV] if self.kv else [])])

    @property
    def key(self) -> str:
        """Its floor's key among the golden's noise floors: `quant:fp8-block:128+dynamic-token`."""
        return KEY_PREFIX + self.name

    @property
    def int8(self) -> bool:
        return self.weights.startswith("int8")

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's output is its own whatever its batch: not with a scale shared over the batch."""
        return self.activations != "dynamic-tensor"

    @property
    def eps(self) -> float:
        """The finest relative step among the formats the spec rounds to."""
        formats = ["int8" if self.int8 else "mxfp4" if self.weights == "mxfp4" else "fp8"]
        if self.activations:
            formats.append("int8" if self.int8 else "fp8")
        if self.kv:
            formats.append("fp8")
        return min(FORMAT_EPS[f] for f in formats)

    @property
    def group(self) -> int | None:
        """`dynamic-token` under a block scheme: its tokens' scales per group of the block's columns."""
        return self.block[1] if self.weights == "fp8-block" and self.block else None

    def describe(self) -> str:
        """One phrase for headers and reports."""
        act_format = "int8" if self.int8 else "e4m3"
        parts = [f"weights {self.weights_name}"]
        if self.activations == "dynamic-token":
            per = f"per token and group of {self.group}" if self.group else "per token"
            parts.append(f"activations {act_format}, a dynamic scale {per}")
        elif self.activations == "dynamic-tensor":
            parts.append(f"activations {act_format}, one dynamic scale per tensor (shared by the batch)")
        elif self.activations == "static":
            parts.append(f"activations {act_format}, static scales")
        if self.kv:
            parts.append("K/V e4m3, a scale per layer")
        return ", ".join(parts)


def parse_spec(text: str, flag: str = "--noise-quant") -> QuantSpec:
    """`WEIGHTS[+ACTIVATIONS][+kv-fp8]` -> QuantSpec; ValueError, one sentence naming `flag` and the value
    (with `flag=""`, the value alone: `--hw-option quant=` names its option itself)."""
    said = f"{flag} {text}: " if flag else ""
    parts = [p.strip() for p in str(text).split("+")]
    if not parts[0]:
        raise ValueError(f"{said or repr(text) + ': '}give a weight scheme first ({', '.join(WEIGHT_SCHEMES)}), "
                         "e.g. fp8-block:128+dynamic-token")  # fmt: skip
    try:
        weights, block = parse_weight_scheme(parts[0])
    except ValueError as exc:
        raise ValueError(f"{said}{exc}") from None
    activations, kv = None, False
    for part in parts[1:]:
        if part in ACTIVATIONS and activations is None:
            activations = part
        elif part == KV and not kv:
            kv = True
        elif part in ACTIVATIONS or part == KV:
            raise ValueError(f"{said}{part!r} is given twice (one activation scheme, one {KV})")
        else:
            raise ValueError(f"{said}{part!r} is neither an activation scheme ({', '.join(ACTIVATIONS)}) nor {KV}")
    return QuantSpec(weights, block, activations, kv)


def spec_of_key(key: str) -> QuantSpec | None:
    """The spec of a floor's key (`quant:...`), None for a dtype's floor."""
    return parse_spec(key[len(KEY_PREFIX) :]) if key.startswith(KEY_PREFIX) else None


def resolves(dtype: torch.dtype, spec: QuantSpec) -> bool:
    """Whether `dtype`'s own rounding is fine enough (RESOLVES times the spec's finest step) for an
    error under the spec to be the spec's, not the dtype's."""
    return torch.finfo(dtype).eps * RESOLVES <= spec.eps


def fake_quant_activation(
    x: torch.Tensor, how: str, *, scale: torch.Tensor | None = None, group: int | None = None, int8: bool = False
) -> torch.Tensor:
    """`x` through e4m3 (or symmetric int8) and back, in its dtype: with `scale` (static), else a
    dynamic scale per token (`dynamic-token`, per `group` of its last dimension where given) or one
    over the whole tensor (`dynamic-tensor`)."""
    if not x.is_floating_point() or x.numel() == 0:
        return x
    top = INT8_MAX if int8 else FP8_MAX
    xf = x.to(torch.float32)
    shape = xf.shape
    if scale is None and how == "dynamic-token" and group:
        pad = (-shape[-1]) % group
        xf = torch.nn.functional.pad(xf, (0, pad)).reshape(*shape[:-1], -1, group)
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True) if how == "dynamic-token" else xf.abs().amax()
        scale = (amax / top).clamp(min=_TINY)
    scale = scale.to(device=xf.device, dtype=torch.float32)
    y = xf / scale
    q = y.round().clamp(-top, top) if int8 else y.clamp(-top, top).to(FP8).to(torch.float32)
    out = q * scale
    if out.shape != shape:
        out = out.reshape(*shape[:-1], -1)[..., : shape[-1]]
    return out.to(x.dtype)


@dataclass
class Targets:
    """What the emulation touches in a model: projections (path -> Linear), fused experts (path ->
    module), and each attention's K/V projections (attention path -> [(projection name, "k"|"v"|"kv")])."""

    linears: dict[str, nn.Linear] = field(default_factory=dict)
    experts: dict[str, nn.Module] = field(default_factory=dict)
    kv: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def _is_gate(name: str) -> bool:
    """A router-like gate (`mlp.gate`, `shared_expert_gate`), not a projection (`gate_proj`)."""
    last = name.rsplit(".", 1)[-1]
    return last in ("gate", "router") or last.endswith("_gate")


def expert_weights(module: nn.Module) -> dict[str, nn.Parameter]:
    """A fused experts module's 3-D weights (its biases aside)."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and "bias" not in n}


def find_targets(model: nn.Module, spec: QuantSpec, where: str = "the model") -> Targets:
    """The projections, experts and K/V projections `spec` touches; ValueError, one sentence, where the
    model cannot take the spec (mxfp4 dims not multiples of 32, no K/V projection for kv-fp8)."""
    from .archs import layers_path, plan_points

    plan = plan_points(model)
    layers = layers_path(model) + "."
    routers = {p.module for p in plan.points if p.component == ROUTER}
    experts = {p.module for p in plan.points if p.component == EXPERTS}
    attentions = {p.module for p in plan.points if p.component == "attention"}
    targets = Targets()
    for name, module in model.named_modules():
        if not name.startswith(layers):
            continue
        if any(name == r or name.startswith(r + ".") for r in routers) or _is_gate(name):
            continue
        under_experts = any(name == e or name.startswith(e + ".") for e in experts)
        if name in experts and expert_weights(module):
            targets.experts[name] = module
        elif isinstance(module, nn.Linear) and (spec.weights != "mxfp4" or under_experts):
            targets.linears[name] = module
    if spec.weights == "mxfp4":
        _check_mxfp4(targets, where)
    if not targets.linears and not targets.experts:
        raise ValueError(f"--noise-quant {spec.name}: {where} has no projection in its decoder layers to quantize")
    if spec.kv:
        for path in sorted(attentions):
            attention = model.get_submodule(path)
            found = [(n, n[0]) for n in ("k_proj", "v_proj") if isinstance(getattr(attention, n, None), nn.Module)]
            if len(found) < 2 and isinstance(getattr(attention, "kv_b_proj", None), nn.Module):
                found = [("kv_b_proj", "kv")]  # DeepSeek's MLA: K and V come out of one projection
            if len(found) < 2 and found != [("kv_b_proj", "kv")]:
                raise ValueError(f"--noise-quant {spec.name}: {path} has no k_proj / v_proj (nor kv_b_proj) for {KV}")
            targets.kv[path] = found
    return targets


def _check_mxfp4(targets: Targets, where: str) -> None:
    for path, module in targets.experts.items():
        transposed = bool(getattr(module, "is_transposed", False))
        for name, p in expert_weights(module).items():
            size = p.shape[-2] if transposed else p.shape[-1]
            if size % MX_GROUP:
                raise ValueError(
                    f"--noise-quant mxfp4: {where}'s {path}.{name} has an input dimension of {size}, not a multiple "
                    f"of {MX_GROUP} (MXFP4 shares an exponent among {MX_GROUP} values along it)"
                )
    for path, linear in targets.linears.items():
        if linear.in_features % MX_GROUP:
            raise ValueError(
                f"--noise-quant mxfp4: {where}'s {path} has {linear.in_features} inputs, not a multiple of {MX_GROUP}"
            )
    if not targets.experts and not targets.linears:
        raise ValueError(f"--noise-quant mxfp4 quantizes the experts (GPT-OSS's release): {where} has none")


def quantize_expert_weight(w: torch.Tensor, spec: QuantSpec, transposed: bool, halves: bool) -> torch.Tensor:
    """A fused experts weight through the scheme: `[E, out, in]` (or `[E, in, out]`, `transposed`),
    a concatenated gate/up (`halves`) as its two halves, as the hub stores them."""
    t = w.transpose(-1, -2) if transposed else w
    if halves and t.shape[-2] % 2 == 0 and spec.weights != "mxfp4":
        gate, up = t.chunk(2, dim=-2)
        q = torch.cat([fake_quant(gate, spec.weights, spec.block), fake_quant(up, spec.weights, spec.block)], dim=-2)
    else:
        q = fake_quant(t, spec.weights, spec.block)
    return q.transpose(-1, -2) if transposed else q


_MATMULS = frozenset({torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})


class _DownInputs(TorchFunctionMode):
    """Inside a fused experts module's forward: the input of each matmul with a slice of its down
    projection (the intermediate activation) through `quantize`."""

    def __init__(self, storages: set[int], quantize: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.storages, self.quantize = storages, quantize

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[1] if func in _MATMULS and len(args) >= 2 else None
        if isinstance(weight, torch.Tensor) and weight.untyped_storage().data_ptr() in self.storages:
            args = (self.quantize(args[0]), *args[1:])
        return func(*args, **kwargs)


SCALE_SUFFIXES = (".input_scale", ".activation_scale")


class Emulation:
    """A QuantSpec applied to one model (built on the meta device or loaded): its weights as each unit
    loads (`quantize_unit`), its activations and K/V through hooks (`attach`), the static and KV scales
    from the checkpoint (`checkpoint_scales`) or computed over a forward (`calibrating`)."""

    def __init__(self, spec: QuantSpec, model: nn.Module, *, where: str = "the model", weights: bool = True):
        self.spec = spec
        self.model = model
        self.targets = find_targets(model, spec, where)
        self.weights = weights  # False: the checkpoint's weights are already in the scheme
        self.scales: dict[str, torch.Tensor] = {}  # site -> its static scale (activations and K/V)
        self.sources: dict[str, str] = {}  # site -> "checkpoint" or "computed"
        self._amax: dict[str, torch.Tensor] | None = None  # while calibrating: site -> the largest |value|
        self._handles: list[Any] = []
        self._wrapped: list[nn.Module] = []

    # -- sites ----------------------------------------------------------------------------------
    def activation_sites(self) -> list[str]:
        """Where activations are quantized: each projection's path, each fused experts' `path:in`
        (its input) and `path:mid` (its down projection's input)."""
        if not self.spec.activations:
            return []
        return [*self.targets.linears, *(f"{p}:{s}" for p in self.targets.experts for s in ("in", "mid"))]

    def kv_sites(self) -> list[str]:
        return [f"{a}.{proj}:out" for a, projs in self.targets.kv.items() for proj, _ in projs]

    def missing(self) -> list[str]:
        """The sites that need a static scale and have none yet."""
        static = self.activation_sites() if self.spec.activations == "static" else []
        return [s for s in (*static, *self.kv_sites()) if s not in self.scales]

    # -- weights --------------------------------------------------------------------------------
    @torch.no_grad()
    def quantize_unit(self, module: nn.Module, path: str) -> None:
        """The weights of one loaded unit (`path`, e.g. `model.layers.3`) through the scheme, in place."""
        if not self.weights:
            return
        spec, inside = self.spec, (lambda name: name == path or name.startswith(path + "."))
        for name, linear in self.targets.linears.items():
            if inside(name) and linear.weight.device.type != "meta":
                linear.weight.data = fake_quant(linear.weight.data, spec.weights, spec.block)
        for name, experts in self.targets.experts.items():
            if not inside(name):
                continue
            transposed = bool(getattr(experts, "is_transposed", False))
            for pname, p in expert_weights(experts).items():
                if p.device.type != "meta":
                    halves = "gate_up" in pname and bool(getattr(experts, "is_concatenated", True))
                    p.data = quantize_expert_weight(p.data, spec, transposed, halves)

    # -- activations and K/V --------------------------------------------------------------------
    def activation(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """`x` at `site` through the activation scheme (while calibrating: seen, left as it is)."""
        if self._amax is not None:
            self._see(site, x)
            return x
        spec = self.spec
        if spec.activations == "static" and site in self.scales:
            return fake_quant_activation(x, "static", scale=self.scales[site], int8=spec.int8)
        how = spec.activations if spec.activations != "static" else "dynamic-tensor"  # a site no forward reached
        group = spec.group if how == "dynamic-token" else None
        return fake_quant_activation(x, how, group=group, int8=spec.int8)

    def _see(self, site: str, x: torch.Tensor) -> None:
        assert self._amax is not None
        if x.is_floating_point() and x.numel():
            a = x.detach().abs().amax().to(device="cpu", dtype=torch.float32)
            self._amax[site] = torch.maximum(self._amax[site], a) if site in self._amax else a

    def _pre_hook(self, site: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            return (self.activation(args[0], site), *args[1:]) if args else None

        return hook

    def _kv_hook(self, site: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, out: Any) -> Any:
            if not isinstance(out, torch.Tensor):
                return None
            if self._amax is not None:
                self._see(site, out)
                return None
            scale = self.scales.get(site)
            return fake_quant_activation(out, "static" if scale is not None else "dynamic-tensor", scale=scale)

        return hook

    def _wrap_experts(self, path: str, module: nn.Module) -> None:
        """The experts' forward with its input through the scheme, and its down projection's input too."""
        forward = module.forward

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if args:
                args = (self.activation(args[0], f"{path}:in"), *args[1:])
            elif "hidden_states" in kwargs:
                kwargs["hidden_states"] = self.activation(kwargs["hidden_states"], f"{path}:in")
            down = {p.untyped_storage().data_ptr() for n, p in expert_weights(module).items() if "down" in n}
            with _DownInputs(down, lambda x: self.activation(x, f"{path}:mid")):
                return forward(*args, **kwargs)

        module.forward = wrapped
        self._wrapped.append(module)

    def attach(self) -> None:
        """The activation and K/V hooks on the model (its weights are `quantize_unit`'s)."""
        if self.spec.activations:
            for path, linear in self.targets.linears.items():
                self._handles.append(linear.register_forward_pre_hook(self._pre_hook(path)))
            for path, experts in self.targets.experts.items():
                self._wrap_experts(path, experts)
        for attention, projs in self.targets.kv.items():
            module = self.model.get_submodule(attention)
            for proj, _ in projs:
                hook = self._kv_hook(f"{attention}.{proj}:out")
                self._handles.append(getattr(module, proj).register_forward_hook(hook))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._wrapped:
            with contextlib.suppress(AttributeError):
                del module.forward  # the class's own again
        self._wrapped.clear()

    # -- scales ---------------------------------------------------------------------------------
    def checkpoint_scales(self, keys: list[str], read: Callable[[str], torch.Tensor]) -> None:
        """The static activation scales (`input_scale`, `activation_scale`) and KV scales (`k_scale`,
        `v_scale`) a checkpoint holds for this model's sites (an experts module's: the largest of its
        experts'), each a per-tensor scale (the largest where a checkpoint keeps more)."""
        found: dict[str, list[str]] = {}
        if self.spec.activations == "static":
            for path in self.targets.linears:
                found[path] = [k for k in (path + s for s in SCALE_SUFFIXES) if k in keys]
            for path in self.targets.experts:
                own = [k for k in keys if k.startswith(path + ".") and k.endswith(SCALE_SUFFIXES)]
                mid = [k for k in own if any(w in k[len(path) :] for w in ("down", ".w2."))]
                found[f"{path}:mid"], found[f"{path}:in"] = mid, [k for k in own if k not in mid]
        for attention, projs in self.targets.kv.items():
            for proj, which in projs:
                names = ("k_scale", "v_scale") if which == "kv" else (f"{which}_scale",)
                found[f"{attention}.{proj}:out"] = [k for k in (f"{attention}.{n}" for n in names) if k in keys]
        for site, names in found.items():
            if names:
                values = [read(k).to(torch.float32).max() for k in names]
                self.scales[site] = torch.stack(values).max().clamp(min=_TINY)
                self.sources[site] = "checkpoint"

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[None]:
        """Inside: a forward on the golden's own inputs sets the scales still missing (the largest |value|
        at each site over the format's largest value); nothing is rounded but the weights."""
        self._amax = {}
        try:
            yield
        finally:
            amax, self._amax = self._amax, None
        kv = set(self.kv_sites())
        for site in self.missing():
            if site in amax:
                top = INT8_MAX if self.spec.int8 and site not in kv else FP8_MAX
                self.scales[site] = (amax[site] / top).clamp(min=_TINY)
                self.sources[site] = "computed"

    def describe_scales(self) -> list[str]:
        """Where the static and KV scales came from, a phrase each (none for dynamic activations)."""
        said = []
        if self.spec.activations == "static":
            sites = self.activation_sites()
            said.append(_sources("static activation scales", sites, self.sources, "input_scale", "inputs"))
        if self.spec.kv:
            said.append(_sources("K/V scales", self.kv_sites(), self.sources, "k_scale / v_scale", "K / V"))
        return said

    def to_dict(self) -> dict[str, Any]:
        """What the manifest and reports keep of the emulation."""
        return {
            "spec": self.spec.name,
            "describe": self.spec.describe(),
            "weights": "quantized as each layer loads"
            if self.weights
            else "the checkpoint's own (already in the scheme)",
            "scales": self.describe_scales(),
            "sites": {
                "projections": len(self.targets.linears),
                "experts": len(self.targets.experts),
                "kv": len(self.kv_sites()),
            },
        }


def _sources(what: str, sites: list[str], sources: dict[str, str], name: str, of: str) -> str:
    ours = sum(sources.get(s) == "checkpoint" for s in sites)
    computed = sum(sources.get(s) == "computed" for s in sites)
    rest = len(sites) - ours - computed
    text = (
        f"{what}: {ours} of {len(sites)} from the checkpoint's {name}, {computed} computed from the golden's own "
        f"{of} (the largest |value| over its prompt / the format's largest)"
    )
    return text + (f", {rest} dynamic per tensor (no forward reached them)" if rest else "")
