"""The page-safety stress harness: its sequences, its ranks, shrinking and saved cases."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from kvchain.testing import harness
from kvchain.testing.harness import Case, Rank, config_for_seed, ddmin, generate_ops, run_case, seed_case

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def test_seeds_vary_the_chain_and_the_timing():
    """HARN-2, HARN-4: owner end, one or two floating windows and a state end; page sizes 1, 2 and 4;
    page bytes that differ per band; two ranks with different timing."""
    configs = [config_for_seed(s) for s in range(40)]
    assert {c.page_size for c in configs} == {1, 2, 4}
    assert {len(c.windows) for c in configs} == {1, 2}
    assert {c.war_barrier for c in configs} == {True, False}
    for c in configs:
        assert c.timing[0] != c.timing[1]
        storage = harness.harness_storage(c, harness.HarnessDevice(c.timing[0]))
        kinds = [b.pool.kind.value for b in storage.allocator.bands]
        assert kinds[0] == "state" and kinds[-1] == "full" and set(kinds[1:-1]) == {"window"}
    page_bytes = {b.page_bytes for b in harness.harness_storage(configs[0], harness.HarnessDevice(
        configs[0].timing[0])).allocator.bands}
    assert len(page_bytes) > 1


def test_operations_are_json_and_deterministic():
    """HARN-1: a seed's sequence is plain JSON and the same every time."""
    ops = generate_ops(7, 300)
    assert ops == generate_ops(7, 300) and ops != generate_ops(8, 300)
    assert json.loads(json.dumps(ops)) == ops
    assert set(harness.OP_WEIGHTS) >= {op["op"] for op in ops}


def test_seeds_draw_every_profile_and_splice_its_families():
    """HARN-1, HARN-3: every nine seeds draw each profile in its share; a profile's sequence holds
    its scenario families' runs (here `compaction_under_decode`'s free of the older of two new
    requests) and only known operations; the original mix holds none."""
    from kvchain.testing.harness_profiles import PROFILE_CYCLE, PROFILES

    assert Counter(config_for_seed(s).profile for s in range(9)) == Counter(PROFILE_CYCLE)
    assert set(PROFILE_CYCLE) == set(PROFILES)
    for seed in range(9):
        case = seed_case(seed, 300)
        assert {op["op"] for op in case.ops} <= set(harness.OP_WEIGHTS)
        spliced = any(op == {"op": "free", "pick": -2} for op in case.ops)
        assert spliced == (case.config.profile != "mixed"), (seed, case.config.profile)


def test_a_profile_opening_runs_first_and_leaves_the_rest_of_its_draws():
    """HARN-1, HARN-3: a profile's opening family (`timing`: `float_over_state`) runs first, on the
    fresh pool, from a generator of its own, so the rest of the sequence is what the profile draws
    without an opening, shifted by the opening's length."""
    import dataclasses
    import random

    from kvchain.testing.harness_profiles import FAMILIES, PROFILES

    config = config_for_seed(3)
    assert config.profile == "timing" and PROFILES["timing"].opening == ("float_over_state",)
    ops = harness.generate_ops(3, 300, config)
    opening = FAMILIES["float_over_state"](random.Random(3 * 7793 + 5), config)
    assert ops[:len(opening)] == opening
    plain = dataclasses.replace(PROFILES["timing"], opening=())
    rest = plain.generate(random.Random(3 * 104729 + 3), 300, config)
    assert ops[len(opening):] == rest[:300 - len(opening)]

def test_a_seed_runs_clean_and_exercises_every_operation():
    """HARN-3, HARN-5: overlapped forwards, frees under them, window retirement, host-tier loads and
    backups, network sends and receives, flushes, reliefs, float relocations, state copies and
    hand-out zeroing all happen, with every check after every operation."""
    outcomes: Counter = Counter()
    decisions: Counter = Counter()
    zeroed = 0
    for seed in range(6):
        case = seed_case(seed, 300)
        rank = Rank(case.config, 0)
        for op in [*case.ops, harness.FINAL]:
            outcome = rank.step(op)
            outcomes[(op["op"], outcome.split()[0].rstrip("0123456789") if outcome else "")] += 1
            decisions.update(d[0] if d[0] != "stream_wait" else d[2].split(" under")[0].split(" left")[0]
                             for d in rank.take_decisions())
            assert rank.take_findings() == []
        zeroed += sum(b.stats["zeroed_pages"] for b in rank.chain.bands)
    for kind, first in [("forward", "launched"), ("process", "processed"), ("free", "freed"), ("load", "load"),
                        ("backup", "backup"), ("send", "send"), ("publish", "published"), ("copy_state", "copied"),
                        ("relayout", "relayout"), ("relief", "relief"), ("flush", "moved"), ("quiesce", "quiet")]:
        assert outcomes[(kind, first)] > 0, (kind, first)
    assert decisions["relocate"] and decisions["move"] and decisions["settle pending"] and decisions["fence"]
    assert decisions["host_wait"] and decisions["take"]
    assert zeroed > 0


def test_any_subsequence_is_a_valid_sequence():
    """HARN-13: operations pick among what exists when they run, so dropping any of them leaves a
    sequence that runs (and on a sound pool, passes): what shrinking relies on."""
    rng = random.Random(0)
    for seed in (1, 2, 3):
        ops = generate_ops(seed, 200)
        kept = [op for op in ops if rng.random() < 0.5]
        result = run_case(Case(config_for_seed(seed), kept))
        assert result.failure is None, result.failure.describe()


def test_ddmin_finds_a_one_minimal_subsequence():
    """HARN-13: removing any single item of the result makes the predicate false."""
    def fails(items):
        return {3, 17} <= set(items) and sum(items) % 2 == 0

    small = ddmin(list(range(40)), fails)
    assert fails(small)
    assert all(not fails(small[:i] + small[i + 1:]) for i in range(len(small)))


def test_threads_device_runs_the_same_operations():
    """HARN-14's CPU counterpart: the same operations on real threads, with payload, divergence and
    ledger checks."""
    for seed in (0, 1):
        result = run_case(seed_case(seed, 150), device="threads")
        assert result.failure is None, result.failure.describe()


def test_a_saved_case_round_trips(tmp_path):
    """HARN-16: a case saves as JSON and loads back unchanged."""
    case = seed_case(3, 50)
    case.mutant = "keep_fences"
    case.description = "a round trip"
    path = case.save(tmp_path / "case.json")
    back = Case.load(path)
    assert back.to_json() == case.to_json()
    with pytest.raises(Exception, match="cannot read stress case"):
        Case.load(tmp_path / "missing.json")


def test_a_case_saved_with_workarounds_still_loads(tmp_path):
    """HARN-16: cases saved while the harness offered known-bug workarounds carry a "workarounds" key;
    it loads, is ignored, and is not written back."""
    data = seed_case(3, 20).to_json()
    data["workarounds"] = ["vacated_hole_count"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    back = Case.load(path)
    assert "workarounds" not in back.to_json()
    assert back.ops == data["ops"] and back.config.to_json() == data["config"]


def _replay_saved(name: str):
    case = Case.load(SCENARIOS / f"{name}.json")
    assert case.failure is None and case.mutant is None, "a regression case expects no failure"
    return run_case(case)


def test_fixed_bug_moves_under_a_send_keep_the_hole_count():
    """COMP-18, CHK-15: regression for a fixed pool bug the harness found. A move whose sources a network
    send reads vacates them; the destination holes it filled must leave `n_holes` (`Band._vacate_sources`).
    Before the fix the saved case failed `chain.byte_accounting` right after its flush."""
    result = _replay_saved("stress_vacated_hole_count")
    assert result.failure is None, result.failure.describe()


def test_fixed_bug_relief_keeps_network_rows_in_place():
    """ALLOC-7, ALLOC-14, CAP-11: regression for a fixed pool bug the harness found. A relief plan priced
    with network-held rows in place is realized by an urgent flush that steps over those rows
    (`Band.flush_for_allocation(hold_network)`). Before the fix the flush moved them, the plan no longer
    served the demand, and a refused admission changed the pool."""
    result = _replay_saved("stress_relief_moves_network_rows")
    assert result.failure is None, result.failure.describe()


def test_fixed_bug_relief_recovers_after_its_transfer_wait():
    """ALLOC-7, ALLOC-15, CAP-11: regression for a fixed pool bug the harness found. Relief's second pass
    host-waits the network transfers, then recovers again (settles pending batches, parks floats left empty)
    before pricing its plan. Before the fix it priced a recovered chain over pending pages and an unparked
    empty float, and a refused admission changed the pool."""
    result = _replay_saved("stress_relief_second_pass_unrecovered")
    assert result.failure is None, result.failure.describe()


def test_threads_gate_holds_work_until_the_host_is_operations_on():
    """HARN-14: with `gate_ops`, work launched on the forward stream waits until the host has
    reached the seeded number of operations (schedule-stream work does not), and a host wait opens
    every gate, so the host never waits work it holds."""
    import threading
    import time

    from kvchain.device.threads import ThreadDevice

    device = ThreadDevice(seed=0, gate_ops=3)  # random.Random(0).randint(0, 3) draws 3 first
    ran, scheduled = threading.Event(), threading.Event()
    try:
        device.launch(device.forward_stream, ran.set, label="forward")
        device.launch(device.schedule_stream, scheduled.set, label="zero")
        assert scheduled.wait(5)
        for _ in range(2):
            device.host_op()
        time.sleep(0.05)
        assert not ran.is_set()
        device.host_op()
        assert ran.wait(5)
        held = threading.Event()
        device.launch(device.forward_stream, held.set, label="forward")  # the next draw holds it too
        time.sleep(0.05)
        assert not held.is_set()
        device.host_wait(device.record(device.forward_stream, "done"), timeout=5)
        assert held.is_set()
    finally:
        device.close()


def test_threads_host_wait_opens_only_the_gates_its_event_can_depend_on():
    """HARN-14: a host wait opens the gates made before its event was recorded (the held work the
    event can depend on, on its own stream or on one it waits), and work launched after the event
    stays held until the host is its operations on: a forward queued behind the one the host
    processes is still held when the schedule stream runs on."""
    import threading
    import time

    from kvchain.device.threads import ThreadDevice

    device = ThreadDevice(seed=0, gate_ops=100)  # random.Random(0).randint(0, 100) draws 49, 97, ...
    first, copied, second = threading.Event(), threading.Event(), threading.Event()
    try:
        device.launch(device.forward_stream, first.set, label="forward 1")
        done = device.record(device.forward_stream, "forward 1 done")
        copy = device.stream(device.COPY)
        device.stream_wait(copy, done)
        device.launch(copy, copied.set, label="copy")  # held too, and after forward 1
        device.stream_wait(device.schedule_stream, device.record(copy, "copy done"))
        after_copy = device.record(device.schedule_stream, "after the copy")
        device.launch(device.forward_stream, second.set, label="forward 2")
        device.host_wait(after_copy, timeout=5)  # opens forward 1's gate and the copy's
        assert first.is_set() and copied.is_set()
        time.sleep(0.05)
        assert not second.is_set(), "a host wait opened a gate made after its event"
        device.synchronize()
        assert second.is_set()
    finally:
        device.close()
