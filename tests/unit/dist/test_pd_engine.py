"""`generate --pd`: a prefill process and a decode process give the single-process engine's outputs,
token for token, on hybrid tiny checkpoints (Gemma 3: sliding-window and full attention; Qwen3-Next:
full attention and linear-attention state)."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from kvchain.dist.pd_engine import generate_pd
from kvchain.dist.transfer import nixl_available
from kvchain.engine.serve import Engine, EngineConfig
from support.engine import PAGE, checkpoint_dir, workload
from support.models import kvchain

NIXL_MISSING = nixl_available()
CONFIG = EngineConfig(budget_bytes=8 * 2**20, page_size=PAGE, context_len=128, max_running=8, ignore_eos=True)


@pytest.mark.nixl
@pytest.mark.skipif(NIXL_MISSING is not None, reason=str(NIXL_MISSING))
def test_pd_outputs_are_the_single_process_engines():
    """Qwen3-Next over NIXL: without the state slot (or with a stale one) the decode diverges at once."""
    family, kind = "qwen3_next", "nixl"
    requests = workload(6, seed=3)
    path = checkpoint_dir(family)
    with Engine(path, CONFIG) as engine:
        single = engine.generate(requests)
    pd = generate_pd(path, CONFIG, requests, kind=kind, timeout_s=120)
    assert [o.token_ids for o in pd.outputs] == [o.token_ids for o in single.outputs]
    assert all(len(o.token_ids) == r.max_new_tokens for o, r in zip(pd.outputs, requests))
    assert not mp.active_children()


def test_generate_pd_on_the_command_line_matches_generate(tmp_path):
    """Gemma 3 over gloo, through `kvchain generate --pd`: without the window rows the decode
    diverges at once."""
    requests = workload(6, seed=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": list(r.prompt_token_ids),
                                           "max_new_tokens": r.max_new_tokens}) + "\n" for r in requests))
    common = ["generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompts", str(prompts), "--json",
              "--ignore-eos", "--page-size", str(PAGE), "--context", "128", "--budget", "8MiB", "--max-running", "8"]
    single = kvchain(*common)
    pd = kvchain(*common, "--pd", "--pd-engine", "gloo")
    assert single.returncode == 0 and pd.returncode == 0, (single.stderr[-2000:], pd.stderr[-2000:])
    want = [o["token_ids"] for o in json.loads(single.stdout)["outputs"]]
    got = [o["token_ids"] for o in json.loads(pd.stdout)["outputs"]]
    assert got == want and all(len(o) == r.max_new_tokens for o, r in zip(got, requests))


def test_generate_pd_refuses_a_device_it_does_not_run_on():
    out = kvchain("generate", "--model-path", str(checkpoint_dir("gemma3")), "--prompt", "hi", "--pd",
                  "--device", "cuda")
    assert out.returncode == 2 and out.stderr.count("\n") <= 2
