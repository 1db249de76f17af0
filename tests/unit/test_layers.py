"""The import-linter contracts of pyproject.toml hold for this checkout, and they catch what they are
there for: an import that runs up the layers, and a circle among the modules of one package. The
layer map in docs/overview.md is the contract's, line for line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter import api as importlinter_api

import kvchain

PACKAGE = Path(kvchain.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
OVERVIEW = ROOT / "docs" / "overview.md"


def _lint(root: Path, src: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package found under `src`, with the contracts of `root`'s pyproject."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _contracts() -> dict[str, dict]:
    config = importlinter_api.read_configuration(str(PYPROJECT))
    return {c["id"]: c for c in config["contracts_options"]}


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the package and the pyproject, to break on purpose."""
    shutil.copytree(PACKAGE, tmp_path / "src" / "kvchain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_this_checkout_keeps_every_contract():
    done = _lint(ROOT, PACKAGE.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in done.stdout


def test_an_upward_import_breaks_the_layers(copy):
    _append(copy / "src" / "kvchain" / "decl.py", "from .sim import scheduler  # noqa: E402, F401")
    done = _lint(copy, copy / "src")
    assert done.returncode != 0
    assert "kvchain.decl is not allowed to import kvchain.sim" in done.stdout


def test_an_import_back_into_the_cli_breaks_the_layers(copy):
    """The subcommand modules import cli_common, never the table in cli.py that lists them."""
    _append(copy / "src" / "kvchain" / "bench" / "__init__.py", "from .. import cli  # noqa: E402, F401")
    done = _lint(copy, copy / "src")
    assert done.returncode != 0
    assert "kvchain.bench is not allowed to import kvchain.cli" in done.stdout


def test_a_circle_inside_a_package_breaks_the_acyclic_contract(copy):
    _append(copy / "src" / "kvchain" / "device" / "base.py", "from . import modeled  # noqa: E402, F401")
    done = _lint(copy, copy / "src")
    assert done.returncode != 0
    assert "No cycles are allowed in kvchain.device" in done.stdout


def test_the_overview_map_is_the_layers_contract():
    """docs/overview.md draws the layers as one fenced block under `## Layers`, one layer a line,
    its name first and what it holds after two or more spaces (an indented line goes on with the
    description above it)."""
    text = OVERVIEW.read_text()
    section = text.split("\n## Layers", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block is not None, "no ```text block under ## Layers in docs/overview.md"
    drawn = [re.split(r"\s{2,}", line)[0] for line in block.group(1).splitlines() if line[:1].strip()]
    assert drawn == _contracts()["layers"]["layers"]
