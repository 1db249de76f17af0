"""`IdStack` and `UnitIds` alone: the host-side id lists and one band's virtual-to-physical map."""

from __future__ import annotations

import numpy as np
import pytest

from kvchain.alloc.id_space import UNBOUND, IdStack, UnitIds


def test_an_id_stack_pops_the_last_pushed_and_keeps_order_on_a_filter():
    stack = IdStack(8, np.array([7, 6, 5]))
    stack.push(np.array([1, 2]))
    assert stack.pop(2).tolist() == [1, 2] and len(stack) == 3
    stack.keep(stack.view() != 6)
    assert stack.view().tolist() == [7, 5]
    with pytest.raises(IndexError):
        stack.pop(3)
    with pytest.raises(OverflowError):
        stack.push(np.arange(7))


def test_unit_ids_read_unbound_ids_as_the_sink_and_follow_a_move():
    """An unbound virtual id (and the id UNBOUND itself) reads as the sink page; a move
    rebinds the virtual id to the destination and frees the source."""
    ids = UnitIds(n_virtual=6, n_grid=10, sink=0)
    ids.bind(np.array([1, 2]), np.array([4, 5]))
    assert ids.read_map[[1, 2, 3, UNBOUND]].tolist() == [4, 5, 0, 0]
    ids.rebind_physical(np.array([5]), np.array([8]))
    assert ids.v2p[2] == 8 and ids.p2v[8] == 2 and ids.p2v[5] == UNBOUND and ids.read_map[2] == 8
    ids.unbind_physical(np.array([4]))
    assert ids.v2p[1] == UNBOUND and ids.read_map[1] == 0 and ids.p2v[4] == UNBOUND
    assert ids.v2p[-1] == UNBOUND  # the entry past the last id is never bound
