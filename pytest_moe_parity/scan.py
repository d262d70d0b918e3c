"""`moe-parity scan`: find the prompt that shows a port's problem before recording a golden for it.

Each prompt is continued greedily by the reference (float32), then the reference, the reference in
the candidate's dtype (its own rounding: the noise floor) and the candidate each run once, teacher-
forced, on the prompt and that continuation, in padded batches. Every position predicts the next
token; per prompt the scan reports the first position whose next token really differs (a flip beyond
the golden's rounding, not a near-tie), the top-1 agreement, the worst position's KL divergence, and
the candidate's logits error against the reference's own error in that dtype (the noise ratio). A
prompt is beyond tolerance when a next token really flips or the noise ratio exceeds the noise
factor; the prompts are ranked worst first, and the worst can be recorded as goldens.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backends import Backend, BackendSetup, backend_class, parse_hw_options, registry
from .dtypes import dtype_name, json_safe
from .errors import BackendError, BadInput
from .judge.distance import rel_l2
from .judge.logits import compare_logits
from .judge.tolerances import default_tolerance
from .model.archs import plan_points
from .model.calls import cache_kwarg
from .points import LOGITS
from .record.prompts import Batch, Prompt, make_batch, prompt_ids, read_prompts
from .record.reference import load_checked_config, load_model, tokenizer_of

# A floor for the reference's own logits error: a reference whose low-precision run is exact (a
# candidate in float32) would make any difference an infinite ratio.
NOISE_FLOOR = 1e-7


@dataclass
class ScanPrompt:
    """One prompt of a scan: its name, kind (where it came from) and token ids."""

    name: str
    kind: str
    ids: list[int]
    preview: str


@dataclass
class PromptResult:
    """One prompt's figures (see the module docstring)."""

    name: str
    kind: str
    preview: str
    prompt_tokens: int
    tokens: list[int]  # the prompt and the reference's greedy continuation, as fed teacher-forced
    positions: int  # positions judged (each predicts the next token)
    first_difference: int | None  # the first position whose next token really differs (None: none)
    top1_agreement: float
    real_flips: int
    ties: int  # positions whose next token differs within rounding (a near-tie, or as the reference's own run)
    kl_max: float
    kl_worst_position: int | None
    rel_l2: float  # the candidate's logits against the reference's, over the judged positions
    noise_rel_l2: float  # the reference's own in the candidate's dtype
    noise_ratio: float
    beyond: bool = False
    why: list[str] = field(default_factory=list)
    golden: str | None = None  # --record-worst: the golden recorded for it

    def to_json(self) -> dict[str, Any]:
        return json_safe(asdict(self))


def builtin_prompts(tokenize: Callable[[str], list[int]] | None, vocab: int, context: int | None) -> list[ScanPrompt]:
    """A small set that exercises the usual breaking points: lengths around powers of two, repeated
    tokens, a long-range copy, and (with a tokenizer) numbers, code and several languages. Token-id
    prompts are drawn from a fixed seed, clear of the low ids where vocabularies keep special tokens."""
    gen = torch.Generator().manual_seed(0)
    low = min(4, max(vocab - 1, 0))

    def draw(n: int) -> list[int]:
        return torch.randint(low, max(vocab, low + 1), (n,), generator=gen).tolist()

    limit = (context or 4096) - 8
    prompts = [
        ScanPrompt(f"length_{n}", "length around 2^k", draw(n), f"{n} random ids")
        for n in (15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
    ]
    one, two = draw(1)[0], draw(2)
    prompts.append(ScanPrompt("repeat_one", "repeated tokens", [one] * 32, f"id {one} x32"))
    prompts.append(ScanPrompt("repeat_pair", "repeated tokens", two * 16, f"ids {two[0]}, {two[1]} x16"))
    seq = draw(24)
    prompts.append(ScanPrompt("copy_24", "long-range copy", seq + draw(8) + seq, "24 ids, 8 others, the 24 again"))
    if tokenize is not None:
        texts = {
            "numbers": ("numbers", "3.14159 2.71828 1.41421 1234567890 = 1,234,567,890; 7 x 8 = 56, 2^16 = 65536"),
            "code": ("code", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(20))"),
            "english": ("languages", "The quick brown fox jumps over the lazy dog while the cat sleeps."),
            "chinese": ("languages", "混合专家模型在推理时只激活一部分专家，因此移植时路由最容易出错。"),
            "french": ("languages", "Le modèle de mélange d'experts choisit deux experts pour chaque jeton."),
            "russian": ("languages", "Модель смеси экспертов выбирает двух экспертов для каждого токена."),
        }
        for name, (kind, text) in texts.items():
            ids = tokenize(text)
            if ids:
                prompts.append(ScanPrompt(name, kind, ids, Prompt(text=text).preview()))
    return [p for p in prompts if len(p.ids) <= limit]  # what fits the model's context with new tokens


def file_prompts(path: Path, tokenize: Callable[[str], list[int]] | None) -> list[ScanPrompt]:
    """The prompts of a `--prompts` file (text lines need the model's tokenizer)."""
    return [
        ScanPrompt(f"prompt_{n}", "file", prompt_ids(prompt, n, tokenize), prompt.preview())
        for n, prompt in enumerate(read_prompts(path))
    ]


def _by_length(rows: list[list[int]], batch_size: int) -> list[list[int]]:
    """Batches of row indices, rows of similar length together (the least padding)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def _padded(rows: list[list[int]], side: str = "right") -> Any:
    """Token-id rows as one padded batch (ids already checked against the vocabulary)."""
    return make_batch([Prompt(ids=tuple(r)) for r in rows], None, vocab=1 << 62, pad_id=0, padding_side=side)


def model_forward(model: Any, device: str) -> Callable[[Batch], torch.Tensor | None]:
    """A transformers causal LM's logits [B, T, V] on a padded batch (one forward, no cache)."""

    def forward(batch: Batch) -> torch.Tensor | None:
        with torch.no_grad():
            return model(**batch.tensors(device), use_cache=False).logits

    return forward


def _logits(
    forward: Callable[[Batch], torch.Tensor | None],
    rows: list[list[int]],
    batch_size: int,
    done: Callable[[int], None] = lambda n: None,
) -> list[torch.Tensor]:
    """Each row's logits [T_row, V] in float32, teacher-forced, `batch_size` rows of similar length per
    forward (padded on the right, with the attention mask and positions over the real tokens); `done`
    is told how many rows are through after each forward."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    finished = 0
    for chunk in _by_length(rows, batch_size):
        logits = forward(_padded([rows[i] for i in chunk]))
        if logits is None:
            raise BadInput("the candidate gives no logits (its forward returns none): scan needs a causal LM")
        for n, i in enumerate(chunk):
            out[i] = logits[n, : len(rows[i])].float().cpu()
        finished += len(chunk)
        done(finished)
    return out  # type: ignore[return-value]


def _continue(
    model: Any,
    prompts: list[ScanPrompt],
    new_tokens: int,
    device: str,
    batch_size: int,
    done: Callable[[int], None] = lambda n: None,
) -> list[list[int]]:
    """Each prompt followed by the reference's greedy continuation of `new_tokens - 1` tokens (the
    last new token is predicted, never fed), from batched forwards with a KV cache (left padding);
    `done` is told how many prompts are through after each batch."""
    if new_tokens <= 1:
        return [list(p.ids) for p in prompts]
    from transformers import DynamicCache

    sequences: list[list[int]] = [list(p.ids) for p in prompts]
    finished = 0
    for indices in _by_length(sequences, batch_size):
        chunk = [sequences[i] for i in indices]  # continued in place
        inputs = _padded(chunk, "left").tensors(device)
        mask, positions = inputs["attention_mask"], inputs["position_ids"]
        cache = DynamicCache(config=model.config)
        ids = inputs["input_ids"]
        with torch.no_grad():
            for _ in range(new_tokens - 1):
                step = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": True}
                logits = model(**step, **{cache_kwarg(model): cache}).logits
                token = logits[:, -1].float().argmax(-1, keepdim=True)
                for row, t in zip(chunk, token.flatten().tolist(), strict=True):
                    row.append(t)
                ids = token
                mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
                positions = positions[:, -1:] + 1
        finished += len(indices)
        done(finished)
    return sequences


def _judge(
    prompt: ScanPrompt, tokens: list[int], ref: torch.Tensor, low: torch.Tensor, cand: torch.Tensor, dtype, tol
) -> PromptResult:
    if cand.shape != ref.shape:
        raise BadInput(
            f"the candidate's logits for {prompt.name} are {tuple(cand.shape)}, the reference's {tuple(ref.shape)}: "
            "not the same vocabulary"
        )
    lm = compare_logits(ref, cand, dtype, tie_factor=tol.tie_factor)
    # a flip the reference's own run in that dtype makes too is its rounding, not a finding
    rounding = set(torch.nonzero(low.argmax(-1) != ref.argmax(-1)).flatten().tolist())
    flips = [t for t in lm.top1.flipped_tokens if t not in rounding]
    ties = len(lm.top1.ties) + len(lm.top1.flipped_tokens) - len(flips)
    rel, noise = rel_l2(cand.double(), ref.double()), rel_l2(low.double(), ref.double())
    ratio = rel / max(noise, NOISE_FLOOR)
    worst = lm.kl_worst[0][0] if lm.kl_worst else None
    result = PromptResult(
        name=prompt.name, kind=prompt.kind, preview=prompt.preview, prompt_tokens=len(prompt.ids), tokens=tokens,
        positions=ref.shape[0], first_difference=min(flips) if flips else None, top1_agreement=lm.top1_agreement,
        real_flips=len(flips), ties=ties, kl_max=lm.kl_max, kl_worst_position=worst, rel_l2=rel,
        noise_rel_l2=noise, noise_ratio=ratio,
    )  # fmt: skip
    if flips:
        result.why.append(f"the next token really differs at {len(flips)} position(s), first at {min(flips)}")
    if ratio > tol.noise_factor:
        own = f"the reference's own in {dtype_name(dtype)}"
        result.why.append(f"logits error {ratio:.3g}x {own} (> {tol.noise_factor})")
    result.beyond = bool(result.why)
    return result


def rank(results: list[PromptResult]) -> list[PromptResult]:
    """Worst first: beyond tolerance before within, then by noise ratio, then by the worst KL."""
    return sorted(results, key=lambda r: (not r.beyond, -_finite(r.noise_ratio), -_finite(r.kl_max)))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e300


INPUTS_FILE = "inputs.jsonl"


def whole_model_backend_class(name: str, options: Sequence[str]) -> type[Backend]:
    """The backend `name`, checked before any run: it exists, has a whole-model run and takes these
    options (BadInput in one line otherwise)."""
    backends = registry()
    if name not in backends:
        raise BadInput(f"--hw {name!r} is not a known backend; available: {', '.join(sorted(backends))}")
    try:
        cls = backend_class(name)
        cls.parse_options(parse_hw_options(options))
    except (ValueError, BackendError) as exc:
        raise BadInput(str(exc) if str(exc).startswith("--") else f"--hw {name}: {exc}") from None
    if cls.chain_kind != "model":
        raise BadInput(
            f"--hw {name} has no whole-model run (its chain is {cls.chain_kind or 'none'}): scan runs a backend whose "
            "chain_kind is 'model' (cpu, cuda); for another port, --write-inputs DIR, then --logits DIR"
        )
    return cls


def whole_model_backend(
    name: str, options: Sequence[str], candidate: Path, dtype: torch.dtype, trust_remote_code: bool
) -> Backend:
    """The backend `name` built on the candidate checkpoint for its whole-model run, with no golden
    (`BackendSetup.golden` is None: a scan has none); BadInput in one line where it cannot be."""
    cls = whole_model_backend_class(name, options)
    try:
        setup = BackendSetup(None, candidate, dtype, options=parse_hw_options(options),  # type: ignore[arg-type]
                             trust_remote_code=trust_remote_code)  # fmt: skip
        backend = cls(setup)
        backend.start()
    except (ValueError, BackendError) as exc:
        raise BadInput(str(exc) if str(exc).startswith("--") else f"--hw {name}: {exc}") from None
    except AttributeError as exc:
        raise BadInput(f"--hw {name} cannot be built without a golden ({exc}); scan it with --write-inputs DIR, "
                       "then --logits DIR") from None  # fmt: skip
    return backend


@dataclass
class ScanRequest:
    """A scan, as `moe-parity scan` is asked for it; `run()` checks it first (BadInput). The candidate
    is a checkpoint (`candidate_dir`, run with transformers here) or the logits a port wrote per prompt
    (`logits_dir`, for the sequences `write_inputs` wrote there)."""

    model_dir: Path
    candidate_dir: Path | None = None
    prompts: Path | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    new_tokens: int = 8
    batch_size: int = 8
    trust_remote_code: bool = False
    logits_dir: Path | None = None
    hw: str | None = None  # the candidate checkpoint run through this backend's whole-model run
    hw_options: Sequence[str] = ()  # its --hw-option KEY=VALUE settings

    def _check(self) -> tuple[torch.dtype, Any]:
        from .dtypes import parse_dtype

        try:
            dtype = parse_dtype(self.dtype)
        except ValueError:
            raise BadInput(f"--dtype {self.dtype!r} is not a torch dtype (e.g. float32, bfloat16)") from None
        if self.new_tokens < 1 or self.batch_size < 1:
            raise BadInput("--new-tokens and --batch-size must be at least 1")
        config = load_checked_config(self.model_dir, trust_remote_code=self.trust_remote_code)
        if self.candidate_dir is not None:
            load_checked_config(self.candidate_dir, trust_remote_code=self.trust_remote_code)
        if self.hw is not None:
            if self.candidate_dir is None:
                raise BadInput(
                    f"--hw {self.hw} runs the --candidate checkpoint; --write-inputs and --logits are for a port run "
                    "elsewhere: drop one"
                )
            whole_model_backend_class(self.hw, self.hw_options)  # before anything runs
        return dtype, config

    def _prompts(self, config: Any) -> list[ScanPrompt]:
        tokenize, _ = tokenizer_of(self.model_dir, trust_remote_code=self.trust_remote_code)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        context = getattr(config, "max_position_embeddings", None)
        prompts = file_prompts(self.prompts, tokenize) if self.prompts else builtin_prompts(tokenize, vocab, context)
        for p in prompts:
            bad = [i for i in p.ids if not 0 <= i < vocab]
            if bad:
                raise BadInput(f"{p.name} has token ids {bad[:5]} outside the vocabulary of {vocab} tokens")
            if isinstance(context, int) and len(p.ids) + self.new_tokens > context:
                raise BadInput(
                    f"{p.name}: {len(p.ids)} tokens and {self.new_tokens} new ones reach past the model's context of "
                    f"{context} (max_position_embeddings): shorten it or ask for fewer --new-tokens"
                )
        return prompts

    def _load(self, path: Path, dtype: torch.dtype) -> Any:
        load = dict(device=self.device, device_map=None, max_memory=None, trust_remote_code=self.trust_remote_code)
        return load_model(path, dtype=dtype, **load)

    def _candidate(self, dtype: torch.dtype, plan: Any) -> tuple[Callable[[Batch], torch.Tensor | None], Callable]:
        """How the candidate gives logits (and how it is let go): its checkpoint loaded here with
        transformers, or, with `hw`, that backend's whole-model run (`Backend.run_model`) on it."""
        if self.hw is None:
            candidate = self._load(self.candidate_dir, dtype)
            return model_forward(candidate, self.device), lambda: None
        backend = whole_model_backend(self.hw, self.hw_options, self.candidate_dir, dtype, self.trust_remote_code)
        logits = next((p for p in plan.points if p.component == LOGITS), None)
        if logits is None:
            raise BadInput(f"{self.model_dir}: no logits point found in its architecture; scan it without --hw")

        def forward(batch: Batch) -> torch.Tensor | None:
            t = batch.tensors("cpu")
            padding = {"attention_mask": t["attention_mask"], "position_ids": t["position_ids"]}
            try:
                out = backend.run_model(t["input_ids"], [logits], padding=padding)
            except BackendError as exc:
                raise BadInput(f"--hw {self.hw}: {exc}") from None
            value = out.get(logits.id)
            return value[0] if isinstance(value, tuple | list) else value

        return forward, backend.close

    def write_inputs(self, out: Path, say: Callable[[str], None] = lambda msg: None) -> Path:
        """The teacher-forced sequences (each prompt and the reference's continuation), one JSON line
        per prompt in `out/inputs.jsonl`, for a port to run and write its logits beside them."""
        _, config = self._check()
        prompts = self._prompts(config)
        sequences = _continue(self._load(self.model_dir, torch.float32), prompts, self.new_tokens, self.device,
                              self.batch_size)  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"name": p.name, "kind": p.kind, "preview": p.preview, "prompt_tokens": len(p.ids), "ids": seq})
            for p, seq in zip(prompts, sequences, strict=True)
        ]
        path = out / INPUTS_FILE
        path.write_text("\n".join(lines) + "\n")
        say(f"scan: {len(prompts)} sequences -> {path}; run the port on each line's ids (one forward, no cache) and "
            f"save its logits [tokens, vocabulary] as {out}/<name>.safetensors (key 'logits') or <name>.pt, then "
            f"`moe-parity scan --model {self.model_dir} --logits {out}`")  # fmt: skip
        return path

    def _written(self) -> tuple[list[ScanPrompt], list[list[int]]]:
        """The prompts and sequences `write_inputs` wrote in `logits_dir`."""
        path = Path(self.logits_dir) / INPUTS_FILE
        if not path.is_file():
            raise BadInput(
                f"--logits {self.logits_dir} has no {INPUTS_FILE}: write the sequences first with "
                f"`moe-parity scan --model {self.model_dir} --write-inputs {self.logits_dir}`"
            )
        prompts, sequences = [], []
        for line in filter(str.strip, path.read_text().splitlines()):
            entry = json.loads(line)
            ids = [int(i) for i in entry["ids"]]
            prompts.append(ScanPrompt(entry["name"], entry.get("kind", "file"), ids[: entry["prompt_tokens"]],
                                      entry.get("preview", entry["name"])))  # fmt: skip
            sequences.append(ids)
        return prompts, sequences

    def _port_logits(self, prompts: list[ScanPrompt], sequences: list[list[int]]) -> list[torch.Tensor]:
        """The logits the port wrote per prompt, [T, V] (a leading batch of one, and positions past the
        sequence, e.g. a bucket's padding, are dropped)."""
        from .dump.reader import DumpError, load_pt

        out = []
        for p, seq in zip(prompts, sequences, strict=True):
            base = Path(self.logits_dir) / p.name
            found = [f for f in (base.with_suffix(".safetensors"), base.with_suffix(".pt")) if f.is_file()]
            if not found:
                raise BadInput(f"--logits {self.logits_dir}: no logits for {p.name} ({p.name}.safetensors or .pt)")
            if found[0].suffix == ".pt":
                try:
                    value = load_pt(found[0])
                except DumpError as exc:
                    raise BadInput(str(exc)) from None
            else:
                from safetensors.torch import load_file

                tensors = load_file(str(found[0]))
                value = tensors.get("logits", next(iter(tensors.values()), None))
            logits = value if isinstance(value, torch.Tensor) else next(iter(value), None) if value else None
            if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3) or logits.shape[-2] < len(seq):
                shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(value).__name__
                raise BadInput(
                    f"--logits {found[0]} holds {shape}, not logits [tokens, vocabulary] for {p.name}'s {len(seq)} "
                    "tokens; save the port's logits of one forward over the line's ids"
                )
            out.append(logits.reshape(-1, logits.shape[-2], logits.shape[-1])[0, : len(seq)].float())
        return out

    def run(self, say: Callable[[str], None] = lambda msg: None) -> list[PromptResult]:
        dtype, config = self._check()
        started = time.perf_counter()
        if self.logits_dir is not None:
            prompts, sequences = self._written()
            cand_logits = self._port_logits(prompts, sequences)
            what = f"the logits in {self.logits_dir}"
        else:
            prompts = self._prompts(config)
            what = f"candidate {self.candidate_dir}" + (f" (--hw {self.hw})" if self.hw else "")
        source = f"{self.prompts}" if self.prompts else self.logits_dir or "the built-in set"
        say(f"scan: {len(prompts)} prompts from {source}, {self.new_tokens} new tokens each, {what} in "
            f"{dtype_name(dtype)} against {self.model_dir} (float32)")  # fmt: skip
        total = len(prompts)

        def progress(stage: str) -> Callable[[int], None]:
            return lambda n: say(f"  {stage}: {n}/{total} prompts [{time.perf_counter() - started:.1f}s]")

        reference = self._load(self.model_dir, torch.float32)
        if self.logits_dir is None:
            sequences = _continue(reference, prompts, self.new_tokens, self.device, self.batch_size,
                                  progress("the reference's continuation"))  # fmt: skip
        ref_logits = _logits(model_forward(reference, self.device), sequences, self.batch_size,
                             progress("the reference (float32)"))  # fmt: skip
        plan = plan_points(reference) if self.hw is not None else None
        del reference
        low = self._load(self.model_dir, dtype)
        low_logits = _logits(model_forward(low, self.device), sequences, self.batch_size,
                             progress(f"the reference ({self.dtype})"))  # fmt: skip
        del low
        if self.logits_dir is None:
            forward, close = self._candidate(dtype, plan)
            try:
                cand_logits = _logits(forward, sequences, self.batch_size, progress("the candidate"))
            finally:
                close()
                del forward  # the candidate with it
        tol = default_tolerance(dtype, LOGITS)
        results = []
        for i, (p, seq) in enumerate(zip(prompts, sequences, strict=True)):
            r = _judge(p, seq, ref_logits[i], low_logits[i], cand_logits[i], dtype, tol)
            results.append(r)
            flag = "BEYOND" if r.beyond else "ok"
            first = r.first_difference if r.first_difference is not None else "-"
            say(f"  [{i + 1}/{len(prompts)}] {p.name:<14} {flag:<6} first difference {first}, top-1 "
                f"{r.top1_agreement:.1%}, worst KL {r.kl_max:.3g}, noise ratio {r.noise_ratio:.3g}")  # fmt: skip
        say(f"scan: {time.perf_counter() - started:.1f} s")
        return rank(results)


def table(results: list[PromptResult]) -> list[str]:
    """The ranked table, worst first."""
    lines = [f"{'rank':>4}  {'prompt':<14} {'verdict':<7} {'first diff':>10} {'top-1':>7} {'worst KL':>10} "
             f"{'noise ratio':>11}  prompt text"]  # fmt: skip
    for n, r in enumerate(results, 1):
        first = str(r.first_difference) if r.first_difference is not None else "-"
        lines.append(
            f"{n:>4}  {r.name:<14} {'BEYOND' if r.beyond else 'ok':<7} {first:>10} {r.top1_agreement:>7.1%} "
            f"{r.kl_max:>10.3g} {r.noise_ratio:>11.3g}  {r.preview}"
        )
    lines.append(
        "first diff: the first position (from the prompt's first token, 0-based) whose next token really differs; "
        "worst KL: the largest per-position KL divergence from the reference's next-token distribution, in nats "
        "(reported, not judged); noise ratio: the logits' rel_l2 over the reference's own in the dtype"
    )
    return lines


def write_json(path: Path, results: list[PromptResult], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**meta, "prompts": [r.to_json() for r in results]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def plot(path: Path, results: list[PromptResult], limit: float | None = None) -> None:
    """A ranked bar chart of the noise ratios (beyond tolerance in red; `limit`: the noise factor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(results) + 2), 4))
    values = [_finite(r.noise_ratio) for r in results]
    ax.bar(range(len(results)), values, color=["#c0392b" if r.beyond else "#7f8c8d" for r in results])
    ax.set_yscale("log")
    if limit is not None:
        ax.axhline(limit, color="#c0392b", linestyle="--", linewidth=1, label=f"noise factor {limit:g}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(range(len(results)), [r.name for r in results], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("logits error / the reference's own")
    ax.set_title("moe-parity scan: prompts ranked worst first (red: beyond tolerance)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def record_worst(
    model_dir: Path, out: Path, results: list[PromptResult], k: int, say, device: str = "cpu"
) -> list[Path]:
    """Goldens of the `k` worst prompts, one directory each (`out/01_<name>`): the prompt and the
    reference's continuation up to the first position whose next token differs (so the golden's last
    position is where it breaks), or the whole sequence."""
    from .record.run import GoldenRequest

    written = []
    for n, r in enumerate(results[:k], 1):
        end = r.first_difference + 1 if r.first_difference is not None else len(r.tokens)
        target = out / f"{n:02d}_{r.name}"
        GoldenRequest(model_dir, target, input_ids=r.tokens[:end], device=device).record()
        r.golden = str(target)
        say(f"  golden for {r.name} ({end} tokens) -> {target}")
        written.append(target)
    return written
