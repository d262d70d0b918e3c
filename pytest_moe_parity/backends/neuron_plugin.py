"""`--hw dump` on a vLLM Neuron plugin capture (`dump.neuron_plugin`): the golden's layout it is read in,
and the plugin's own acceptance terms (`judge.neuron_terms`) computed at each point beside the verdict,
where the plugin's capture of the HF reference run in the candidate's dtype is given
(`--hw-option expected=DIR`: its "BF16 CPU" run, the middle one of its three)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dump.neuron_plugin import Layout
from ..dump.reader import DumpDir, DumpError, PointNotDumped
from ..errors import PointUnavailable
from ..golden import GoldenStore
from ..golden.spec import spec_tensor_keys
from ..judge import neuron_terms
from ..points import LOGITS, ROUTER, Point
from ..report.neuron_terms import KEY, closing_line
from ..tree import leaves
from . import CandidateOutput

EXPECTED_HELP = (
    "a vLLM Neuron plugin capture: its capture of the HF reference run in the candidate's dtype (the plugin's "
    "'expected', e.g. BF16 on CPU), with which each point shows the plugin's own acceptance terms (sigma-ratio, "
    "Bhattacharyya coefficient, L-inf and L2 ratios; logit validation) beside its verdict"
)


def plugin_layout(golden: GoldenStore, batch: int) -> Layout:
    """The golden's prompts, their length, its decode steps and each module's prefill output shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for point in golden.points:
        entry = golden.entry(point)
        key = next(spec_tensor_keys(entry["output"]), None) if point.step is None and entry.get("output") else None
        if key is not None and point.module and point.module not in shapes:
            shapes[point.module] = tuple(entry["tensors"][key]["shape"])
    return Layout(batch, golden.prefill_tokens, tuple(golden.recorded_steps), shapes, golden.padded)


def _first(output: Any) -> torch.Tensor | None:
    return next((t for t in leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "nan"
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


class PluginTerms:
    """The plugin's terms at each point: baseline the golden's output, expected the `expected` capture's,
    actual the candidate's, each as the golden's layout."""

    def __init__(self, backend: Any, root: str | None, layout: Layout):  # backend: a DumpBackend
        self.backend = backend
        self.expected: DumpDir | None = None
        self.batch = layout.batch
        if root:
            self.expected = DumpDir(root, backend.hw_options["map"], backend.golden.model_type, layout)
            if self.expected.plugin is None:
                raise DumpError(f"--hw-option expected={root} is not a vLLM Neuron plugin capture (dp0/prefill_s*/...)")

    def check(self, point: Point) -> None:
        """A point the golden records several tensors of (the rotary table's cos and sin), but a router: the
        plugin's hook keeps a module's first output only, so it is not in its capture."""
        if self.backend.dump.plugin is None or point.component == ROUTER:
            return
        entry = self.backend.golden.entry(point)
        held = len(list(spec_tensor_keys(entry["output"]))) if entry.get("output") else 0
        if held > 1 and self.backend.dump.locate(point) is not None:
            raise PointNotDumped(
                f"{point.id}: the vLLM Neuron plugin's capture hook keeps a module's first output only "
                f"(tensor_capture.register_capture_hooks: output[0]); {point.module} gives {held} tensors"
            )

    def add(self, point: Point, out: CandidateOutput) -> None:
        """The terms of `point` in `out.info[KEY]`, or a note saying why there are none. The golden's output
        (which a backend's call is not shown) is read here for these figures only, after the candidate's
        output is made: it feeds nothing but them."""
        if self.expected is None:
            return
        try:
            expected = _first(self.backend._read(self.expected, point).output)
        except PointUnavailable as exc:
            out.info.setdefault("notes", []).append(f"the plugin's terms: not computed ({exc})")
            return
        baseline, actual = _first(self.backend.golden.load(point).output), _first(out.output)
        if baseline is None or expected is None or actual is None:
            return
        if not baseline.shape == expected.shape == actual.shape:
            shapes = ", ".join(str(list(t.shape)) for t in (baseline, expected, actual))
            out.info.setdefault("notes", []).append(f"the plugin's terms: not computed (shapes {shapes})")
            return
        out.info[KEY] = _json(self.terms(point, baseline, expected, actual))

    def terms(self, point: Point, baseline: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> dict:
        b, e, a = (self._tokens(t) for t in (baseline, expected, actual))
        if point.component != LOGITS:
            return {"module": neuron_terms.module_terms(b, e, a)}
        # the plugin validates the logits of generated tokens: the prefill's last position (token 0), then
        # each decode step's; its tensor compare keeps lm_head's last position too (TAKE_LAST_MODULES)
        last = [t.reshape(self.batch, -1, t.shape[-1])[:, -1] for t in (baseline, expected, actual)]
        return {
            "module": neuron_terms.module_terms(*last),
            "logit": neuron_terms.logit_terms(*last),
            "gen_token": 0 if point.step is None else point.step,
        }

    def _tokens(self, t: torch.Tensor) -> torch.Tensor:
        """`[tokens, *rest]` flattened to `[tokens, features]`: each token one input."""
        lead = 2 if t.dim() > 2 and t.shape[0] == self.batch else 1
        return t.flatten(0, lead - 1).flatten(1) if t.dim() > lead else t.reshape(-1, 1)

    def closing_lines(self, rows: list[dict[str, Any]]) -> list[str]:
        lines = [self.backend.dump.plugin.describe()] if self.backend.dump.plugin is not None else []
        if self.backend.dump.plugin is not None and self.expected is None:
            lines.append(
                "the vLLM Neuron plugin's acceptance terms: not computed; pass --hw-option expected=DIR (moe-parity "
                "compare: --expected DIR), the plugin's capture of the HF reference run in the candidate's dtype"
            )
        said = closing_line(rows)
        return lines + ([said] if said else [])
