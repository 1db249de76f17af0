"""Byte conservation of one chain (CHK-15): what `ChainAllocator.verify_byte_accounting` checks.

Counts match page states, spans lie in order inside the chain without overlap, and ids and maps
agree. Run at idle, by the invariant checks and in tests."""

from __future__ import annotations

import numpy as np

from .band import HOLE, LIVE, OUT, PENDING, SINK, VACATED, Band
from .id_space import UNBOUND
from .npfast import has_duplicates


def chain_problems(chain) -> list[str]:
    """What breaks byte conservation in `chain` (a `ChainAllocator`), one line each; none when
    it holds."""
    problems: list[str] = []
    cursor = chain.layout.chain_lo
    for band in chain.bands:
        problems += band_problems(band)
        if band.parked:
            continue
        if band.bottom < cursor:
            problems.append(f"{band.name}: span starts at byte {band.bottom}, below its neighbour's end {cursor}")
        cursor = band.top
    if cursor > chain.layout.arena_bytes:
        problems.append(f"chain ends at byte {cursor}, past the arena's {chain.layout.arena_bytes}")
    bound = int(np.count_nonzero(chain.owner.ids.v2p >= 0))
    if bound + len(chain.virtual_free) != chain.n_virtual - 1:
        problems.append(f"owner: {bound} bound + {len(chain.virtual_free)} free virtual pages "
                        f"!= {chain.n_virtual - 1}")
    if chain.state_band is not None:
        slots = int(np.count_nonzero(chain.state_band.ids.v2p >= 0))
        if slots + len(chain.slot_free) != chain.state_band.grid.n_grid:
            problems.append(f"state: {slots} bound + {len(chain.slot_free)} free slot ids != "
                            f"{chain.state_band.grid.n_grid}")
    return problems


def band_problems(band: Band) -> list[str]:
    """What breaks one band's accounting: counts against page states, its span, its id maps."""
    out = []
    st = band.state
    counts = np.bincount(st, minlength=6)
    if counts[VACATED] != band.n_vacated:
        out.append(f"{band.name}: {counts[VACATED]} vacated pages, counted {band.n_vacated}")
    if int(np.count_nonzero(band.fixed_mask)) != band.n_fixed:
        out.append(f"{band.name}: {int(np.count_nonzero(band.fixed_mask))} fixed pages, counted {band.n_fixed}")
    if counts[LIVE] != band.n_live:
        out.append(f"{band.name}: {counts[LIVE]} live pages, counted {band.n_live}")
    if counts[HOLE] != band.n_holes or len(band.holes) != band.n_holes:
        out.append(f"{band.name}: {counts[HOLE]} holes ({len(band.holes)} listed), counted {band.n_holes}")
    if counts[PENDING] != band.n_pending or band.pending.count != band.n_pending:
        out.append(f"{band.name}: {counts[PENDING]} pending pages ({band.pending.count} batched), "
                   f"counted {band.n_pending}")
    listed = band.holes.view()
    if len(listed) and (has_duplicates(listed) or (st[listed] != HOLE).any()):
        out.append(f"{band.name}: hole list repeats ids or lists pages that are not holes")
    if band.parked:
        if (st != OUT).sum() - (st == SINK).sum():
            out.append(f"{band.name}: parked but holds pages")
    else:
        outside = np.concatenate([st[: band.lo], st[band.hi :]])
        if ((outside != OUT) & (outside != SINK)).any():
            out.append(f"{band.name}: pages outside its span [{band.lo}, {band.hi})")
        inside = st[band.lo : band.hi]
        if (inside == OUT).any() or (inside == SINK).any():
            out.append(f"{band.name}: span [{band.lo}, {band.hi}) has pages outside the band")
        # pricing counts every page of the span once (CAP-9: its yes and no are exact only then)
        snap = band.snapshot()
        priced = snap.live + snap.holes + snap.pending + snap.fixed
        if priced != band.hi - band.lo:
            out.append(f"{band.name}: its pricing snapshot counts {priced} pages (live {snap.live}, holes "
                       f"{snap.holes}, pending {snap.pending}, fixed {snap.fixed}) in a span of {band.hi - band.lo}")
    live = np.flatnonzero(st == LIVE)
    if len(live) and ((band.ids.p2v[live] < 0).any() or (band.ids.v2p[band.ids.p2v[live]] != live).any()):
        out.append(f"{band.name}: a live page is unbound or its virtual id maps elsewhere")
    if int(np.count_nonzero(band.ids.v2p >= 0)) != len(live):
        out.append(f"{band.name}: {int(np.count_nonzero(band.ids.v2p >= 0))} virtual ids bound to "
                   f"{len(live)} live pages (two ids share a page, or an id outlived its page)")
    if band.ids.v2p[-1] != UNBOUND or band.ids.read_map[-1] != band.ids.sink:
        out.append(f"{band.name}: the map entry past the last virtual id was bound")
    not_live = np.flatnonzero(st != LIVE)
    if len(not_live) and (band.ids.p2v[not_live] >= 0).any():
        out.append(f"{band.name}: a page that is not live is bound")
    return out
