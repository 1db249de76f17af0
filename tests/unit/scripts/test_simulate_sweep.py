"""`scripts/simulate_sweep.py`, the comparison table's sweep: its presets are the ones `kvchain
simulate` compares, and a preset it cannot run is one line and exit 2 before any work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "simulate_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("simulate_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_presets_leave_out_the_state_only_model(sweep) -> None:
    from kvchain.models import list_presets

    every = {p.name for p in list_presets()}
    assert not sweep._has_attention("falcon-mamba-7b") and sweep._has_attention("qwen3-next-80b")
    defaults = {name for name in every if sweep._has_attention(name)}
    assert defaults == every - {"falcon-mamba-7b"}


@pytest.mark.parametrize(("preset", "needle"), [("falcon-mamba-7b", "only recurrent state"), ("nope", "unknown preset")])
def test_a_preset_it_cannot_run_is_one_line_and_exit_2(sweep, preset, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--presets", preset, "--workloads", "mixed", "--requests", "2", "--jobs", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
