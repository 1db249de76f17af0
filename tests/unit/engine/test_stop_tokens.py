"""A request's own stop token ids end it on the first one it generates (the token kept, `finish_reason`
"stop"), beside the model's end of sequence and even under `ignore_eos`, in one process, under a
draft and on PD nodes."""

from __future__ import annotations

import json
import multiprocessing as mp
from dataclasses import replace

import pytest
from spec_support import serve_spec

from kvchain.cli import main
from kvchain.dist.pd_engine import generate_pd
from kvchain.engine.serve import Engine, EngineConfig, GenerateRequest
from kvchain.errors import InputError
from support.engine import checkpoint_dir, serve, workload, write_prompts

N = 6


def _stopping(family: str) -> tuple[list[GenerateRequest], list[list[int]], int]:
    """The workload with request 0 told to stop on a token its plain output first generates at
    output 3 or later, its plain outputs, and where that output ends it."""
    requests = workload(N)
    plain = [o.token_ids for o in serve(family, N).outputs]
    out = plain[0]
    j = next(j for j in range(3, len(out)) if out[j] not in out[:j])
    stopped = [replace(requests[0], stop_token_ids=[out[j]]), *requests[1:]]
    return stopped, plain, j


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_a_stop_token_ends_its_request_under_ignore_eos(family: str) -> None:
    requests, plain, j = _stopping(family)
    result = serve(family, N, requests=requests)  # the support's engine ignores the model's eos
    outputs = result.outputs
    assert outputs[0].token_ids == plain[0][: j + 1] and outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in outputs[1:]] == plain[1:]
    assert all(o.finish_reason == "length" for o in outputs[1:])


def test_a_stop_token_under_a_draft_and_on_pd_nodes() -> None:
    """A round that verifies past the stop token keeps nothing after it; the decode node stops the
    request as the single process does."""
    requests, plain, j = _stopping("gemma3")
    spec = serve_spec("gemma3", N, requests=requests)
    assert spec.outputs[0].token_ids == plain[0][: j + 1] and spec.outputs[0].finish_reason == "stop"
    assert spec.stats.spec_rounds > 0
    config = EngineConfig(budget_bytes=8 * 2**20, page_size=4, max_running=8, context_len=128, ignore_eos=True)
    pd = generate_pd(checkpoint_dir("gemma3"), config, requests, kind="gloo", timeout_s=120)
    assert pd.outputs[0].token_ids == plain[0][: j + 1] and pd.outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in pd.outputs[1:]] == plain[1:]
    assert not mp.active_children()


def test_stop_token_ids_outside_the_vocabulary_are_refused() -> None:
    with Engine(str(checkpoint_dir("llama")), EngineConfig(budget_bytes=4 * 2**20, page_size=4)) as engine:
        for bad in ([256], [-1], ["a"], "ab"):
            with pytest.raises(InputError, match="stop_token_ids must be integers in"):
                engine.generate([GenerateRequest([1, 2, 3], 4, stop_token_ids=bad)])


def test_generate_takes_stop_token_ids(tmp_path, capsys) -> None:
    requests, plain, j = _stopping("gemma3")
    prompts = write_prompts(tmp_path / "p.jsonl", requests[:1])
    argv = ["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts), "--budget", "4MiB",
            "--ignore-eos", "--json"]
    capsys.readouterr()
    assert main([*argv, "--stop-token-ids", str(plain[0][j])]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"][0]
    assert out["token_ids"] == plain[0][: j + 1] and out["finish_reason"] == "stop"
    line = tmp_path / "l.jsonl"
    line.write_text(json.dumps({"prompt_token_ids": list(requests[0].prompt_token_ids),
                                "max_new_tokens": requests[0].max_new_tokens,
                                "stop_token_ids": [plain[0][j]]}) + "\n")
    assert main([*argv[:4], str(line), *argv[5:]]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == plain[0][: j + 1]
    line.write_text(json.dumps({"prompt_token_ids": [1, 2], "stop_token_ids": "x"}) + "\n")
    assert main([*argv[:4], str(line), *argv[5:]]) == 2
    assert "stop_token_ids must be a list of integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--stop-token-ids", "a,b"])
