"""Model tests' shared steps: a config planned through the real parser, and the CLI run as a user
runs it (a fresh interpreter, output captured)."""

from __future__ import annotations

import subprocess
import sys

from kvchain.models import model_from_config
from kvchain.plan import KVStoragePlan, plan_kv_storage


def plan_of(cfg: dict, page_size: int = 64, **kwargs) -> KVStoragePlan:
    """`cfg` read as `kvchain plan --config` reads it (`kwargs`: tp, kv dtype), then planned."""
    return plan_kv_storage(model_from_config(cfg, **kwargs).decls, page_size=page_size)


def kvchain(*args: str) -> subprocess.CompletedProcess:
    """`kvchain ARGS...` in a fresh interpreter, bounded by a timeout."""
    return subprocess.run([sys.executable, "-m", "kvchain.cli", *args], capture_output=True, text=True,
                          timeout=600)
