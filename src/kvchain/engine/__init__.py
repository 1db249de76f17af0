"""The serving side of the pool: the scheduler's step sequence that every driver of a `KVStorage`
goes through (`steps.py`), the scheduler's pool over a storage, the prefix tree and admission
(`pool.py`, with the admission policies of `policies.py` and the requests of `request.py`), and the
model engine built on them. It sits above `storage.py` and `cache/`, below `testing/`, `sim/`, the
benches and the CLI, and imports none of those: the simulator is this loop with a modeled forward."""

from __future__ import annotations

from .steps import Forward, Launched, MetadataUpload, SequenceStats, StepResult, StepSequence

__all__ = ["Forward", "Launched", "MetadataUpload", "SequenceStats", "StepResult", "StepSequence"]
