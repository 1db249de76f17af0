"""`PoolConfig` refuses a waiting order, an eviction order or an admission mode it does not know
when it is made (an `InputError` listing the allowed values, the same constants the CLI's choices
use), instead of passing it through `compare` to be read as the default."""

from __future__ import annotations

import dataclasses

import pytest

from kvchain.engine.policies import ADMISSION_MODES
from kvchain.errors import InputError, KVChainError
from kvchain.sim.baselines import PoolConfig
from kvchain.sim.waiting import EVICTION_ORDERS, WAITING_ORDERS


@pytest.mark.parametrize(("field", "allowed"), [
    ("waiting_order", WAITING_ORDERS),
    ("eviction", EVICTION_ORDERS),
    ("admission", ADMISSION_MODES),
])
@pytest.mark.parametrize("bad", ["nope", "", None, "FCFS"])
def test_an_unknown_choice_is_refused_at_construction(field, allowed, bad):
    with pytest.raises(InputError) as info:
        PoolConfig(1 << 20, **{field: bad})
    assert isinstance(info.value, KVChainError)
    text = str(info.value)
    assert "\n" not in text and field in text and repr(bad) in text
    assert all(choice in text for choice in allowed)
    with pytest.raises(InputError):
        dataclasses.replace(PoolConfig(1 << 20), **{field: bad})


def test_every_allowed_choice_is_taken():
    for order in WAITING_ORDERS:
        assert PoolConfig(1 << 20, waiting_order=order).waiting_order == order
    for order in EVICTION_ORDERS:
        assert PoolConfig(1 << 20, eviction=order).eviction == order
    for mode in ADMISSION_MODES:
        assert PoolConfig(1 << 20, admission=mode).admission == mode
    cfg = PoolConfig(1 << 20)
    assert (cfg.waiting_order, cfg.eviction, cfg.admission) == ("fcfs", "waiting-aware", "optimistic")
