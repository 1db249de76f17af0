"""Host layouts: host-tier pools laid out page by page like their device views, so a host copy
moves whole page envelopes."""

from __future__ import annotations

from ..errors import InputError
from ..plan import SubPool
from .entry import HostLayout


def host_layout(pool: SubPool, n_pages: int) -> HostLayout:
    if n_pages < 0:
        raise InputError(f"host pages for sub-pool {pool.name!r} must be >= 0, got {n_pages}")
    return HostLayout((pool.name,), pool.envelope, n_pages)

