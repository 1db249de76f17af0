"""Distributed pieces over torch.distributed (gloo on CPU, NCCL on GPU)."""

from .reduce import all_ranks_done

__all__ = ["all_ranks_done"]
