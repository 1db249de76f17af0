"""What a 100-column terminal shows of a rendering: every table must fit it without cutting a cell."""

from __future__ import annotations

from rich.console import Console

WIDTH = 100


def narrow_console() -> Console:
    """A terminal of `WIDTH` columns that records what is printed, without colour codes."""
    return Console(width=WIDTH, record=True, force_terminal=True, color_system=None)


def assert_fits(text: str) -> None:
    """No cell cut short (rich marks a cut with an ellipsis) and no line past `WIDTH`."""
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= WIDTH, text


def rendered(*tables) -> str:
    """The text `tables` print on a narrow console."""
    console = narrow_console()
    for table in tables:
        console.print(table)
    return console.export_text()
