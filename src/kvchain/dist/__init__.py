"""Distributed pieces: tensor-parallel ranks, pipeline stages and PD nodes as processes.

Their control planes run on torch.distributed's gloo backend, which carries the host values they
exchange (digests, MIN-reduced judgements, ids); PD's page bytes go through a transfer engine
(`transfer.py`: NIXL, or gloo staging buffers)."""

from .reduce import all_ranks_done

__all__ = ["all_ranks_done"]
