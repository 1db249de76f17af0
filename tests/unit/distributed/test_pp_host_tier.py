"""A host tier behind pipeline stages: each stage backs up and loads back its own layers' pages, its
host pools holding as many pages per sub-pool as every other stage's (`stage_host_groups`), so the
stages take the same host-tier decisions and their capacity digests agree every step (PP-15).
Sized each from its own budget, the stage with the smaller pages kept more on the host, and the
digests diverged (`chain.stage_capacity_agreement`)."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace

import pytest

from kvchain.cli import main
from kvchain.dist.pp_engine import generate_in_stages
from kvchain.dist.tp_pp_engine import generate_in_grid
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.errors import KVChainError
from support.engine import gemma_six, qwen_eight, workload, write_prompts

CHECKS = {"KVCHAIN_INVARIANT_CHECK": "1"}
N = 12


def _config(budget: int, host: int | None) -> EngineConfig:
    return EngineConfig(budget_bytes=budget, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                        ignore_eos=True, host_budget=host)


@pytest.mark.parametrize("host", [128 * 1024, 2**20])
def test_two_stages_with_a_host_tier_agree_and_print_what_they_print_without_it(host: int) -> None:
    """Gemma 3's six layers split 4/2 (3 and 1 window layers: other page bytes on each stage), at a
    device budget that evicts cached prefixes: with a host budget that binds (128 KiB: the stages'
    own budgets would hold 32 and 64 groups) and one that does not, both stages back up, load back
    and hit alike, every step's digests agree, and the tokens are those of the stages without one."""
    path, requests = str(gemma_six()), workload(N)
    without = generate_in_stages(path, _config(300_000, None), requests, 2, (4, 2))
    runs = generate_in_stages(path, _config(300_000, host), requests, 2, (4, 2), env=CHECKS)
    first, second = runs
    assert first.digests == second.digests and len(first.digests) == first.result.stats.steps
    figures = [(r.result.stats.host_hits, r.result.stats.host_loads, r.result.stats.host_backups) for r in runs]
    assert figures[0] == figures[1] and figures[0][0] > 0
    assert first.result.stats.cached_tokens > without[0].result.stats.cached_tokens
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in without[0].result.outputs]
    assert not mp.active_children()


@pytest.mark.parametrize(("budget", "partition", "draft"), [(2_100_000, (6, 2), False), (2_600_000, (4, 4), True)])
def test_recurrent_state_on_stages_with_a_host_tier_prints_what_one_process_prints(budget, partition, draft):
    """Qwen3-Next's DeltaNet state and full attention split 6/2 (three and one state layers: other
    state bytes per stage), and 4/4 with a draft on every stage: each stage's host records carry its
    own layers' state at their checkpoints, a host hit restores it on every stage, and the tokens
    are one process's greedy tokens."""
    target, draft_dir = qwen_eight()
    requests = workload(N)
    config = replace(_config(budget, 2**20), checkpoint_interval=8)
    if draft:
        config = replace(config, draft_model_path=str(draft_dir), num_speculative_tokens=2)
    with Engine(str(target), replace(_config(8 << 20, None), checkpoint_interval=8)) as engine:
        one = engine.generate(requests)
    runs = generate_in_stages(str(target), config, requests, 2, partition, env=CHECKS)
    assert runs[0].digests == runs[1].digests
    assert runs[0].result.stats.host_hits == runs[1].result.stats.host_hits > 0
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in one.outputs]
    assert not mp.active_children()


def test_ranks_on_stages_with_a_host_tier_agree_and_print_what_they_print_without_it() -> None:
    """Two ranks on each of two stages: every process backs up its shard of its stage's layers; the
    stages' capacity digests and the ranks' decision digests agree, and the tokens are unchanged."""
    path, requests = str(gemma_six()), workload(N)
    without = generate_in_grid(path, _config(140_000, None), requests, 2, 2, (4, 2))
    runs = generate_in_grid(path, _config(140_000, 2**20), requests, 2, 2, (4, 2), env=CHECKS)
    assert all(r.result.stats.host_hits == runs[0].result.stats.host_hits > 0 for r in runs)
    assert all(r.stage_digests == runs[0].stage_digests for r in runs)
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in without[0].result.outputs]
    assert not mp.active_children()


def test_generate_cli_runs_a_host_tier_on_stages(tmp_path, capsys) -> None:
    """`kvchain generate --pp 2 --host-budget` serves and reports the host tier's hits and the last
    stage's host bytes (the table left the host tier out on every split run)."""
    prompts = write_prompts(tmp_path / "p.jsonl", workload(N))
    args = ["generate", "--model-path", str(gemma_six()), "--prompts", str(prompts), "--budget", "300000",
            "--page-size", "4", "--context", "128", "--max-batched-tokens", "64", "--ignore-eos", "--pp", "2",
            "--pp-partition", "4,2", "--json"]
    capsys.readouterr()
    assert main([*args, "--host-budget", "1MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["host_hits"] > 0 and len(out["stages"]) == 2
    assert 0 < out["stats"]["host_bytes"] <= 2**20
    assert main([arg for arg in args if arg != "--json"] + ["--host-budget", "1MiB"]) == 0
    assert f"{out['stats']['host_bytes']:,} host bytes on the last stage" in capsys.readouterr().out
    assert not mp.active_children()


def test_a_host_budget_under_one_group_is_refused_on_every_stage() -> None:
    """A host budget too small for one group of the stage with the largest pages is refused in one
    line, as on one process."""
    with pytest.raises(KVChainError, match="holds no host page"):
        generate_in_stages(str(gemma_six()), _config(300_000, 2_000), workload(2), 2, (4, 2))
    assert not mp.active_children()
