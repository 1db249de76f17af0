"""The prefix cache over the unified pool."""

from .radix import CheckpointStrategy, MatchResult, TreeNode, UnifiedRadixCache

__all__ = ["CheckpointStrategy", "MatchResult", "TreeNode", "UnifiedRadixCache"]
