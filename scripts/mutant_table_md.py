"""Render `kvchain stress --mutant-table --json` outputs as one markdown table, for docs/stress.md.

    python scripts/mutant_table_md.py LABEL=table.json [LABEL=table.json ...]

Each column is one table's catches (`caught/seeds`) per mutant; a mutant the device cannot show
reads `-`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        sys.stderr.write("usage: mutant_table_md.py LABEL=table.json [LABEL=table.json ...]\n")
        return 2
    columns = []
    for arg in argv:
        label, path = arg.split("=", 1)
        rows = {m["mutant"]: m for m in json.loads(Path(path).read_text())["mutants"]}
        columns.append((label, rows))
    names = list(columns[0][1])
    print("| mutant | " + " | ".join(label for label, _ in columns) + " |")
    print("| - |" + " - |" * len(columns))
    for name in names:
        cells = []
        for _label, rows in columns:
            m = rows.get(name)
            cells.append("-" if m is None or m["target"] is None else f"{m['caught']}/{m['seeds']}")
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
