"""`examples/own_engine.py`, the integration guide's complete loop, runs as documented: a toy hybrid
served through one `KVStorage` under the overlap scheduler on `ThreadDevice`, with preemption,
window retirement, compaction and float relocation, gives every request the tokens the same model
gives densely, one request at a time; and its comparison catches a forward that reads the pool
through untranslated ids."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from kvchain.alloc.runner_ids import RunnerIds
from kvchain.storage import KVStorage

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "own_engine.py"
#: a budget at which 24 requests preempt, move pages and relocate the window band
TIGHT_KIB = 520


@pytest.fixture(scope="module")
def own_engine():
    spec = importlib.util.spec_from_file_location("own_engine", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["own_engine"] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("own_engine", None)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_the_example_matches_the_dense_model_under_pressure(own_engine, overlap):
    figures = own_engine.run(24, TIGHT_KIB, seed=0, overlap=overlap)  # raises on a token that differs
    assert figures["preemptions"] > 0
    assert figures["window_pages_retired"] > 0
    assert figures["pages_moved"] > 0
    assert figures["float_relocations"] > 0


def test_the_example_catches_a_forward_reading_virtual_page_ids(own_engine, monkeypatch):
    """The page tables handed to the forward are the rows' virtual page ids, as an engine that
    forgot to translate would read: once a page moves, the tokens differ from the dense model's."""
    translate = KVStorage.runner_ids

    def untranslated(self, rows):
        read = translate(self, rows)
        width = next(iter(read.page_tables.values())).shape[1]
        virtual = self.table.page_table[np.asarray(rows)][:, :width]
        return RunnerIds({name: virtual.copy() for name in read.page_tables}, read.state_slots)

    monkeypatch.setattr(KVStorage, "runner_ids", untranslated)
    with pytest.raises(AssertionError, match="!= dense"):
        own_engine.run(24, TIGHT_KIB, seed=0)


def _draw(seed: int) -> dict:
    """A configuration of the example's engine from `seed` alone: page size, token budget, batch
    cap, budget (from below the floor to roomy), request count and overlap."""
    rng = np.random.default_rng(seed)
    return {
        "page_size": int(rng.choice([1, 2, 4, 8, 16, 32, 64])),
        "token_budget": int(rng.choice([2, 3, 8, 17, 32, 96, 256])),
        "max_running": int(rng.choice([1, 2, 4, 8, 16])),
        "budget_kib": int(rng.choice([420, 470, 520, 600, 700, 900, 1200, 4000])),
        "requests": int(rng.choice([4, 12, 24])),
        "overlap": bool(rng.random() < 0.75),
    }


@pytest.mark.sweep
@pytest.mark.parametrize("seed", range(120))
def test_the_example_matches_the_dense_model_on_drawn_configurations(own_engine, seed):
    """Every drawn configuration the pool accepts serves every request with the dense model's tokens
    and leaves the pool idle; one it cannot serve is refused with a typed error before a token is
    wrong (a budget below the floor, a request the pool cannot hold even alone)."""
    from kvchain.errors import BudgetError, CapacityError

    c = _draw(seed)
    model, reqs = own_engine.ToyHybrid(seed), own_engine.make_requests(c["requests"], seed)
    try:
        engine = own_engine.OwnEngine(model, c["budget_kib"] * 1024, page_size=c["page_size"],
                                      max_running=c["max_running"], token_budget=c["token_budget"],
                                      overlap=c["overlap"])
    except BudgetError:
        pytest.skip(f"below the floor: {c}")
    try:
        engine.serve(reqs)
    except CapacityError as e:
        assert "raise the budget" in str(e), (c, e)  # a request the pool cannot hold even alone
        pytest.skip(f"a request larger than the pool: {c}")
    finally:
        engine.device.close()
    for req in reqs:
        assert req.output == model.generate_dense(req.prompt, req.max_new), (c, req.rid)
