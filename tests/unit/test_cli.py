"""`kvchain plan` and `kvchain models`: every preset plans at 80 GiB; bad input is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvchain.cli import main
from kvchain.models import list_presets

PRESETS = [p.name for p in list_presets()]


@pytest.mark.parametrize("name", PRESETS)
def test_plan_json_for_every_preset(name, capsys):
    assert main(["plan", "--model", name, "--budget", "80GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    chain = out["plan"]["chain"]
    assert chain[-1]["kind"] == "full" and chain[-1]["placement"] == "down-end"
    assert out["sizing"]["full_tokens"] > 0 and out["sizing"]["concurrency"] > 0
    assert sum(t["bytes"] for t in out["sizing"]["targets"]) <= out["sizing"]["arena_bytes"]


def test_hybrid_with_windows_shows_floats_in_spec_order(capsys):
    """DECL-6/DECL-7 through the CLI: state end, the window floating, full attention at the other end."""
    assert main(["plan", "--model", "hymba-1.5b", "--budget", "80GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert [(p["kind"], p["placement"]) for p in plan["chain"]] == [
        ("state", "up-end"), ("window", "float"), ("full", "down-end")]
    assert plan["floats"] == ["window1024"]


def test_plan_table(capsys):
    assert main(["plan", "--model", "gpt-oss-120b", "--budget", "80GiB", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    for text in ("window128", "full", "concurrency at 8,192 tokens", "Batch-size-1 floor"):
        assert text in out


def test_models_lists_presets(capsys):
    assert main(["models", "--json"]) == 0
    names = {p["name"] for p in json.loads(capsys.readouterr().out)["presets"]}
    assert {"gpt-oss-120b", "qwen3-next-80b", "gemma-3-27b", "deepseek-v3"} <= names


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--model", "no-such-model", "--budget", "80GiB"], "unknown preset"),
        (["plan", "--model", "gpt-oss-20b", "--budget", "1MiB"], "below the batch-size-1 floor"),
        (["plan", "--model", "gpt-oss-20b", "--budget", "-5GiB"], "--budget"),
        (["plan", "--model", "gpt-oss-20b", "--budget", "80GiB", "--page-size", "0"], "--page-size"),
        (["plan", "--model", "gpt-oss-20b", "--budget", "80GiB", "--tp", "3"], "tp"),
        (["plan", "--model", "gpt-oss-20b", "--budget", "80GiB", "--state-share", "2"], "--state-share"),
        (["plan", "--config", "/definitely/missing.json", "--budget", "80GiB"], "not found"),
        (["plan", "--budget", "80GiB"], "--model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_malformed_config_file(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 4096')
    assert main(["plan", "--config", str(bad), "--budget", "8GiB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("JSON" in err or "json" in err)


def test_console_script_runs():
    done = subprocess.run([sys.executable, "-m", "kvchain.cli", "plan", "--model", "no-such", "--budget", "1GiB"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown preset" in done.stderr and "Traceback" not in done.stderr


def test_module_run_sees_the_subcommands_of_the_table():
    """`python -m kvchain.cli` runs cli.py as __main__: the table, not registration on import, lists
    the subcommands, so `simulate` is one of them there too."""
    done = subprocess.run([sys.executable, "-m", "kvchain.cli", "simulate", "--model", "no-such", "--budget", "1GiB"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvchain simulate: error: unknown preset") and done.stderr.count("\n") == 1


def test_help_lists_every_row_of_the_table_in_order(capsys):
    from kvchain.cli import COMMANDS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    names = [c.name for c in COMMANDS]
    assert names == ["plan", "models", "generate", "make-checkpoint", "bench", "simulate", "stress", "trace"]
    assert "{" + ",".join(names) + "}" in out
    for c in COMMANDS:
        assert c.help.split(":")[0] in " ".join(out.split())
