"""The API boundary of `KVStorage`: ids and lengths are integers, in range, distinct where a call
needs it and owned by the caller, checked on the host with invariant checks off, and every public
call raises `KVChainError` only, leaving the pool as it was when it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchain.errors import InputError, InvariantError, KVChainError
from kvchain.storage_roles import boundary
from support.chains import allocator_state, same_state, small_storage
from support.contracts import assert_unchanged
from support.modeled import request


@pytest.fixture(autouse=True, scope="module")
def checks_off():
    """The boundary holds without the invariant checks: they stay at their default, off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAIN_INVARIANT_CHECK", "0")
        mp.setenv("KVCHAIN_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1")
        yield


# -- the checks, one by one ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [[150.7], [1.9], [True], ["3"], [None], [2**70], [[1, 2], [3]], 1.5])
def test_id_arrays_take_integers_only(values):
    with pytest.raises(InputError, match="integer"):
        boundary.id_array(values, "ids")


def test_id_arrays_take_any_integer_type_and_empty_sequences():
    assert boundary.id_array(np.array([3], dtype=np.uint8), "ids").tolist() == [3]
    assert boundary.id_array(np.int32(4), "ids").tolist() == [4]
    assert boundary.id_array([], "ids").dtype == np.int64
    with pytest.raises(InputError, match="int64 range"):
        boundary.id_array(np.array([2**63], dtype=np.uint64), "ids")


@pytest.mark.parametrize("value", [1.5, True, np.bool_(False), "2", None])
def test_scalars_take_integers_only(value):
    with pytest.raises(InputError, match="integer"):
        boundary.index(value, "n")


def n_state_slots(storage) -> int:
    return storage.arena.layout.grids[storage.plan.state.index].n_grid


def storage_with_rows(n=2, length=5):
    storage = small_storage()
    return storage, [request(storage, length)[0] for _ in range(n)]


@pytest.mark.parametrize("rows, lens, match", [
    ([1], [150.7], "integers"),
    ([1.9], [6], "integers"),
    ([True], [6], "integers"),
    ([1, 1], [6, 7], "named twice"),
    ([-1], [6], "outside the table"),
])
def test_extend_refuses_non_integer_negative_and_repeated_rows(rows, lens, match):
    storage, _ = storage_with_rows()
    assert_unchanged(storage, lambda: storage.alloc_extend(np.array(rows), np.array(lens)), InputError, match)


def test_a_negative_row_is_refused_even_when_the_last_row_is_in_use():
    storage = small_storage(rows=4)
    for _ in range(3):
        request(storage, 3)
    for call in (lambda: storage.alloc_decode(np.array([-1])), lambda: storage.free_rows(np.array([-1])),
                 lambda: storage.advance(np.array([-1]))):
        assert_unchanged(storage, call, InputError, "outside the table")


@pytest.mark.parametrize("call", ["alloc_decode", "free_rows", "advance"])
def test_a_row_named_twice_is_refused(call):
    storage, rows = storage_with_rows(length=40)
    assert_unchanged(storage, lambda: getattr(storage, call)(np.array([rows[0], rows[1], rows[0]])),
                     InputError, "named twice")


@pytest.mark.parametrize("checkpoints", [None, [40, 40, 30]])
def test_advance_refuses_a_row_named_twice_so_no_window_page_is_freed_twice(checkpoints):
    """WIN-1: `advance` retires each row's window pages by an ordinary free, once; a row named
    twice would free them twice, so the call is refused and the rows retire after."""
    storage, rows = storage_with_rows(length=40)
    named = np.array([rows[0], rows[1], rows[0]])
    assert_unchanged(storage, lambda: storage.advance(named, None if checkpoints is None else np.array(checkpoints)),
                     InputError, "named twice")
    assert storage.advance(np.array(rows), None if checkpoints is None else np.array([30, 40])) > 0
    storage.check_idle()


def test_advance_checkpoints_are_one_integer_per_row():
    storage, rows = storage_with_rows(length=40)
    assert_unchanged(storage, lambda: storage.advance(np.array(rows), np.array([1])), InputError, "against")
    assert_unchanged(storage, lambda: storage.advance(np.array(rows), np.array([1.5, 2.5])), InputError,
                     "integers")
    assert_unchanged(storage, lambda: storage.advance(np.array(rows), np.array([-1, 2])), InputError, "outside")


def test_a_state_slot_is_freed_once_and_only_by_its_holder():
    storage, rows = storage_with_rows()
    slot = storage.alloc_state_slots(1)
    storage.free_state_slots(slot)
    assert_unchanged(storage, lambda: storage.free_state_slots(slot), InputError, "freed already")
    never = np.setdiff1d(np.arange(n_state_slots(storage)), storage.table.state_slot)[-1:]
    assert_unchanged(storage, lambda: storage.free_state_slots(never), InputError, "never allocated")
    held = storage.table.state_slot[rows[:1]]
    assert_unchanged(storage, lambda: storage.free_state_slots(held), InputError, "belong to request rows")
    two = storage.alloc_state_slots(1)
    assert_unchanged(storage, lambda: storage.free_state_slots(np.r_[two, two]), InputError, "more than once")
    assert_unchanged(storage, lambda: storage.free_state_slots(np.array([10**6])), InputError, "outside")
    assert_unchanged(storage, lambda: storage.free_state_slots(np.array([0.5])), InputError, "integers")
    storage.free_state_slots(two)
    storage.free_rows(np.array(rows))
    storage.check_idle()


def test_a_virtual_page_is_freed_once_and_only_when_no_row_in_use_owns_it():
    """WIN-5: tree eviction is a logical free of pages the tree holds; a page a row in use owns is
    refused, since the row would go on reading (and later free) a page handed to someone else."""
    storage, rows = storage_with_rows()
    free_id = np.array([storage.allocator.virtual_free.view()[-1]])
    assert_unchanged(storage, lambda: storage.free_virtual_pages(free_id), InputError, "never allocated")
    assert_unchanged(storage, lambda: storage.free_virtual_pages(np.array([0])), InputError, "outside")
    pages = storage.table.pages_of(rows[0])
    assert_unchanged(storage, lambda: storage.free_virtual_pages(pages[:1].repeat(2)), InputError, "more than once")
    for some in (pages[:1], pages[-1:], pages):
        assert_unchanged(storage, lambda some=some: storage.free_virtual_pages(some), InputError, "belong to request rows")
    for window in ("window8", "window32"):
        assert_unchanged(storage, lambda window=window: storage.free_window_rows(window, pages[-1:]), InputError,
                         "belong to request rows")
    storage.release_to_tree(rows[0], len(pages))  # the tree takes them: no row owns them now
    storage.free_rows(np.array(rows[:1]))
    storage.check_idle({"full": len(pages), "window8": len(pages), "window32": len(pages)})
    storage.free_window_rows("window8", pages)
    storage.free_virtual_pages(pages)
    assert_unchanged(storage, lambda: storage.free_virtual_pages(pages[:1]), InputError, "freed already")
    storage.free_rows(np.array(rows[1:]))
    storage.check_idle()


def test_a_tree_page_a_new_row_took_is_that_row_s_own():
    """A page id the tree freed and a new row took is the new row's: the free is refused again."""
    storage, rows = storage_with_rows(n=1)
    pages = storage.table.pages_of(rows[0])
    storage.release_to_tree(rows[0], len(pages))
    storage.free_rows(np.array(rows))
    storage.free_virtual_pages(pages)
    row, _ = request(storage, 5)
    again = np.intersect1d(storage.table.pages_of(row), pages)
    assert len(again)  # the freed ids are reused first
    assert_unchanged(storage, lambda: storage.free_virtual_pages(again), InputError, "belong to request rows")


def test_an_insert_s_duplicates_go_with_release_to_tree_and_nothing_leaks():
    """The row's own pages the tree already held are freed by `release_to_tree`, and only those:
    another row's page, a page past `n_pages`, one of the tree-shared prefix, one named twice are
    refused with nothing changed; the row's columns of the freed pages read the null page."""
    storage, rows = storage_with_rows(length=8)  # 4 pages each
    mine, other = storage.table.pages_of(rows[0]), storage.table.pages_of(rows[1])
    storage.release_to_tree(rows[0], 1)
    # another row's page, one past n_pages, one of the tree-shared prefix, one named twice, the null page
    for dups in (other[1:2], mine[3:4], mine[:1], mine[1:2].repeat(2), np.array([0])):
        assert_unchanged(storage, lambda dups=dups: storage.release_to_tree(rows[0], 3, dups), InputError)
    assert int(storage.table.shared_pages[rows[0]]) == 1
    before = storage.stats().live_pages["full"]
    storage.release_to_tree(rows[0], 3, mine[1:3])
    assert storage.stats().live_pages["full"] == before - 2
    assert storage.table.page_table[rows[0], :4].tolist() == [mine[0], 0, 0, mine[3]]
    tree = {"full": 1, "window8": 1, "window32": 1}  # the page the tree kept of the row
    storage.check_idle(tree)
    storage.free_rows(np.array(rows))
    storage.check_idle(tree)
    storage.free_window_rows("window8", mine[:1])
    storage.free_window_rows("window32", mine[:1])
    storage.free_virtual_pages(mine[:1])
    storage.check_idle()


def test_bytes_that_passed_before_are_still_checked_for_rows_in_use():
    """An array is checked again once its contents change (in place, too), and rows are checked
    for being in use on every call, whatever their bytes passed before."""
    storage, rows = storage_with_rows(n=3)
    named = np.array(rows)
    storage.alloc_decode(named)
    storage.iteration_ids(storage.alloc_decode(named), named)
    storage.free_rows(named[2:])
    assert_unchanged(storage, lambda: storage.alloc_decode(named), InputError, "not")
    assert_unchanged(storage, lambda: storage.alloc_extend(named, np.array([9, 9, 9])), InputError, "not")
    named[2] = named[0]
    assert_unchanged(storage, lambda: storage.alloc_decode(named), InputError, "named twice")
    assert_unchanged(storage, lambda: storage.advance(named), InputError, "named twice")
    storage.runner_ids(named)  # repeats are fine to read
    assert_unchanged(storage, lambda: storage.alloc_decode(named), InputError, "named twice")
    named[2] = -1
    for call in (lambda: storage.runner_ids(named), lambda: storage.iteration_ids(np.array([0]), named),
                 lambda: storage.advance(named)):
        assert_unchanged(storage, call, InputError, "outside the table")
    written = storage.alloc_decode(named[:2])
    storage.iteration_ids(written)
    written[0] = -written[0]
    assert_unchanged(storage, lambda: storage.iteration_ids(written), InputError, "outside")
    written[0] = storage.allocator.n_virtual * storage.page_size
    assert_unchanged(storage, lambda: storage.iteration_ids(written), InputError, "outside")
    storage.free_rows(named[:2])
    storage.check_idle()


def test_window_calls_name_a_window_and_pages_it_binds():
    storage, rows = storage_with_rows()
    pages = storage.table.pages_of(rows[0])
    assert_unchanged(storage, lambda: storage.free_window_rows("full", pages), InputError, "not a window")
    assert_unchanged(storage, lambda: storage.free_window_rows(7, pages), InputError, "string")
    free_id = np.array([storage.allocator.virtual_free.view()[-1]])
    assert_unchanged(storage, lambda: storage.free_window_rows("window8", free_id), InputError, "does not hold")
    assert_unchanged(storage, lambda: storage.bind_window("window8", free_id, np.array([10**6])), InputError,
                     "outside")


def test_translation_refuses_ids_that_would_wrap():
    storage, _ = storage_with_rows()
    with pytest.raises(InputError, match="outside"):
        storage.iteration_ids(np.array([-1]))
    with pytest.raises(InputError, match="outside the table"):
        storage.runner_ids(np.array([-1]))
    with pytest.raises(InputError, match="outside"):
        storage.physical_pages("full", np.array([-1]))
    with pytest.raises(InputError, match="integer"):
        storage.seq_len(1.5)


def test_scalars_and_handles_are_typed():
    storage, rows = storage_with_rows()
    for call in (lambda: storage.alloc_state_slots(1.5), lambda: storage.alloc_state_slots(True),
                 lambda: storage.flush_opportunistic(-1), lambda: storage.forward_processed("step"),
                 lambda: storage.end_host_transfer(None), lambda: storage.alloc_load("full", 2.0),
                 lambda: storage.release_to_tree(rows[0], 99), lambda: storage.view(["full"])):
        assert_unchanged(storage, call, InputError)


def test_a_prefix_is_bound_pages_that_fit_the_table():
    storage, _ = storage_with_rows()
    row = storage.alloc_row()
    free_id = np.array([storage.allocator.virtual_free.view()[-1]])
    assert_unchanged(storage, lambda: storage.assign_prefix(row, free_id, 2, np.zeros(2, dtype=np.int64)),
                     InputError, "does not hold")
    many = np.arange(1, storage.table.max_pages + 2)
    assert_unchanged(storage, lambda: storage.assign_prefix(row, many, len(many) * 2, np.zeros(2, dtype=np.int64)),
                     InputError, "past the context")


def test_the_in_use_answer_remembered_for_an_array_ends_when_a_row_leaves_use():
    """The boundary remembers that an array's rows were in use until a row leaves use (the table's
    `row_frees`): the same bytes, named again after a free, are refused, whichever way the row left."""
    storage, rows = storage_with_rows(n=3)
    named = np.array(rows)
    storage.alloc_decode(named)
    storage.alloc_decode(named)  # remembered: no gather
    storage.free_rows(named)  # the same bytes: the answer was found before the free
    assert_unchanged(storage, lambda: storage.alloc_decode(named), InputError, "not")
    assert_unchanged(storage, lambda: storage.free_rows(named), InvariantError, r"requests\.row_state")
    storage, rows = storage_with_rows(n=3)
    named = np.array(rows)
    storage.alloc_decode(named)
    storage.free_rows(named[2:])
    storage.alloc_decode(named[:2])
    storage.table.free_row(rows[1])  # a row left use without passing the boundary
    assert_unchanged(storage, lambda: storage.alloc_decode(named[:2]), InputError, "not")


def test_a_row_freed_twice_still_names_the_row_state_check():
    storage, rows = storage_with_rows()
    storage.free_rows(np.array(rows[:1]))
    assert_unchanged(storage, lambda: storage.free_rows(np.array(rows[:1])), InvariantError, r"requests\.row_state")


# -- the fuzz: random valid and invalid calls ------------------------------------------------------

JUNK = st.sampled_from([1.5, True, "x", None, -1, 2**70, 10**6, [], [0.5, 1.0]])


def ids(known: list[int], hi: int):
    """Id arguments: known ids (repeats possible), random ints around the range, or junk."""
    some = st.sampled_from(known) if known else st.integers(0, hi)
    return st.one_of(
        st.lists(st.one_of(some, st.integers(-3, hi + 3)), max_size=4),
        st.lists(JUNK, min_size=1, max_size=2),
        JUNK,
    )


@st.composite
def call(draw, storage, rows: list[int], slots: list[int]):
    """One public call with arguments that may or may not be valid."""
    n_rows, n_virtual, n_slots = storage.table.rows, storage.allocator.n_virtual, n_state_slots(storage)
    r, s = ids(rows, n_rows), ids(slots + rows, n_slots)
    own = owned(storage)
    mine = st.lists(st.sampled_from(own), min_size=1, max_size=3, unique=True) if own else st.just([])
    v = st.one_of(ids([], n_virtual), mine)  # pages of rows in use: every free of them is refused
    kind = draw(st.sampled_from([
        "alloc_row", "seq_len", "alloc_extend", "alloc_decode", "advance", "free_rows", "alloc_state_slots",
        "free_state_slots", "copy_state", "free_virtual_pages", "free_window_rows", "iteration_ids",
        "runner_ids", "physical_pages", "view", "flush_opportunistic", "release_to_tree", "alloc_load",
    ]))
    if kind == "alloc_row":
        return kind, ()
    if kind in ("seq_len",):
        return kind, (draw(st.one_of(st.integers(-2, n_rows + 2), JUNK)),)
    if kind == "alloc_extend":
        return kind, (draw(r), draw(st.one_of(st.lists(st.integers(-2, 140), max_size=4), JUNK)))
    if kind in ("alloc_decode", "free_rows", "runner_ids"):
        return kind, (draw(r),)
    if kind == "advance":
        return kind, (draw(r), draw(st.one_of(st.none(), st.lists(st.integers(-2, 140), max_size=4), JUNK)))
    if kind == "alloc_state_slots":
        return kind, (draw(st.one_of(st.integers(-2, 4), JUNK)),)
    if kind == "free_state_slots":
        return kind, (draw(s),)
    if kind == "copy_state":
        return kind, (draw(s), draw(s))
    if kind == "free_virtual_pages":
        return kind, (draw(v),)
    if kind == "free_window_rows":
        return kind, (draw(st.sampled_from(["window8", "window32", "full", "state", "nope", 3])), draw(v))
    if kind == "iteration_ids":
        return kind, (draw(st.one_of(st.lists(st.integers(-3, n_virtual * 2 + 3), max_size=4), JUNK)),
                      draw(st.one_of(st.none(), r)))
    if kind == "physical_pages":
        return kind, (draw(st.sampled_from(["window8", "full", "state", "nope", None])), draw(v))
    if kind == "view":
        return kind, (draw(st.sampled_from(["full", "nope", 3, None])),)
    if kind == "flush_opportunistic":
        return kind, (draw(st.one_of(st.none(), st.integers(-2, 8), JUNK)),)
    if kind == "release_to_tree":
        return kind, (draw(st.one_of(st.integers(-2, n_rows + 2), JUNK)), draw(st.one_of(st.integers(-2, 0), JUNK)),
                      draw(st.one_of(st.none(), v)))
    return kind, (draw(st.sampled_from(["window8", "full", "nope", 5])), draw(st.one_of(st.integers(-2, 0), JUNK)))


def owned(storage) -> list[int]:
    """The pages rows in use own now: a free of any of them must be refused."""
    table = storage.table
    return table.own_pages(np.flatnonzero(table.active)).tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_calls_raise_kvchain_errors_only_and_a_refusal_changes_nothing(data):
    storage = small_storage()
    rows = [request(storage, n)[0] for n in (3, 9)]
    slots = storage.alloc_state_slots(1).tolist()
    for _ in range(25):
        kind, args = data.draw(call(storage, rows, slots))
        before = allocator_state(storage)
        try:
            out = getattr(storage, kind)(*args)
        except KVChainError:
            assert same_state(before, allocator_state(storage)), f"refused {kind}{args} changed the pool"
        else:
            if kind == "alloc_row":
                rows.append(out)
            elif kind == "free_rows":
                freed = boundary.id_array(args[0], "rows").tolist()
                assert set(freed) <= set(rows), f"{kind}{args} freed rows not in use"
                rows[:] = [x for x in rows if x not in freed]
            elif kind == "alloc_state_slots":
                slots += out.tolist()
            elif kind == "free_state_slots":
                freed = boundary.id_array(args[0], "slots").tolist()
                assert set(freed) <= set(slots), f"{kind}{args} freed slots nobody held"
                slots[:] = [x for x in slots if x not in freed]
            elif kind == "release_to_tree":
                assert int(args[1]) == 0  # the fuzz only hands the tree nothing, and no duplicate
                assert args[2] is None or not len(boundary.id_array(args[2], "ids"))
        storage.allocator.verify_byte_accounting()
        storage.check_idle(held={"state": len(slots)})
    storage.free_rows(np.array(rows, dtype=np.int64))
    storage.free_state_slots(np.array(slots, dtype=np.int64))
    storage.check_idle()
    assert set(storage.stats().live_pages.values()) == {0}
