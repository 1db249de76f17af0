"""Pipeline stages in one process: each stage its own allocator over its own arena, every stage
driven by the same operations, every capacity question asked of every stage's simulated snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc import stage_capacity
from kvchain.alloc.demand import KVDemand
from kvchain.alloc.pricing import feasible, reclaimed_snapshot
from kvchain.alloc.stage_capacity import StageGeometry, shared_counts, simulated_snapshot
from kvchain.decl import MHA, FullLifetime, KVPart, WindowLifetime, kv_layer_decls
from kvchain.errors import CapacityError, InputError, InvariantError
from kvchain.plan import StagePartitionError, plan_stages, stage_layer_ranges
from kvchain.sim.pp import StageLoop, StageSpec, build_stage, install_stages, run_stages_in_process
from kvchain.sizing import size_plan, size_stages
from support.stages import PARTITION, gemma_like, spec, stage_pools, traffic


@pytest.fixture(autouse=True)
def _checks_on(monkeypatch):
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "1")


# -- partition, planning and sizing --------------------------------------------------------------


def test_layers_split_contiguously_as_engines_split_them():
    assert stage_layer_ranges(12, 2) == [range(0, 6), range(6, 12)]
    # the remainder goes one layer apiece to the stages before the last
    assert stage_layer_ranges(11, 3) == [range(0, 4), range(4, 8), range(8, 11)]
    assert stage_layer_ranges(12, 2, (7, 5)) == [range(0, 7), range(7, 12)]
    with pytest.raises(StagePartitionError, match="at least one layer"):
        stage_layer_ranges(12, 2, (12, 0))


def test_each_stage_plans_its_own_layers():
    """PP-1: a stage's arena and its sub-pools' unit bytes follow the layers it hosts."""
    pools = stage_pools()
    plans = [p.plan for p in pools]
    assert [p.layer_ids for p in plans[0].sub_pools] == [(0, 1, 2, 3, 4, 6), (5,)]
    assert [p.layer_ids for p in plans[1].sub_pools] == [(7, 8, 9, 10), (11,)]
    window = [p.sub_pools[0] for p in plans]
    assert window[0].unit_bytes == 6 * MHA(2, 4).unit_bytes() and window[1].unit_bytes == 4 * MHA(2, 4).unit_bytes()
    geoms = [StageGeometry.of_chain(p.chain, i) for i, p in enumerate(pools)]
    assert geoms[0].bytes_per_token() > geoms[1].bytes_per_token()
    assert [g.arena_bytes for g in geoms] == [p.storage.arena.nbytes for p in pools]
    assert geoms[0].arena_bytes != geoms[1].arena_bytes
    assert geoms[0].bands[0].page_bytes != geoms[1].bands[0].page_bytes


def test_the_concurrency_is_the_least_of_the_stages():
    """PP-3: each stage sizes its own plan; the pipeline serves the least concurrency of them."""
    plans = plan_stages(gemma_like(), 2, page_size=4, partition=PARTITION)
    budget = spec(8).budget_bytes
    sized = size_stages(plans, budget, context_len=256, max_running_requests=16)
    alone = [size_plan(p, budget, context_len=256, max_running_requests=16).concurrency for p in plans]
    assert alone[0] != alone[1]
    assert sized.concurrency == min(alone) and sized.limiting_stage == alone.index(min(alone))
    assert sized.to_dict()["concurrency"] == min(alone)


def test_a_stage_without_a_full_attention_owner_is_refused():
    """PP-4: layers 0..4 of Gemma 3 are all sliding-window layers: that stage has no owner."""
    with pytest.raises(StagePartitionError, match=r"stage 0 \(layers 0..4\) has no full-attention layer"):
        plan_stages(gemma_like(), 2, page_size=4, partition=(5, 7))


def test_a_stage_lacking_a_kind_or_a_window_length_is_refused():
    """PP-5: a partition that leaves a stage without a layer kind, or with a window length another
    stage lacks, is refused when planned and when installed; so are stages on another page size."""
    f = KVPart(MHA(1, 8), FullLifetime())
    w16, w8 = KVPart(MHA(1, 8), WindowLifetime(16)), KVPart(MHA(1, 8), WindowLifetime(8))
    with pytest.raises(StagePartitionError, match="window16"):
        plan_stages(kv_layer_decls([w16, f, f, f]), 2, page_size=4)
    with pytest.raises(StagePartitionError, match="window16, window8"):
        plan_stages(kv_layer_decls([w16, f, w8, f]), 2, page_size=4)
    pools = stage_pools(install=False)
    geoms = [StageGeometry.of_chain(p.chain, i) for i, p in enumerate(pools)]
    other = build_stage(StageSpec(kv_layer_decls([w8, f, w8, f]), 2, spec().budget_bytes), 1)
    with pytest.raises(StagePartitionError, match="window8"):
        pools[0].chain.install_stage_capacity([geoms[0], StageGeometry.of_chain(other.chain, 1)], 0)
    repaged = StageGeometry(1, 8, geoms[1].arena_bytes, geoms[1].chain_lo, geoms[1].bands)
    with pytest.raises(StagePartitionError, match="same page size"):
        pools[0].chain.install_stage_capacity([geoms[0], repaged], 0)
    assert pools[0].chain.stage_capacity is None  # nothing was installed


def test_the_installed_geometry_is_what_each_stage_reports():
    """PP-6: the geometry a stage reports (arena bytes; per band unit bytes, page counts, id counts)
    is what every stage installs; a geometry that is not the installing chain's is refused."""
    pools = stage_pools(install=False)
    geoms = [StageGeometry.of_chain(p.chain, i) for i, p in enumerate(pools)]
    for g, pool in zip(geoms, pools):
        chain = pool.chain
        assert g.arena_bytes == chain.layout.arena_bytes
        assert [b.unit_bytes for b in g.bands] == [p.unit_bytes for p in pool.plan.sub_pools]
        assert [b.n_pages for b in g.bands] == [b.grid.n_grid for b in chain.bands]
        assert g.virtual_ids == chain.n_virtual - 1
    assert StageGeometry(**{**geoms[0].to_dict(), "bands": geoms[0].bands}) == geoms[0]
    with pytest.raises(StagePartitionError, match="not this chain's"):
        pools[0].chain.install_stage_capacity(geoms[::-1] and [geoms[1], geoms[0]], 1)
    install_stages(pools, geoms)
    assert all(p.chain.stage_capacity.geometries == tuple(geoms) for p in pools)


# -- every question on every stage ---------------------------------------------------------------


def _fill(pool, tokens: int) -> int:
    row = pool.storage.alloc_row()
    pool.storage.alloc_extend(np.array([row]), np.array([tokens]))
    return row


def test_every_question_is_asked_of_every_stage():
    """PP-7, PP-8: the larger stage (more arena, fewer bytes per token) answers every question as the
    smaller one would: `units_fit`, `admits`, a take and the owner's id shortfall all refuse a demand
    that fits its own arena but not the other stage's."""
    pools = stage_pools(install=False)
    big = pools[1].chain
    small_geom = StageGeometry.of_chain(pools[0].chain, 0)
    owner_fit = [0, 0]
    for n in range(1, big.owner.grid.n_grid):
        pages = [n, n]
        if big.units_fit(pages):
            owner_fit[1] = n
        if pools[0].chain.units_fit(pages):
            owner_fit[0] = n
    assert owner_fit[1] > owner_fit[0]
    between = [owner_fit[0] + 1] * 2
    assert big.units_fit(between)
    big.install_stage_capacity([small_geom, StageGeometry.of_chain(big, 1)], 1)
    assert not big.units_fit(between) and big.units_fit([owner_fit[0]] * 2)
    assert not big.admits(KVDemand(tuple(between), between[0], 0))
    assert not big.fits_after_frees(between, [0, 0])
    assert not big.ensure_capacity(between)
    with pytest.raises(CapacityError, match="pipeline stage"):
        big.take(between)
    # the owner's ids: the small stage mints fewer virtual pages than the big one has
    ids = small_geom.virtual_ids
    assert big.stage_capacity.id_shortfall(ids + 1, 0) == f"stage 0: owner has {ids} free virtual pages, {ids + 1} needed"
    with pytest.raises(CapacityError, match="stage 0: owner has"):
        big.take_virtual(ids + 1, 0)


def test_estimates_read_the_same_snapshots():
    """PP-9: an estimate is the least over every stage's simulated snapshot."""
    pools = stage_pools()
    _fill(pools[0], 40)
    _fill(pools[1], 40)
    counts = shared_counts(pools[1].chain)
    geoms = pools[1].chain.stage_capacity.geometries
    free = [g.chain_bytes - sum(n * b.page_bytes for n, b in zip(counts.held, g.bands)) for g in geoms]
    for pool in pools:
        chain = pool.chain
        assert chain.available_bytes_estimate() == min(free)
        owner = len(chain.bands) - 1
        want = min(min(f // g.bands[owner].page_bytes, g.virtual_ids - counts.virtual_held) * 4
                   for f, g in zip(free, geoms))
        assert chain.full_available_size() == want
        held = [sum(n * b.page_bytes for n, b in zip(counts.held, g.bands)) / g.chain_bytes for g in geoms]
        assert chain.usage() == max(held)


def test_stages_agree_on_every_iteration_of_mixed_traffic():
    """PP-2, PP-10, PP-11: two stages with different arenas and bytes per token serve a few hundred
    iterations of mixed traffic (admission, chunked prefill, decode, prefix sharing, retraction,
    relief, opportunistic compaction) with no relay between them: every iteration's digest agrees,
    and every stage holds the same units and made the same admissions. Every take decided on the
    snapshots was realized on each stage's real layout, in place or by relief."""
    from kvchain.alloc.chain import ChainAllocator

    reliefs = {0: 0, 1: 0}
    relieve = ChainAllocator._relieve
    pools = stage_pools(12, admission="optimistic")  # optimistic admission retracts; exact never does
    index = {id(p.chain): i for i, p in enumerate(pools)}

    def counting(self, pages):
        reliefs[index[id(self)]] += 1
        return relieve(self, pages)

    ChainAllocator._relieve = counting
    try:
        loops = run_stages_in_process(pools, traffic(), 300)
    finally:
        ChainAllocator._relieve = relieve
    assert len(loops[0].digests) == 300 and loops[0].digests == loops[1].digests
    summaries = [loop.summary() for loop in loops]
    assert summaries[0]["decisions"] == summaries[1]["decisions"]
    assert summaries[0]["preemptions"] > 0 and summaries[0]["finished"] > 10
    assert reliefs[0] > 0 and summaries[0]["moves"] > 0
    # the real layouts differ (the larger stage never needed to compact), the units held do not
    assert summaries[0]["moves"] != summaries[1]["moves"]
    assert [b.n_live for b in pools[0].chain.bands] == [b.n_live for b in pools[1].chain.bands]
    assert np.array_equal(pools[0].storage.table.page_table, pools[1].storage.table.page_table)
    for pool in pools:
        pool.chain.verify_byte_accounting()


def test_without_stage_capacity_the_stages_diverge():
    """PP-8 (the reason for it): asked of its own arena only, each stage admits differently."""
    pools = stage_pools(install=False)
    loops = [StageLoop(p, traffic()) for p in pools]
    for loop in loops:
        while not loop.sched.idle and loop.sched.step_no < 300:
            loop.sched.step()
    assert loops[0].summary()["decisions"] != loops[1].summary()["decisions"]


def test_gemma3_stages_admit_what_the_snapshots_predict(monkeypatch):
    """PP-7, PP-8, PP-10: a Gemma-3-like model split so that its stages differ in bytes per token:
    the concurrency and every admission decision are the same on both stages, and each equals what
    every stage's simulated snapshot, rebuilt here from the geometries and the shared counts, says."""
    pools = stage_pools()
    asked: dict[int, list] = {0: [], 1: []}
    admits = type(pools[0].chain).admits

    def recording(self, demand, reclaimable=None):
        answer = admits.__wrapped__(self, demand, reclaimable)
        geoms = self.stage_capacity.geometries
        counts = shared_counts(self)
        ids = all(demand.virtual_pages <= g.virtual_ids - counts.virtual_held
                  + (reclaimable[-1] if reclaimable else 0) for g in geoms)
        predicted = ids and all(
            feasible(reclaimed_snapshot(simulated_snapshot(g, counts), reclaimable or (0,) * len(g.bands)),
                     demand.pages) for g in geoms)
        asked[0 if self is pools[0].chain else 1].append((demand, reclaimable, answer, predicted))
        return answer

    monkeypatch.setattr(type(pools[0].chain), "admits", recording)
    run_stages_in_process(pools, traffic(), 300)
    assert len(asked[0]) > 100 and asked[0] == asked[1]
    assert all(answer == predicted for _d, _r, answer, predicted in asked[0])
    assert {answer for *_rest, answer, _p in asked[0]} == {True, False}
    plans = [p.plan for p in pools]
    sized = size_stages(plans, spec().budget_bytes, context_len=256, max_running_requests=16)
    assert sized.concurrency == min(s.concurrency for s in sized.stages)


def test_only_a_load_reservation_fixes_pages_and_it_ends_when_the_tree_names_the_rows():
    """PP-12: a stage's fixed pages are a load's window reservation; the simulated snapshots count
    them (once) while reserved, and once `name_loaded_window_rows_by_owner` binds them the band holds no
    fixed page."""
    pools = stage_pools()
    for pool in pools:
        row = _fill(pool, 12)
        vpages = pool.storage.table.page_table[row, :3].copy()
        window = pool.plan.sub_pools[0].name
        pool.storage.release_to_tree(row, 3)  # the prefix tree keeps the pages; the row ends
        pool.storage.free_rows(np.array([row]))
        pool.storage.free_window_rows(window, vpages[:2])
        _pages, reservation = pool.storage.alloc_load(window, 2)
        band = pool.chain.bands[0]
        # counted once: the two loaded pages are live pages held in place, beside the row left
        assert band.n_fixed == 2 and band.n_live == 3 and shared_counts(pool.chain).held[0] == 3
        pool.tree.name_loaded_window_rows_by_owner(window, reservation, vpages[:2])
        assert band.n_fixed == 0 and not band.fixed_mask.any()
    assert shared_counts(pools[0].chain) == shared_counts(pools[1].chain)


def test_the_owner_may_take_every_byte_every_stage_has():
    """PP-14: no separate cap on live full-attention tokens: the owner alone fills the smallest
    stage's chain, as far as its bytes (and ids) allow."""
    pools = stage_pools()
    chain = pools[1].chain
    assert chain.caps is None
    small = chain.stage_capacity.geometries[0]
    up, owner = small.bands
    up_top = up.origin + up.first_id * up.page_bytes  # the empty window band's base
    most = min(owner.n_pages - max(owner.first_id, -(-(up_top - owner.origin) // owner.page_bytes)),
               small.virtual_ids)
    assert most * owner.page_bytes > 0.9 * small.chain_bytes
    assert chain.units_fit([0, most]) and not chain.units_fit([0, most + 1])


# -- the digest ------------------------------------------------------------------------------------


def test_the_digest_folds_questions_answers_and_units(monkeypatch):
    """PP-15: at level 1 and above each stage folds its questions, their answers and the units it
    holds; at level 0 nothing is folded."""
    pools = stage_pools()
    caps = [p.chain.stage_capacity for p in pools]
    assert caps[0].take_digest() == caps[1].take_digest()
    pools[0].chain.units_fit([1, 1])
    assert caps[0].questions == 1 and caps[0].take_digest() != caps[1].take_digest()
    pools[0].chain.units_fit([1, 1])
    pools[1].chain.units_fit([1, 2])  # another question, the same answer
    assert caps[0].take_digest() != caps[1].take_digest()
    _fill(pools[0], 4)  # other units held
    assert caps[0].take_digest() != caps[1].take_digest()
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "0")
    pools[1].chain.units_fit([1, 1])
    assert caps[1].questions == 0


def test_a_corrupted_count_fails_agreement_on_the_next_iteration():
    """PP-16, CHK-9: one stage's count is corrupted mid-run; the very next iteration's digest differs
    from the previous stage's and `chain.stage_capacity_agreement` fails, fatally at level 1."""
    pools = stage_pools()
    loops = [StageLoop(p, traffic()) for p in pools]
    for it in range(40):
        digests = [loop.iterate() for loop in loops]
        stage_capacity.check_stage_agreement(digests[1], digests[0], 1, it)
    pools[1].chain.bands[1].n_live += 1
    digests = [loop.iterate() for loop in loops]
    with pytest.raises(InvariantError, match=r"chain\.stage_capacity_agreement: iteration 40: stage 1"):
        stage_capacity.check_stage_agreement(digests[1], digests[0], 1, 40)


def test_the_digest_checks_need_one_receive_per_iteration(monkeypatch):
    """PP-17: with the checks on, a loop that receives requests less often than every iteration is
    refused; with the checks off it may run."""
    pool = stage_pools()[0]
    with pytest.raises(InputError, match="receive interval of 1"):
        StageLoop(pool, traffic(4), recv_interval=2)
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "0")
    StageLoop(pool, traffic(4), recv_interval=2)


def test_a_chain_without_stages_answers_from_its_own_snapshot():
    """Without stage capacity the chain prices its own layout alone."""
    pools = stage_pools(install=False)
    chain = pools[1].chain
    assert chain.stage_capacity is None
    fits = [n for n in range(1, chain.owner.grid.n_grid) if feasible(chain.pricing_snapshot(), (n, n))]
    assert chain.units_fit([fits[-1]] * 2) and not chain.units_fit([fits[-1] + 1] * 2)


# -- kvchain plan --pp -------------------------------------------------------------------------------


def test_plan_pp_prints_each_stage_and_the_reduced_concurrency(capsys):
    """PP-1, PP-3: `kvchain plan --pp 2` sizes each stage's layers; JSON keys are snake_case and the
    concurrency is the least of the stages'."""
    import json

    from kvchain.cli import main

    args = ["plan", "--model", "gemma-3-12b", "--budget", "20GiB", "--pp", "2", "--pp-partition", "26,22"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["stages"]
    assert [(s["first_layer"], s["last_layer"]) for s in stages] == [(0, 25), (26, 47)]
    assert stages[0]["bytes_per_token"] > stages[1]["bytes_per_token"]
    assert report["concurrency"] == min(s["sizing"]["concurrency"] for s in stages)
    assert stages[0]["sizing"]["concurrency"] != stages[1]["sizing"]["concurrency"]
    keys = {k for s in stages for k in (*s, *s["geometry"], *s["geometry"]["bands"][0])} | set(report)
    assert all(k == k.lower() and " " not in k and "-" not in k for k in keys)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    assert f"MIN-reduce across stages: {report['concurrency']} requests" in text


def test_plan_pp_refuses_a_partition_with_one_line(capsys):
    """PP-4: a stage of only sliding-window layers is refused on one line, exit code 2."""
    from kvchain.cli import main

    assert main(["plan", "--model", "gemma-3-12b", "--budget", "20GiB", "--pp", "2", "--pp-partition", "5,43"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stage 0 (layers 0..4) has no full-attention layer" in err
