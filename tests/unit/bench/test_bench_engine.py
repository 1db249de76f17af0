"""`kvchain bench engine` on one small family: the numbers it reports are consistent with each other
(ratios are the quotients of the throughputs it prints), kvchain agrees with transformers'
continuous batching token for token, and the CLI speaks JSON and refuses bad input. Nothing here
asserts a speed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvchain.bench.engine import (
    KVCHAIN,
    PEERS,
    cb_bytes_per_block,
    render_engine_bench,
    run_engine_bench,
    run_generate_batch,
    shared_prefix_workload,
)
from kvchain.cli import main
from kvchain.engine.tiny import tiny_config
from kvchain.errors import BudgetError, InputError
from support.output import assert_fits, narrow_console


@pytest.fixture(scope="module")
def result() -> dict:
    return run_engine_bench(families=["gemma3"], requests=4, repeats=3, seed=0)


def test_every_engine_has_a_finite_positive_throughput(result: dict) -> None:
    family = result["families"]["gemma3"]
    for engine in (*KVCHAIN, *PEERS):
        tps = family[engine]["tokens_per_second"]
        assert math.isfinite(tps) and tps > 0, engine
        assert family[engine]["seconds"] > 0
        assert len(family[engine]["runs"]) == len(family[engine]["cpu_runs"]) == 3
        assert all(c > 0 for c in family[engine]["cpu_runs"]), engine


def test_ratios_are_the_quotients_of_the_printed_throughputs(result: dict) -> None:
    family = result["families"]["gemma3"]
    head = result["headline"]["gemma3"]
    for name, prefix in (("kvchain", ""), ("kvchain_inline", "inline_")):
        ours = family[name]["tokens_per_second"]
        for peer in PEERS:
            assert family[peer][f"{prefix}ratio"] == pytest.approx(ours / family[peer]["tokens_per_second"], rel=1e-3)
            assert head[f"{prefix}ratio_vs_{peer}"] == family[peer][f"{prefix}ratio"]
        assert head[f"{prefix}tokens_per_second"] == ours
    assert next(iter(result)) == "headline"


def test_paired_ratios_come_from_neighbouring_runs(result: dict) -> None:
    """Each repeat's ratio divides the peer's run by kvchain's run of the same round."""
    family = result["families"]["gemma3"]
    tokens = family["output_tokens"]
    for name, prefix in (("kvchain", ""), ("kvchain_inline", "inline_")):
        for peer in PEERS:
            theirs = family[peer]
            ratios = sorted((tokens / a) / (theirs["output_tokens"] / b)
                            for a, b in zip(family[name]["runs"], theirs["runs"], strict=True))
            paired = theirs[f"{prefix}paired"]
            assert paired["min"] == pytest.approx(ratios[0], rel=1e-3)
            assert paired["median"] == pytest.approx(ratios[1], rel=1e-3)
            assert paired["max"] == pytest.approx(ratios[2], rel=1e-3)
            assert result["headline"]["gemma3"][f"{prefix}worst_vs_{peer}"] == paired["min"]


def test_greedy_outputs_agree_with_generate_batch(result: dict) -> None:
    family = result["families"]["gemma3"]
    assert family["generate_batch"]["mismatches"] == 0
    assert family["kvchain_inline"]["mismatches"] == 0
    assert family["generate_batch"]["output_tokens"] == family["output_tokens"] > 0
    assert family["kvchain_inline"]["streams"] == "inline" and family["kvchain"]["streams"] == "threads"


def test_generate_batch_gets_kvchains_kv_bytes(result: dict) -> None:
    family = result["families"]["gemma3"]
    theirs = family["generate_batch"]
    block = cb_bytes_per_block(tiny_config("gemma3"), torch.float32)
    assert theirs["num_blocks"] == family["kv_bytes"] // block
    assert abs(theirs["kv_bytes"] - family["kv_bytes"]) < 0.02 * family["kv_bytes"]


def test_workload_is_seeded_and_shares_prefixes() -> None:
    a, b = shared_prefix_workload(32, 7), shared_prefix_workload(32, 7)
    assert a == b and a != shared_prefix_workload(32, 8)
    assert len({tuple(p.token_ids[:32]) for p in a}) <= 4
    assert all(40 <= len(p.token_ids) <= 96 and 16 <= p.max_new_tokens <= 32 for p in a)


def test_an_unknown_family_is_an_input_error() -> None:
    with pytest.raises(InputError, match="llama3000"):
        run_engine_bench(families=["llama3000"], requests=1, repeats=1)


def test_cli_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "engine", "--families", "gemma3", "--requests", "2", "--repeats", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["families"]) == {"gemma3"}
    assert out["config"]["repeats"] == 1 and out["workload"]["requests"] == 2


def test_cli_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--families", "nope", "--json"]) == 2
    assert "unknown family 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--requests", "0"])
    assert exc.value.code == 2


def test_a_budget_the_continuous_batching_peer_cannot_hold_is_a_budget_error() -> None:
    """transformers checks its cache's buffers against free memory and raises `MemoryError`: a
    `--budget` past the machine's memory was a traceback after kvchain's own runs."""

    class Peer:
        def continuous_batching_context_manager(self, **_kwargs):
            raise MemoryError("Memory footprint 31494161408 is more than available memory 12962800435")

    prompts = shared_prefix_workload(1, 0)
    with pytest.raises(BudgetError, match=r"cannot hold the same KV budget .*available memory"):
        run_generate_batch(Peer(), prompts, 98253)


def test_cli_refuses_more_threads_than_a_thread_pool_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "engine", "--threads", "99999999999999999999"])  # torch's overflow traceback
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err


def test_the_tables_fit_100_columns_without_cutting_a_figure(result: dict) -> None:
    console = narrow_console()
    render_engine_bench(result, console)
    text = console.export_text()
    assert_fits(text)
    family = result["families"]["gemma3"]
    for engine in (*KVCHAIN, *PEERS):
        assert f"{family[engine]['tokens_per_second']:.1f}" in text, engine


def test_engine_and_family_names_stay_whole_on_an_80_column_terminal(result: dict) -> None:
    """The notes column wraps before a name is split ("kvchain_inlin" / "e")."""
    from rich.console import Console

    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    render_engine_bench(result, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    cells = {cell.strip() for line in text.splitlines() for cell in line.split("│")}
    for name in (*KVCHAIN, *PEERS, *result["families"]):
        assert name in cells, name
