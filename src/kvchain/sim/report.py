"""The comparison as a headline and tables, as JSON, and as a plot of utilisation and running
requests.

The headline is one line, before any table: the whole-run figure (seconds to serve the whole
trace with the step-time model, steps without) of the reference pool, and its figure over each
other pool's, all measured in the same run. The figures at saturation are a slice (the steps that
ended with requests waiting, where a pool's memory sets the pace) and are labelled as one."""

from __future__ import annotations

from rich.console import Console

from ..cli_common import output_console, print_fitted
from ..units import format_bytes
from .compare import Comparison


def _static_best(result: Comparison) -> dict[str, float | None] | None:
    """static-best's split, each ratio None where the model has no sub-pool of its kind."""
    if result.static_best is None:
        return None
    tried = result.sweep[0] if result.sweep else {}
    return {"window_ratio": result.static_best.window_ratio if tried.get("window_ratio") is not None else None,
            "state_ratio": result.static_best.state_ratio if tried.get("state_ratio") is not None else None}


def comparison_json(model, args, result: Comparison) -> dict:
    steps = result.ratios("steps")
    throughput = result.ratios("throughput")
    return {
        "model": model.name,
        "budget_bytes": args.budget,
        "workload": args.trace or args.workload,
        "requests": result.results[0].requests if result.results else 0,
        "admission": getattr(args, "admission", None),
        "headline": {**result.headline(), "text": headline_text(result)} if result.results else None,
        "results": [{**r.to_dict(), "steps_vs_kvchain": steps.get(r.pool),
                     "kvchain_steps_ratio": (1 / steps[r.pool]) if steps.get(r.pool) else None,
                     "throughput_vs_kvchain": throughput.get(r.pool)} for r in result.results],
        "static_best_split": _static_best(result),
        "static_best_sweep": result.sweep,
    }



def _short(x: float) -> str:
    """Three significant figures, at least the integer part: 4,120, 412, 41.2, 4.12, 0.412,
    8.79e-08 (a figure that is not zero never prints as 0)."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x == 0 or abs(x) >= 0.01 else f"{x:.3g}"


def _pair(d: dict | None, scale: float = 1.0) -> str:
    """p50/p99 of a latency summary, each to three significant figures ("-" where absent)."""
    return "/".join(_short(d[k] * scale) if d and k in d else "-" for k in ("p50", "p99"))


def headline_text(result: Comparison) -> str:
    """The headline as one line: "steps to serve the whole trace: kvchain 16,283; kvchain / pool:
    vllm-hybrid 0.997x, ..." (below 1: the reference serves the trace in less than that pool)."""
    h = result.headline()
    metric, ref = h["metric"], h["reference"]

    def served(pool: str) -> str:
        """A pool that did not serve every request (it aborted or rejected some) says so: its
        figure is not the whole trace's."""
        r = result.result(pool)
        return "" if r.finished >= r.requests else f" (served {r.finished:,} of {r.requests:,})"

    value = f"{h['reference_value']:,.1f} s" if metric == "seconds" else f"{h['reference_value']:,}"
    line = f"{metric} to serve the whole trace: {ref} {value}{served(ref)}"
    others = [p for p in h["pools"] if p["pool"] != ref]
    if not others:
        return line
    ratios = ", ".join((f"{p['pool']} {p['reference_over_pool']:.3f}x" if p["value"] else f"{p['pool']} -")
                       + served(p["pool"]) for p in others)
    return f"{line}; {ref} / pool: {ratios} (below 1: {ref} takes less)"


def render_comparison(model, args, result: Comparison, console: Console | None = None) -> None:
    """The headline line, then two stacked tables that fit 100 columns: the whole-run figures
    first (steps to serve the trace, kvchain's steps over each pool's, seconds and tokens/s with
    the step-time model, TTFT/TPOT, preemptions, recomputed tokens), then the saturation slice
    (labelled as one) and the request counts."""
    console = console or output_console()
    head = result.headline()
    metric, ref = head["metric"], head["reference"]  # the ratio column is the headline's own figure
    over = {p["pool"]: p["reference_over_pool"] for p in head["pools"] if p["value"]}
    timed = metric == "seconds"
    # no highlighting: it would set "1." and "0x" of "1.000x" apart as if "0x" began a hex number
    admission = getattr(args, "admission", None)
    console.print(f"[bold]{model.name}[/] · {format_bytes(args.budget)} · {args.trace or args.workload} · "
                  f"{result.results[0].requests} requests"
                  + (f" · kvchain admission {admission}" if admission not in (None, "optimistic") else ""),
                  highlight=False)
    console.print(f"[bold]Headline[/]: {headline_text(result)}", highlight=False)
    cols = ["pool", "steps", f"{ref}\n/ pool\n{metric}"]
    if timed:
        cols += ["seconds", "tok/s", "TTFT\np50/p99 s", "TPOT\np50/p99 ms"]
    else:
        cols += ["TTFT\np50/p99\nsteps", "TPOT\np50/p99\nsteps"]
    cols += ["pre-\nempted", "recomp.\ntokens"]
    whole, memory = [], []
    for r in result.results:
        row = [r.pool, f"{r.steps:,}", f"{over[r.pool]:.3f}x" if r.pool in over else "-"]
        if timed:
            row += [f"{r.seconds:,.1f}", _short(r.tokens_per_second), _pair(r.ttft_s), _pair(r.tpot_s, 1e3)]
        else:
            row += [_pair(r.ttft_steps), _pair(r.tpot_steps)]
        whole.append([*row, f"{r.preemptions:,}", f"{r.recomputed_tokens:,}"])
        memory.append([r.pool, f"{r.saturated_steps:,}", f"{r.hit_rate:.1%}", f"{r.throughput:,.1f}",
                       f"{r.mean_concurrency:,.1f}",
                       f"{r.utilisation:.1%}", f"{r.peak_running:,}", f"{r.aborted:,}", f"{r.rejected:,}",
                       f"{r.finished:,}"])
    print_fitted(console, "Whole run", cols, whole)
    print_fitted(console, "Slice: at saturation (steps with requests waiting), and requests",
                  ["pool", "satu-\nrated\nsteps", "hit\nrate", "tok/\nstep", "running", "memory\nused", "peak",
                   "aborted", "rejected", "finished"], memory)
    hosted = [r for r in result.results if r.host is not None]
    if hosted:
        print_fitted(console, "Host tier", ["pool", "hit rate\ndevice", "hit rate\nhost", "swapped\ntokens",
                                             "recomp.\ntokens", "copied", "loads", "swaps\nrefused"],
                      [[r.pool, f"{r.device_hit_rate:.1%}", f"{r.host_hit_rate:.1%}", f"{r.swapped_tokens:,}",
                        f"{r.recomputed_tokens:,}", format_bytes(r.host_copied_bytes), f"{r.host['loads']:,}",
                        f"{r.host['swap_refused']:,}"] for r in hosted])
    less = "in less time" if timed else "in fewer steps"
    console.print(f"steps: to serve the whole trace; {ref} / pool: {ref}'s {metric} over the pool's (below 1: "
                  f"{ref} serves it {less}); the saturation slice averages only the steps that ended with "
                  "requests waiting, not the whole run; memory used: bytes running requests and the prefix "
                  "cache hold over the budget"
                  + ("; ideal is the memory bound (exact bytes, known output lengths), not a bound on prefix "
                     "hits: its tree evicts least recently used first, so a pool can hit more and take fewer "
                     "steps" if any(r.pool == "ideal" for r in result.results) else ""), highlight=False)
    split = _static_best(result)
    if split is not None:
        ratios = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in split.items() if v is not None)
        console.print(f"static-best split (oracle, swept on the trace): {ratios or 'one pool per kind'}")


#: one marker and one line style a pool, in `--pools` order, so that pools with identical curves
#: (kvchain and `ideal` where memory does not bind) stay visible on top of each other
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
#: markers a curve carries; each pool's are shifted along the curve so that identical curves
#: show every pool's
MARKS_PER_CURVE = 12


def plot_comparison(result: Comparison, path: str, title: str = "") -> None:
    """Utilisation and running requests over the run, one line per pool; against seconds with
    the step-time model, against steps without. Each pool's figure at saturation (the table's
    "memory used") is in its legend entry and drawn as a dashed level over the steps it averages,
    whose points are the curve's bold part: the rest of the curve (the ramp, the drain, where a
    prefix cache keeps bytes held with few requests running) is not in that figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = comparison_figure(result, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def comparison_figure(result: Comparison, title: str = ""):
    """The plot's figure (for `plot_comparison`, and for tests to read its lines)."""
    import matplotlib.pyplot as plt
    import numpy as np

    timed = bool(result.times) and all(r.pool in result.times for r in result.results)
    fig, (ax_u, ax_r) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    n = len(result.histories)
    for i, (pool, history) in enumerate(result.histories.items()):
        x = np.asarray(result.times[pool] if timed else [h.step for h in history], dtype=np.float64)
        util = np.asarray([h.utilisation * 100 for h in history])
        style = {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)],
                 "markersize": 4, "markerfacecolor": "none"}
        every = max(1, len(history) // MARKS_PER_CURVE)
        marks = (i * every // max(n, 1), every)
        (line,) = ax_u.plot(x, util, linewidth=0.8, markevery=marks, alpha=0.8, gid=f"{pool}:utilisation", **style)
        colour = line.get_color()
        ax_r.plot(x, [h.running for h in history], linewidth=0.8, markevery=marks, alpha=0.8, color=colour,
                  gid=f"{pool}:running", **style)
        sat = np.asarray([h.waiting > 0 for h in history])
        r = result.result(pool)
        label = f"{pool}: {r.utilisation:.1%} used at saturation"
        if sat.any():
            ax_u.plot(x[sat], util[sat], linestyle="none", marker=".", markersize=2, color=colour,
                      gid=f"{pool}:saturated")
            ax_u.plot([x[sat][0], x[sat][-1]], [r.utilisation * 100] * 2, linestyle=(0, (4, 2)), linewidth=1.6,
                      color=colour, gid=f"{pool}:saturation_level", label=label)
        else:  # never saturated: the table reports the whole run
            ax_u.plot([x[0], x[-1]], [r.utilisation * 100] * 2, linestyle=(0, (4, 2)), linewidth=1.6,
                      color=colour, gid=f"{pool}:saturation_level", label=f"{pool}: {r.utilisation:.1%} used "
                      "(never saturated: whole run)")
    ax_u.set_ylabel("memory utilisation (%)")
    ax_u.set_ylim(0, 105)
    ax_r.set_ylabel("running requests")
    ax_r.set_xlabel("time (s, step-time model)" if timed else "scheduler step")
    ax_u.legend(loc="lower right", fontsize=7)
    ax_u.set_title(title)
    ax_u.grid(alpha=0.3)
    ax_r.grid(alpha=0.3)
    fig.tight_layout()
    return fig
