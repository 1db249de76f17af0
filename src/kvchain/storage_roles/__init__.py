"""The roles `KVStorage` plays, one interface each, whose docstrings are the contracts.

A caller that needs one role types its argument by it (the prefix tree a `PrefixSharing`, a host-tier
controller a `HostTier`), so a reader learns what a caller may do, and what stays valid, from the
interface instead of the call sites. `KVStorage` implements every role over one `ChainAllocator`."""

from __future__ import annotations

from .forward_hooks import ForwardHooks
from .host_tier import HostTier
from .inspection import Inspection, StorageStats
from .pd import PDTransfers
from .prefix import PrefixSharing
from .rows import RowsAndTakes
from .translation import Translation

ROLES = (RowsAndTakes, PrefixSharing, ForwardHooks, HostTier, PDTransfers, Translation, Inspection)

__all__ = [
    "ROLES",
    "ForwardHooks",
    "HostTier",
    "Inspection",
    "PDTransfers",
    "PrefixSharing",
    "RowsAndTakes",
    "StorageStats",
    "Translation",
]
