"""Every rule of the design is either held by a test that names it or listed in docs/rules.md as
not built here, with a reason; never both."""

from __future__ import annotations

from support.rules import ids_named, ids_named_by_tests, ids_not_built, rule_ids


def test_ids_are_read_with_lists_and_ranges():
    assert ids_named('"""ALLOC-16/17/18 and LEDG-10..12, WIN-9."""') == {
        "ALLOC-16", "ALLOC-17", "ALLOC-18", "LEDG-10", "LEDG-11", "LEDG-12", "WIN-9"}
    assert ids_named("no rule here: DEAD-BEEF, X-1") == set()


def test_every_rule_is_held_by_a_test_or_listed_as_not_built():
    rules = rule_ids()
    assert len(rules) == len(set(rules)) > 0
    named = ids_named_by_tests()
    not_built = ids_not_built()
    unknown = sorted(set(not_built) - set(rules))
    assert not unknown, f"docs/rules.md lists ids the checklist does not have: {unknown}"
    both = sorted(set(not_built) & named)
    assert not both, f"listed as not built, yet a test names them: {both}"
    bare = [r for r in rules if r not in named and r not in not_built]
    assert not bare, f"no test names these rules and docs/rules.md does not list them: {' '.join(bare)}"
    assert all(reason for reason in not_built.values())


def test_every_clearance_cell_is_held_by_behaviour():
    """Each cell of CLEARANCE (consumer x hazard) has its own behavioural case in
    `alloc/test_clearance_behaviour.py`, named by the cell's rule, and together they name every
    rule of the table: comparing the dict with the design's table alone holds none of them."""
    import importlib.util
    import re
    import sys

    from kvchain.alloc.page_usage import CLEARANCE
    from support.rules import ROOT

    path = ROOT / "tests/unit/alloc/test_clearance_behaviour.py"
    spec = importlib.util.spec_from_file_location("clearance_behaviour", path)
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    cells = {(c, h) for c, row in CLEARANCE.items() for h in row}
    assert set(module.CELLS) == cells == set(module.RULE)
    table_rules = {r for r in rule_ids() if re.fullmatch(r"LEDG-(1\d|2\d)", r)}
    assert set(module.RULE.values()) == table_rules
