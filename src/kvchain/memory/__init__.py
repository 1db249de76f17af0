"""The arena: one uint8 device region that holds every band, and where each band's page grid sits."""

from .arena import ArenaLayout, BandGrid, KVArena, arena_layout

__all__ = ["ArenaLayout", "BandGrid", "KVArena", "arena_layout"]
