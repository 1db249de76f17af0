"""Every mutant is caught by the check it targets: proof that each check sees the fault it is for."""

from __future__ import annotations

import pytest

from kvchain import faults
from kvchain.errors import InputError
from kvchain.testing import checks
from kvchain.testing.harness import Case, minimize, run_case, seed_case
from kvchain.testing.mutants import MUTANTS, applied

#: within how many seeds (of 400 operations) each mutant must be caught; the first catching seed is
#: far below each bound (see docs/stress.md), and a run stops at its first catch
BOUNDS = {
    "skip_war_barrier": 8, "free_to_holes": 10, "skip_settle_wait": 10, "skip_zeroing": 16, "unzeroed_growth": 24,
    "reuse_vacated": 60, "move_without_writer_wait": 8, "skip_fence_waits": 8, "skip_copy_clearance": 12,
    "read_after_settle": 8, "free_on_fired_event": 16, "holes_by_fired_event": 12, "never_end_uses": 8,
    "keep_fences": 8, "release_network_early": 8, "lose_move_copy": 8,
}


def _first_catch(name: str, seeds, n_ops: int = 400) -> tuple[int, Case, object] | None:
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
    assert len(MUTANTS) >= 10 and set(BOUNDS) == set(MUTANTS)
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
    """HARN-6..12: injected, the fault fails the check it targets within a bounded number of seeds."""
    found = _first_catch(name, range(BOUNDS[name]))
    assert found is not None, f"{name} not caught by {MUTANTS[name].target} within {BOUNDS[name]} seeds"
    _seed, _case, failure = found
    assert MUTANTS[name].target in failure.checks


@pytest.mark.parametrize("name", ["skip_settle_wait", "read_after_settle", "lose_move_copy"])
def test_a_minimized_mutant_case_replays_and_is_minimal(name, tmp_path):
    """HARN-13, HARN-16: the shrunk case, saved and loaded, replays to the same failure, and
    removing any one of its operations makes it pass."""
    target = MUTANTS[name].target
    _seed, case, failure = _first_catch(name, range(BOUNDS[name]))
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
def test_mutant_sweep(name):
    """HARN-18: the fuller version: caught at 400 and at 1,000 operations per seed, and every first
    catch shrinks to a minimal case that replays."""
    target = MUTANTS[name].target
    for n_ops in (400, 1000):
        found = _first_catch(name, range(4 * BOUNDS[name]), n_ops)
        assert found is not None, (name, n_ops)
    _seed, case, failure = found
    with applied(name):
        small = minimize(case, failure, check=target, until=target)
        assert small.failure is not None and target in small.failure["checks"]
