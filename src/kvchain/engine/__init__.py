"""The engine side of the pool: the scheduler's step sequence that every driver of a `KVStorage`
goes through (`steps.py`). It sits above `storage.py` and `cache/`, below `testing/`, `sim/`, the
benches and the CLI, and imports none of those."""

from __future__ import annotations

from .steps import Forward, Launched, MetadataUpload, SequenceStats, StepResult, StepSequence

__all__ = ["Forward", "Launched", "MetadataUpload", "SequenceStats", "StepResult", "StepSequence"]
