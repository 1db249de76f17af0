"""Human and JSON renderings of plans, sizings and model lists for the CLI (the CLI owns the
terminal; the library never prints)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .cli_common import output_console
from .plan import KVStoragePlan, TokenIds
from .sizing import PlanSizing
from .units import count_of, format_bytes


def plan_report(model, plan: KVStoragePlan, sizing: PlanSizing) -> dict:
    """The plan as JSON: fixed snake_case keys, the same for every model (docs/cli.md lists them)."""
    return {
        "model": {"name": model.name, "family": model.family, "layers_with_kv": len(model.decls),
                  "tp_size": model.tp_size, "max_context": model.max_context},
        "plan": plan.to_dict(),
        "sizing": sizing.to_dict(),
    }


def _column(table: Table, name: str, number: bool = False) -> None:
    """Numbers are right-aligned and never wrapped; text folds onto more lines instead of being cut."""
    if number:
        table.add_column(name, justify="right", no_wrap=True, overflow="fold")
    else:
        table.add_column(name, overflow="fold")


def render_plan(model, plan: KVStoragePlan, sizing: PlanSizing, console: Console | None = None) -> None:
    console = console or output_console()
    console.print(
        f"[bold]{model.name}[/] ({model.family}, tp={model.tp_size}) · budget {format_bytes(sizing.budget_bytes)}"
        f" · page size {count_of(plan.page_size, 'token')} · context {sizing.context_len:,}"
    )
    chain = Table(title="Chain (grow-up end first, grow-down end last)", title_justify="left")
    for col in ("#", "sub-pool", "placement", "lifetime", "geometry", "layers"):
        _column(chain, col, number=col in ("#", "layers"))
    targets = Table(title="Boot targets", title_justify="left")
    for col in ("#", "bytes per unit", "page bytes", "target", "target bytes"):
        _column(targets, col, number=True)
    for pool, target in zip(plan.sub_pools, sizing.targets):
        chain.add_row(str(pool.index), pool.name, pool.placement.value, pool.lifetime.describe(),
                      pool.geometry.describe(), str(len(pool.layer_ids)))
        targets.add_row(str(pool.index), f"{pool.unit_bytes:,} / {pool.unit.value}", f"{pool.page_bytes:,}",
                        f"{target.units:,} {pool.unit.value}s", format_bytes(target.bytes))
    console.print(chain)
    console.print(targets)
    summary = Table(title="Sizing", title_justify="left", show_header=False)
    _column(summary, "what")
    _column(summary, "value", number=True)
    for name, b in sizing.fixed.terms():
        summary.add_row(f"fixed: {name}", format_bytes(b))
    summary.add_row("sink pages", format_bytes(sizing.sink_bytes))
    summary.add_row("arena", format_bytes(sizing.arena_bytes))
    if plan.state is not None:
        summary.add_row("state slots", f"{sizing.state_slots:,} ({sizing.state_slots_per_request} per request)")
    # a chain with no full-attention layer has a token-id owner: its tokens are ids, not KV
    owned = "token ids (no full-attention layer)" if isinstance(plan.owner.geometry, TokenIds) else "full-attention tokens"
    summary.add_row(owned, f"{sizing.full_tokens:,}")
    summary.add_row(f"concurrency at {sizing.context_len:,} tokens", f"{sizing.concurrency:,} requests")
    summary.add_row("limited by", sizing.limited_by)
    summary.add_row("unused", format_bytes(sizing.budget_bytes - sizing.used_bytes))
    console.print(summary)
    console.print(f"[italic]Batch-size-1 floor: {format_bytes(sizing.floor.one_request)} serves one request "
                  f"(refused below {format_bytes(sizing.floor.total)})[/]")
    floor = Table(show_header=False)
    _column(floor, "term")
    _column(floor, "bytes", number=True)
    for term in sizing.floor.terms:
        floor.add_row(term.name, format_bytes(term.bytes))
    console.print(floor)
    console.print(PLAN_KEY, markup=False, highlight=False)


#: what `render_plan`'s terms mean, printed under the tables (docs/overview.md has the design)
PLAN_KEY = (
    "Key: the arena is one chain of sub-pools; the up-end and down-end sub-pools grow from the two ends "
    "of the arena toward each other, a float sits between them and is relocated as they grow. Boot "
    "targets: what each sub-pool is sized for at start-up (any sub-pool may take any free bytes later). "
    "Sink pages: what an unbound page id reads (never out of range). Gaps between sub-pools: a page of "
    "the larger of each pair of neighbours kept free, so each can align its grid next to the other. "
    "Batch-size-1 floor: the least budget that serves one request at the context length."
)


def render_models(presets, console: Console | None = None) -> None:
    console = console or output_console()
    table = Table(title="Built-in model presets", title_justify="left")
    for col in ("name", "family", "layers", "HuggingFace id"):
        _column(table, col, number=col == "layers")
    for p in presets:
        table.add_row(p.name, p.family, str(p.num_layers), p.hf_id)
    console.print(table)


def stages_report(model, ranges, plans, sizing) -> dict:
    """Pipeline stages as JSON: each stage's layers, plan, sizing and geometry, and the concurrency
    after the MIN-reduce across stages (docs/cli.md lists the keys)."""
    from .alloc.stage_capacity import StageGeometry
    from .memory.arena import arena_layout

    stages = []
    for i, (layers, plan, sized) in enumerate(zip(ranges, plans, sizing.stages)):
        geometry = StageGeometry.of_layout(plan, arena_layout(plan, sized.arena_bytes), i)
        with_kv = len({layer for pool in plan.sub_pools for layer in pool.layer_ids})
        stages.append({"stage": i, "first_layer": layers.start, "last_layer": layers.stop - 1, "layers_with_kv": with_kv,
                       "bytes_per_token": geometry.bytes_per_token(), "plan": plan.to_dict(),
                       "sizing": sized.to_dict(), "geometry": geometry.to_dict()})
    return {"model": {"name": model.name, "family": model.family, "layers_with_kv": len(model.decls),
                      "tp_size": model.tp_size, "max_context": model.max_context},
            "pp_size": len(stages), "stages": stages, "concurrency": sizing.concurrency,
            "limiting_stage": sizing.limiting_stage}


def render_stages(report: dict, console: Console | None = None) -> None:
    console = console or output_console()
    model, stages = report["model"], report["stages"]
    first = stages[0]["sizing"]
    console.print(f"[bold]{model['name']}[/] (tp={model['tp_size']}, pp={report['pp_size']}) · "
                  f"budget {format_bytes(first['budget_bytes'])} per stage · page size "
                  f"{stages[0]['plan']['page_size']} · context {first['context_len']:,}")
    table = Table(title="Stages (each plans and sizes its own layers)", title_justify="left")
    for col in ("stage", "layers", "arena", "bytes/token", "concurrency", "limited by"):
        _column(table, col, number=col not in ("layers", "limited by"))
    geometry = Table(title="Stage geometry (all-gathered when the loop starts)", title_justify="left")
    for col in ("stage", "sub-pool", "layers", "unit bytes", "page bytes", "pages", "ids"):
        _column(geometry, col, number=col != "sub-pool")
    for s in stages:
        sized = s["sizing"]
        table.add_row(str(s["stage"]), f"{s['first_layer']}..{s['last_layer']}",
                      format_bytes(sized["arena_bytes"]), f"{s['bytes_per_token']:,}",
                      f"{sized['concurrency']:,}", sized["limited_by"])
        for pool, band in zip(s["plan"]["chain"], s["geometry"]["bands"]):
            geometry.add_row(str(s["stage"]), band["name"], str(pool["layers"]), f"{band['unit_bytes']:,}",
                             f"{band['page_bytes']:,}", f"{band['n_pages']:,}", f"{band['n_ids']:,}")
    console.print(table)
    console.print(geometry)
    console.print(f"Concurrency after the MIN-reduce across stages: [bold]{report['concurrency']:,} requests[/] "
                  f"at {first['context_len']:,} tokens (stage {report['limiting_stage']} limits)")
