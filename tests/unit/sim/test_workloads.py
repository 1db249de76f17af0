"""Synthetic workloads and trace replay: seeded and well-formed, sharing prefixes that a prefix tree
really matches (and nothing else), traces that round-trip, bad traces named by line, and the real
scheduler draining them with cache hits."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from kvchain.engine.request import Phase, ScheduledRequest
from kvchain.engine.scheduler import Scheduler
from kvchain.errors import InputError
from kvchain.sim.workloads import (
    WORKLOADS,
    closed_loop_params,
    describe_workloads,
    load_trace,
    save_trace,
    workload_from_name,
    workload_params,
)
from support.simworld import world

# small lengths so the tests are fast; every generator gets the caps it takes
SMALL = {
    "chat": dict(prompt_median=60, output_median=20, max_len=300),
    "multi_turn": dict(system_len=0, user_median=30, output_median=20, max_len=400),
    "long_doc_qa": dict(doc_min=100, doc_max=300, max_len=400),
    "agentic": dict(prefix_len=120, task_median=20, tool_median=30, max_len=600),
    "mixed": {},
}


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _same(a: list[ScheduledRequest], b: list[ScheduledRequest]) -> bool:
    return len(a) == len(b) and all(
        x.rid == y.rid and x.arrival == y.arrival and x.max_new == y.max_new and x.output_len == y.output_len
        and np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_generators_are_seeded_and_well_formed(name):
    params = SMALL[name]
    a = workload_from_name(name, 60, 7, **params)
    b = workload_from_name(name, 60, 7, **params)
    c = workload_from_name(name, 60, 8, **params)
    assert _same(a, b)
    assert not _same(a, c)
    assert [r.rid for r in a] == list(range(60))
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert all(isinstance(r.arrival, int) for r in a)
    cap = params.get("max_len", workload_params(name).get("max_len", 10**9))
    for r in a:
        assert r.prompt.dtype == np.int32 and r.output.dtype == np.int32
        assert len(r.prompt) >= 1 and 1 <= r.output_len <= r.max_new
        assert len(r.output) >= r.output_len
        assert len(r.prompt) + r.max_new <= cap
        assert r.prompt.min() >= 1
    assert workload_from_name(name, 0, 1, **params) == []


def test_mixed_keeps_its_default_caps():
    reqs = workload_from_name("mixed", 200, 3)
    assert len(reqs) == 200
    assert max(len(r.prompt) + r.max_new for r in reqs) <= 32768
    assert any(len(r.prompt) >= 8192 for r in reqs)  # the long documents are in


def test_chat_lengths_follow_the_medians_and_respect_max_len():
    reqs = workload_from_name("chat", 400, 1)
    assert 600 < np.median([len(r.prompt) for r in reqs]) < 1600
    assert 200 < np.median([r.output_len for r in reqs]) < 450
    assert max(len(r.prompt) + r.max_new for r in reqs) <= 16384
    capped = workload_from_name("chat", 200, 1, max_len=512, max_new_slack=2.0)
    assert all(len(r.prompt) + r.max_new <= 512 for r in capped)
    assert any(r.max_new > r.output_len for r in capped)


def test_rate_sets_the_arrival_span():
    slow = workload_from_name("chat", 400, 2, rate=0.1)
    fast = workload_from_name("chat", 400, 2, rate=1.0)
    assert 2500 < slow[-1].arrival < 5500 and 250 < fast[-1].arrival < 550


def test_chat_requests_share_nothing():
    reqs = workload_from_name("chat", 200, 5)
    firsts = {int(r.prompt[0]) for r in reqs}
    assert len(firsts) == len(reqs)


def _sessions(reqs: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """Chains of turns: a request continues the latest earlier request whose prompt + output it
    starts with."""
    chains: list[list[ScheduledRequest]] = []
    for r in reqs:
        for chain in chains:
            last = chain[-1]
            history = last.tokens(len(last.prompt) + last.output_len)
            if len(r.prompt) > len(history) and np.array_equal(r.prompt[: len(history)], history):
                chain.append(r)
                break
        else:
            chains.append([r])
    return chains


@pytest.mark.parametrize("name", ["multi_turn", "agentic"])
def test_turns_extend_the_previous_turn(name):
    """Turn k+1's prompt starts with turn k's prompt + output, and arrives no earlier than turn k
    could have finished; sessions interleave."""
    reqs = workload_from_name(name, 80, 3, **SMALL[name])
    chains = _sessions(reqs)
    assert any(len(c) >= 3 for c in chains)
    assert sum(len(c) for c in chains) == 80
    for chain in chains:
        for prev, nxt in itertools.pairwise(chain):
            assert nxt.arrival >= prev.arrival + prev.output_len
    # interleaved: some session's turn arrives between two turns of another
    spans = [(c[0].arrival, c[-1].arrival) for c in chains if len(c) > 1]
    assert any(a0 < b0 < a1 for a0, a1 in spans for b0, _ in spans)


def test_multi_turn_sessions_share_no_prefix_across_sessions():
    reqs = workload_from_name("multi_turn", 80, 4, **SMALL["multi_turn"])
    heads = [c[0] for c in _sessions(reqs)]
    assert len({int(r.prompt[0]) for r in heads}) == len(heads)
    shared = workload_from_name("multi_turn", 40, 4, **{**SMALL["multi_turn"], "system_len": 50})
    assert all(np.array_equal(r.prompt[:50], shared[0].prompt[:50]) for r in shared)


def test_agentic_calls_share_the_system_prefix():
    reqs = workload_from_name("agentic", 60, 2, n_prefixes=2, **SMALL["agentic"])
    prefixes = {r.prompt[:120].tobytes() for r in reqs}
    assert len(prefixes) == 2
    assert all(r.output_len <= 200 for r in reqs)
    assert np.median([r.output_len for r in workload_from_name("agentic", 200, 2)]) < 80  # tens of tokens


def test_long_doc_questions_share_their_document():
    reqs = workload_from_name("long_doc_qa", 60, 6, n_docs=3, **SMALL["long_doc_qa"])
    groups: dict[bytes, list[ScheduledRequest]] = {}
    for r in reqs:
        groups.setdefault(r.prompt[:100].tobytes(), []).append(r)
    assert len(groups) == 3
    for group in groups.values():
        assert len(group) >= 5
        doc_len = min(_common_prefix(group[0].prompt, r.prompt) for r in group[1:])
        assert 100 <= doc_len <= 300  # the whole document is shared, the questions are not
        assert all(np.array_equal(r.prompt[:doc_len], group[0].prompt[:doc_len]) for r in group)
        assert all(len(r.prompt) > doc_len for r in group)
    docs = [g[0].prompt for g in groups.values()]
    assert all(_common_prefix(docs[i], docs[j]) == 0 for i in range(3) for j in range(i + 1, 3))


def test_mixed_fractions_and_params():
    reqs = workload_from_name("mixed", 100, 1, chat=1.0, multi_turn=0.0, long_doc_qa=0.0, agentic=0.0,
                              params={"chat": {"max_len": 256}})
    assert len(reqs) == 100 and all(len(r.prompt) + r.max_new <= 256 for r in reqs)
    with pytest.raises(InputError, match="unknown workloads"):
        workload_from_name("mixed", 10, 1, params={"nope": {}})
    with pytest.raises(InputError, match="'chat' has no parameter 'bogus'"):
        workload_from_name("mixed", 10, 1, params={"chat": {"bogus": 1}})


def test_names_parameters_and_string_values():
    assert set(describe_workloads()) == {"chat", "multi_turn", "long_doc_qa", "agentic", "mixed"}
    assert all(isinstance(d, str) and d and "\n" not in d for d in describe_workloads().values())
    a = workload_from_name("chat", 20, 1, rate="0.25", max_len="512")
    b = workload_from_name("chat", 20, 1, rate=0.25, max_len=512)
    assert _same(a, b)
    with pytest.raises(InputError, match="unknown workload"):
        workload_from_name("nope", 1, 1)
    with pytest.raises(InputError, match="no parameter"):
        workload_from_name("chat", 1, 1, bogus=3)
    with pytest.raises(InputError, match="wants an integer"):
        workload_from_name("chat", 1, 1, max_len="big")
    with pytest.raises(InputError, match="rate must be positive"):
        workload_from_name("chat", 1, 1, rate=0)
    with pytest.raises(InputError, match="seed"):
        workload_from_name("chat", 1, -1)


# -- traces ---------------------------------------------------------------------------------------


def _hash_structure(reqs: list[ScheduledRequest], block: int) -> list[list[int]]:
    """Per request, per block: the rid and block index of the first request holding the same
    prefix through that block (the sharing structure, independent of token values)."""
    first: dict[bytes, tuple[int, int]] = {}
    out = []
    for r in sorted(reqs, key=lambda r: (r.arrival, r.rid)):
        row = []
        for lo in range(0, len(r.prompt), block):
            key = r.prompt[: lo + block].tobytes()
            row.append(first.setdefault(key, (r.rid, lo // block)))
        out.append(row)
    return out


def test_trace_round_trips(tmp_path):
    reqs = workload_from_name("mixed", 80, 9, params={k: v for k, v in SMALL.items() if k != "mixed"})
    path = tmp_path / "t.jsonl"
    save_trace(reqs, path, block_tokens=16)
    back = load_trace(path, block_tokens=16)
    assert [(r.rid, r.arrival, len(r.prompt), r.output_len, r.max_new) for r in back] == \
        [(r.rid, r.arrival, len(r.prompt), r.output_len, r.max_new) for r in reqs]
    assert _hash_structure(back, 16) == _hash_structure(reqs, 16)
    again = tmp_path / "u.jsonl"
    save_trace(back, again, block_tokens=16)
    assert [json.loads(x)["hash_ids"] for x in path.read_text().splitlines()] == \
        [json.loads(x)["hash_ids"] for x in again.read_text().splitlines()]
    # arrivals survive through timestamps alone too
    stripped = tmp_path / "v.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    stripped.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "arrival_step"}) + "\n"
                                for row in rows))
    assert [r.arrival for r in load_trace(stripped, block_tokens=16)] == [r.arrival for r in reqs]


MOONCAKE = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    {"timestamp": 1049, "input_length": 300, "output_length": 7, "hash_ids": [4]},
    {"timestamp": 1175, "input_length": 1024, "output_length": 9, "hash_ids": [0, 1]},
    {"timestamp": 1200, "input_length": 700, "output_length": 3},
]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_sample_loads_with_shared_blocks(tmp_path):
    path = _write(tmp_path / "mooncake.jsonl", MOONCAKE)
    reqs = load_trace(path, ms_per_step=50.0, max_new_slack=1.5)
    assert [r.rid for r in reqs] == [0, 1, 2, 3, 4]
    assert [r.arrival for r in reqs] == [0, 0, 0, 3, 4]
    assert [len(r.prompt) for r in reqs] == [1100, 600, 300, 1024, 700]
    assert [r.output_len for r in reqs] == [20, 5, 7, 9, 3]
    assert [r.max_new for r in reqs] == [30, 8, 11, 14, 5]
    a, b, c, d, e = (r.prompt for r in reqs)
    assert _common_prefix(a, b) == 512  # hash 0 shared, then 1 vs 3
    assert _common_prefix(a, d) == 1024  # hashes 0, 1
    assert _common_prefix(a, c) == 0 and _common_prefix(a, e) == 0
    assert all(len(r.output) >= r.output_len for r in reqs)
    assert load_trace(path, limit=2)[-1].arrival == 0 and len(load_trace(path, limit=2)) == 2


def test_a_partial_block_is_the_start_of_the_same_hash(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        {"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 0, "input_length": 70, "output_length": 1, "hash_ids": [7, 8]},
    ])
    x, y = load_trace(path, block_tokens=50)
    assert np.array_equal(x.prompt[:70], y.prompt)


def test_same_timestamp_keeps_file_order_and_own_fields(tmp_path):
    path = _write(tmp_path / "o.jsonl", [
        {"timestamp": 100, "input_length": 10, "output_length": 2},
        {"timestamp": 40, "input_length": 11, "output_length": 2},
        {"timestamp": 40, "input_length": 12, "output_length": 2},
        {"timestamp": 0, "arrival_step": 1, "input_length": 13, "output_length": 2, "rid": 9, "max_new": 6},
    ])
    reqs = load_trace(path, ms_per_step=50.0)
    assert [len(r.prompt) for r in reqs] == [11, 12, 13, 10]
    assert [r.arrival for r in reqs] == [0, 0, 1, 1]
    assert [r.rid for r in reqs] == [0, 1, 9, 2]
    assert reqs[2].max_new == 6


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": 0, "output_length": 3}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 3}', "missing field 'output_length'"),
    ('{"input_length": 3, "output_length": 3}', "missing field 'timestamp'"),
    ('{"timestamp": -5, "input_length": 3, "output_length": 3}', "'timestamp' must be >= 0"),
    ('{"timestamp": 0, "input_length": -3, "output_length": 3}', "'input_length' must be >= 0"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 3}', "'input_length' must be >= 1"),
    ('{"timestamp": 0, "input_length": 3, "output_length": -1}', "'output_length' must be >= 0"),
    ('{"timestamp": 0, "input_length": 3.5, "output_length": 1}', "must be an integer"),
    ('{"timestamp": "x", "input_length": 3, "output_length": 1}', "must be a number"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": 5}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1, 2]}', "wrong block_tokens"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 4, "max_new": 2}', "below output_length"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "rid": 0}', "rid 0 already used on line 1"),
])
def test_bad_traces_name_the_line(tmp_path, line, message):
    good = '{"timestamp": 0, "input_length": 3, "output_length": 1, "rid": 0}'
    path = _write(tmp_path / "bad.jsonl", [good, "", line])
    with pytest.raises(InputError) as err:
        load_trace(path)
    text = str(err.value)
    assert f"{path}:3:" in text and message in text and "\n" not in text


def test_a_missing_trace_names_the_file(tmp_path):
    with pytest.raises(InputError, match=r"missing\.jsonl"):
        load_trace(tmp_path / "missing.jsonl")


# -- through the real scheduler -------------------------------------------------------------------

TINY = {
    "chat": dict(prompt_median=20, output_median=6, max_len=120),
    "multi_turn": dict(system_len=0, user_median=10, output_median=6, max_len=150, think_steps=5.0,
                       prefill_per_step=64),
    "long_doc_qa": dict(n_docs=2, doc_min=40, doc_max=80, question_median=6, output_median=6, max_len=150),
    "agentic": dict(prefix_len=48, task_median=8, tool_median=10, output_median=5, max_len=150,
                    prefill_per_step=64),
}


def _drain(requests, state=True):
    pool = world(chain_kib=200, window=16, state=state, context=256)
    sched = Scheduler(pool, max_batched_tokens=64, max_running=16, max_wait_steps=2_000)
    sched.add(requests)
    sched.run(max_steps=20_000)
    assert sched.idle, "the workload did not drain"
    pool.check_idle()
    return sched


def test_mixed_runs_through_the_scheduler():
    reqs = workload_from_name("mixed", 60, 1, rate=0.3, params=TINY)
    sched = _drain(reqs)
    assert all(r.phase is Phase.FINISHED for r in reqs), [(r.rid, r.phase, r.reason) for r in reqs
                                                          if r.phase is not Phase.FINISHED]
    assert all(r.generated == r.output_len for r in reqs)
    assert sched.stats.cached_tokens > 0


@pytest.mark.parametrize("name", ["multi_turn", "long_doc_qa", "agentic"])
def test_sharing_workloads_hit_the_prefix_cache(name):
    reqs = workload_from_name(name, 30, 2, rate=0.2, **TINY[name])
    _drain(reqs)
    assert all(r.phase is Phase.FINISHED for r in reqs)
    hits = sum(r.cached for r in reqs)
    assert hits > 0.2 * sum(len(r.prompt) for r in reqs), name
    chat = workload_from_name("chat", 30, 2, rate=0.2, **TINY["chat"])
    _drain(chat)
    assert sum(r.cached for r in chat) == 0


def test_a_window_model_reuses_documents_primed_or_not():
    """The pool caches a running request's prompt pages once it is prefilled, window rows
    included, so questions on a document reuse it on a window-only model; priming
    (`prime_docs`: each document alone first) makes even each document's first question a hit."""
    plain = workload_from_name("long_doc_qa", 20, 3, rate=0.2, **TINY["long_doc_qa"])
    _drain(plain, state=False)
    primed = workload_from_name("long_doc_qa", 20, 3, rate=0.2, prime_docs="true", **TINY["long_doc_qa"])
    docs = primed[:2]
    assert all(r.arrival == 0 and r.output_len == 1 for r in docs)
    assert all(r.arrival >= 2 for r in primed[2:])  # after the documents could be prefilled
    _drain(primed, state=False)
    plain_hits = sum(r.cached for r in plain) / sum(len(r.prompt) for r in plain)
    primed_hits = sum(r.cached for r in primed[2:]) / sum(len(r.prompt) for r in primed[2:])
    assert plain_hits >= 0.5 and primed_hits >= plain_hits, (plain_hits, primed_hits)


# -- `kvchain simulate --block-tokens` ----------------------------------------------------------------


def _blocks_trace(tmp_path):
    """12 requests of 700 tokens hashed in 256-token blocks: the first two blocks (512 tokens) are
    shared by all, the third is each request's own."""
    trace = tmp_path / "t256.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 5000 * i, "input_length": 700, "output_length": 20,
                                         "hash_ids": [0, 1, 100 + i]}) + "\n" for i in range(12)))
    return trace


def _simulate(trace, *extra):
    from kvchain.cli import main

    return main(["simulate", "--model", "llama-3.1-8b", "--budget", "2GiB", "--trace", str(trace), "--jobs", "1",
                 "--pools", "kvchain", "--json", *extra])


def test_simulate_replays_a_trace_at_its_block_size(tmp_path, capsys):
    """--block-tokens 256: every request after the first reuses the two shared blocks (512 of its
    700 tokens)."""
    assert _simulate(_blocks_trace(tmp_path), "--block-tokens", "256") == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["finished"] == 12
    assert result["hit_rate"] == pytest.approx(11 * 512 / (12 * 700))


def test_simulate_at_the_default_block_size_names_the_option(tmp_path, capsys):
    """At the default 512-token blocks the three hash ids overrun the 700-token prompt: one line,
    exit 2, naming the block size and the option."""
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(_simulate(_blocks_trace(tmp_path)))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 blocks of 512 tokens" in err and "--block-tokens" in err


def test_block_tokens_decides_what_two_requests_share(tmp_path):
    """The same hash ids read at two block sizes: shared blocks are `block_tokens` long."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [7, 1]}) + "\n"
                    + json.dumps({"timestamp": 1, "input_length": 300, "output_length": 1, "hash_ids": [7, 2]}) + "\n")
    for block in (100, 150):
        x, y = load_trace(path, block_tokens=block)
        common = int(np.argmin(x.prompt == y.prompt))
        assert common == block


def test_the_checkpoint_interval_assumes_the_multi_turn_chat_turn():
    """The default checkpoint interval is sized on what a chat turn appends: the multi-turn
    workload's median user message plus median answer."""
    from kvchain.cache.checkpoints import CHAT_TURN_TOKENS

    params = workload_params("multi_turn")
    assert params["user_median"] + params["output_median"] == CHAT_TURN_TOKENS


def test_closed_loop_turns_follow_the_turn_before_them():
    """`closed_loop`: every turn but a session's first follows the turn whose prompt and output
    its prompt extends, with a gap of its own; the open-loop sequence is otherwise the same
    requests (one generator, the same draws). In `mixed` the follows survive renumbering."""
    open_ = workload_from_name("multi_turn", 60, 5, **SMALL["multi_turn"])
    closed = workload_from_name("multi_turn", 60, 5, closed_loop=True, **SMALL["multi_turn"])
    assert [r.prompt.tobytes() for r in closed] == [r.prompt.tobytes() for r in open_]
    assert all(r.follows == -1 for r in open_)
    by_rid = {r.rid: r for r in closed}
    followers = [r for r in closed if r.follows >= 0]
    assert len(followers) == sum(len(c) - 1 for c in _sessions(closed)) > 0
    for r in followers:
        prev = by_rid[r.follows]
        n = prev.prompt_len
        assert np.array_equal(r.prompt[:n], prev.prompt)
        assert np.array_equal(r.prompt[n : n + prev.output_len], prev.output[: prev.output_len])
    assert any(r.gap > 0 for r in followers)
    mixed = workload_from_name("mixed", 80, 2, params={**TINY, **{k: {**TINY[k], "closed_loop": True}
                                                                    for k in ("multi_turn", "agentic")}})
    chained = [r for r in mixed if r.follows >= 0]
    assert chained and all(r.rid == i for i, r in enumerate(mixed))
    for r in chained:
        prev = mixed[r.follows]
        assert np.array_equal(r.prompt[: prev.prompt_len], prev.prompt)


def test_closed_loop_params_name_the_session_parts():
    assert closed_loop_params("multi_turn") == {"closed_loop": True}
    assert set(closed_loop_params("mixed")["params"]) == {"multi_turn", "agentic"}
    with pytest.raises(InputError, match="--closed-loop needs a workload of sessions"):
        closed_loop_params("long_doc_qa")


def test_a_closed_loop_turn_arrives_its_gap_after_the_turn_before_it_finishes():
    """The scheduler holds a follower until the turn it follows has finished, then lets it arrive
    `gap` steps later (its `arrival` is rewritten to that step), never admitted before; a
    follower of a rejected turn is released at the rejection; the run drains."""
    first = ScheduledRequest(0, 0, np.arange(1, 9), max_new=4, output_len=4)
    second = ScheduledRequest(1, 0, np.concatenate([np.arange(1, 9), first.output[:4], [77]]), max_new=3,
                              output_len=3, follows=0, gap=3)
    huge = ScheduledRequest(2, 0, np.arange(1, 400), max_new=4, output_len=4)  # past the context: rejected
    after_huge = ScheduledRequest(3, 0, np.arange(1, 20), max_new=2, output_len=2, follows=2, gap=0)
    sched = Scheduler(world(chain_kib=200, window=16, state=False, context=256), max_batched_tokens=64,
                      max_running=16, max_wait_steps=2_000)
    sched.add([first, second, huge, after_huge])
    assert sched.held and not sched.idle
    while not sched.idle:
        assert sched.step_no < 2_000, "the held turns were never released"
        assert second.phase is Phase.PENDING or first.phase is Phase.FINISHED
        sched.step()
    assert huge.phase is Phase.REJECTED and after_huge.phase is Phase.FINISHED
    assert after_huge.arrival == 1  # released at step 0's rejection, no gap
    assert first.phase is second.phase is Phase.FINISHED
    assert second.arrival == first.finished_step + 1 + 3
    assert second.admitted_step >= second.arrival
    assert second.cached > 0  # the turn before it was cached when it came


def test_a_follower_of_a_request_not_served_is_refused():
    sched = Scheduler(world(chain_kib=200, window=0, state=False, context=256), max_batched_tokens=64,
                      max_running=16)
    with pytest.raises(InputError, match="follows request 9"):
        sched.add([ScheduledRequest(0, 0, np.arange(1, 9), max_new=2, output_len=2, follows=9)])


def test_closed_loop_mixed_runs_through_the_scheduler():
    closed = closed_loop_params("mixed")["params"]
    reqs = workload_from_name("mixed", 60, 1, rate=0.3, params={k: {**v, **closed.get(k, {})} for k, v in TINY.items()})
    by_rid = {r.rid: r for r in reqs}
    sched = _drain(reqs)
    assert all(r.phase is Phase.FINISHED for r in reqs)
    for r in reqs:
        if r.follows >= 0:
            assert r.arrival >= by_rid[r.follows].finished_step + 1 + r.gap
            assert r.admitted_step > by_rid[r.follows].finished_step
    assert sched.stats.cached_tokens > 0
