"""The prefix cache over the unified pool."""

from .radix import CheckpointStrategy, MatchResult, TreeNode, UnifiedRadixCache, WindowLock

__all__ = ["CheckpointStrategy", "MatchResult", "TreeNode", "UnifiedRadixCache", "WindowLock"]
