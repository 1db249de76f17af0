"""The comparison as a table, as JSON, and as a plot of utilisation and running requests."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..units import format_bytes
from .compare import Comparison


def comparison_json(model, args, result: Comparison) -> dict:
    ratios = result.ratios()
    return {
        "model": model.name,
        "budget_bytes": args.budget,
        "workload": args.trace or args.workload,
        "requests": result.results[0].requests if result.results else 0,
        "results": [{**r.to_dict(), "throughput_vs_kvchain": ratios.get(r.pool)} for r in result.results],
        "static_best_split": None if result.static_best is None else {
            "window_ratio": result.static_best.window_ratio, "state_ratio": result.static_best.state_ratio},
        "static_best_sweep": result.sweep,
    }


def render_comparison(model, args, result: Comparison, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console = Console(width=160)
    ratios = result.ratios()
    table = Table(title=f"{model.name} · {format_bytes(args.budget)} · {args.trace or args.workload} · "
                        f"{result.results[0].requests} requests", title_justify="left")
    cols = ["pool", "tok/step", "vs kvchain", "running", "utilisation", "tok/step (run)", "peak", "hit rate",
            "queue delay", "preempted", "aborted", "rejected", "finished"]
    if result.results and result.results[0].seconds is not None:
        cols.insert(3, "tok/s (model)")
    for c in cols:
        table.add_column(c, justify="left" if c == "pool" else "right")
    for r in result.results:
        row = [r.pool, f"{r.throughput:.1f}", f"{ratios.get(r.pool, float('nan')):.2f}x", f"{r.mean_concurrency:.1f}",
               f"{r.utilisation:.1%}", f"{r.throughput_overall:.1f}", str(r.peak_running), f"{r.hit_rate:.1%}",
               f"{r.queue_delay:.0f}",
               str(r.preemptions), str(r.aborted), str(r.rejected), str(r.finished)]
        if r.seconds is not None:
            row.insert(3, f"{r.tokens_per_second:.0f}")
        table.add_row(*row)
    console.print(table)
    console.print("tok/step, running and utilisation at saturation (steps that ended with requests waiting); "
                  "tok/step (run) over the whole run, drain included")
    if result.static_best is not None:
        console.print(f"static-best split (oracle, swept on the trace): window ratio {result.static_best.window_ratio}, "
                      f"state ratio {result.static_best.state_ratio}")


def plot_comparison(result: Comparison, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_u, ax_r) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for pool, history in result.histories.items():
        steps = [h.step for h in history]
        ax_u.plot(steps, [h.utilisation * 100 for h in history], label=pool, linewidth=1)
        ax_r.plot(steps, [h.running for h in history], label=pool, linewidth=1)
    ax_u.set_ylabel("memory utilisation (%)")
    ax_u.set_ylim(0, 105)
    ax_r.set_ylabel("running requests")
    ax_r.set_xlabel("scheduler step")
    ax_u.legend(loc="lower right", fontsize=8)
    ax_u.set_title(title)
    ax_u.grid(alpha=0.3)
    ax_r.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
