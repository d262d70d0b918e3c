"""`--parity-state DIR` on NxDI's application route: NxDI's `NeuronQwen3MoeForCausalLM` on the CPU (its
`to_cpu` path, one KV-cache slot: batch_size 1, seq_ids [0]) serves the golden's prompt with its decode
tokens fed in (the context encoding and two token-generation steps, each written as NxDI's tensor capture):
first on a fresh cache (`clean`), then again after another request (the prompt reversed) held the same
slot (`reused`). `pytest --hw dump --model CLEAN --parity-state REUSED` judges the two captures point by
point: NxDI's own cache handling passes every item; a fault put into NxDI's KV-cache manager for one run
(a context encoding into a slot already written keeps its first rows: the earlier request's keys and
values) passes the context encoding's items, whose attention reads its own keys, and fails first at the
first decode step's attention, the first read of the cache. One application built for the module (about
1.5 s on 2 cores); each test serves three requests and runs one inner session (under 3 s)."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import read_json, run_parity
from test_real_capture_batch import modules_to_capture, upstream_notices

from pytest_moe_parity.backends import nxdi
from pytest_moe_parity.golden import GoldenStore
from pytest_moe_parity.report.files import REPORT_FILE

pytestmark = [upstream_notices[0], upstream_notices[1]]
STALE = 8  # the rows of a reused slot the faulty context encoding leaves as they were


class Served:
    """NxDI's application on the CPU with every module of the qwen3_moe capture table captured, and the
    golden's prompt served through NxDI's Hugging Face adapter with the golden's decode tokens fed in."""

    def __init__(self, model: Path, golden: GoldenStore):
        from neuronx_distributed.utils.tensor_capture import enable_tensor_capture
        from neuronx_distributed.utils.tensor_capture.registry import TensorRegistry
        from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig, TensorCaptureConfig
        from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter, load_pretrained_config

        table = nxdi.load_module_table("qwen3_moe")
        self.ids = torch.tensor(golden.manifest["inputs"]["input_ids"])
        self.forced = list(golden.manifest["decode"]["tokens"])
        longest = self.ids.shape[1] + len(self.forced) + 1
        hf_config = nxdi.nxdi_hf_config(model)
        capture = TensorCaptureConfig(modules_to_capture=modules_to_capture(hf_config.num_hidden_layers))
        with nxdi.upstream_warnings():
            # one model for the context encoding and token generation (to_cpu shares it, and its KV cache,
            # where the two take one length); the prompt is shorter than the bucket: NxDI pads it on the right
            # (its positions are then the cache's rows, as its token generation writes them)
            neuron_config = nxdi.resolve(table.neuron_config)(
                tp_degree=1, batch_size=1, max_context_length=longest, seq_len=longest, torch_dtype=torch.float32,
                padding_side="right", on_cpu=True, output_logits=True,
                on_device_sampling_config=OnDeviceSamplingConfig(do_sample=False, top_k=1),
                tensor_capture_config=capture,
            )  # fmt: skip
            config = nxdi.resolve(table.config)(neuron_config, load_config=load_pretrained_config(hf_config=hf_config))
            self.app = nxdi.resolve(table.application)(str(model), config)
            self.app.to_cpu()
            # as tests_neuron/test_real_capture_batch.py's nxdi_capture: the trace path's hook install, and the
            # registry configured again before each forward (NxDI clears it after each)
            captured = enable_tensor_capture(
                self.app.models[0].model, modules_to_capture=capture.modules_to_capture,
                max_tensors=capture.max_intermediate_tensors, capture_inputs=capture.capture_inputs,
            )  # fmt: skip
        for wrapper in self.app.models:
            wrapper.model = captured
        captured.register_forward_pre_hook(
            lambda module, args: TensorRegistry.get_instance().configure(
                enabled=True, modules=capture.modules_to_capture, max_tensors=capture.max_intermediate_tensors,
                capture_inputs=capture.capture_inputs,
            )
        )  # fmt: skip
        self.captured = captured
        self.adapter = HuggingFaceGenerationAdapter(self.app)
        run, forced = self.adapter.forward, self.forced  # the adapter's forward is the application's

        @functools.wraps(run)  # its signature: the keywords generate checks its own against
        def fed(*args, **kwargs):
            """The application's forward whose next token is the golden's decode token (its steps are of those)."""
            out = run(*args, **kwargs)
            if self.app._fed < len(forced):
                out.tokens = torch.full_like(out.tokens, forced[self.app._fed])
            self.app._fed += 1
            return out

        self.adapter.forward = fed

    def serve(self, ids: torch.Tensor, out: Path | None) -> list[int]:
        """One request in the slot: NxDI's capture of it written to `out` (None: not captured); its tokens."""
        from neuronx_distributed_inference.utils.tensor_capture_utils import get_tensor_capture_hook
        from transformers import GenerationConfig

        self.app._fed = 0
        if hasattr(self.app, "_tensor_capture_step"):  # NxDI counts capture steps across requests
            del self.app._tensor_capture_step
        hook = get_tensor_capture_hook(tensor_capture_save_dir=str(out)) if out else None
        with nxdi.upstream_warnings():
            made = self.adapter.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(self.forced) + 1,
                generation_config=GenerationConfig(do_sample=False, top_k=1, pad_token_id=0, eos_token_id=None),
                tensor_capture_hook=hook,
            )  # fmt: skip
        return made[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def served(t5: Path) -> Iterator[tuple[Served, GoldenStore]]:
    """The application, once for this module, in a one-rank gloo group on a file store."""
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.utils.tensor_capture import disable_tensor_capture

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as store:
        mp.setenv("NXD_CPU_MODE", "1")
        mp.delenv("WORLD_SIZE", raising=False)
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
        try:
            golden = GoldenStore(t5 / "qwen3_moe-golden")
            app = Served(t5 / "qwen3_moe-model", golden)
            try:
                yield app, golden
            finally:
                disable_tensor_capture(app.captured)
        finally:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def stale_rows_in_a_reused_slot() -> Iterator[None]:
    """NxDI's KV-cache manager writing a context encoding's keys and values into the cache, but leaving the
    first STALE rows of a slot an earlier request wrote (since the fault was put in) as they were (a slot's
    "written" mark not cleared): the first request is written right; a request in the slot after it keeps
    that request's first rows. Put back on exit."""
    from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager

    original = KVCacheManager.update_kv_by_layer_id
    written: set[tuple[int, int]] = set()

    def update(self, idx, is_for_context_encoding, *args, kvcache_buffer=None, **kwargs):
        before = [c[:, :, :STALE].clone() for c in self._fetch_cache(idx, kvcache_buffer)]
        k_cache, v_cache = original(self, idx, is_for_context_encoding, *args, kvcache_buffer=kvcache_buffer, **kwargs)
        if is_for_context_encoding:
            if (id(self), idx) in written:
                k_cache, v_cache = k_cache.clone(), v_cache.clone()
                k_cache[:, :, :STALE], v_cache[:, :, :STALE] = before
            written.add((id(self), idx))
        return k_cache, v_cache

    KVCacheManager.update_kv_by_layer_id = update
    try:
        yield
    finally:
        KVCacheManager.update_kv_by_layer_id = original


def state_rows(pytester: pytest.Pytester, golden: GoldenStore, clean: Path, other: Path) -> tuple[Any, list[dict]]:
    report = pytester.path / "r"
    result = run_parity(pytester, golden.root, "--hw", "dump", "--parity-state", str(other), "--parity-report",
                        str(report), model=clean)  # fmt: skip
    return result, sorted(read_json(report / REPORT_FILE)["points"], key=lambda r: r["order"])


def test_nxdi_s_application_in_a_reused_slot_gives_the_clean_run_s_output(
    served, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The prompt on a fresh cache, then after another request in the same slot: every point of the clean
    capture passes against the golden (decode steps too), and every item of the reused capture passes
    against the clean one (NxDI's context encoding rewrites the slot, its token generation masks the rest)."""
    app, golden = served
    clean, reused = tmp_path / "clean", tmp_path / "reused"
    assert app.serve(app.ids, clean)[: len(app.forced)] == app.forced
    app.serve(app.ids.flip(-1), None)
    app.serve(app.ids, reused)
    result, rows = state_rows(pytester, golden, clean, reused)
    judged = [r for r in rows if r["status"] != "skipped"]
    assert judged and all(r["status"] == "passed" for r in judged), [r["id"] for r in judged if r["status"] != "passed"]
    states = [r for r in judged if r["id"].endswith("::state")]
    assert len(states) == len(judged) // 2 and max(r["figures"]["state_vs_clean"] for r in states) == 0.0
    unavailable = {r["id"] for r in rows if r["status"] == "skipped"}  # the capture table's: rotary, logits
    assert unavailable and all(p.rsplit(".", 1)[-1].split("::")[0] in ("rotary", "logits") for p in unavailable)
    result.stdout.fnmatch_lines(["first divergence: none*"])


def test_a_reused_slot_s_stale_rows_fail_first_at_the_first_decode_step_s_attention(
    served, pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """NxDI's cache write keeping a reused slot's first rows, for the other request and the prompt after it:
    every point of the clean capture passes; the reused capture's context-encoding items pass (its attention
    reads its own keys, not the cache), and its state items fail first at the first decode step's attention,
    the first that reads the slot."""
    app, golden = served
    clean, reused = tmp_path / "clean", tmp_path / "reused"
    app.serve(app.ids, clean)
    with stale_rows_in_a_reused_slot():  # the other request written whole, the prompt after it not
        app.serve(app.ids.flip(-1), None)
        app.serve(app.ids, reused)
    from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager

    assert KVCacheManager.update_kv_by_layer_id.__module__ == KVCacheManager.__module__  # NxDI's own again
    result, rows = state_rows(pytester, golden, clean, reused)
    points = [r for r in rows if not r["id"].endswith("::state") and r["status"] != "skipped"]
    assert all(r["status"] == "passed" for r in points), [r["id"] for r in points if r["status"] != "passed"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and failed[0]["id"] == "step_1.layer_0.attention::state", [r["id"] for r in failed]
    first = rows.index(failed[0])
    assert all(r["status"] in ("passed", "skipped") for r in rows[:first])
    by_id = {r["id"]: r for r in rows}
    assert by_id["step_1.embedding::state"]["status"] == "passed"  # the decode token fed in: the same lookup
    assert failed[0]["figures"]["rows"] == [0] and failed[0]["figures"]["clean_vs_golden"] < 1e-5
    result.stdout.fnmatch_lines(["first divergence: step_1.layer_0.attention::state*"])
