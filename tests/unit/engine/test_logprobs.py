"""Log-probabilities of the output tokens: the model's own distribution at each output, the chosen
token's and the likeliest alternatives', as transformers' logits give them; the same under a draft,
on ranks and on PD nodes."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace

import pytest
from spec_support import serve_spec

from kvchain.cli import main
from kvchain.dist.pd_engine import generate_pd
from kvchain.dist.tp_engine import generate_in_ranks
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.errors import InputError
from support.engine import LOGIT_TOL, checkpoint_dir, reference, serve, workload

N = 6
TOP = 3


def _asking(n: int = N, top: int = TOP) -> list[GenerateRequest]:
    return [replace(r, logprobs=top) for r in workload(n)]


def _close(got: list[dict], want: list[dict], tol: float) -> bool:
    return all(g["token_id"] == w["token_id"] and abs(g["logprob"] - w["logprob"]) < tol
               and [i for i, _ in g["top"]] == [i for i, _ in w["top"]] for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_logprobs_are_transformers_log_softmax(family: str) -> None:
    """Each output token's entry: the log-softmax of transformers' logits at that output, for the
    token and for the `TOP` likeliest (in order)."""
    result = serve(family, N, requests=_asking())
    _tokens, logits = reference(family, N)
    for i, out in enumerate(result.outputs):
        assert len(out.logprobs) == len(out.token_ids)
        for j, entry in enumerate(out.logprobs):
            lp = logits[i][j].float().log_softmax(-1)
            assert entry["token_id"] == out.token_ids[j]
            assert abs(entry["logprob"] - float(lp[entry["token_id"]])) < LOGIT_TOL[family]
            top = lp.topk(TOP)
            assert [t for t, _ in entry["top"]] == top.indices.tolist()
            assert max(abs(v - w) for (_t, v), w in zip(entry["top"], top.values.tolist())) < LOGIT_TOL[family]
    assert serve(family, 2).outputs[0].logprobs is None  # not asked, not computed


def test_logprobs_under_a_draft_on_ranks_and_on_pd_nodes() -> None:
    """A round reports the target's log-probabilities at each accepted position; ranks and PD
    nodes report one process's."""
    requests = _asking()
    plain = serve("gemma3", N, requests=requests).outputs
    spec = serve_spec("gemma3", N, requests=requests)
    assert spec.stats.spec_rounds > 0
    assert all(_close(s.logprobs, p.logprobs, 1e-4) for s, p in zip(spec.outputs, plain))
    config = EngineConfig(budget_bytes=8 * 2**20, page_size=4, max_running=8, context_len=128, ignore_eos=True,
                          overlap=False)
    path = str(checkpoint_dir("gemma3"))
    with Engine(path, config) as engine:
        one = engine.generate(requests).outputs
    for run in generate_in_ranks(path, config, requests, 2):
        assert all(_close(r.logprobs, o.logprobs, 1e-4) for r, o in zip(run.result.outputs, one))
    pd = generate_pd(path, config, requests, kind="gloo", timeout_s=120)
    assert all(_close(r.logprobs, o.logprobs, 1e-4) for r, o in zip(pd.outputs, one))
    assert not mp.active_children()


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_bad_logprobs_are_refused(bad) -> None:
    with Engine(str(checkpoint_dir("llama")), EngineConfig(budget_bytes=4 * 2**20, page_size=4)) as engine, \
            pytest.raises(InputError, match=r"logprobs must be an integer in \[0, 20\]"):
        engine.generate([GenerateRequest([1, 2, 3], 4, logprobs=bad)])


def test_generate_reports_logprobs(capsys) -> None:
    argv = ["generate", "--model-path", str(checkpoint_dir("llama")), "--prompt", "hi", "--max-new-tokens", "3",
            "--json"]
    capsys.readouterr()
    assert main([*argv, "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"][0]
    assert len(out["logprobs"]) == 3 and all(len(e["top"]) == 2 for e in out["logprobs"])
    assert out["logprobs"][0]["logprob"] <= 0
    assert main(argv) == 0 and "logprobs" not in json.loads(capsys.readouterr().out)["outputs"][0]
    with pytest.raises(SystemExit):
        main([*argv, "--logprobs", "99"])
