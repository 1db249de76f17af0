"""What the commands print: tables that fit a 100-column terminal without cutting a cell,
`--version`, JSON with a `schema_version`, fixed snake_case keys and no NaN, and a progress bar
with an ETA on stderr only where stderr is a terminal and `--json` is not given."""

from __future__ import annotations

import json
import re

import pytest

from kvchain import __version__
from kvchain.cli import main
from kvchain.cli_common import SCHEMA_VERSION, dump_json
from kvchain.models import list_presets, model_from_preset
from kvchain.plan import plan_kv_storage
from kvchain.report import render_models, render_plan
from kvchain.sizing import size_plan
from support.output import assert_fits, narrow_console

PRESETS = [p.name for p in list_presets()]
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


def _strict(text: str) -> dict:
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""

    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("name", PRESETS)
def test_plan_table_fits_100_columns_without_cutting_a_cell(name):
    model = model_from_preset(name)
    plan = plan_kv_storage(model.decls, page_size=64)
    sizing = size_plan(plan, 80 * 2**30, context_len=min(model.max_context, 32768))
    console = narrow_console()
    render_plan(model, plan, sizing, console)
    text = console.export_text()
    assert_fits(text)
    for pool, target in zip(plan.sub_pools, sizing.targets):
        assert pool.name in text and f"{target.units:,}" in text and f"{pool.page_bytes:,}" in text
    assert f"{sizing.full_tokens:,}" in text
    # the output's own terms are explained under it
    key = " ".join(text[text.index("Key:"):].split())
    for term in ("up-end", "down-end", "float", "Boot targets", "Sink pages", "Gaps between sub-pools",
                 "Batch-size-1 floor"):
        assert term in key, term


def test_models_table_fits_100_columns():
    console = narrow_console()
    render_models(list_presets(), console)
    text = console.export_text()
    assert_fits(text)
    for p in list_presets():
        assert p.hf_id in text


@pytest.mark.parametrize("step_time", [[], ["--step-time", "base_ms=8"]])
def test_simulate_tables_fit_100_columns(step_time, monkeypatch, capsys):
    """Every pool, with every figure whole (the pool names included: "stat…" was both static pools)."""
    import kvchain.sim.report as report

    console = narrow_console()
    monkeypatch.setattr(report, "output_console", lambda: console)
    pools = "kvchain,vllm-hybrid,sglang-static,static-default,static-best,uniform-page,ideal"
    argv = ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "12",
            "--jobs", "1", "--pools", pools, *step_time]
    assert main(argv) == 0
    text = console.export_text()
    assert_fits(text)
    for pool in pools.split(","):
        assert re.search(rf"│ {re.escape(pool)} +│", text), pool


@pytest.mark.parametrize("argv", [
    ["stress", "--list-mutants"],
    ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "5",
     "--jobs", "1", "--pp", "2"],
    ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "5",
     "--jobs", "1", "--spec-tokens", "2", "--spec-acceptance", "0.5", "--pools", "kvchain"],
], ids=["list-mutants", "simulate-pp", "simulate-spec"])
def test_prose_lines_wrap_at_100_columns(argv, capsys):
    """Lines printed as prose (`cli_common.say`) wrap at 100 columns, a number never cut."""
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvchain {__version__}"


def _keys(value, prefix="") -> set[str]:
    """Every key path of a JSON value; list items share the path `[]`."""
    if isinstance(value, dict):
        out = set()
        for k, v in value.items():
            out |= {f"{prefix}.{k}"} | _keys(v, f"{prefix}.{k}")
        return out
    if isinstance(value, list):
        return set().union(*(_keys(v, f"{prefix}[]") for v in value)) if value else set()
    return set()


def _plan_json(name: str, capsys, *extra: str) -> dict:
    assert main(["plan", "--model", name, "--budget", "80GiB", "--json", *extra]) == 0
    return _strict(capsys.readouterr().out)


def test_plan_json_keys_are_fixed_snake_case_for_every_preset(capsys):
    """The keys do not vary with the model and hold no spaces ("window128 rows (3 pages)" was one)."""
    shapes = {}
    for name in PRESETS:
        out = _plan_json(name, capsys)
        assert out["schema_version"] == SCHEMA_VERSION
        keys = _keys(out)
        for key in keys:
            for part in re.split(r"[.\[\]]+", key):
                assert not part or SNAKE.match(part), (name, key)
        shapes[name] = keys
    # a model has a state end or not and windows or not: keys may only be missing where a list is empty
    union = set().union(*shapes.values())
    for name, keys in shapes.items():
        missing = union - keys
        assert all("[]" in k for k in missing), (name, missing)


def test_plan_json_floor_terms_are_named_by_fixed_keys(capsys):
    out = _plan_json("hymba-1.5b", capsys)
    floor = out["sizing"]["bs1_floor"]
    terms = {t["term"] for t in floor["terms"]}
    assert {"request_table", "scratch", "request_rows", "window_rows", "state_slots", "sub_pool_gaps",
            "sink_pages", "full_attention_rows"} == terms
    assert floor["total_bytes"] == sum(t["bytes"] for t in floor["terms"] if t["checked"])
    assert floor["one_request_bytes"] == sum(t["bytes"] for t in floor["terms"])
    assert set(out["sizing"]["fixed"]) == {"request_table", "scratch", "request_rows"}


def test_models_json_has_a_schema_version(capsys):
    assert main(["models", "--json"]) == 0
    out = _strict(capsys.readouterr().out)
    assert out["schema_version"] == SCHEMA_VERSION and {p["name"] for p in out["presets"]} == set(PRESETS)


def test_dump_json_writes_null_for_nan_and_infinity():
    out = _strict(dump_json({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}}))
    assert out == {"schema_version": SCHEMA_VERSION, "a": None, "b": [1.0, None], "c": {"d": None}}


def test_simulate_json_of_a_trace_longer_than_the_context_has_no_nan(tmp_path, capsys):
    """A request past the context is rejected and the JSON stays strict; a trace of nothing but such
    requests would serve nothing, and is refused in one line."""
    long = json.dumps({"timestamp": 0, "input_length": 200_000, "output_length": 5})
    trace = tmp_path / "t.jsonl"
    trace.write_text(long + "\n" + json.dumps({"timestamp": 0, "input_length": 100, "output_length": 5}) + "\n")
    argv = ["simulate", "--model", "llama-3.1-8b", "--budget", "2GiB", "--trace", str(trace), "--jobs", "1",
            "--pools", "kvchain,ideal", "--json"]
    assert main(argv) == 0
    out = _strict(capsys.readouterr().out)
    assert out["schema_version"] == SCHEMA_VERSION
    assert all(r["rejected"] == 1 for r in out["results"])
    trace.write_text(long + "\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none would be served" in err


def _has_eta(columns) -> bool:
    from rich.progress import TimeRemainingColumn

    return any(isinstance(c, TimeRemainingColumn) for c in columns)


def test_progress_bar_has_an_eta_and_is_off_without_a_terminal(monkeypatch):
    from kvchain.cli_common import progress

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    bar = progress(disable=False)  # pytest's stderr is not a terminal
    assert bar.disable and _has_eta(bar.columns)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert not progress(disable=False).disable
    assert progress(disable=True).disable


@pytest.mark.parametrize("json_flag", [False, True])
def test_simulate_bar_goes_to_stderr_on_a_terminal_and_never_with_json(json_flag, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    argv = ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "12",
            "--jobs", "1", "--pools", "kvchain,ideal", *(["--json"] if json_flag else [])]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "simulate 2 pools" not in out
    if json_flag:
        assert err == "" and json.loads(out)["headline"]["reference"] == "kvchain"
    else:
        assert "simulate 2 pools" in err and "24/24" in err and "requests" in err and "eta" in err


def test_stress_bar_has_an_eta(monkeypatch, capsys):
    import kvchain.testing.stress_cli as stress_cli

    seen = []
    real = stress_cli.progress

    def spy(*columns, **kwargs):
        seen.append(columns)
        return real(*columns, **kwargs)

    monkeypatch.setattr(stress_cli, "progress", spy)
    assert main(["stress", "--seeds", "0:2", "--ops", "30"]) == 0
    capsys.readouterr()
    assert len(seen) == 1 and _has_eta(seen[0])


@pytest.mark.parametrize("timed", [True, False], ids=["seconds", "steps"])
def test_simulate_tables_keep_every_figure_whole_at_real_scale(timed, capsys):
    """Figures as large as a real run's (the default `make run` trace with the step-time model:
    TTFT p99 343.47 s, 16,295 steps) and larger: each table fits 100 columns, stacked into two
    where it must, and every figure and pool name is printed whole on one line (a folded cell,
    "238.90/343.4" then "7" on the next line, is a cut number)."""
    from kvchain.sim.compare import Comparison
    from kvchain.sim.report import render_comparison
    from kvchain.sim.runner import PoolResult

    def result(pool: str, k: float) -> PoolResult:
        return PoolResult(pool=pool, requests=2000, steps=int(16_295 * k), throughput=247.4, mean_concurrency=247.5,
                          peak_running=256, utilisation=0.981, utilisation_mean=0.9, throughput_overall=240.0,
                          concurrency_overall=240.0, saturated_steps=15_000, hit_rate=0.108, queue_delay=0.0,
                          preemptions=int(123_456 * k), finished=2000, aborted=0, rejected=0, output_tokens=3_000_000,
                          recomputed_tokens=int(12_345_678 * k),
                          ttft_steps={"p50": 3039.0 * k, "p99": 4781.0 * k}, tpot_steps={"p50": 1.0, "p99": 12.25 * k},
                          seconds=876.8 * k if timed else None, tokens_per_second=2601.0 / k if timed else None,
                          ttft_s={"p50": 291.36 * k, "p99": 343.47 * k} if timed else None,
                          tpot_s={"p50": 0.0923 * k, "p99": 0.2028 * k} if timed else None)

    def short(x: float) -> str:  # three significant figures, at least the integer part
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"

    def _pair(d: dict, scale: float = 1.0) -> str:
        return f"{short(d['p50'] * scale)}/{short(d['p99'] * scale)}"

    pools = ["kvchain", "vllm-hybrid", "sglang-static", "static-default", "ideal"]
    results = [result(p, 1.0 + 11 * i) for i, p in enumerate(pools)]
    comparison = Comparison(results=results, histories={})
    args = type("Args", (), {"budget": 80 * 2**30, "trace": None, "workload": "mixed"})()
    console = narrow_console()
    render_comparison(type("Model", (), {"name": "qwen3-next-80b"})(), args, comparison, console)
    text = console.export_text()
    assert_fits(text)
    lines = text.splitlines()
    for r in results:
        figures = [r.pool, f"{r.steps:,}", f"{r.preemptions:,}", f"{r.recomputed_tokens:,}"]
        if timed:
            figures += [f"{r.seconds:,.1f}", _pair(r.ttft_s), _pair(r.tpot_s, 1e3)]
        else:
            figures += [_pair(r.ttft_steps), _pair(r.tpot_steps)]
        for figure in figures:
            assert any(re.search(rf"│ *{re.escape(figure)} *│", line) for line in lines), (figure, text)


def _rendered(results) -> str:
    from kvchain.sim.compare import Comparison
    from kvchain.sim.report import render_comparison

    console = narrow_console()
    args = type("Args", (), {"budget": 8 * 2**30, "trace": None, "workload": "mixed"})()
    render_comparison(type("Model", (), {"name": "qwen3-next-80b"})(), args, Comparison(results, {}), console)
    return console.export_text()


def _pool_result(pool: str, steps: int, seconds: float | None, finished: int = 100, tokens_per_second=None):
    from kvchain.sim.runner import PoolResult

    return PoolResult(pool=pool, requests=100, steps=steps, throughput=10.0, mean_concurrency=10.0, peak_running=16,
                      utilisation=0.9, utilisation_mean=0.8, throughput_overall=9.0, concurrency_overall=9.0,
                      saturated_steps=steps // 2, hit_rate=0.1, queue_delay=0.0, preemptions=0, finished=finished,
                      aborted=0, rejected=100 - finished, output_tokens=1000,
                      ttft_steps={"p50": 10.0, "p99": 20.0}, tpot_steps={"p50": 1.0, "p99": 2.0}, seconds=seconds,
                      tokens_per_second=tokens_per_second if seconds is None or tokens_per_second else 1000 / seconds,
                      ttft_s={"p50": 1.0, "p99": 2.0} if seconds else None,
                      tpot_s={"p50": 0.01, "p99": 0.02} if seconds else None)


def test_the_ratio_column_is_the_headline_figure_and_names_it():
    """With the step-time model the headline is seconds, and so is the table's ratio column (it
    printed steps under the same "kvchain / pool", 1.030x beside a headline of 0.652x)."""
    text = _rendered([_pool_result("kvchain", 10_300, 231.8), _pool_result("vllm-hybrid", 10_000, 355.5)])
    assert "vllm-hybrid 0.652x" in text
    assert re.search(r"│ vllm-hybrid +│ +10,000 │ +0\.652x │", text), text
    assert "kvchain's seconds over the pool's" in text


def test_a_pool_that_did_not_serve_every_request_says_so_in_the_headline():
    text = _rendered([_pool_result("kvchain", 5_000, None), _pool_result("sglang-static", 6_000, None, finished=85)])
    assert "sglang-static 0.833x (served 85 of 100)" in " ".join(text.split())


def test_without_kvchain_the_ratio_names_the_reference_pool():
    text = _rendered([_pool_result("vllm-hybrid", 5_000, None), _pool_result("sglang-static", 6_000, None)])
    assert "vllm-hybrid / pool: sglang-static 0.833x" in " ".join(text.split())
    assert re.search(r"│ sglang-static +│ +6,000 │ +0\.833x │", text) and "kvchain" not in text, text


def test_a_tiny_rate_is_never_printed_as_zero():
    text = _rendered([_pool_result("kvchain", 5_000, 7.5e11, tokens_per_second=8.79e-08)])
    assert re.search(r"│ 8\.79e-08 │", text), text


def test_a_count_of_one_is_singular(capsys):
    """"page size 1 tokens" read wrong; one is singular, every other count plural."""
    from kvchain.units import count_of

    assert [count_of(n, "token") for n in (0, 1, 2, 2048)] == ["0 tokens", "1 token", "2 tokens", "2,048 tokens"]
    assert main(["plan", "--model", "llama-3.1-8b", "--budget", "1GiB", "--page-size", "1"]) == 0
    assert "page size 1 token ·" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["models"], ["models", "--json"]], ids=["table", "json"])
def test_a_reader_that_leaves_ends_the_command_quietly(argv):
    """`kvchain models | head -1`: the closed pipe is not an error (it was exit 2 with "cannot write
    or read Broken pipe" for JSON, and rich's exit 1 for tables)."""
    import subprocess
    import sys

    code = ("import os, sys\nr, w = os.pipe()\nos.close(r)\nos.dup2(w, 1)\n"
            f"from kvchain.cli import main\nsys.exit(main({argv!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
