"""Sampling: transformers' warpers, draws seeded by (request seed, output index), and so outputs
that do not depend on how the requests were batched, overlapped, cached or split over processes."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace

import pytest
import torch
from spec_support import serve_spec
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from kvchain.cli import main
from kvchain.dist.pd_engine import generate_pd
from kvchain.dist.tp_engine import generate_in_ranks
from kvchain.engine.checkpoint import load_checkpoint
from kvchain.engine.sampling import SamplingParams, draw_seed, sample_rows, warp
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.errors import InputError
from support.engine import checkpoint_dir, tight_budget, workload, write_prompts

N = 12
PARAMS = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)


def _sampled(n: int, params: SamplingParams = PARAMS, seed0: int = 100) -> list[GenerateRequest]:
    return [GenerateRequest(r.prompt_token_ids, r.max_new_tokens, replace(params, seed=seed0 + i))
            for i, r in enumerate(workload(n))]


def _serve(family: str, requests, **overrides) -> list[list[int]]:
    config = dict(budget_bytes=tight_budget(family, 4), page_size=4, max_running=8, max_batched_tokens=48,
                  context_len=128, ignore_eos=True, checkpoint_interval=8)
    config.update(overrides)
    with Engine(str(checkpoint_dir(family)), EngineConfig(**config)) as engine:
        result = engine.generate(requests)
    return [o.token_ids for o in result.outputs]


@pytest.mark.parametrize(("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.5),
                                           (2.0, 1, 0.9), (1.0, 0, 1e-6), (0.9, 300, 0.95)])
def test_warp_is_transformers_warpers(t: float, k: int, p: float) -> None:
    """Temperature, then top-k, then top-p, each as transformers applies it (ties at the k-th score
    kept, the most likely token always kept): the same scores, -inf at the same tokens."""
    torch.manual_seed(0)
    logits = torch.randn(4, 256) * 3
    logits[0, :10] = logits[0, 0]  # ties at the top
    ids = torch.zeros(1, 1, dtype=torch.long)
    for row in logits:
        want = TemperatureLogitsWarper(t)(ids, row[None].clone())
        if k:
            want = TopKLogitsWarper(k)(ids, want)
        if p < 1.0:
            want = TopPLogitsWarper(p)(ids, want)
        assert torch.equal(warp(row, SamplingParams(t, k, p)), want[0])


def test_draws_follow_the_warped_distribution_and_their_seeds() -> None:
    """4,000 seeds over one row of logits: each token drawn about as often as its probability
    (within four standard deviations); top-k 2 draws only the two likeliest; a draw is a function of
    (seed, output index) alone; greedy rows are the argmax."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    counts = torch.zeros(4)
    for seed in range(4000):
        tokens = sample_rows(logits.clone(), [(0, SamplingParams(temperature=1.0, seed=seed), 0)])
        counts[tokens[0]] += 1
        assert tokens[1] == 3  # greedy
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert ((counts / 4000 - probs).abs() <= 4 * (probs * (1 - probs) / 4000).sqrt()).all()
    two = {int(sample_rows(logits, [(0, SamplingParams(1.0, top_k=2, seed=s), 0)])[0]) for s in range(200)}
    assert two == {0, 1}
    draw = [(0, SamplingParams(1.0, seed=7), 3)]
    assert all(torch.equal(sample_rows(logits, draw), sample_rows(logits, draw)) for _ in range(5))
    assert draw_seed(7, 3) != draw_seed(7, 4) and draw_seed(7, 3) != draw_seed(8, 3)


def test_sampled_decoding_is_transformers_with_the_same_draws() -> None:
    """Each output token is what transformers' own forward and warpers give, drawn with the
    generator `draw_seed(seed, j)` seeds: the engine's sampled outputs token for token."""
    requests = _sampled(6)
    served = _serve("llama", requests)
    model = load_checkpoint(checkpoint_dir("llama")).model
    ids_ = torch.zeros(1, 1, dtype=torch.long)
    for request, tokens in zip(requests, served):
        ids, p, out = list(request.prompt_token_ids), request.sampling, []
        for j in range(request.max_new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            scores = TopPLogitsWarper(p.top_p)(ids_, TopKLogitsWarper(p.top_k)(
                ids_, TemperatureLogitsWarper(p.temperature)(ids_, logits[None].float())))
            generator = torch.Generator().manual_seed(draw_seed(p.seed, j))
            token = int(torch.multinomial(scores.softmax(-1)[0], 1, generator=generator)[0])
            out.append(token)
            ids.append(token)
        assert tokens == out


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_sampled_outputs_do_not_depend_on_batching_overlap_or_the_cache(family: str) -> None:
    """Twelve sampled requests batched from a tight pool under the overlap loop (pages moved, prefixes
    reused) print what each prints served alone, without overlap or prefix cache; greedy, they print
    other tokens."""
    requests = _sampled(N)
    batched = _serve(family, requests)
    alone = [_serve(family, [r], budget_bytes=8 * 2**20, overlap=False, prefix_cache=False, max_running=1)[0]
             for r in requests]
    assert batched == alone
    assert sum(a != b for a, b in zip(batched, _serve(family, workload(N)))) >= N // 2


def test_temperature_zero_is_greedy() -> None:
    requests = [GenerateRequest(r.prompt_token_ids, r.max_new_tokens, SamplingParams(0.0, 5, 0.5, seed=1))
                for r in workload(4)]
    assert _serve("gemma3", requests) == _serve("gemma3", workload(4))


def test_ranks_and_pd_nodes_sample_what_one_process_samples() -> None:
    """The seeds go with the requests to every process (one drawn in the parent where none was
    given), and each draw is seeded by its output index: two ranks and a prefill and a decode node
    print one process's sampled outputs."""
    requests = [GenerateRequest(r.prompt_token_ids, r.max_new_tokens, PARAMS) for r in workload(4)]  # no seeds
    config = EngineConfig(budget_bytes=8 * 2**20, page_size=4, max_running=8, context_len=128, ignore_eos=True,
                          overlap=False)
    path = str(checkpoint_dir("gemma3"))
    seeded = [replace(r, sampling=replace(PARAMS, seed=9 + i)) for i, r in enumerate(requests)]
    with Engine(path, config) as engine:
        one = [o.token_ids for o in engine.generate(seeded).outputs]
    for run in generate_in_ranks(path, config, seeded, 2):
        assert [o.token_ids for o in run.result.outputs] == one
    pd = generate_pd(path, config, seeded, kind="gloo", timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == one
    runs = generate_in_ranks(path, config, requests, 2)  # seeds drawn once, in the parent
    assert [o.token_ids for o in runs[0].result.outputs] == [o.token_ids for o in runs[1].result.outputs]
    assert not mp.active_children()


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_k=-1),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(seed=-3), dict(seed=2**63),
                                 dict(temperature=True)])
def test_bad_sampling_is_refused(bad: dict) -> None:
    with pytest.raises(InputError):
        SamplingParams(**bad)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "nemotron_h"])
def test_speculative_sampling_is_plain_sampling(family: str) -> None:
    """With a draft, the target draws each verify position's token with the seed plain decoding
    draws that output with, and keeps the proposals it drew: the outputs are plain sampling's. A
    draft that is the target draws alike (the same distribution, the same seed) and has every
    proposal accepted."""
    requests = _sampled(N, SamplingParams(temperature=0.8), seed0=50)
    plain = _serve(family, requests, budget_bytes=8 * 2**20)
    spec = serve_spec(family, N, requests=requests)
    assert [o.token_ids for o in spec.outputs] == plain
    assert spec.stats.spec_rounds > 0 and spec.stats.spec_accepted > 0
    if family == "gemma3":
        same = serve_spec(family, N, requests=requests, whole=True)
        assert [o.token_ids for o in same.outputs] == plain
        assert same.stats.spec_accepted == same.stats.spec_proposed > 0


def test_generate_samples_from_the_command_line(tmp_path, capsys) -> None:
    """`--temperature --top-k --top-p --seed`: one seed gives one output twice, another another; a
    prompts line's fields override the flags; bad values are one line and exit 2."""
    prompts = write_prompts(tmp_path / "p.jsonl", workload(3))
    argv = ["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts), "--budget",
            "4MiB", "--json", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95"]
    capsys.readouterr()
    runs = []
    for seed in ("3", "3", "4"):
        assert main([*argv, "--seed", seed]) == 0
        runs.append([o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]])
    assert runs[0] == runs[1] != runs[2]
    greedy_line = tmp_path / "g.jsonl"
    request = workload(1)[0]
    greedy_line.write_text(json.dumps({"prompt_token_ids": list(request.prompt_token_ids),
                                       "max_new_tokens": request.max_new_tokens, "temperature": 0}) + "\n")
    assert main([*argv[:4], str(greedy_line), *argv[5:], "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == _serve("gemma3", [request])[0]
    for flags in (["--top-p", "0"], ["--temperature", "-1"], ["--temperature", "nan"]):
        assert main([*argv, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("top_p" in err or "temperature" in err)
    bad_line = tmp_path / "b.jsonl"
    bad_line.write_text(json.dumps({"prompt_token_ids": [1, 2], "top_k": -2}) + "\n")
    assert main([*argv[:4], str(bad_line), *argv[5:]]) == 2
    assert "line 1: top_k must be an integer >= 0" in capsys.readouterr().err
