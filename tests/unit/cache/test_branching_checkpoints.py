"""Checkpoints that survive branching: a running request whose prefix the tree already holds under
another request's pages still hands its checkpoint to the tree, so a later request on the same
branch matches it (issue 13's lost checkpoint).

The three-request case: A = blocks [0,1,2,3] (1,911 tokens), B = [0,1,2,4,5], C = [0,1,2,4,6]
(512-token blocks), state checkpoints every 1,600 tokens. A leaves a checkpoint at 1,600 on its
branch; B shares A's first 1,536 tokens, diverges, and reaches 1,600 on its own branch; C follows
B's branch and must match B's checkpoint at 1,600, as it does when A never ran."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvchain.cache.radix import CheckpointStrategy, UnifiedRadixCache
from kvchain.engine.scheduler import Scheduler
from kvchain.models import model_from_preset
from kvchain.sim.baselines import PoolConfig, kvchain_pool
from kvchain.sim.workloads import load_trace
from support.chains import small_storage

BLOCK = 512
INTERVAL = 1600  # Qwen3-Next's checkpoint interval before the interval followed the traffic
A = {"arrival_step": 0, "input_length": 1911, "output_length": 8, "hash_ids": [0, 1, 2, 3]}
B = {"arrival_step": 20, "input_length": 2400, "output_length": 8, "hash_ids": [0, 1, 2, 4, 5]}
C = {"arrival_step": 40, "input_length": 2400, "output_length": 8, "hash_ids": [0, 1, 2, 4, 6]}


def _replay(tmp_path, lines, interval=INTERVAL, exact=False):
    """Serve the trace `lines` through the simulator's kvchain pool on Qwen3-Next (80 GiB, so
    memory never binds) with `extra_buffer` checkpoints; returns the requests. `exact`: hold only
    the states chunks end on, as a pool that runs a model does."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = load_trace(path, block_tokens=BLOCK)
    model = model_from_preset("qwen3-next-80b")
    pool = kvchain_pool(model.decls, PoolConfig(80 * 2**30, strategy=CheckpointStrategy.EXTRA_BUFFER,
                                                checkpoint_interval=interval))
    pool.exact_checkpoints = exact
    sched = Scheduler(pool, max_batched_tokens=8192, max_running=256)
    sched.add(requests)
    while not sched.idle:
        sched.step()
        pool.tree.verify()
    pool.check_idle()
    return requests, pool


def test_trace_replay_a_sibling_branch_does_not_lose_the_checkpoint(tmp_path):
    """With A before them, C still matches the checkpoint B left at 1,600 tokens, as it
    does without A."""
    alone, _ = _replay(tmp_path, [B, C])
    assert max(alone, key=lambda r: r.rid).cached == INTERVAL
    requests, pool = _replay(tmp_path, [A, B, C])
    a, b, c = sorted(requests, key=lambda r: r.rid)
    assert a.cached == 0 and b.cached == 0  # B diverges from A before A's checkpoint
    assert c.cached == INTERVAL
    assert pool.stats_counters["checkpoints"] == 2


def test_trace_replay_the_three_requests_hit_with_the_default_interval(tmp_path):
    """With the interval chosen for chat traffic (256 tokens, a divisor of the 512-token blocks)
    each request checkpoints where its branch leaves the tree besides its chunk's last grid point:
    B at the 1,536 tokens it shares with A (its prefill is one chunk, whose last grid point lies
    past any sibling), C matches it and checkpoints at the 2,048 it shares with B, and a fourth
    request on C's branch matches that. The simulator counts the state at the branch point inside
    the chunk, as a kernel saving it there would, so each prompt still prefills in one step; a pool
    that holds only the states chunks end on (`exact_checkpoints`, the engine's) ends the first
    chunk there instead (and the next at the prompt's last grid point): the same hits, later first
    tokens."""
    d = {"arrival_step": 60, "input_length": 2400, "output_length": 8, "hash_ids": [0, 1, 2, 4, 7]}
    # the engine's pool: B and C cut at the branch point, then at the prompt's last grid point
    for exact, prefill_steps in ((False, [1, 1, 1]), (True, [3, 3, 2])):
        requests, pool = _replay(tmp_path, [A, B, C, d], interval=None, exact=exact)
        assert pool.checkpoint_interval == 256
        a, b, c, d2 = sorted(requests, key=lambda r: r.rid)
        assert (a.cached, b.cached, c.cached, d2.cached) == (0, 0, 3 * BLOCK, 4 * BLOCK)
        assert [r.first_token_step - r.admitted_step + 1 for r in (b, c, d2)] == prefill_steps


# -- the tree itself ---------------------------------------------------------------------------------


def _blocks(ids, length, rng_blocks):
    return np.concatenate([rng_blocks[i] for i in ids])[:length]


def _prefill(storage, length):
    row = storage.alloc_row()
    storage.alloc_extend(np.array([row]), np.array([length]))
    return row


def _checkpoint(storage, tree, row, tokens, at):
    """What a running request does at grid point `at`: the tree takes its prefix with a copy of its
    state there; False when the tree does not take it."""
    slot = int(storage.alloc_state_slots(1)[0])
    result = tree.insert_running(row, tokens[:at], slot)
    if result is None:
        storage.free_state_slots(np.array([slot]))
        return False
    assert result.state_taken
    storage.copy_state(storage.table.state_slot[[row]], np.array([slot]))
    storage.release_to_tree(row, at // storage.page_size)
    return True


def _finish(storage, tree, row, tokens):
    ps = storage.page_size
    n = len(tokens) // ps
    table = storage.table
    result = tree.insert(tokens[: n * ps], table.page_table[row, :n].copy(), table.window_lo[row], -1)
    storage.release_to_tree(row, n, result.duplicates)
    storage.free_rows(np.array([row]))


@pytest.mark.parametrize("with_a", [True, False])
def test_tree_a_checkpoint_reaches_the_tree_past_a_sibling_branch(with_a):
    """At the tree: B's checkpoint at 1,600 tokens lies on its own branch below the node
    A's branch split off; the tree takes it (B moves onto the tree's pages for the shared 1,536
    tokens and frees its copies), and C matches it."""
    storage = small_storage(page_size=64, windows=(), state=True, context=4096, chain_kib=2048)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, INTERVAL)
    rng = np.random.default_rng(0)
    blocks = [rng.integers(1, 2**31, BLOCK, dtype=np.int64).astype(np.int32) for _ in range(7)]
    a, b, c = (_blocks(x["hash_ids"], x["input_length"], blocks) for x in (A, B, C))
    if with_a:
        row = _prefill(storage, len(a))
        assert _checkpoint(storage, tree, row, a, INTERVAL)
        _finish(storage, tree, row, a)
    assert tree.match_prefix(b[:-1]).length == 0  # no state where B leaves A's branch
    row = _prefill(storage, len(b))
    live = storage.allocator.owner.n_live
    assert _checkpoint(storage, tree, row, b, INTERVAL)
    if with_a:  # B now reads the tree's copy of the 24 shared pages: its own went back
        assert storage.allocator.owner.n_live == live - 3 * BLOCK // 64
    tree.verify()
    _finish(storage, tree, row, b)
    match = tree.match_prefix(c[:-1])
    assert match.length == INTERVAL and match.state_slot >= 0
    tree.verify()
    tree.evict_all()
    storage.check_idle(tree.held_pages())


def test_tree_a_running_row_moves_onto_the_tree_pages_with_its_window_rows():
    """WIN-7: the tree holds a prefix whose window rows it retired; a running row that
    prefilled the same tokens with its own pages checkpoints past it: its window rows the tree lacks
    are rehomed onto the tree's pages (no allocation), its other copies are freed, and it reads
    the tree's pages from then on."""
    storage = small_storage(page_size=2, windows=(8,), state=True, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 16)
    band = storage.allocator.window_bands[0]
    owner = storage.allocator.owner
    tokens = np.arange(1, 61, dtype=np.int32)
    first = _prefill(storage, 40)
    storage.advance(np.array([first]))  # its window rows fell behind: only the last 4 pages stay
    _finish(storage, tree, first, tokens[:40])
    (node,) = tree.root.children.values()
    assert node.window_lo.tolist() == [16]
    row = _prefill(storage, 60)
    mine = storage.table.page_table[row, :20].copy()
    rows_before = band.ids.v2p[mine[:16]].copy()
    live, window_live = owner.n_live, band.n_live
    assert _checkpoint(storage, tree, row, tokens, 48)
    assert np.array_equal(storage.table.page_table[row, :20], node.vpages)
    assert np.array_equal(band.ids.v2p[node.vpages[:16]], rows_before)  # the same rows, renamed
    assert node.window_lo.tolist() == [0] and (band.ids.v2p[mine] < 0).all()
    assert owner.n_live == live - 20 and band.n_live == window_live - 4
    tree.verify()
    tree.lock(node)  # as the request does: what it reads stays
    storage.advance(np.array([row]))
    _finish(storage, tree, row, tokens)
    tree.unlock(node)
    tree.verify()
    tree.evict_all()
    storage.check_idle(tree.held_pages())


def test_tree_a_checkpoint_already_there_is_left_alone():
    """Two running rows with the same prompt: the second's checkpoint at the same point finds the
    tree's and changes nothing (its pages stay its own)."""
    storage = small_storage(page_size=2, windows=(), state=True, context=128, chain_kib=64)
    tree = UnifiedRadixCache(storage, CheckpointStrategy.EXTRA_BUFFER, 16)
    tokens = np.arange(1, 41, dtype=np.int32)
    one, two = _prefill(storage, 40), _prefill(storage, 40)
    assert _checkpoint(storage, tree, one, tokens, 32)
    mine = storage.table.page_table[two].copy()
    slots = len(storage.allocator.slot_free)
    assert not _checkpoint(storage, tree, two, tokens, 32)
    assert np.array_equal(storage.table.page_table[two], mine) and int(storage.table.shared_pages[two]) == 0
    assert len(storage.allocator.slot_free) == slots
    for row in (one, two):
        _finish(storage, tree, row, tokens)
    tree.verify()
    tree.evict_all()
    storage.check_idle(tree.held_pages())
