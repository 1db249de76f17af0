"""Planning refuses meaningless arguments as one `InputError` naming what was passed: a bool or
float page size, declarations that are not `KVLayerDecl`s, stage counts and layer partitions
that are not integers (never truncated)."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.decl import MHA, FullLifetime, KVLayerDecl, KVPart
from kvchain.errors import InputError, PlanError
from kvchain.models.small import small_hybrid
from kvchain.plan import StagePartitionError, plan_kv_storage, stage_layer_ranges

DECLS = small_hybrid(MHA(2, 64), (128,))


@pytest.mark.parametrize("page_size", [True, False, 16.0, "16", None, 0, -16, np.bool_(True)])
def test_a_page_size_that_is_not_a_positive_integer_is_refused(page_size):
    with pytest.raises(InputError, match="page size") as e:
        plan_kv_storage(DECLS, page_size=page_size)
    assert repr(page_size) in str(e.value)


def test_a_numpy_page_size_plans_as_its_int():
    plan = plan_kv_storage(DECLS, page_size=np.int64(16))
    assert type(plan.page_size) is int and plan.to_dict() == plan_kv_storage(DECLS, page_size=16).to_dict()


@pytest.mark.parametrize(("decls", "needle"), [
    ([1, 2], "decls"),
    ([*DECLS, "layer"], "decls"),
    (5, "decls"),
    ([KVPart(MHA(2, 64), FullLifetime())], "decls"),
])
def test_declarations_that_are_not_layer_decls_are_refused(decls, needle):
    with pytest.raises(InputError, match=needle):
        plan_kv_storage(decls)


def test_a_draft_that_is_not_layer_decls_is_refused():
    with pytest.raises(InputError, match="draft"):
        plan_kv_storage(DECLS, draft=[7])
    with pytest.raises(InputError, match="draft_offset"):
        plan_kv_storage(DECLS, draft=[KVLayerDecl(0, (KVPart(MHA(2, 64), FullLifetime()),))], draft_offset=5.5)


def test_no_declarations_is_still_a_plan_error():
    with pytest.raises(PlanError, match="no layers declared"):
        plan_kv_storage([])


@pytest.mark.parametrize(("args", "needle"), [
    ((2.5, 1), "n_layers"),
    ((True, 1), "n_layers"),
    (("4", 2), "n_layers"),
    ((-4, 2), "n_layers"),
    ((4, True), "stages"),
    ((4, 2.0), "stages"),
    ((4, 2, ["a", "b"]), "partition"),
    ((4, 2, [1.5, 2.5]), "partition"),
    ((4, 2, [True, 3]), "partition"),
    ((4, 2, 5), "partition"),
])
def test_stage_arguments_that_are_not_integers_are_refused(args, needle):
    with pytest.raises(InputError, match=needle) as e:
        stage_layer_ranges(*args)
    assert repr(args[-1] if needle == "partition" else args[0 if needle == "n_layers" else 1]) in str(e.value)


def test_a_fractional_partition_is_not_truncated_into_a_valid_one():
    # 1.5 + 2.5 = 4 layers; truncated, [1, 2] was refused for summing to 3, and named as [1, 2]
    with pytest.raises(InputError, match=r"\[1\.5, 2\.5\]"):
        stage_layer_ranges(4, 2, [1.5, 2.5])
    with pytest.raises(InputError):  # truncated, [2.0, 2.9] gave a valid [2, 2]
        stage_layer_ranges(4, 2, [2.0, 2.9])


def test_valid_stage_arguments_are_unchanged():
    assert stage_layer_ranges(np.int64(12), np.int64(2)) == [range(0, 6), range(6, 12)]
    assert stage_layer_ranges(12, 2, (np.int64(7), 5)) == [range(0, 7), range(7, 12)]
    with pytest.raises(StagePartitionError):
        stage_layer_ranges(12, 2, (12, 0))
    with pytest.raises(StagePartitionError):
        stage_layer_ranges(0, 1)
