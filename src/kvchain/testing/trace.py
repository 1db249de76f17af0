"""Allocator traces (TRACE-1..6): record the calls a scheduler makes on the pool, with their results
and the allocator's decisions, then replay them against another checkout and report where it
first differs.

A run is a list of steps (`{"call": "admit", "tokens": 40, "as": "a"}`) over an `Adapter`, the
scheduler-level surface a trace drives: `StorageAdapter` over a real `KVStorage`, or any stand-in
with the same calls. Steps come from a scenario file (`tests/scenarios/*.json`, which also say
which configurations they need and may state the outcome a step must have) or from a seed. A
recorded trace is JSONL, one run per line: its configuration, and per call its arguments, its
result and the decisions the allocator logged (`ChainAllocator.decisions`)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from ..alloc.signals import NetworkTransfer
from ..decl import MHA, State, StateTensor
from ..device.modeled import ModeledDevice
from ..engine.steps import Forward, StepSequence
from ..errors import CapacityError, InputError
from ..models.small import small_hybrid
from ..plan import PoolKind, plan_kv_storage

FORMAT_VERSION = 1
REFUSED = "refused"

# ----------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class TraceConfig:
    """A chain to trace against: page size, window lengths, a state sub-pool or not, and its size
    in owner pages (so a scenario means the same at page size 1 and 64)."""

    name: str
    page_size: int
    windows: tuple[int, ...]
    state: bool
    chain_pages: int = 48
    rows: int = 16
    context_pages: int = 32
    state_floats: int = 256

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TraceConfig:
        data = dict(data)
        data["windows"] = tuple(data["windows"])
        return cls(**data)

    @property
    def context(self) -> int:
        return self.context_pages * self.page_size


#: the model shapes `kvchain trace record` traces at each page size
SHAPES: tuple[tuple[str, tuple[int, ...], bool], ...] = (
    ("hybrid", (2,), True),  # state end, one window (in pages), full attention
    ("two-windows", (4, 1), True),
    ("dense-window", (2,), False),
)


def configs_for(page_sizes: Sequence[int]) -> list[TraceConfig]:
    out = []
    for ps in page_sizes:
        for name, windows, state in SHAPES:
            out.append(TraceConfig(f"{name}/ps{ps}", ps, tuple(w * ps for w in windows), state))
    return out


def build_storage(config: TraceConfig, device=None):
    """The traced chain: float16 attention (one KV head) and float32 state, on a CPU arena."""
    from ..build import build_kv_storage
    from ..sizing import size_plan

    ssm = State((StateTensor("ssm", (config.state_floats,), "float32"),)) if config.state else None
    plan = plan_kv_storage(small_hybrid(MHA(1, 8, dtype="float16"), config.windows, state=ssm),
                           page_size=config.page_size)
    chain_bytes = config.chain_pages * sum(p.page_bytes for p in plan.sub_pools if p.kind is not PoolKind.STATE)
    if plan.state is not None:
        chain_bytes += config.rows * plan.state.page_bytes // 2
    kwargs = dict(context_len=config.context, max_running_requests=config.rows,
                  state_slots=1 if config.state else None)
    probe = size_plan(plan, 2**34, **kwargs)
    sizing = size_plan(plan, probe.fixed.total + chain_bytes, **kwargs)
    storage = build_kv_storage(plan, sizing, "cpu", backend=device or ModeledDevice(seed=0))
    storage.allocator.compaction_gap_fraction = 1.0
    return storage


# ----------------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    requires: dict
    steps: tuple[dict, ...]
    chain_pages: int | None = None

    def selected_by(self, config: TraceConfig) -> bool:
        """Whether `config` has what the scenario needs (TRACE-5)."""
        req = self.requires
        if req.get("state") and not config.state:
            return False
        if len(config.windows) < req.get("min_windows", 0):
            return False
        sizes = req.get("page_sizes")
        if sizes is not None and config.page_size not in sizes:
            return False
        return config.page_size <= req.get("max_page_size", config.page_size)

    def config_for(self, config: TraceConfig) -> TraceConfig:
        if self.chain_pages is None:
            return config
        return TraceConfig(**{**asdict(config), "chain_pages": self.chain_pages, "windows": config.windows})


def load_scenario(path: str | Path) -> Scenario:
    try:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "trace-scenario":
            raise ValueError("not a trace scenario (kind != 'trace-scenario')")
        return Scenario(data["name"], data.get("description", ""), dict(data.get("requires", {})),
                        tuple(data["steps"]), data.get("chain_pages"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"cannot read trace scenario {path}: {e}") from None


def load_scenarios(folder: str | Path) -> list[Scenario]:
    """Every trace scenario in a folder (other JSON files there, such as saved stress cases, are skipped)."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind == "trace-scenario":
            out.append(load_scenario(path))
    return out


def select(config: TraceConfig, scenarios: Iterable[Scenario]) -> list[str]:
    return [s.name for s in scenarios if s.selected_by(config)]


# ----------------------------------------------------------------------------------- adapters


class Adapter(Protocol):
    """The scheduler-level calls a trace makes. Requests, slot groups and transfers are named by
    the step (`as`) and passed back by name. A refused allocation returns `REFUSED` and changes
    nothing; `decisions()` returns (and forgets) what the allocator decided since the last call."""

    def admit(self, name: str, tokens: int) -> object: ...
    def decode(self, names: Sequence[str]) -> object: ...
    def free(self, name: str) -> object: ...
    def advance(self, names: Sequence[str]) -> object: ...
    def launch(self) -> object: ...
    def process(self) -> object: ...
    def flush(self) -> object: ...
    def ensure(self, pages: Sequence[int]) -> object: ...
    def alloc_slots(self, name: str, n: int) -> object: ...
    def free_slots(self, name: str) -> object: ...
    def load(self, name: str, pages: int) -> object: ...
    def end_load(self, name: str) -> object: ...
    def send(self, name: str, req: str) -> object: ...
    def end_send(self, name: str) -> object: ...
    def decisions(self) -> list: ...


class StorageAdapter:
    """The real pool: a `KVStorage` on a modeled device. Forwards write their requests' newest
    tokens and stay in flight until processed, so frees under them pend; launching, processing,
    flushing and the idle checks go through the one step sequence (`engine.steps`)."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.storage = build_storage(config)
        self.chain = self.storage.allocator
        self.chain.decisions = []
        self.device = self.storage.device
        self.rows: dict[str, int] = {}
        self.slots: dict[str, np.ndarray] = {}
        self.loads: dict[str, object] = {}
        self.sends: dict[str, NetworkTransfer] = {}
        #: a trace's steps launch and process one at a time: the sequence keeps any number in flight
        self.steps: StepSequence[None] = StepSequence(self.storage)
        self.unwritten: dict[str, int] = {}

    def decisions(self) -> list:
        out, self.chain.decisions = self.chain.decisions, []
        return [_plain(d) for d in out]

    def admit(self, name: str, tokens: int) -> object:
        storage = self.storage
        if not storage.table.free_rows:
            return REFUSED
        row = storage.alloc_row()
        try:
            vtok = storage.alloc_extend(np.array([row]), np.array([tokens]))
        except CapacityError:
            storage.table.free_row(row)
            return REFUSED
        self.rows[name] = row
        self.unwritten[name] = tokens
        return len(vtok)

    def decode(self, names: Sequence[str]) -> object:
        rows = np.array([self.rows[n] for n in names], dtype=np.int64)
        try:
            self.storage.alloc_decode(rows)
        except CapacityError:
            return REFUSED
        for n in names:
            self.unwritten[n] = self.unwritten.get(n, 0) + 1
        return len(rows)

    def free(self, name: str) -> object:
        row = self.rows.pop(name)
        self.unwritten.pop(name, None)
        self.storage.free_rows(np.array([row]))
        return True

    def advance(self, names: Sequence[str]) -> object:
        return int(self.storage.advance(np.array([self.rows[n] for n in names], dtype=np.int64)))

    def launch(self) -> object:
        storage, device = self.storage, self.device
        names = [n for n, k in self.unwritten.items() if k]
        rows = np.array([self.rows[n] for n in names], dtype=np.int64)
        table = storage.table
        parts = []
        for n, row in zip(names, rows):
            end = int(table.seq_lens[row])
            pos = np.arange(end - self.unwritten[n], end)
            parts.append(table.page_table[row, pos // self.config.page_size] * self.config.page_size
                         + pos % self.config.page_size)
            self.unwritten[n] = 0
        vtok = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        ids = storage.iteration_ids(vtok, rows if len(rows) else None)

        def reads(step: int) -> None:  # no kernels: a forward with no shared-read end (LIFE-5)
            device.launch(device.forward_stream, None, label=f"forward:{step}")

        return self.steps.launch(Forward(reads, ids=ids), None).step

    def process(self) -> object:
        if not self.steps.in_flight:
            return None
        return self.steps.process_oldest().step

    def flush(self) -> object:
        return int(self.steps.flush())

    def ensure(self, pages: Sequence[int]) -> object:
        return bool(self.chain.ensure_capacity(list(pages)))

    def alloc_slots(self, name: str, n: int) -> object:
        if self.chain.state_band is None:
            return REFUSED
        try:
            self.slots[name] = self.storage.alloc_state_slots(n)
        except CapacityError:
            return REFUSED
        return n

    def free_slots(self, name: str) -> object:
        self.storage.free_state_slots(self.slots.pop(name))
        return True

    def load(self, name: str, pages: int) -> object:
        storage = self.storage
        owner = self.chain.owner.name
        try:
            ids, reservation = storage.alloc_load(owner, pages)
        except CapacityError:
            return REFUSED
        done = self.device.record(self.device.stream("copy"), f"{name} done")
        transfer = storage.record_host_transfer(name, True, {owner: ids}, done)
        storage.end_load_reservations(owner, reservation)
        self.loads[name] = (ids, transfer)
        return [int(i) for i in ids]

    def end_load(self, name: str) -> object:
        ids, transfer = self.loads.pop(name)
        self.device.host_wait(transfer.done)
        self.storage.end_host_transfer(transfer)
        owner = self.chain.owner
        vpages = self.chain.virtual_free.pop(len(ids))  # the tree takes the pages, then lets them go
        owner.bind(vpages, ids)
        self.storage.free_virtual_pages(vpages)
        return len(ids)

    def send(self, name: str, req: str) -> object:
        storage = self.storage
        vpages = storage.table.pages_of(self.rows[req])
        owner = self.chain.owner.name
        device = self.device
        device.launch(device.stream("network"), None, label=name)
        transfer = NetworkTransfer(name, sends=True, done=device.record(device.stream("network"), f"{name} done"),
                                   id=len(self.sends) + 1)
        storage.record_network_transfer(transfer, {owner: storage.physical_pages(owner, vpages)})
        self.sends[name] = transfer
        return len(vpages)

    def end_send(self, name: str) -> object:
        transfer = self.sends.pop(name)
        self.device.host_wait(transfer.done)
        self.storage.end_network_transfer(transfer)
        return True

    def drain(self) -> None:
        """Process every forward and end every transfer, then check the pool at idle (CHK-15)."""
        self.steps.drain()
        for name in list(self.sends):
            self.end_send(name)
        for name in list(self.loads):
            self.end_load(name)
        self.steps.check_idle({self.chain.state_band.name: sum(len(s) for s in self.slots.values())}
                              if self.chain.state_band is not None else None)


def _plain(x: object) -> object:
    """JSON-able: tuples to lists, numpy scalars to Python numbers, enums to their value."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


# ----------------------------------------------------------------------------------- steps


_ARGS = {
    "admit": ("tokens",), "decode": ("reqs",), "free": ("req",), "advance": ("reqs",), "launch": (),
    "process": (), "flush": (), "ensure": ("pages",), "alloc_slots": ("n",), "free_slots": ("slots",),
    "load": ("pages",), "end_load": ("load",), "send": ("req",), "end_send": ("send",),
}


def apply_step(adapter: Adapter, step: dict) -> object:
    """Run one step on an adapter and return its result (JSON-able)."""
    call = step.get("call")
    if call not in _ARGS:
        raise InputError(f"unknown trace call {call!r} in {step}")
    name = step.get("as", "")
    if call == "admit":
        return adapter.admit(name, int(step["tokens"]))
    if call in ("decode", "advance"):
        return getattr(adapter, call)(list(step["reqs"]))
    if call == "free":
        return adapter.free(step["req"])
    if call in ("launch", "process", "flush"):
        return getattr(adapter, call)()
    if call == "ensure":
        return adapter.ensure(list(step["pages"]))
    if call == "alloc_slots":
        return adapter.alloc_slots(name, int(step["n"]))
    if call == "free_slots":
        return adapter.free_slots(step["slots"])
    if call == "load":
        return adapter.load(name, int(step["pages"]))
    if call == "end_load":
        return adapter.end_load(step["load"])
    if call == "send":
        return adapter.send(name, step["req"])
    return adapter.end_send(step["send"])


def _check_expect(step: dict, result: object) -> str | None:
    """A scenario may state a step's outcome: `"ok"` (not refused), `"refused"`, or a value."""
    if "expect" not in step:
        return None
    want = step["expect"]
    ok = (result != REFUSED) if want == "ok" else (result == want)
    return None if ok else f"expected {want!r}, got {result!r}"


def seeded_steps(seed: int, n: int, config: TraceConfig) -> list[dict]:
    """A random but always valid step list: requests are named as they are admitted, and a step
    names only requests (slot groups, loads, sends) that exist at that point of the list."""
    rng = random.Random(seed)
    live: list[str] = []
    slot_groups: list[str] = []
    loads: list[str] = []
    sends: list[str] = []
    steps: list[dict] = []
    lengths: dict[str, int] = {}
    context = config.context
    n_bands = len(config.windows) + 1 + int(config.state)
    for counter in range(1, n + 1):
        kind = rng.choices(("admit", "decode", "free", "advance", "launch", "process", "flush", "ensure",
                            "slots", "load", "send"), weights=(6, 8, 4, 2, 6, 5, 3, 2, 2, 2, 2))[0]
        if kind == "admit" or not live:
            tokens = rng.randint(1, context // 2)
            steps.append({"call": "admit", "tokens": tokens, "as": f"r{counter}"})
            live.append(f"r{counter}")
            lengths[f"r{counter}"] = tokens
        elif kind == "decode":
            reqs = [r for r in rng.sample(live, k=min(len(live), rng.randint(1, 4))) if lengths[r] < context]
            if reqs:
                steps.append({"call": "decode", "reqs": reqs})
                for r in reqs:
                    lengths[r] += 1
        elif kind == "free":
            r = rng.choice(live)
            live.remove(r)
            steps.append({"call": "free", "req": r})
        elif kind == "advance":
            steps.append({"call": "advance", "reqs": rng.sample(live, k=min(len(live), 2))})
        elif kind in ("launch", "process", "flush"):
            steps.append({"call": kind})
        elif kind == "ensure":
            steps.append({"call": "ensure", "pages": [rng.randint(0, config.chain_pages // 4) for _ in range(n_bands)]})
        elif kind == "slots" and config.state:
            if slot_groups and rng.random() < 0.5:
                steps.append({"call": "free_slots", "slots": slot_groups.pop(0)})
            else:
                steps.append({"call": "alloc_slots", "n": rng.randint(1, 3), "as": f"s{counter}"})
                slot_groups.append(f"s{counter}")
        elif kind == "load":
            if loads and rng.random() < 0.5:
                steps.append({"call": "end_load", "load": loads.pop(0)})
            else:
                steps.append({"call": "load", "pages": rng.randint(1, 4), "as": f"l{counter}"})
                loads.append(f"l{counter}")
        elif kind == "send":
            if sends and rng.random() < 0.5:
                steps.append({"call": "end_send", "send": sends.pop(0)})
            else:
                r = rng.choice(live)
                steps.append({"call": "send", "req": r, "as": f"t{counter}"})
                sends.append(f"t{counter}")
    return steps


# ----------------------------------------------------------------------------------- record, replay


@dataclass
class TraceRun:
    """One recorded run: its configuration, where its steps came from, and each call's record."""

    name: str
    config: TraceConfig
    source: dict
    calls: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "run": self.name, "config": self.config.to_json(), "source": self.source,
                "calls": self.calls}

    @classmethod
    def from_json(cls, data: dict) -> TraceRun:
        if data.get("version") != FORMAT_VERSION:
            raise InputError(f"trace run of format {data.get('version')!r}, expected {FORMAT_VERSION}")
        return cls(data["run"], TraceConfig.from_json(data["config"]), dict(data["source"]), list(data["calls"]))


def _skip_refused(step: dict, result: object, refused: set[str]) -> None:
    """A refused allocation names nothing: later steps naming it do nothing."""
    if result == REFUSED and "as" in step:
        refused.add(step["as"])


def _names(step: dict) -> list[str]:
    out = []
    for key in ("req", "slots", "load", "send"):
        if key in step:
            out.append(step[key])
    out += step.get("reqs", [])
    return out


def record(adapter: Adapter, steps: Sequence[dict], name: str, config: TraceConfig, source: dict) -> TraceRun:
    """Run `steps` on `adapter`, recording each call's result and decisions (TRACE-1). A step
    naming something refused earlier is recorded as skipped; a stated outcome that does not hold
    is recorded as `expect_failed`."""
    run = TraceRun(name, config, source)
    refused: set[str] = set()
    for step in steps:
        if step.get("call") in ("decode", "advance"):
            step = {**step, "reqs": [r for r in step["reqs"] if r not in refused]}
        if any(n in refused for n in _names(step)) or step.get("reqs") == []:
            run.calls.append({"step": step, "skipped": True})
            if "as" in step:
                refused.add(step["as"])
            continue
        try:
            result = _plain(apply_step(adapter, step))
        except InputError:
            raise
        except Exception as e:  # the pool broke: record where and how, and stop this run there
            run.calls.append({"step": step, "raised": f"{type(e).__name__}: {e}", "decisions": adapter.decisions()})
            break
        _skip_refused(step, result, refused)
        entry = {"step": step, "result": result, "decisions": adapter.decisions()}
        problem = _check_expect(step, result)
        if problem is not None:
            entry["expect_failed"] = problem
        run.calls.append(entry)
    return run


@dataclass(frozen=True)
class Divergence:
    call: int
    what: str

    def describe(self, run: str) -> str:
        return f"{run}: first divergence at call {self.call}: {self.what}"


def replay(adapter: Adapter, run: TraceRun) -> Divergence | None:
    """Replay a recorded run on `adapter`; the first call whose result or decisions differ
    (TRACE-2), or None when every call matches."""
    for i, entry in enumerate(run.calls):
        if entry.get("skipped"):
            continue
        step = entry["step"]
        try:
            result = _plain(apply_step(adapter, step))
        except InputError:
            raise
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
            if raised.split(":")[0] == str(entry.get("raised", "")).split(":")[0]:
                return None  # broke where the recorded run broke, the same way
            return Divergence(i, f"{_step_text(step)} raised {raised}")
        if "raised" in entry:
            return Divergence(i, f"{_step_text(step)}: returned {result!r}, recorded raising {entry['raised']}")
        if result != entry["result"]:
            return Divergence(i, f"{_step_text(step)}: result {result!r}, recorded {entry['result']!r}")
        got = adapter.decisions()
        want = entry["decisions"]
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mine = got[k] if k < len(got) else "nothing"
            theirs = want[k] if k < len(want) else "nothing"
            return Divergence(i, f"{_step_text(step)}: decision {k} is {_short(mine)}, recorded {_short(theirs)}")
    return None


def _step_text(step: dict) -> str:
    args = " ".join(f"{k}={v}" for k, v in step.items() if k not in ("call", "expect"))
    return f"{step.get('call')}({args})"


def _short(x: object, limit: int = 140) -> str:
    text = json.dumps(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def record_runs(page_sizes: Sequence[int], scenarios: Sequence[Scenario], seeds: Sequence[int],
                steps_per_seed: int = 120) -> Iterator[TraceRun]:
    """Every configuration at each page size: the scenarios it selects, then the seeded runs (TRACE-2/3)."""
    for config in configs_for(page_sizes):
        for scenario in scenarios:
            if scenario.selected_by(config):
                cfg = scenario.config_for(config)
                yield record(StorageAdapter(cfg), scenario.steps, f"{scenario.name}@{config.name}", cfg,
                             {"scenario": scenario.name})
        for seed in seeds:
            steps = seeded_steps(seed, steps_per_seed, config)
            yield record(StorageAdapter(config), steps, f"seed{seed}@{config.name}", config, {"seed": seed})


def write_jsonl(runs: Iterable[TraceRun], path: str | Path) -> int:
    """Write `runs` one a line; the file appears whole or not at all (a run that fails half-way
    leaves no partial trace behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    n = 0
    try:
        with partial.open("w") as f:
            for run in runs:
                f.write(json.dumps(run.to_json(), separators=(",", ":")) + "\n")
                n += 1
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return n


def read_jsonl(path: str | Path) -> Iterator[TraceRun]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read trace {path}: {e}") from None
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield TraceRun.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}:{k}: not a trace run: {e}") from None
