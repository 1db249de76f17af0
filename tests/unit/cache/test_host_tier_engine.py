"""The host tier through the engine: a tight device budget evicts cached prefixes, the host tier
backs them up and loads them back on later matches, and the outputs are those of the run without a
host tier (attention and window rows for Gemma 3, recurrent state for Nemotron-H, latents for
DeepSeek-V3), and transformers'."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvchain.cli import main
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.errors import InputError
from support.engine import LOGIT_TOL, checkpoint_dir, gemma_six, mismatches, serve, tight_budget, workload

N = 9
HOST = 4 * 2**20


@pytest.mark.parametrize("family", ["gemma3", "nemotron_h", "deepseek_v3", "deepseek_v32"])
def test_prefixes_evicted_to_host_and_loaded_back_give_the_same_outputs(family):
    with_host = serve(family, N, at_once=1, host_budget=HOST)
    without = serve(family, N, at_once=1)
    assert with_host.stats.host_hits > 0 and with_host.stats.host_loads > 0 and with_host.stats.host_backups > 0
    assert without.stats.host_hits == 0 and with_host.stats.cached_tokens > without.stats.cached_tokens
    assert [o.token_ids for o in with_host.outputs] == [o.token_ids for o in without.outputs]
    assert max(float((with_host.logits[k] - without.logits[k]).abs().max()) for k in without.logits) < LOGIT_TOL[family]
    if family != "nemotron_h":  # transformers' reference is cheap with its cache
        assert mismatches(with_host, family, N) == []


@pytest.mark.parametrize(("family", "used"), [("qwen3_next", False), ("nemotron_h", True)])
def test_a_load_back_is_made_only_for_a_request_admission_keeps_it_for(family, used):
    """At a budget for one request, a match's own state checkpoint is the slot the request cannot
    also hold: admission would abort it with the match and start it over from an emptied cache, so
    each load brought pages back that nothing read (Qwen3-Next: every load, 16 requests, no cached
    token). The load is asked of admission first, with its pages as the pass's demand; where the
    loaded match is kept (Nemotron-H) the loads still come, and are read."""
    with_host = serve(family, 16, at_once=1, host_budget=HOST)
    without = serve(family, 16, at_once=1)
    assert [o.token_ids for o in with_host.outputs] == [o.token_ids for o in without.outputs]
    stats = with_host.stats
    if used:
        assert stats.host_loads > 0 and stats.cached_tokens > without.stats.cached_tokens
    else:
        assert stats.host_loads == 0 and stats.cached_tokens == 0


@pytest.mark.parametrize(("budget", "seed"), [(324_000, 0), (340_000, 2)])
def test_a_host_tier_aborts_no_request_the_run_without_one_serves(budget, seed):
    """ADM-11 with a host tier: a match's load-back evicts to make room and adds what it loads to
    the tree, even when the match then finds nothing, so the pass re-reads what the cache could
    evict. Read from before the match, it priced the request against a tree that was gone and
    aborted it as unschedulable (1 to 7 of 12 requests at these budgets), where the pool served it."""
    config = EngineConfig(budget_bytes=budget, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                          ignore_eos=True)
    requests = workload(12, seed)
    with Engine(str(gemma_six()), config) as engine:
        without = engine.generate(requests)
    with Engine(str(gemma_six()), replace(config, host_budget=2**20)) as engine:
        with_host = engine.generate(requests)
    assert [o.finish_reason for o in with_host.outputs] == [o.finish_reason for o in without.outputs]
    assert "aborted" not in {o.finish_reason for o in without.outputs}
    assert [o.token_ids for o in with_host.outputs] == [o.token_ids for o in without.outputs]
    assert with_host.stats.host_hits > 0


@pytest.mark.parametrize(("budget", "host", "seed"), [(340_000, 64 * 1024, 0), (340_000, 2**20, 1),
                                                     (420_000, 2**20, 0)])
def test_every_load_back_is_read_by_the_match_that_asked_for_it(budget, host, seed):
    """A load-back ends where a match can use it: where the window rows the host and the device tree
    hold together cover every window's last tokens, and the device's stay while the load makes
    room. The host lacks rows that had retired on the device before their backup; loaded to the
    end of the host's pages anyway, 10 of 10 and 8 of 29 loads here brought pages back that no
    match read (copies and evictions for nothing); and the room a load made evicted the device rows
    below it that its match needed (1 of 4 loads at 420,000 bytes)."""
    config = EngineConfig(budget_bytes=budget, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                          ignore_eos=True)
    requests = workload(16, seed)
    with Engine(str(gemma_six()), config) as engine:
        without = engine.generate(requests)
    with Engine(str(gemma_six()), replace(config, host_budget=host)) as engine:
        with_host = engine.generate(requests)
    stats = with_host.stats
    assert stats.host_loads > 0 and stats.host_hits == stats.host_loads
    assert [o.token_ids for o in with_host.outputs] == [o.token_ids for o in without.outputs]


def test_a_host_tier_needs_the_prefix_cache_and_a_budget_that_holds_a_page():
    checkpoint = load_checkpoint(checkpoint_dir("gemma3"))
    base = dict(budget_bytes=tight_budget("gemma3", 1), page_size=4, context_len=128, max_running=8)
    with pytest.raises(InputError, match="prefix caching"):
        Engine(checkpoint, EngineConfig(**base, prefix_cache=False, host_budget=HOST))
    with pytest.raises(InputError, match="holds no host page"):
        Engine(checkpoint, EngineConfig(**base, host_budget=10))


def test_generate_cli_reports_the_host_tier(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    shared = list(range(1, 25))
    rows = [{"prompt_token_ids": [*shared, 30 + i, 40 + i], "max_new_tokens": 4} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    capsys.readouterr()
    args = ["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts),
            "--budget", "4MiB", "--page-size", "4", "--context", "128", "--json"]
    assert main([*args, "--host-budget", "1MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in out["outputs"]] == [o["token_ids"] for o in plain["outputs"]]
    assert {"host_hits", "host_backups", "host_loads"} <= set(out["stats"])
    assert main([*args, "--host-budget", "12"]) == 2
    assert "holds no host page" in capsys.readouterr().err
