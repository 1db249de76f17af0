"""`kvchain.env` reads the environment live: a variable set or deleted is seen by the next read."""

from __future__ import annotations

import os

from kvchain import env
from kvchain.env import InvariantCheckLevel


def test_every_read_sees_the_environment_as_it_is_now(monkeypatch):
    """The check level and declared variables follow `os.environ` from one call to the next, with
    no process restart (tests and operators switch checks on in a running process)."""
    monkeypatch.delenv("KVCHAIN_INVARIANT_CHECK", raising=False)
    monkeypatch.delenv("KVCHAIN_ENABLE_ASYNC_ASSERT", raising=False)
    assert env.invariant_level() is InvariantCheckLevel.OFF
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    assert env.invariant_level() is InvariantCheckLevel.STRICT
    os.environ["KVCHAIN_INVARIANT_CHECK"] = "1"
    assert env.invariant_level() is InvariantCheckLevel.WARN
    monkeypatch.delenv("KVCHAIN_INVARIANT_CHECK")
    assert env.invariant_level() is InvariantCheckLevel.OFF
    monkeypatch.setenv("KVCHAIN_ENABLE_ASYNC_ASSERT", "1")
    assert env.invariant_level() is InvariantCheckLevel.STRICT

    name = "KVCHAIN_LAZY_COMPACTION_MAX_MOVES_PER_CALL"
    monkeypatch.delenv(name, raising=False)
    default = env.get(name)
    monkeypatch.setenv(name, "7")
    assert env.get(name) == 7 != default
    monkeypatch.setenv(name, "")
    assert env.get(name) == default


def test_a_value_outside_ascii_reads_back_as_set(monkeypatch):
    """The live read decodes as `os.environ` does (the file system encoding, surrogate escapes)."""
    monkeypatch.setenv("KVCHAIN_INVARIANT_CHECK", "2")
    assert env._getenv("KVCHAIN_INVARIANT_CHECK") == os.environ["KVCHAIN_INVARIANT_CHECK"] == "2"
    monkeypatch.setenv("KVCHAIN_TEST_UNICODE_VALUE", "schön")
    assert env._getenv("KVCHAIN_TEST_UNICODE_VALUE") == "schön"
