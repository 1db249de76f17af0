"""The comparison as a table, as JSON, and as a plot of utilisation and running requests."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..units import format_bytes
from .compare import Comparison


def comparison_json(model, args, result: Comparison) -> dict:
    steps = result.ratios("steps")
    throughput = result.ratios("throughput")
    return {
        "model": model.name,
        "budget_bytes": args.budget,
        "workload": args.trace or args.workload,
        "requests": result.results[0].requests if result.results else 0,
        "admission": getattr(args, "admission", None),
        "results": [{**r.to_dict(), "steps_vs_kvchain": steps.get(r.pool),
                     "kvchain_steps_ratio": (1 / steps[r.pool]) if steps.get(r.pool) else None,
                     "throughput_vs_kvchain": throughput.get(r.pool)} for r in result.results],
        "static_best_split": None if result.static_best is None else {
            "window_ratio": result.static_best.window_ratio, "state_ratio": result.static_best.state_ratio},
        "static_best_sweep": result.sweep,
    }


def _p(d: dict | None, key: str, fmt: str) -> str:
    return format(d[key], fmt) if d and key in d else "-"


#: the width the tables are laid out for when stdout is not a terminal (a pipe, a file)
TABLE_WIDTH = 100


def _table(title: str, columns: list[str]) -> Table:
    """Headers are broken onto lines no wider than their figures, so the tables keep their natural
    width within 100 columns and no cell is squeezed; were one too narrow anyway, `fold` breaks a
    word rather than hiding its end behind an ellipsis."""
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if c == "pool" else "right", overflow="fold")
    return table


def render_comparison(model, args, result: Comparison, console: Console | None = None) -> None:
    """Two stacked tables that fit 100 columns: the whole-run figures first (steps to serve the
    trace, kvchain's steps over each pool's, seconds and tokens/s with the step-time model,
    TTFT/TPOT, preemptions, recomputed tokens), then the memory figures at saturation and the
    request counts."""
    console = console or Console()
    if not console.is_terminal:
        console = Console(width=TABLE_WIDTH)
    steps = result.ratios("steps")
    timed = bool(result.results) and result.results[0].seconds is not None
    console.print(f"[bold]{model.name}[/] · {format_bytes(args.budget)} · {args.trace or args.workload} · "
                  f"{result.results[0].requests} requests")
    cols = ["pool", "steps", "kvchain\n/ pool"]
    if timed:
        cols += ["seconds", "tok/s", "TTFT\np50/p99 s", "TPOT\np50/p99 ms"]
    else:
        cols += ["TTFT\np50/p99\nsteps", "TPOT\np50/p99\nsteps"]
    cols += ["pre-\nempted", "recomp.\ntokens"]
    whole = _table("Whole run", cols)
    memory = _table("At saturation, and requests", ["pool", "hit\nrate", "tok/\nstep", "running", "memory\nused",
                                                     "peak", "aborted", "rejected", "finished"])
    for r in result.results:
        ratio = steps.get(r.pool)
        row = [r.pool, f"{r.steps:,}", f"{1 / ratio:.3f}x" if ratio else "-"]
        if timed:
            tpot_ms = r.tpot_s and {k: v * 1e3 for k, v in r.tpot_s.items()}
            row += [f"{r.seconds:,.1f}", f"{r.tokens_per_second:,.0f}",
                    f"{_p(r.ttft_s, 'p50', '.2f')}/{_p(r.ttft_s, 'p99', '.2f')}",
                    f"{_p(tpot_ms, 'p50', '.1f')}/{_p(tpot_ms, 'p99', '.1f')}"]
        else:
            row += [f"{_p(r.ttft_steps, 'p50', '.0f')}/{_p(r.ttft_steps, 'p99', '.0f')}",
                    f"{_p(r.tpot_steps, 'p50', '.2f')}/{_p(r.tpot_steps, 'p99', '.2f')}"]
        row += [f"{r.preemptions:,}", f"{r.recomputed_tokens:,}"]
        whole.add_row(*row)
        memory.add_row(r.pool, f"{r.hit_rate:.1%}", f"{r.throughput:,.1f}", f"{r.mean_concurrency:,.1f}",
                       f"{r.utilisation:.1%}", f"{r.peak_running:,}", f"{r.aborted:,}", f"{r.rejected:,}",
                       f"{r.finished:,}")
    console.print(whole)
    console.print(memory)
    console.print("steps: to serve the whole trace; kvchain / pool: kvchain's steps over the pool's (below 1: "
                  "kvchain serves it in fewer); at saturation: over the steps that ended with requests waiting")
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
