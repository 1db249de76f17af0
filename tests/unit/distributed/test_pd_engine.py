"""`generate --pd`: a prefill process and a decode process give the single-process engine's outputs,
token for token, on hybrid tiny checkpoints (Gemma 3: sliding-window and full attention; Qwen3-Next:
full attention and linear-attention state)."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace

import numpy as np
import pytest

from kvchain.cli import main
from kvchain.dist.pd_engine import _DecodeScheduler, generate_pd, received_request
from kvchain.dist.transfer import nixl_available
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.errors import InvariantError
from support.engine import PAGE, checkpoint_dir, tight_budget, workload, write_prompts

NIXL_MISSING = nixl_available()
CONFIG = EngineConfig(budget_bytes=8 * 2**20, page_size=PAGE, context_len=128, max_running=8, ignore_eos=True)


NIXL = pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(NIXL_MISSING is not None,
                                                                         reason=str(NIXL_MISSING))])


@pytest.mark.parametrize("kind", [NIXL, "gloo"])
def test_pd_outputs_are_the_single_process_engines(kind):
    """Qwen3-Next: without the state slot (or with a stale one) the decode diverges at once. NIXL
    writes the slot in place; gloo stages it, and the slot's copy runs on the forward stream that
    reads it next (PD-16)."""
    family = "qwen3_next"
    requests = workload(3, seed=3)
    path = checkpoint_dir(family)
    with Engine(path, CONFIG) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, CONFIG, requests, kind=kind, timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert all(len(o.token_ids) == r.max_new_tokens for o, r in zip(pd.outputs, requests))
    assert not mp.active_children()


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_linear", "zamba2", "deepseek_v32"])
def test_pd_moves_latents_kda_state_and_shared_attention_kv(family):
    """The decode node continues from what the prefill node sent: DeepSeek-V3's latents, Kimi
    Linear's KDA state beside its latents, Zamba2's Mamba2 state and its shared blocks' KV,
    DeepSeek-V3.2's indexer keys beside its latents."""
    requests = workload(3, seed=3)
    path = checkpoint_dir(family)
    with Engine(path, CONFIG) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, CONFIG, requests, kind="gloo", timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert not mp.active_children()


def test_generate_pd_on_the_command_line_matches_generate(tmp_path, capsys):
    """Gemma 3 over gloo, through `kvchain generate --pd`: without the window rows the decode
    diverges at once."""
    requests = workload(6, seed=3)
    prompts = write_prompts(tmp_path / "prompts.jsonl", requests)
    common = ["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts), "--json",
              "--ignore-eos", "--page-size", str(PAGE), "--context", "128", "--budget", "8MiB", "--max-running", "8"]
    outputs, stats = [], []
    for extra in ([], ["--pd", "--pd-engine", "gloo"]):
        assert main([*common, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        outputs.append([o["token_ids"] for o in out["outputs"]])
        stats.append(out["stats"])
    single, pd = outputs
    assert pd == single and all(len(o) == r.max_new_tokens for o, r in zip(pd, requests))
    # the run's figures are both nodes' (they were zeros): every decode step a forward, one at least
    # for the prefills, and the pools in use
    pd_stats = stats[1]
    assert pd_stats["forwards"] > pd_stats["steps"] > 0
    assert 0 < pd_stats["peak_utilisation"] <= 1
    assert pd_stats["output_tokens"] == stats[0]["output_tokens"]


def test_the_decode_node_decodes_while_other_prefills_are_in_flight():
    """Gemma 3 over gloo, prompts prefilled a chunk per step: the decode node starts each request's
    decode as soon as its hand-off arrives, so it has stepped before the last hand-off; outputs
    are still the single-process engine's."""
    config = replace(CONFIG, max_batched_tokens=48)
    requests = workload(6, seed=5)
    assert _same_outputs_and_overlapped(config, requests)["deferred_publication"] is False


def test_generate_pd_with_deferred_publication_matches_generate(monkeypatch):
    """PD-13 in the engine: with `KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH` on, the decode
    node (ThreadDevice, the overlap scheduler) publishes each take's ids in its next iteration;
    outputs are the single-process engine's."""
    monkeypatch.setenv("KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH", "1")
    report = _same_outputs_and_overlapped(replace(CONFIG, max_batched_tokens=48), workload(6, seed=5))
    assert report["deferred_publication"] is True


def _same_outputs_and_overlapped(config, requests) -> dict:
    path = checkpoint_dir("gemma3")
    with Engine(path, config) as engine:
        single = engine.generate(requests)
    report: dict = {}
    pd = generate_pd(path, config, requests, kind="gloo", timeout_s=120, report=report)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert 0 < report["overlapped_steps"] < report["decode_steps"], report
    assert not mp.active_children()
    return report


def test_deferred_publication_without_overlap_is_one_line_before_any_node_starts(monkeypatch, capsys):
    """PD-12 on the command line: the switch on with `--no-overlap` is refused in one line and exit
    2 before the prefill and decode processes start (none is left running)."""
    from kvchain.dist import pd_engine

    monkeypatch.setenv("KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH", "1")
    monkeypatch.setattr(pd_engine, "run_stage_processes", lambda *a, **k: pytest.fail("a PD node started"))
    path = checkpoint_dir("gemma3")
    capsys.readouterr()
    code = main(["generate", "--model-path", str(path), "--prompt", "ab", "--pd", "--pd-engine", "gloo",
                 "--no-overlap"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the overlap scheduler is off" in err, err
    assert not mp.active_children()


def _shared_prefix_requests(n: int) -> list:
    """`n` prompts on one 24-token prefix: after the first, each the prefill node matches."""
    shared = list(range(5, 29))
    return [GenerateRequest([*shared, 40 + i, 60 + i, 80 + i], 12) for i in range(n)]


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_the_prefill_node_reuses_cached_prefixes(family):
    """The prefill node keeps the prefix cache: a prompt whose prefix an earlier one left in the tree
    is prefilled from it, and its hand-off sends the whole row, the tree's pages with its own
    (Gemma 3's window rows of the prefix are the tree's: the offer names the pages a fresh row of
    its length keeps, which the decode node's take keeps too; naming the row's own, it was refused
    as not matching). Outputs are the single-process engine's."""
    requests = _shared_prefix_requests(4)
    config = replace(CONFIG, max_running=1)  # one at a time: each later prompt finds the prefix cached
    path = checkpoint_dir(family)
    with Engine(path, config) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, config, requests, kind="gloo", timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert all(o.finish_reason == "length" for o in pd.outputs)
    assert pd.stats.cached_tokens >= 3 * 20
    assert not mp.active_children()


def test_a_full_decode_node_holds_prefills_back_instead_of_refusing_them():
    """A decode node with room for two requests, nine handed to it: each offer it has no room for
    while it serves others is made again once one finishes (the prefill node keeps the row), so
    every request is served, none rejected."""
    requests = workload(9, seed=3)
    config = replace(CONFIG, max_running=2)
    path = checkpoint_dir("gemma3")
    with Engine(path, config) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, config, requests, kind="gloo", timeout_s=120)
    assert [o.finish_reason for o in pd.outputs] == ["length"] * 9
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert not mp.active_children()


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_a_decode_node_holds_back_only_what_its_requests_have_left_to_write(family):
    """A decode node whose budget holds one long request, twelve handed to it over the run: each
    request's growth is held back from later offers only while it still decodes. Held back for
    good once taken, the finished requests' outputs added up until the node refused offers with
    nothing running (requests rejected on both, 2 of 12 on Gemma 3) where one process served them all."""
    requests = workload(12, seed=5)
    config = replace(CONFIG, budget_bytes=tight_budget(family, 1), max_batched_tokens=48, checkpoint_interval=8)
    path = checkpoint_dir(family)
    with Engine(path, config) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, config, requests, kind="gloo", timeout_s=120)
    assert [o.finish_reason for o in single.outputs] == ["length"] * 12
    assert [o.finish_reason for o in pd.outputs] == ["length"] * 12
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert not mp.active_children()


def test_a_host_tier_behind_the_prefill_node():
    """`--pd --host-budget`: the prefill node's tree evicts to the host tier and loads back from it
    (Nemotron-H's state checkpoints with the attention pages); outputs are the single-process
    engine's."""
    family = "nemotron_h"
    requests = workload(9)
    config = replace(CONFIG, budget_bytes=tight_budget(family, 2), checkpoint_interval=8, max_running=2)
    path = checkpoint_dir(family)
    with Engine(path, config) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, replace(config, host_budget=4 * 2**20), requests, kind="gloo", timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert pd.stats.host_hits > 0 and pd.stats.host_loads > 0
    assert not mp.active_children()


def test_a_decode_node_that_cannot_grow_its_requests_raises_instead_of_retracting():
    """The decode node holds a received request's KV, not its prompt's ids: a retraction would
    recompute placeholders. Three received requests a pool for one cannot grow (what the
    preallocation check prevents) raise `pd.decode_retraction`; retracted, the request went back
    to the queue with a prompt of zeros."""
    config = replace(CONFIG, budget_bytes=tight_budget("gemma3", 1), max_batched_tokens=48)
    with Engine(checkpoint_dir("gemma3"), config) as engine:
        storage, pool = engine.storage, engine.pool
        scheduler = _DecodeScheduler(pool, max_batched_tokens=48, max_running=8)
        for rid, length in enumerate((40, 40, 40)):
            row = storage.alloc_row()
            storage.alloc_extend(np.array([row]), np.array([length]))
            storage.advance(np.array([row]))
            pool._known[rid] = 1
            scheduler.inject(received_request(rid, row, length, 0, 60))
        with pytest.raises(InvariantError, match=r"pd\.decode_retraction"):
            for _ in range(60):
                scheduler.step()
