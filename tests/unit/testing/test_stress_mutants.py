"""Every mutant is caught by the check it targets: proof that each check sees the fault it is for."""

from __future__ import annotations

import pytest

from kvchain import faults
from kvchain.errors import InputError
from kvchain.testing import checks
from kvchain.testing.harness import Case, minimize, run_case, seed_case
from kvchain.testing.mutant_table import mutant_row
from kvchain.testing.mutants import MUTANTS, applied

#: operations per seed in the mutant tests and the catch-rate table (docs/stress.md)
N_OPS = 200
#: two seeds whose 200-operation run each mutant's target check fails on the modeled device (from
#: `kvchain stress --mutant-table --seeds 0:50 --ops 200`): the quick default-suite check
CATCHING = {"skip_war_barrier": [0, 2], "free_to_holes": [3, 4], "skip_settle_wait": [3, 4], "skip_zeroing": [3, 7], "unzeroed_growth": [3, 8], "reuse_vacated": [7, 11], "move_without_writer_wait": [0, 1], "skip_fence_waits": [3, 7], "skip_copy_clearance": [0, 3], "read_after_settle": [0, 3], "free_on_fired_event": [0, 1], "holes_by_fired_event": [6, 7], "never_end_uses": [0, 1], "keep_fences": [0, 3], "release_network_early": [2, 3], "lose_move_copy": [0, 1]}
#: the goal: each mutant's target check catches this share of seeds 0:50 (200 operations, modeled)
#: and of seeds 0:20 (300 operations, threads); docs/stress.md lists the mutants still short of it
GOAL_RATE = 0.2
#: seeds of 0:50 at 200 operations each mutant's target check catches on the modeled device today
#: (deterministic): the sweep holds each to at least this many, or to the goal where it is reached
CAUGHT_OF_50 = {"skip_war_barrier": 25, "free_to_holes": 15, "skip_settle_wait": 14, "skip_zeroing": 20, "unzeroed_growth": 11, "reuse_vacated": 10, "move_without_writer_wait": 38, "skip_fence_waits": 23, "skip_copy_clearance": 28, "read_after_settle": 33, "free_on_fired_event": 21, "holes_by_fired_event": 11, "never_end_uses": 47, "keep_fences": 25, "release_network_early": 33, "lose_move_copy": 49}
#: seeds of 0:20 at 300 operations caught on threads today; real threads interleave differently
#: each run, so the sweep holds each to half of it (at least one)
CAUGHT_OF_20_THREADS = {"skip_war_barrier": 6, "free_to_holes": 5, "skip_settle_wait": 5, "skip_zeroing": 13, "unzeroed_growth": 12, "reuse_vacated": 5, "move_without_writer_wait": 14, "skip_fence_waits": 5, "skip_copy_clearance": 5, "free_on_fired_event": 17, "holes_by_fired_event": 7, "never_end_uses": 19, "keep_fences": 11, "release_network_early": 5, "lose_move_copy": 20}


def _first_catch(name: str, seeds, n_ops: int = N_OPS) -> tuple[int, Case, object] | None:
    target = MUTANTS[name].target
    with applied(name):
        for seed in seeds:
            case = seed_case(seed, n_ops)
            case.mutant = name
            result = run_case(case, until=target)
            if result.failure is not None:
                return seed, case, result.failure
    return None


def test_mutants_are_named_and_cover_every_check():
    """HARN-5..12: at least ten mutants, lowercase identifiers, together aimed at all six checks."""
    assert len(MUTANTS) >= 10 and set(CATCHING) == set(MUTANTS)
    assert all(name.isidentifier() and name.islower() for name in MUTANTS)
    assert {m.target for m in MUTANTS.values()} == set(checks.CHECKS)


def test_each_mutant_switches_one_fault_point_on_only_while_applied():
    """A mutant patches nothing: it switches its own named fault point on for the body of
    `applied`, and every real run has none on."""
    assert not faults.ACTIVE
    points = {m.fault for m in MUTANTS.values()}
    assert points <= faults.POINTS and len(points) == len(MUTANTS)
    for name, m in MUTANTS.items():
        with applied(name):
            assert {m.fault} == faults.ACTIVE, name
        assert not faults.ACTIVE
    with pytest.raises(InputError), faults.injected("no_such_point"):
        pass


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught_by_its_target_check(name):
    """HARN-6..12: injected, the fault fails the check it targets on each of two seeds known to
    reach its hazard (a run stops at the target's first failure; another check's does not count)."""
    row = mutant_row(name, CATCHING[name], N_OPS)
    assert row.caught == CATCHING[name], f"{name}: {MUTANTS[name].target} caught only seeds {row.caught}"


def test_real_devices_hold_mutants_to_a_payload_divergence_or_ledger_check():
    """HARN-14: on threads and CUDA only the payload, divergence and ledger checks apply, so each
    mutant names the one of those that shows its hazard there, or why a real device cannot."""
    real = {checks.LOST_WRITE, checks.RANK_DIVERGENCE, checks.LEDGER_LEAK}
    for m in MUTANTS.values():
        if m.real_target is None:
            assert m.real_reason, m.name
        else:
            assert m.real_target in real and not m.real_reason, m.name
            assert m.real_target == m.target or m.target not in real, m.name
    assert [m.name for m in MUTANTS.values() if m.real_target is None] == ["read_after_settle"]


@pytest.mark.parametrize("name", ["skip_settle_wait", "read_after_settle", "lose_move_copy"])
def test_a_minimized_mutant_case_replays_and_is_minimal(name, tmp_path):
    """HARN-13, HARN-16: the shrunk case, saved and loaded, replays to the same failure, and
    removing any one of its operations makes it pass."""
    target = MUTANTS[name].target
    _seed, case, failure = _first_catch(name, CATCHING[name])
    with applied(name):
        small = minimize(case, failure, check=target, until=target)
        path = small.save(tmp_path / f"{name}.json")
        loaded = Case.load(path)
        replayed = run_case(loaded, until=target)
        assert replayed.failure is not None
        assert replayed.failure.op == loaded.failure["op"] and list(replayed.failure.checks) == loaded.failure["checks"]
        assert target in replayed.failure.checks
        assert len(loaded.ops) < len(case.ops)
        for i in range(len(loaded.ops)):
            shorter = Case(loaded.config, loaded.ops[:i] + loaded.ops[i + 1:], name)
            result = run_case(shorter)
            assert result.failure is None, f"still fails without op {i}: {result.failure.describe()}"


@pytest.mark.sweep
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_catch_rate(name):
    """HARN-6..12, HARN-18: each mutant's target check catches at least GOAL_RATE of seeds 0:50 at
    200 operations on the modeled device (or, short of it, as many as it does today), and its first
    catch shrinks to a minimal case that fails the same check."""
    target = MUTANTS[name].target
    row = mutant_row(name, range(50), N_OPS)
    floor = min(CAUGHT_OF_50[name], int(GOAL_RATE * 50))
    assert len(row.caught) >= floor, f"{name}: {target} caught {len(row.caught)} of 50 seeds: {row.caught}"
    _seed, case, failure = _first_catch(name, row.caught[:1])
    with applied(name):
        small = minimize(case, failure, check=target, until=target)
        assert small.failure is not None and target in small.failure["checks"]


#: the mutants threads show at the goal rate; the rest (docs/stress.md) are caught on some runs and
#: on none on others, since real threads do not replay, so no rate of theirs can be held
THREADS_AT_GOAL = sorted(n for n, m in MUTANTS.items()
                         if m.real_target is not None and CAUGHT_OF_20_THREADS[n] >= GOAL_RATE * 20)


@pytest.mark.sweep
@pytest.mark.parametrize("name", THREADS_AT_GOAL)
def test_mutant_catch_rate_on_threads(name):
    """HARN-14, HARN-18: on worker threads with seeded launch delays, each mutant threads show at
    the goal rate is caught by its payload, divergence or ledger check in seeds 0:20 at 300
    operations, in at least half the goal's seeds (real threads do not replay)."""
    row = mutant_row(name, range(20), 300, device="threads")
    floor = int(GOAL_RATE * 20) // 2
    assert len(row.caught) >= floor, f"{name}: {row.target} caught {len(row.caught)} of 20 seeds: {row.caught}"


#: scenario families and a fault each puts in reach, with seeds whose family run alone reaches it
#: (for the ordering faults, chains without the write-after-read barrier, where nothing else orders
#: the schedule stream after a running forward's reads)
FAMILY_HAZARDS = [("frees_under_queued_forward", "free_to_holes", (1, 3, 7)),
                  ("frees_under_queued_forward", "skip_settle_wait", (1, 3, 7)),
                  ("moves_under_queued_forward", "reuse_vacated", (1, 3, 7)),
                  ("state_then_growth", "skip_zeroing", (4, 7, 9)),
                  ("float_over_state", "unzeroed_growth", (3, 8, 9)),
                  ("frees_under_transfer", "skip_copy_clearance", (1, 2, 3)),
                  ("frees_under_transfer", "release_network_early", (0, 4, 8))]


@pytest.mark.parametrize(("family", "name", "seeds"), FAMILY_HAZARDS, ids=[f"{f}-{n}" for f, n, _ in FAMILY_HAZARDS])
def test_a_family_run_alone_reaches_its_hazard(family, name, seeds):
    """HARN-3, HARN-6..11: one run of a scenario family, from a fresh pool, passes every check on
    the sound pool and fails the target check of the fault it puts in reach: the family builds
    the hazard from ordinary operations, not from knowledge of the fault."""
    import random

    from kvchain.testing.harness_config import config_for_seed
    from kvchain.testing.harness_profiles import FAMILIES

    target = MUTANTS[name].target
    for seed in seeds:
        config = config_for_seed(seed)
        ops = FAMILIES[family](random.Random(seed), config)
        clean = run_case(Case(config, ops))
        assert clean.failure is None, f"seed {seed}: {clean.failure.describe()}"
        with applied(name):
            result = run_case(Case(config, ops, name), until=target)
        assert result.failure is not None and target in result.failure.checks, f"seed {seed}: {name} not caught"
