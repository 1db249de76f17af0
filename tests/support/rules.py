"""Which rule ids the tests name: a docstring names one id (`ALLOC-2`), a list (`ALLOC-16/17/18`,
`LEDG-3, 4`) or a range (`LEDG-10..29`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_ID = re.compile(r"\b([A-Z]{2,5})-(\d+)((?:\s*(?:/|\.\.)\s*\d+)*)")
_MORE = re.compile(r"\s*(/|\.\.)\s*(\d+)")


def rule_ids() -> list[str]:
    """Every rule id of the checklist, in its order."""
    lines = (ROOT / "tests/support/rule_ids.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ids_named(text: str) -> set[str]:
    """The rule ids `text` names, lists and ranges expanded."""
    named: set[str] = set()
    for m in _ID.finditer(text):
        prefix, numbers = m.group(1), [int(m.group(2))]
        for sep, n in _MORE.findall(m.group(3)):
            n = int(n)
            numbers += range(numbers[-1] + 1, n + 1) if sep == ".." else [n]
        named.update(f"{prefix}-{n}" for n in numbers)
    return named


def ids_named_by_tests() -> set[str]:
    """Ids named anywhere in a test module (the coverage check's own examples aside)."""
    files = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_rule_coverage.py"]
    return set().union(*(ids_named(p.read_text()) for p in files))


def ids_not_built() -> dict[str, str]:
    """Rules docs/rules.md lists as not built here, with the reason it gives."""
    out = {}
    for line in (ROOT / "docs/rules.md").read_text().splitlines():
        m = re.match(r"\|\s*`?([A-Z]{2,5}-\d+)`?\s*\|\s*(.+?)\s*\|\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out
