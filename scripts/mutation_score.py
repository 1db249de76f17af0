"""Print the mutation score per mutated file from mutmut's results under mutants/ (`make mutation`).

A mutant counts as killed when its tests failed (or timed out: the mutant made them loop); every
other verdict (survived, no tests, suspicious, not checked) counts against the score."""

from __future__ import annotations

import json
import sys
from pathlib import Path

KILLED = {1, 3}  # a failing test run; pytest's internal error
TIMEOUT = {36, 24, -24, 152, 255}


def main(root: str = "mutants") -> int:
    metas = sorted(Path(root).rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {root}/: run `make mutation` first", file=sys.stderr)
        return 2
    total_killed = total = 0
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"].values()
        killed = sum(1 for c in codes if c in KILLED or c in TIMEOUT)
        survived = sum(1 for c in codes if c == 0)
        name = str(meta.relative_to(root))[: -len(".meta")]
        print(f"{name:40} {killed:5} / {len(codes):5} killed ({100 * killed / max(len(codes), 1):5.1f}%), "
              f"{survived} survived")
        total_killed += killed
        total += len(codes)
    print(f"{'total':40} {total_killed:5} / {total:5} killed ({100 * total_killed / max(total, 1):5.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
