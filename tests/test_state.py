"""`--parity-state reused|prefix|DIR`: the same prompt in another serving state of the candidate against its
own clean run, point by point. Stateful ports as third-party backends (`state_ports`): the right one passes
every item in both states; a slot that keeps stale keys and values and a prefix cache keyed by the prefix's
length alone each fail their `::state` item first at layer 0's attention (and at each point whose module
runs an attention: the layers' outputs, the later layers' attention), naming the slot or the cache entry and
the rows, while every point item passes (their clean runs are right). Dumps of the prompt under two states
(`--hw dump`, `DIR`); a backend without state skips its items with one reason; bad input is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import state_ports
import torch
from helpers import read_json, run_parity, usage_error

from pytest_moe_parity import backends
from pytest_moe_parity.golden import GoldenStore

pytestmark = pytest.mark.usefixtures("_import_everything_once")

PORTS = {p.name: p for p in (state_ports.ServingPort, state_ports.StaleSlotPort, state_ports.PrefixKeyPort)}
# the points whose module runs an attention (where a state of the attention's caches can show)
ATTENDING = ("attention", "output")


@pytest.fixture
def ports(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, cls in PORTS.items():
        monkeypatch.setitem(backends.registry(), name, cls)


def _rows(report: Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_json(report / "comparison_report.json")["points"]}


@pytest.mark.parametrize(
    ("port", "state", "said"),
    [
        ("serving-port", "reused", None),
        ("serving-port", "prefix", None),
        ("stale-slot-port", "reused", "after another request (16 rows) in slot 0"),
        ("prefix-key-port", "prefix", "on a prefix-cache hit of rows 0-7 in slot 0, written by request 0"),
    ],
)
def test_a_stateful_port_fails_its_state_items_where_the_state_changes_it(
    ports, pytester: pytest.Pytester, golden_dir, port: str, state: str, said: str | None
) -> None:
    golden = golden_dir("qwen3_moe", 2)
    report = pytester.path / "report"
    result = run_parity(pytester, golden, "--hw", port, "--parity-state", state, "--parity-report", str(report))
    rows = _rows(report)
    points = GoldenStore(golden).point_ids
    assert all(rows[p]["status"] == "passed" for p in points), [p for p in points if rows[p]["status"] != "passed"]
    failed = [r for r in rows if rows[r]["status"] == "failed"]
    if said is None:
        result.assert_outcomes(passed=2 * len(points))
        result.stdout.fnmatch_lines(["first divergence: none"])
        return
    attending = [f"{p}::state" for p in points if p.rpartition(".")[2] in ATTENDING]
    assert failed == attending and failed[0] == "layer_0.attention::state", failed
    result.assert_outcomes(passed=2 * len(points) - len(attending), failed=len(attending))
    first = rows["layer_0.attention::state"]
    assert first["said"] == said and first["figures"]["rows"] == list(range(16))
    assert first["figures"]["clean_vs_golden"] < 1e-5 < first["figures"]["state_vs_golden"]
    result.stdout.fnmatch_lines(
        [f"layer_0.attention::state: the state alone changes it: {said}, its output differs from its clean run's "
         "at tokens 0-15: rel_l2 *",
         f"first divergence: layer_0.attention::state  (the serving state ({said}): *"]
    )  # fmt: skip
    read = {  # the cache rows its queries read: the stale ones, then its own after them; another prefix's 8
        "stale-slot-port": "its keys differ at cache rows 0-31, its values at 0-31 (it read 32 cache rows, its clean "
        "run 16)",
        "prefix-key-port": "its keys differ at cache rows 0-7, its values at 0-7",
    }[port]
    assert first["notes"][0].endswith(read), first["notes"]


def test_a_backend_without_state_skips_its_items_with_one_reason(pytester: pytest.Pytester, golden_dir) -> None:
    result = run_parity(pytester, golden_dir("qwen3_moe", 2), "--parity-state", "prefix", "-k", "layer_0", "-rs")
    outcomes = result.parseoutcomes()
    assert outcomes["skipped"] == outcomes["passed"] and not outcomes.get("failed"), outcomes
    result.stdout.fnmatch_lines(
        ["*--parity-state prefix: its items are skipped: the cpu backend runs each call afresh: it holds no cache *",
         "*layer_0.attention::state*the cpu backend runs each call afresh*"]
    )  # fmt: skip


# -- dumps of the prompt under two states ----------------------------------------------------------

DUMPED = {
    "embedding": "model.embed_tokens",
    "layer_{layer}.attention": "model.layers.{layer}.self_attn",
    "layer_{layer}.output": "model.layers.{layer}",
    "logits": "lm_head",
}


def _dump(model_dir: Path, ids: list[int], out: Path, stale: list[int] | None = None) -> Path:
    """The model's run of `ids`, dumped; with `stale`, in a cache that holds that other request's keys and
    values first (a reused slot): the prompt at its own positions, its queries reading the stale rows too."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from pytest_moe_parity.dump import record
    from pytest_moe_parity.model.calls import cache_kwarg

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = torch.tensor([ids])
    cache, name = None, cache_kwarg(model)
    with torch.no_grad():
        if stale is not None:
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([stale]), use_cache=True, **{name: cache})
        with record(model, out, DUMPED):
            positions = torch.arange(len(ids))[None]
            model(input_ids=prompt, position_ids=positions, use_cache=cache is not None, **{name: cache})
    return out


def test_dumps_of_the_prompt_under_two_states(pytester: pytest.Pytester, golden_dir, tiny_model, tmp_path) -> None:
    model, golden = tiny_model("qwen3_moe", 2), golden_dir("qwen3_moe", 2)
    ids = GoldenStore(golden).manifest["inputs"]["input_ids"]
    ids = ids[0] if isinstance(ids[0], list) else ids
    clean = _dump(model, ids, tmp_path / "clean")
    again = _dump(model, ids, tmp_path / "again")
    stale = _dump(model, ids, tmp_path / "stale", stale=ids[::-1])
    args = ("--hw", "dump", "-k", "state")
    result = run_parity(pytester, golden, *args, "--parity-state", str(again), model=clean)
    points = len(GoldenStore(golden).point_ids)
    result.assert_outcomes(passed=6, skipped=points - 6)  # the dumped points' state items; the others are not dumped
    result = run_parity(pytester, golden, *args, "--parity-state", str(stale), model=clean)
    # a dump is a whole run: from layer 0's attention on, every dumped output reads the stale rows' effect
    result.assert_outcomes(passed=1, failed=5, skipped=points - 6)
    result.stdout.fnmatch_lines(
        [f"layer_0.attention::state: the state alone changes it: in the dump {stale}, its output differs from its "
         "clean run's at tokens 0-15: rel_l2 *", "first divergence: layer_0.attention::state*"]
    )  # fmt: skip
    # bad input: one line each, exit 4
    other = _dump(model, ids[1:] + ids[:1], tmp_path / "other")
    usage_error(
        run_parity(pytester, golden, *args, "--parity-state", str(other), model=clean),
        f"--parity-state {other}: {other} is a dump of another prompt: its embedding differs from the candidate's",
    )
    usage_error(
        run_parity(pytester, golden, "--parity-state", str(stale)),
        f"--parity-state {stale}: a dump under another state is judged against the prompt's clean run dumped the "
        "same way, and the cpu backend runs the candidate afresh (no dump): pass the clean run's dump as --hw dump",
    )
    usage_error(
        run_parity(pytester, golden, *args, "--parity-state", str(clean), model=clean),
        f"--parity-state {clean}: this is the candidate's own dump (--model)",
    )
    usage_error(
        run_parity(pytester, golden, "--parity-state", "stale"),
        "--parity-state stale: not a state: expected reused, prefix, or the directory of a dump of the golden's prompt",
    )
    usage_error(
        run_parity(pytester, golden, "--parity-state", str(tmp_path / "nowhere")),
        f"--parity-state {tmp_path / 'nowhere'}: not a directory",
    )
