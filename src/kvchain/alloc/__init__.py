"""The chain allocator: bands, ids, pricing, demand, and the checks that hold them."""
