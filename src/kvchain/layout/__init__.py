"""Page envelopes (`entry`: what one page of a sub-pool holds, byte by byte), the typed views
kernels index by physical page id (`views`), and host layouts for host-tier pools (`host`)."""

from .entry import Component, PageEnvelope, page_envelope

__all__ = ["Component", "PageEnvelope", "page_envelope"]
