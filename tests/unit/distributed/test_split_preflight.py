"""What a split engine's processes would refuse as their engines start is refused in one line by the
process that would start them, before any does: a budget under a process's batch-size-1 floor, a
step's token budget under the checkpoint interval, a host budget that holds no host page."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from kvchain.cli import main
from kvchain.dist import pd_engine, pp_engine, tp_engine, tp_pp_engine
from kvchain.engine.serve import EngineConfig, GenerateRequest
from kvchain.errors import InputError
from support.engine import qwen_eight

MODES = {"tp": ["--tp", "2"], "pp": ["--pp", "2"], "tp-pp": ["--tp", "2", "--pp", "2"], "pd": ["--pd", "--pd-engine", "gloo"]}
FAULTS = {
    "budget": (["--budget", "300KiB"], "is below the batch-size-1 floor"),
    "step-tokens": (["--max-batched-tokens", "8", "--checkpoint-interval", "16", "--page-size", "8"],
                    "max_batched_tokens 8 is below the checkpoint interval 16"),
    "host-budget": (["--host-budget", "100"], "a host budget of 100 bytes holds no host page"),
}


def _no_process(monkeypatch) -> None:
    def no_process(*_args, **_kwargs):
        raise AssertionError("a process was started for a configuration its engine refuses")

    for module in (tp_engine, pp_engine, tp_pp_engine, pd_engine):
        monkeypatch.setattr(module, "run_stage_processes", no_process)


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_what_a_process_would_refuse_is_refused_before_any_starts(mode, fault, monkeypatch, capsys):
    _no_process(monkeypatch)
    target, _draft = qwen_eight()
    flags, needle = FAULTS[fault]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["generate", "--model-path", str(target), "--prompt", "ab", "--context", "128",
                               *MODES[mode], *flags]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert not mp.active_children()


ENTRIES = {
    "ranks": lambda path, cfg, reqs: tp_engine.generate_in_ranks(path, cfg, reqs, 2),
    "stages": lambda path, cfg, reqs: pp_engine.generate_in_stages(path, cfg, reqs, 2),
    "grid": lambda path, cfg, reqs: tp_pp_engine.generate_in_grid(path, cfg, reqs, 2, 2),
    "pd": lambda path, cfg, reqs: pd_engine.generate_pd(path, cfg, reqs, kind="gloo"),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize(("request_", "needle"), [
    (GenerateRequest([], 2), "request 1: a prompt needs at least one token id"),
    (GenerateRequest([1, 10**6], 2), "request 1: token ids must lie in"),
    (GenerateRequest([1, 2], 0), "request 1: max_new_tokens must be a positive integer"),
])
def test_a_request_no_engine_takes_is_refused_before_any_process_starts(entry, request_, needle, monkeypatch):
    """A split engine's requests are checked as one engine checks them, in the process that hands
    them out: PD's prefill node refused an empty prompt, and the error read back was the decode
    node's lost link ("the control plane to the peer failed")."""
    _no_process(monkeypatch)
    target, _draft = qwen_eight()
    config = EngineConfig(budget_bytes=4 * 2**20, page_size=4, context_len=128)
    with pytest.raises(InputError, match=needle):
        ENTRIES[entry](str(target), config, [GenerateRequest([1, 2, 3], 2), request_])
