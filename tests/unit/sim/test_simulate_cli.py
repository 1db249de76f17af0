"""`kvchain simulate`: the JSON a script reads, the plot, and one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest

from kvchain.cli import main

SMALL = ["simulate", "--model", "gpt-oss-20b", "--budget", "2GiB", "--workload", "chat", "--requests", "30",
         "--jobs", "1"]


def test_json_has_every_pool_and_the_fields_scripts_read(capsys, tmp_path):
    plot = tmp_path / "run.png"
    assert main([*SMALL, "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["pool"] for r in out["results"]] == ["kvchain", "vllm-hybrid", "sglang-static", "ideal"]
    for r in out["results"]:
        for key in ("pool", "steps", "throughput", "mean_concurrency", "peak_running", "utilisation",
                    "preemptions", "aborted", "throughput_overall", "throughput_vs_kvchain", "steps_vs_kvchain",
                    "recomputed_tokens", "prefill_tokens", "ttft_steps", "tpot_steps"):
            assert key in r
        assert r["finished"] == 30
    assert out["static_best_split"] is None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_names_the_pools_and_the_split(capsys):
    assert main([*SMALL, "--pools", "kvchain,static-best", "--step-time", "base_ms=8"]) == 0
    out = capsys.readouterr().out
    assert "kvchain" in out and "static-best" in out and "static-best split" in out


def test_trace_replay(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 5000 * i, "input_length": 700, "output_length": 20,
                                         "hash_ids": [0, 100 + i]}) + "\n" for i in range(12)))
    assert main(["simulate", "--model", "llama-3.1-8b", "--budget", "2GiB", "--trace", str(trace), "--jobs", "1",
                 "--pools", "kvchain,static-default", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["finished"] == 12 for r in out["results"])
    assert out["results"][0]["hit_rate"] > 0.5  # a full-attention model reuses the shared first block


@pytest.mark.parametrize(("argv", "needle"), [
    (["--pools", "kvchain,nope"], "--pools"),
    (["--workload", "nope"], "nope"),
    (["--budget", "lots"], "--budget"),
    (["--step-time", "warp=9"], "step-time"),
    (["--host-budget", "lots"], "--host-budget"),
    (["--waiting-order", "random"], "--waiting-order"),
    (["--eviction", "mru"], "--eviction"),
    (["--workload", "chat", "--closed-loop"], "--closed-loop"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    base = [a for a in SMALL if a not in ("--budget", "2GiB")] if "--budget" in argv else SMALL
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*base, *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_a_token_budget_below_the_checkpoint_interval_is_one_line_and_exit_2(capsys):
    """Prefill chunks of a model with state end on the checkpoint grid: a smaller token budget would
    leave every longer prompt waiting forever (the run hung), so it is refused before any work."""
    argv = ["simulate", "--model", "qwen3-next-80b", "--budget", "8GiB", "--requests", "5", "--jobs", "1",
            "--pools", "kvchain", "--max-batched-tokens", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint interval" in err
    assert main([*argv, "--checkpoint-every", "64", "--json"]) == 0  # the pool's grid
    assert json.loads(capsys.readouterr().out)["results"][0]["finished"] == 5


def test_trace_priorities_reach_the_scheduler(tmp_path, capsys):
    """A trace's `priority` field is read (lower is more important); `--admission exact` never
    preempts on its own, and with `--priority` the only preemptions are those that make room for
    a more important request."""
    from kvchain.sim.workloads import load_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 900, "output_length": 200,
                                         "priority": 2 - i % 3}) + "\n" for i in range(24)))
    assert sorted({r.priority for r in load_trace(trace)}) == [0, 1, 2]
    base = ["simulate", "--model", "llama-3.1-8b", "--budget", "1GiB", "--trace", str(trace), "--jobs", "1",
            "--pools", "kvchain", "--admission", "exact", "--json"]
    runs = []
    for extra in ([], ["--priority"]):
        assert main([*base, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out)["results"][0])
    plain, prio = runs
    assert plain["finished"] == prio["finished"] == 24
    assert plain["preemptions"] == 0
    assert prio["priority_preemptions"] > 0 and prio["preemptions"] >= prio["priority_preemptions"]


# -- progress, headline, plot ------------------------------------------------------------------------

def _comparison(pools=("kvchain", "vllm-hybrid", "sglang-static", "ideal"), jobs=1, step_time=None, progress=None,
                requests=40):
    from kvchain import PoolConfig, SchedulerConfig, compare, model_from_preset, workload_from_name

    reqs = workload_from_name("chat", requests, 7, prompt_median=300, output_median=60, max_len=2048)
    cfg = PoolConfig(budget_bytes=256 * 2**20, context_len=4096, max_running=32)
    sched = SchedulerConfig(max_batched_tokens=1024, max_running=32, step_time=step_time)
    return compare(model_from_preset("gpt-oss-20b").decls, cfg, reqs, list(pools), sched=sched, jobs=jobs,
                   progress=progress)


def test_progress_hears_every_step_with_the_total():
    """In one process the callback is called after every simulated step of every pool, with the
    requests settled so far over all runs and the total over all runs."""
    calls = []
    result = _comparison(progress=lambda done, total: calls.append((done, total)))
    assert all(len(result.histories[r.pool]) == r.steps for r in result.results)  # no idle jumps here
    assert len(calls) == sum(r.steps for r in result.results)
    assert {total for _d, total in calls} == {4 * 40}
    done = [d for d, _t in calls]
    assert done == sorted(done) and done[-1] == 4 * 40 and done[0] < 40


def test_progress_counts_the_static_best_sweep():
    from kvchain.models import model_from_preset
    from kvchain.plan import plan_kv_storage
    from kvchain.sim.baselines import static_grid

    calls = []
    _comparison(pools=("kvchain", "static-best"), progress=lambda done, total: calls.append((done, total)),
                requests=20)
    grid = static_grid(plan_kv_storage(model_from_preset("gpt-oss-20b").decls, page_size=64))
    assert calls[-1] == ((len(grid) + 2) * 20,) * 2


def test_worker_processes_report_progress_while_they_run(monkeypatch):
    """With `jobs` > 1 the workers write their settled counts each step and the parent reads them
    while it waits: counts in the middle of a run reach the callback, and the last is the total."""
    import kvchain.sim.compare as compare_mod

    monkeypatch.setattr(compare_mod, "PROGRESS_POLL_S", 0.002)
    calls = []
    _comparison(jobs=2, progress=lambda done, total: calls.append((done, total)), requests=60)
    total = 4 * 60
    assert {t for _d, t in calls} == {total}
    done = [d for d, _t in calls]
    assert done == sorted(done) and done[-1] == total
    assert any(d % 60 for d in done), "no count from inside a run reached the parent"


#: a budget that binds, so that the pools' whole-run figures differ
BINDING = ["simulate", "--model", "gpt-oss-20b", "--budget", "512MiB", "--context", "4096", "--workload", "chat",
           "--requests", "30", "--jobs", "1"]


def test_the_headline_is_the_whole_run_ratio_and_leads_the_report(capsys):
    argv = [*BINDING, "--pools", "vllm-hybrid,kvchain,sglang-static"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    head, steps = out["headline"], {r["pool"]: r["steps"] for r in out["results"]}
    assert len(set(steps.values())) == 3  # the ratios below are not all 1
    assert head["metric"] == "steps" and head["reference"] == "kvchain"
    assert head["reference_value"] == steps["kvchain"]
    for p in head["pools"]:
        assert p["value"] == steps[p["pool"]]
        assert p["reference_over_pool"] == pytest.approx(steps["kvchain"] / steps[p["pool"]])
        row = next(r for r in out["results"] if r["pool"] == p["pool"])
        assert p["reference_over_pool"] == pytest.approx(row["kvchain_steps_ratio"])
    assert main(argv) == 0
    text = capsys.readouterr().out
    first = text.index("Headline")
    assert first < text.index("Whole run") < text.index("Slice: at saturation")
    line = text[first:text.index("Whole run")]
    for p in head["pools"]:
        if p["pool"] != "kvchain":
            assert f"{p['pool']} {p['reference_over_pool']:.3f}x" in " ".join(line.split())


def test_the_headline_is_in_seconds_with_the_step_time_model(capsys):
    assert main([*BINDING, "--pools", "kvchain,sglang-static", "--step-time", "base_ms=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    seconds = {r["pool"]: r["seconds"] for r in out["results"]}
    steps = {r["pool"]: r["steps"] for r in out["results"]}
    head = out["headline"]
    assert seconds["kvchain"] / seconds["sglang-static"] != pytest.approx(steps["kvchain"] / steps["sglang-static"])
    assert head["metric"] == "seconds" and head["reference_value"] == seconds["kvchain"]
    ratio = next(p["reference_over_pool"] for p in head["pools"] if p["pool"] == "sglang-static")
    assert ratio == pytest.approx(seconds["kvchain"] / seconds["sglang-static"])
    assert "seconds to serve the whole trace" in head["text"]


def _lines(fig, kind: str) -> dict:
    return {line.get_gid().split(":")[0]: line for ax in fig.axes for line in ax.get_lines()
            if (line.get_gid() or "").endswith(f":{kind}")}


def test_plot_gives_each_pool_its_own_marker_and_style_and_steps_without_step_time():
    import matplotlib

    matplotlib.use("Agg")
    from kvchain.sim.report import comparison_figure

    result = _comparison()
    fig = comparison_figure(result)
    util = _lines(fig, "utilisation")
    assert set(util) == {r.pool for r in result.results}
    assert len({line.get_marker() for line in util.values()}) == len(util)
    # kvchain and ideal draw the same curve here: their marks sit at different points of it
    assert len({str(line.get_markevery()) for line in util.values()}) == len(util)
    assert fig.axes[1].get_xlabel() == "scheduler step"
    for pool, line in util.items():
        assert list(line.get_xdata()) == [h.step for h in result.histories[pool]]


def test_plot_is_against_seconds_with_the_step_time_model():
    import matplotlib

    matplotlib.use("Agg")
    from kvchain.sim.report import comparison_figure
    from kvchain.sim.runner import StepTimeModel

    result = _comparison(pools=("kvchain", "sglang-static"), step_time=StepTimeModel())
    fig = comparison_figure(result)
    assert fig.axes[1].get_xlabel().startswith("time (s")
    for pool, line in _lines(fig, "utilisation").items():
        x = list(line.get_xdata())
        assert len(x) == len(result.histories[pool]) and x == sorted(x)
        assert x[-1] == pytest.approx(result.result(pool).seconds)


def test_plot_and_table_agree_on_utilisation_at_saturation():
    """The table's "memory used" averages the saturated steps only; the plot draws that figure as
    a level over exactly those steps, whose points average to it (the ramp and the drain, which
    the table leaves out, are the rest of the curve)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    from kvchain.sim.report import comparison_figure

    result = _comparison()
    fig = comparison_figure(result)
    levels, points = _lines(fig, "saturation_level"), _lines(fig, "saturated")
    for r in result.results:
        assert list(levels[r.pool].get_ydata()) == pytest.approx([r.utilisation * 100] * 2)
        if r.saturated_steps:
            assert np.mean(points[r.pool].get_ydata()) == pytest.approx(r.utilisation * 100)
            assert len(points[r.pool].get_xdata()) == r.saturated_steps
            assert f"{r.utilisation:.1%} used at saturation" in levels[r.pool].get_label()
        else:
            assert "never saturated" in levels[r.pool].get_label()


def test_host_budget_adds_the_host_tier_table(capsys):
    assert main([*SMALL, "--pools", "kvchain,vllm-hybrid", "--host-budget", "4GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kv, vllm = out["results"]
    assert kv["host"]["host_budget"] == 4 * 2**30 and kv["host_hit_rate"] is not None
    assert vllm["host"] is None  # the host tier is kvchain's
    assert main([*SMALL, "--pools", "kvchain", "--host-budget", "4GiB"]) == 0
    assert "Host tier" in capsys.readouterr().out


def test_the_static_best_sweep_is_a_list_with_fixed_keys_and_no_ratio_a_model_cannot_use(capsys):
    """JSON keys are fixed snake_case: the sweep is one object per split tried (its keys once held
    the ratios, "window 0.8 state 0.05"), and a model with no window sub-pool has no window ratio
    (Qwen3-Next printed "window ratio 0.8")."""
    assert main(["simulate", "--model", "qwen3-next-80b", "--budget", "8GiB", "--requests", "12", "--jobs", "1",
                 "--pools", "kvchain,static-best", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["static_best_split"]["window_ratio"] is None and out["static_best_split"]["state_ratio"] > 0
    sweep = out["static_best_sweep"]
    assert len(sweep) > 1 and all(set(s) == {"window_ratio", "state_ratio", "steps"} for s in sweep)
    assert all(s["window_ratio"] is None and s["steps"] > 0 for s in sweep)
    assert main(["simulate", "--model", "qwen3-next-80b", "--budget", "8GiB", "--requests", "12", "--jobs", "1",
                 "--pools", "kvchain,static-best"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("static-best split"))
    assert "state ratio" in line and "window" not in line, line


def test_checkpoint_interval_is_the_pools_grid_as_checkpoint_every_is(capsys):
    """`--checkpoint-interval` (the model flag `plan` and `generate` take) sets the pools' grid, as
    `--checkpoint-every` does; the two naming different grids is one line and exit 2."""
    argv = ["simulate", "--model", "qwen3-next-80b", "--budget", "8GiB", "--workload", "multi_turn", "--requests",
            "12", "--pools", "kvchain", "--jobs", "1", "--json"]

    def run(*extra: str) -> dict:
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)["results"][0]

    every, interval, default = run("--checkpoint-every", "1024"), run("--checkpoint-interval", "1024"), run()
    assert every == interval
    assert (every["hit_rate"], every["prefill_tokens"]) != (default["hit_rate"], default["prefill_tokens"])
    assert main([*argv, "--checkpoint-every", "1024", "--checkpoint-interval", "512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "name one grid" in err


def test_a_token_budget_below_a_uniform_pools_block_names_the_pool_and_its_block(capsys):
    """vLLM's layout checkpoints on its block grid, which no checkpoint flag moves: the refusal names
    the pool and its block size, and does not send the user to a flag that cannot help."""
    argv = ["simulate", "--model", "qwen3-next-80b", "--budget", "8GiB", "--requests", "5", "--jobs", "1",
            "--max-batched-tokens", "300", "--checkpoint-every", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vllm-hybrid" in err and "block size 1056" in err
    assert "checkpoint more often" not in err
