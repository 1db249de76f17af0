"""Human and JSON renderings of plans, sizings and model lists for the CLI (the CLI owns the
terminal; the library never prints)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .plan import KVStoragePlan
from .sizing import PlanSizing
from .units import format_bytes


def plan_report(model, plan: KVStoragePlan, sizing: PlanSizing) -> dict:
    return {
        "model": {"name": model.name, "family": model.family, "layers_with_kv": len(model.decls),
                  "tp_size": model.tp_size, "max_context": model.max_context},
        "plan": plan.to_dict(),
        "sizing": sizing.to_dict(),
    }


def _console() -> Console:
    """The terminal's console; piped output gets room for the tables instead of 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=150)


def render_plan(model, plan: KVStoragePlan, sizing: PlanSizing, console: Console | None = None) -> None:
    console = console or _console()
    console.print(
        f"[bold]{model.name}[/] ({model.family}, tp={model.tp_size}) · budget {format_bytes(sizing.budget_bytes)}"
        f" · page size {plan.page_size} tokens · context {sizing.context_len:,}"
    )
    chain = Table(title="Chain (grow-up end first, grow-down end last)", title_justify="left")
    right = {"#", "layers", "bytes per unit", "page bytes", "target", "target bytes"}
    for col in ("#", "sub-pool", "placement", "lifetime", "geometry", "layers", "bytes per unit",
                "page bytes", "target", "target bytes"):
        chain.add_column(col, justify="right" if col in right else "left")
    for pool, target in zip(plan.sub_pools, sizing.targets):
        chain.add_row(
            str(pool.index), pool.name, pool.placement.value, pool.lifetime.describe(), pool.geometry.describe(),
            str(len(pool.layer_ids)), f"{pool.unit_bytes:,} / {pool.unit.value}", f"{pool.page_bytes:,}",
            f"{target.units:,} {pool.unit.value}s", format_bytes(target.bytes),
        )
    console.print(chain)
    summary = Table(title="Sizing", title_justify="left", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    for name, b in sizing.fixed.terms():
        summary.add_row(f"fixed: {name}", format_bytes(b))
    summary.add_row("sink pages", format_bytes(sizing.sink_bytes))
    summary.add_row("arena", format_bytes(sizing.arena_bytes))
    if plan.state is not None:
        summary.add_row("state slots", f"{sizing.state_slots:,} ({sizing.state_slots_per_request} per request)")
    summary.add_row("full-attention tokens", f"{sizing.full_tokens:,}")
    summary.add_row(f"concurrency at {sizing.context_len:,} tokens", f"{sizing.concurrency:,} requests")
    summary.add_row("limited by", sizing.limited_by)
    summary.add_row("unused", format_bytes(sizing.budget_bytes - sizing.used_bytes))
    console.print(summary)
    floor = Table(title=f"Batch-size-1 floor: {format_bytes(sizing.floor.total)}", title_justify="left",
                  show_header=False)
    floor.add_column("term")
    floor.add_column("bytes", justify="right")
    for term in sizing.floor.terms:
        floor.add_row(term.name, format_bytes(term.bytes))
    console.print(floor)


def render_models(presets, console: Console | None = None) -> None:
    console = console or _console()
    table = Table(title="Built-in model presets", title_justify="left")
    for col in ("name", "family", "layers", "HuggingFace id"):
        table.add_column(col, no_wrap=True)
    for p in presets:
        table.add_row(p.name, p.family, str(p.num_layers), p.hf_id)
    console.print(table)
