"""`KVStorage` as a facade: it plays every role in `storage_roles`, every public method has a role
that states its contract, it reaches nothing inside the allocator, and the import paths callers
use keep working."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import kvchain
from kvchain import storage as storage_module
from kvchain.alloc.chain import ChainAllocator
from kvchain.errors import InputError, KVChainError
from kvchain.storage import KVStorage, StorageStats, pages_for
from kvchain.storage_roles import ROLES
from support.chains import small_storage

#: what the facade may read of the allocator besides its methods: plain values, never its parts
_ALLOCATOR_VALUES = {"device", "move_epoch", "relocations"}  # plain counters and handles


def _role_members(role) -> set[str]:
    return {name for name in vars(role) if not name.startswith("_")}


def _public(cls) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_one_storage_plays_every_role():
    storage = small_storage()
    assert all(isinstance(storage, role) for role in ROLES)
    assert not inspect.isabstract(KVStorage)


def test_every_public_method_has_a_role_that_states_its_contract():
    declared = set().union(*(_role_members(role) for role in ROLES))
    assert _public(KVStorage) <= declared, sorted(_public(KVStorage) - declared)
    for role in ROLES:
        for name in _role_members(role):
            doc = inspect.getdoc(getattr(role, name))
            assert doc and len(doc.split()) >= 6, f"{role.__name__}.{name} states no contract"


def test_each_method_reads_its_role_s_contract_as_its_own():
    for role in ROLES:
        for name in _role_members(role):
            assert inspect.getdoc(getattr(KVStorage, name)) == inspect.getdoc(getattr(role, name)), name


def test_roles_do_not_overlap():
    seen: dict[str, str] = {}
    for role in ROLES:
        for name in _role_members(role):
            assert name not in seen, f"{name} is in both {seen[name]} and {role.__name__}"
            seen[name] = role.__name__


def _allocator_uses(source: str) -> set[str]:
    """Every attribute the module reads off the allocator (`self.allocator.x`, or `chain.x` after
    `chain = self.allocator`)."""
    tree = ast.parse(source)
    aliases = {"chain"}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            is_allocator = (isinstance(value, ast.Attribute) and value.attr == "allocator") or (
                isinstance(value, ast.Name) and value.id in aliases)
            if is_allocator:
                used.add(node.attr)
    return used


def test_the_facade_reaches_nothing_inside_the_allocator():
    used = _allocator_uses(Path(storage_module.__file__).read_text())
    methods = {name for name in dir(ChainAllocator)
               if not name.startswith("_") and callable(getattr(ChainAllocator, name))}
    assert used, "the facade reads nothing off the allocator: the check looks in the wrong place"
    assert used <= methods | _ALLOCATOR_VALUES, sorted(used - methods - _ALLOCATOR_VALUES)


def test_the_reach_check_sees_a_reach_into_bands():
    assert _allocator_uses("x = self.allocator.bands[3].held") == {"bands"}
    assert _allocator_uses("chain = self.allocator\nchain.owner.usage.record(u)") == {"owner"}


def test_import_paths_keep_working():
    assert kvchain.KVStorage is KVStorage
    assert StorageStats.__module__ == "kvchain.storage_roles.inspection"
    assert pages_for(5, 2) == 3


def test_unknown_sub_pools_raise_a_typed_error_naming_them():
    storage = small_storage()
    row = storage.alloc_row()
    vtok = storage.alloc_extend(np.array([row]), np.array([2]))
    calls = (lambda: storage.view("nope"), lambda: storage.physical_pages("nope", vtok),
             lambda: storage.alloc_load("nope", 1), lambda: storage.free_window_rows("nope", vtok))
    for call in calls:
        with pytest.raises(InputError, match="nope") as info:
            call()
        assert isinstance(info.value, KVChainError)


def test_build_rejects_a_sizing_of_another_plan_and_an_unknown_device():
    from kvchain.build import build_kv_storage
    from kvchain.plan import plan_kv_storage
    from kvchain.sizing import size_plan
    from support.chains import hybrid_decls

    plan = plan_kv_storage(hybrid_decls(), page_size=2)
    other = plan_kv_storage(hybrid_decls(windows=(32,)), page_size=2)
    sizing = size_plan(plan, 2**20, context_len=64, max_running_requests=4, state_slots=4)
    with pytest.raises(InputError, match=r"the plan has \['state', 'window32', 'full'\]"):
        build_kv_storage(other, sizing)
    with pytest.raises(InputError, match="no torch device 'warp-drive'"):
        build_kv_storage(plan, sizing, "warp-drive")
    assert build_kv_storage(plan, sizing).table.rows == 5
