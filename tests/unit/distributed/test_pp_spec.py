"""Speculative decoding on pipeline stages, one process per stage over gloo: every stage runs the
draft, the last stage accepts and commits inside its forward, the stage before it commits when the
logits are relayed (LIFE-15), after its flush has moved state pages; the outputs are plain greedy
decoding's in one process."""

from __future__ import annotations

import json
import multiprocessing as mp

from kvchain.cli import main
from kvchain.dist.pp_engine import generate_in_stages
from kvchain.dist.tp_pp_engine import generate_in_grid
from kvchain.engine.sampling import SamplingParams
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from support.engine import qwen_eight, workload, write_prompts

#: every flush compacts, so state pages move between a stage's forward and its relayed commit
ENV = {"KVCHAIN_INVARIANT_CHECK": "1", "KVCHAIN_LAZY_COMPACTION_GAP_FRACTION": "1.0"}


def _config(**kw) -> EngineConfig:
    base = dict(budget_bytes=8 << 20, page_size=4, max_running=8, max_batched_tokens=64, context_len=128,
                checkpoint_interval=8, ignore_eos=True)
    return EngineConfig(**{**base, **kw})


def test_life15_stages_with_a_draft_generate_plain_greedy_output():
    """LIFE-15 across processes: stage 0's relayed commits found state slots moved by its flush and
    followed them; both stages sample what one process samples without a draft, and their capacity
    digests agree after every step."""
    target, draft = qwen_eight()
    reqs = workload(6)
    with Engine(str(target), _config(overlap=False)) as engine:
        plain = engine.generate(reqs)
    runs = generate_in_stages(str(target), _config(draft_model_path=str(draft), num_speculative_tokens=3), reqs, 2,
                              (4, 4), env=ENV)
    first, last = runs
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in plain.outputs]
        assert run.result.stats.spec_rounds > 0
    assert first.result.stats.spec_rounds == last.result.stats.spec_rounds
    assert first.relayed_commits > 0 and first.relayed_commits_moved > 0
    assert last.relayed_commits == 0  # the last stage accepts and commits inside its forward
    assert first.result.stats.compaction_moves > 0
    assert len(first.digests) == first.result.stats.steps and first.digests == last.digests
    assert not mp.active_children()


def test_generate_cli_with_pp_and_a_draft_prints_plain_greedy_output(tmp_path, capsys):
    target, draft = qwen_eight()
    prompts = write_prompts(tmp_path / "p.jsonl", workload(3))
    argv = ["generate", "--model-path", str(target), "--prompts", str(prompts), "--budget", "8MiB", "--page-size", "4",
            "--checkpoint-interval", "8", "--ignore-eos", "--json"]
    assert main([*argv, "--no-overlap"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--pp", "2", "--draft-model-path", str(draft), "--num-speculative-tokens", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["outputs"] == one["outputs"]
    assert two["stats"]["spec_rounds"] > 0
    assert two["stages"][0]["relayed_commits"] > 0 and two["stages"][1]["relayed_commits"] == 0
    assert not mp.active_children()


def test_stages_of_two_ranks_with_a_draft_generate_plain_greedy_output():
    """`--tp 2 --pp 2` with a draft: every stage runs the whole draft and each rank keeps its share
    of its heads; all four processes sample what one process samples without a draft, the stages'
    capacity digests and the ranks' decision digests agree after every step."""
    target, draft = qwen_eight()
    reqs = workload(4)
    with Engine(str(target), _config(overlap=False)) as engine:
        plain = engine.generate(reqs)
    runs = generate_in_grid(str(target), _config(draft_model_path=str(draft), num_speculative_tokens=3), reqs, 2, 2,
                            (4, 4), env=ENV)
    for run in runs:
        assert [o.token_ids for o in run.result.outputs] == [o.token_ids for o in plain.outputs]
        assert run.result.stats.spec_rounds == runs[0].result.stats.spec_rounds > 0
        assert run.stage_digests == runs[0].stage_digests
    assert runs[0].rank_digests == runs[1].rank_digests and runs[2].rank_digests == runs[3].rank_digests
    assert not mp.active_children()


def test_stages_sample_what_one_process_samples():
    """Sampled requests (seeded) on two stages: every stage draws output j with the generator its
    request's seed and j give, from the same relayed logits, so both print one process's outputs."""
    target, _draft = qwen_eight()
    reqs = [GenerateRequest(r.prompt_token_ids, r.max_new_tokens, SamplingParams(0.9, 30, 0.9, seed=5 + i))
            for i, r in enumerate(workload(4))]
    with Engine(str(target), _config(overlap=False)) as engine:
        one = [o.token_ids for o in engine.generate(reqs).outputs]
    for run in generate_in_stages(str(target), _config(), reqs, 2, (4, 4)):
        assert [o.token_ids for o in run.result.outputs] == one
    assert not mp.active_children()
