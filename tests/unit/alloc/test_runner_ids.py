"""`RunnerIds.translate` on a small chain: per token band a physical page table over the rows'
virtual pages (the null page and unbound pages read the band's sink), and each row's slot."""

from __future__ import annotations

import numpy as np

from kvchain.alloc.runner_ids import RunnerIds
from support.chains import small_storage


def test_page_tables_read_each_bands_pages_and_the_sink_where_unbound():
    storage = small_storage(page_size=2, chain_kib=16)
    chain = storage.allocator
    rows = np.array([storage.alloc_row() for _ in range(2)])
    storage.alloc_extend(rows, np.array([7, 2]))
    runner = RunnerIds.translate(chain, storage.table, rows)
    n_pages = 4  # ceil(7 / 2): the longest row's pages
    vpages = storage.table.page_table[rows, :n_pages]
    for band in chain.token_bands:
        table = runner.page_tables[band.name]
        assert table.shape == (2, n_pages)
        bound = band.ids.v2p[vpages]
        assert np.array_equal(table, np.where(bound >= 0, bound, band.grid.sink_id)), band.name
        assert (table[1, 1:] == band.grid.sink_id).all()  # past the short row's one page: the sink
    assert np.array_equal(runner.state_slots, chain.state_band.ids.v2p[storage.table.state_slot[rows]])
