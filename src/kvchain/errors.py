"""Typed errors. Every failure kvchain reports is a `KVChainError`, so callers catch one type and
the CLI turns any of them into one line and exit code 2."""

from __future__ import annotations


class KVChainError(Exception):
    """Base of every error kvchain raises on purpose."""


class InputError(KVChainError, ValueError):
    """Bad input: a malformed config, an unknown model, a nonsense size or flag."""


class DeclarationError(InputError):
    """A layer declaration that cannot describe real KV state (bad geometry or lifetime)."""


class EnvVarError(InputError):
    """A `KVCHAIN_*` environment variable set to a value it cannot take, or a name never declared."""


class LayoutError(KVChainError, LookupError):
    """A layer, component or kind of state that a sub-pool's page layout does not hold."""


class PlanError(KVChainError):
    """A set of layer declarations that cannot form a chain (no owner, two geometries in a sub-pool)."""


class BudgetError(KVChainError):
    """A byte budget below what the plan needs (the batch-size-1 floor)."""


class CapacityError(KVChainError):
    """A take or move that the arena cannot serve; raised only after state was left unchanged."""


class InvariantError(KVChainError, AssertionError):
    """A broken invariant of the pool (double free, leak, lost byte, unordered use)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


class TransferTimeoutError(KVChainError, TimeoutError):
    """A host wait on device work or a transfer ran past its deadline."""
