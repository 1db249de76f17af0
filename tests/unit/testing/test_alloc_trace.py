"""Allocator traces: scenarios, configurations, recording and replaying against two implementations."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchain.alloc.band import Band
from kvchain.testing import trace
from kvchain.testing.trace import REFUSED, StorageAdapter

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


class StandIn:
    """A pool with no layout at all: a budget of bytes, each token page and each state slot a fixed
    price. It answers the same calls, which is all a trace replay needs."""

    def __init__(self, budget: int, page: int = 1, slot: int = 1, page_size: int = 16) -> None:
        self.free_bytes = budget
        self.page, self.slot, self.ps = page, slot, page_size
        self.held: dict[str, int] = {}
        self.steps = 0

    def _take(self, name: str, cost: int) -> object:
        if cost > self.free_bytes:
            return REFUSED
        self.free_bytes -= cost
        self.held[name] = self.held.get(name, 0) + cost
        return cost

    def admit(self, name, tokens):
        return REFUSED if self._take(name, -(-tokens // self.ps) * self.page + self.slot) == REFUSED else tokens

    def decode(self, names):
        return len(names)

    def free(self, name):
        self.free_bytes += self.held.pop(name)
        return True

    def advance(self, names):
        return 0

    def launch(self):
        self.steps += 1
        return self.steps

    def process(self):
        return None

    def flush(self):
        return 0

    def ensure(self, pages):
        return sum(pages) * self.page <= self.free_bytes

    def alloc_slots(self, name, n):
        return REFUSED if self._take(name, n * self.slot) == REFUSED else n

    def free_slots(self, name):
        return self.free(name)

    def load(self, name, pages):
        return REFUSED if self._take(name, pages * self.page) == REFUSED else list(range(pages))

    def end_load(self, name):
        return self.free(name) and 0

    def send(self, name, req):
        return 0

    def end_send(self, name):
        return True

    def decisions(self):
        return []


def _scenario(name: str) -> trace.Scenario:
    return trace.load_scenario(SCENARIOS / f"{name}.json")


def test_scenario_replays_against_a_stand_in_adapter():
    """TRACE-4: `state_slots_exhausted` meets every outcome it states on a stand-in, and its recorded
    trace replays there to the call; a stand-in with one more slot of room diverges at the call
    that now succeeds."""
    scenario = _scenario("state_slots_exhausted")
    config = trace.configs_for([16])[0]
    run = trace.record(StandIn(budget=12), scenario.steps, scenario.name, config, {"scenario": scenario.name})
    assert not [c for c in run.calls if "expect_failed" in c]
    results = [c.get("result") for c in run.calls]
    assert REFUSED in results and results[0] == 1
    assert trace.replay(StandIn(budget=12), run) is None
    found = trace.replay(StandIn(budget=13), run)
    assert found is not None
    first_refused = results.index(REFUSED)
    assert found.call == first_refused and "recorded 'refused'" in found.what


def test_configurations_select_the_scenarios_they_can_run():
    """TRACE-5: a scenario runs on the configurations that have what it needs."""
    scenarios = trace.load_scenarios(SCENARIOS)
    names = {s.name for s in scenarios}
    assert {"state_slots_exhausted", "window_retire_under_forward", "two_floats_relocate", "network_send_vacates",
            "load_reservation", "pending_settle"} <= names
    chosen = {c.name: set(trace.select(c, scenarios)) for c in trace.configs_for([1, 16, 64])}
    common = {"window_retire_under_forward", "network_send_vacates", "load_reservation", "pending_settle"}
    assert chosen["hybrid/ps1"] == common | {"state_slots_exhausted"}
    assert chosen["two-windows/ps16"] == common | {"state_slots_exhausted", "two_floats_relocate"}
    assert chosen["two-windows/ps64"] == common | {"two_floats_relocate"}
    assert chosen["dense-window/ps1"] == chosen["dense-window/ps64"] == common
    assert chosen["hybrid/ps64"] == common


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_every_scenario_holds_its_outcomes_on_the_real_allocator(page_size):
    """TRACE-2: every selected scenario meets the outcomes it states, leaves the pool clean at idle,
    and its recorded run replays to the call."""
    scenarios = trace.load_scenarios(SCENARIOS)
    for config in trace.configs_for([page_size]):
        for scenario in scenarios:
            if not scenario.selected_by(config):
                continue
            cfg = scenario.config_for(config)
            adapter = StorageAdapter(cfg)
            run = trace.record(adapter, scenario.steps, scenario.name, cfg, {"scenario": scenario.name})
            assert not [c for c in run.calls if "expect_failed" in c or "raised" in c], (scenario.name, config.name)
            adapter.drain()
            assert trace.replay(StorageAdapter(cfg), run) is None


def test_seeded_traces_record_and_replay_through_the_real_allocator(tmp_path, monkeypatch):
    """TRACE-1, TRACE-3, TRACE-6: seeded runs recorded to JSONL replay call for call on the same
    allocator; a changed hole choice shows as the first divergence of the runs it changes."""
    path = tmp_path / "base.jsonl"
    n = trace.write_jsonl(trace.record_runs([1, 16], [], seeds=range(2), steps_per_seed=100), path)
    runs = list(trace.read_jsonl(path))
    assert n == len(runs) == 2 * len(trace.SHAPES) * 2
    assert all(len(r.calls) <= 100 for r in runs)  # no-state shapes skip slot steps; a pool crash ends a run
    assert sum(len(c.get("decisions", [])) for r in runs for c in r.calls) > 500
    for run in runs:
        assert trace.replay(StorageAdapter(run.config), run) is None, run.name

    original = Band._take_holes
    monkeypatch.setattr(Band, "_take_holes", lambda self, k, fired: original(self, k, fired)[::-1].copy())
    found = [trace.replay(StorageAdapter(r.config), r) for r in runs]
    diverged = [d for d in found if d is not None]
    assert diverged and all("decision" in d.what or "result" in d.what for d in diverged)


def test_replay_names_the_first_decision_that_differs(monkeypatch):
    """TRACE-2: a replay whose calls all return what was recorded but whose allocator decided
    one thing differently diverges at that call, naming the first differing decision."""
    runs = list(trace.record_runs([16], [], seeds=range(1), steps_per_seed=60))
    run = next(r for r in runs if any(c.get("decisions") for c in r.calls))
    first = next(i for i, c in enumerate(run.calls) if c.get("decisions"))
    original = StorageAdapter.decisions

    def one_changed(self):
        got = original(self)
        if got and not getattr(self, "changed", False):
            self.changed = True
            return [["a different decision"], *got[1:]]
        return got

    monkeypatch.setattr(StorageAdapter, "decisions", one_changed)
    found = trace.replay(StorageAdapter(run.config), run)
    assert found is not None and found.call == first
    assert "decision 0 is" in found.what and "a different decision" in found.what, found.what
