"""Every Python example in README.md and docs/*.md runs as written, or says it is a fragment; and
every name `kvchain` exports is documented.

A fenced block opened by exactly "```python" is run as a script in a fresh interpreter (this one's
`sys.executable`, in an empty temporary directory, with the environment as it is) and must exit 0.
A block opened by "```python fragment" is illustrative: it names objects built elsewhere (a
`storage`, a `device`) and is not run. Any other info string that starts with "python" fails, so
a misspelt marker cannot leave a block unchecked. Runnable blocks are numbered per file from 1 in
document order: `docs/simulate.md#1` is the first runnable block of docs/simulate.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN = "python"
FRAGMENT = "python fragment"

#: files that must keep at least one block that is run, so that a parsing slip which finds no
#: blocks (or marks them all fragments) fails here instead of passing with nothing checked
MUST_RUN = ("README.md", "docs/simulate.md", "docs/speculative.md", "docs/workloads.md")

TIMEOUT_S = 120
TAIL_CHARS = 4000

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root, with "/" separators
    line: int  # 1-based line of the opening fence
    info: str  # the opening fence's info string, stripped
    code: str


def _blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, in order (CommonMark fences: a closing fence uses the
    opening one's character, at least as many of them, and nothing after)."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        indent, fence, start = len(m["indent"]), m["fence"], i
        body = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence)
                    and not close["info"].strip()):
                break
            body.append(re.sub(rf"^[ \t]{{0,{indent}}}", "", lines[i]))
            i += 1
        else:
            raise AssertionError(f"{rel}:{start + 1}: fenced block never closed")
        blocks.append(Block(rel, start + 1, m["info"].strip(), "\n".join(body) + "\n"))
        i += 1
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in _blocks(path)]


def _runnable() -> dict[str, Block]:
    out: dict[str, Block] = {}
    counts: dict[str, int] = {}
    for b in ALL_BLOCKS:
        if b.info == RUN:
            counts[b.file] = counts.get(b.file, 0) + 1
            out[f"{b.file}#{counts[b.file]}"] = b
    return out


RUNNABLE = _runnable()


def test_every_python_block_is_run_or_marked_a_fragment():
    def pythonish(info: str) -> bool:
        first = info.split()[0].lower() if info else ""
        return first.startswith("python") or first in ("py", "py3")

    bad = [f"{b.file}:{b.line}: ```{b.info}" for b in ALL_BLOCKS
           if pythonish(b.info) and b.info not in (RUN, FRAGMENT)]
    assert not bad, f"a Python block must open with ```{RUN} or ```{FRAGMENT}:\n" + "\n".join(bad)


def test_each_listed_file_has_a_block_that_runs():
    ran = {b.file for b in RUNNABLE.values()}
    missing = [f for f in MUST_RUN if f not in ran]
    assert not missing, f"no runnable block found in {missing}"


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


@pytest.mark.parametrize("key", list(RUNNABLE))
def test_block_runs(key: str, tmp_path: Path):
    block = RUNNABLE[key]
    script = tmp_path / (re.sub(r"\W", "_", key) + ".py")
    script.write_text(block.code, encoding="utf-8")
    where = f"{block.file}:{block.line}"
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"{where}: still running after {TIMEOUT_S} s\nstderr tail:\n{_tail(stderr)}")
    if proc.returncode != 0:
        pytest.fail(f"{where}: exit code {proc.returncode}\nstderr tail:\n{_tail(proc.stderr)}")


def test_every_public_name_is_documented():
    """Each name `kvchain` exports (`__all__`) appears, as a word, in docs/api.md or the page it
    points to for it: a new entry point comes with its documentation."""
    import kvchain

    docs = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    missing = [name for name in kvchain.__all__ if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", docs)]
    assert not missing, f"exported but named in no page of docs/: {missing}"
