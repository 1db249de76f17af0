"""`kvchain simulate`: serve a workload at real GPU scale through kvchain and the pools engines use
today, side by side, on one byte budget and one scheduler loop."""

from __future__ import annotations

import argparse

from ..cache.radix import CheckpointStrategy
from ..cli_common import (
    PLOT_SUFFIXES,
    add_model_args,
    bounded_int,
    check_context,
    check_model_flags,
    check_output_file,
    dump_json,
    load_model,
    path_text,
    positive_float,
    progress,
    say,
    seed_int,
)
from ..cli_common import byte_size as _byte_size
from ..cli_common import positive_int as _positive_int
from ..engine.policies import ADMISSION_MODES
from ..errors import InputError
from .waiting import EVICTION_ORDERS, WAITING_ORDERS
from .workloads import MAX_REQUEST_TOKENS, WORKLOADS

#: requests a run may generate or replay: each holds its prompt and output tokens in memory
MAX_REQUESTS = 100_000
#: request rows: the request table holds a row of the context length for each
MAX_RUNNING = 65_536
#: pages of the smallest sub-pool a budget may buy: every pool keeps host arrays per page
MAX_PAGES = 2**24
#: the pools a comparison runs unless `--pools` names others
DEFAULT_POOLS = "kvchain,vllm-hybrid,sglang-static,ideal"


def configure(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--budget", required=True, type=_byte_size, help="bytes for the KV pool, e.g. 80GiB")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="mixed", help=f"a built-in workload: {', '.join(WORKLOADS)} (default mixed)")
    src.add_argument("--trace", type=path_text, help="a JSONL trace (Mooncake fields: timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--requests", type=bounded_int(MAX_REQUESTS, "each request holds its tokens in memory"),
                   default=2000, help="requests to generate or replay (default 2000)")
    p.add_argument("--seed", type=seed_int, default=0, help="the generated workload's seed (default 0)")
    p.add_argument("--pools", default=DEFAULT_POOLS,
                   help="comma-separated pools to compare (default: kvchain, the engines and the ideal bound; also "
                        "static-default, static-best, uniform-page: the layouts alone under kvchain's admission)")
    p.add_argument("--admission", default="optimistic", choices=list(ADMISSION_MODES),
                   help="kvchain's admission: optimistic (default: reserve the prompt and an estimate of the output, "
                        "retract when a step cannot grow) or exact (reserve every output in full, never retract)")
    p.add_argument("--priority", action="store_true",
                   help="priority scheduling: admit by each request's priority (a trace's 'priority' field; lower "
                        "is more important), preempting less important running requests when admission says "
                        "that makes room")
    p.add_argument("--page-size", type=_positive_int, default=64, help="tokens per page (default 64)")
    p.add_argument("--context", type=_positive_int, default=None,
                   help="context length (default: min(model, 32768))")
    p.add_argument("--max-batched-tokens", type=_positive_int, default=8192,
                   help="tokens a step may schedule, decodes and prefill chunks together (default 8192)")
    p.add_argument("--max-running", type=bounded_int(MAX_RUNNING, "the request table holds a row for each"),
                   default=256, help="running requests at most (default 256)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off in every pool")
    p.add_argument("--mamba-radix-cache-strategy", dest="strategy", default="auto",
                   choices=["auto", *(s.value for s in CheckpointStrategy)],
                   help="how the pools' prefix trees cache recurrent state: one for every pool, or auto (default): "
                        "each pool its engine's own (kvchain copies checkpoints on its grid, extra_buffer_lazy; "
                        "vLLM at block boundaries; sglang no_buffer, at sequence ends only)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=None,
                   help="tokens between cached recurrent-state checkpoints (default: sized to the state's cost)")
    p.add_argument("--host-budget", type=_byte_size, default=0,
                   help="bytes of a host tier behind kvchain's prefix tree, e.g. 64GiB: evicted tree nodes are backed "
                        "up there and loaded back on a match, retracted requests swapped out instead of recomputed "
                        "(default: none)")
    p.add_argument("--waiting-order", default="fcfs", choices=list(WAITING_ORDERS),
                   help="kvchain's waiting order: fcfs (default, as the engines' pools and ideal) or longest-prefix "
                        "(the waiting request the prefix tree holds most of first, among the first 64; a request "
                        "overtaken 4 times goes next)")
    p.add_argument("--eviction", default="waiting-aware", choices=list(EVICTION_ORDERS),
                   help="what kvchain's prefix tree evicts first: waiting-aware (default: least recently used, but "
                        "what the first 64 waiting requests will match goes last, the one needed latest first) or "
                        "lru (least recently used, as ideal evicts); on a model with state either puts what can end "
                        "no match first, which the engines' pools (recency alone) do not")
    p.add_argument("--step-time", default=None,
                   help="turn steps into seconds: base_ms=8,per_token_us=25,per_kv_token_ns=4,per_host_byte_ps=40 (off by default)")
    p.add_argument("--ms-per-step", type=positive_float, default=50.0,
                   help="trace timestamps to steps (default 50 ms)")
    p.add_argument("--block-tokens", type=bounded_int(MAX_REQUEST_TOKENS, "longer than any request"), default=512,
                   help="tokens per trace hash block: hash_ids[i] names prompt tokens i*N..(i+1)*N (default 512, Mooncake's)")
    p.add_argument("--rate", type=positive_float, default=None, help="arrivals per step for generated workloads (default: the workload's own)")
    p.add_argument("--closed-loop", action="store_true",
                   help="sessions (multi-turn, agentic, the mix's): a turn arrives its gap after the turn "
                        "before it finishes, not at a time fixed in advance")
    p.add_argument("--jobs", type=bounded_int(256, "one process each"), default=None,
                   help="worker processes (default: the cores)")
    p.add_argument("--plot", type=path_text, default=None, help="write utilisation and running requests over time to this image "
                        f"({', '.join(PLOT_SUFFIXES)})")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--pp", type=_positive_int, default=1,
                   help="pipeline stages: serve kvchain alone, each stage its own layers and arena, every capacity "
                        "question asked of every stage's snapshot (default 1)")
    p.add_argument("--pp-partition", type=_layer_counts, default=None,
                   help="layers per stage with --pp, comma separated (default: an even split, as engines do)")
    p.add_argument("--spec-tokens", type=bounded_int(64, "a round proposes a few tokens; each is a decode step of the draft"), default=None,
                   help="speculative decoding: a fused draft (the model's first layers) proposing this many "
                        "tokens per round; every pool then holds the draft's KV too")
    p.add_argument("--spec-acceptance", type=float, default=None,
                   help="with --spec-tokens: the chance each proposal is accepted; a decode step yields 1 + the "
                        "proposals accepted (seeded draws, --seed)")


def _layer_counts(text: str) -> tuple[int, ...]:
    """Layers per pipeline stage, such as `26,22`."""
    return tuple(_positive_int(part) for part in text.split(","))


def _requests(args: argparse.Namespace):
    from . import workloads

    if args.trace:
        return workloads.load_trace(args.trace, ms_per_step=args.ms_per_step, block_tokens=args.block_tokens,
                                    limit=args.requests)
    params = {} if args.rate is None else {"rate": args.rate}
    if args.closed_loop:
        params.update(workloads.closed_loop_params(args.workload))
    return workloads.workload_from_name(args.workload, args.requests, args.seed, **params)


def _served_requests(args: argparse.Namespace):
    """The workload's requests, refused when none could be served: an empty trace, or a context no
    request's prompt fits in (every one would be rejected on arrival)."""
    requests = _requests(args)
    if not requests:
        raise InputError("the workload has no requests")
    shortest = min(r.input_len for r in requests)
    if shortest >= args.context:
        raise InputError(f"--context {args.context:,}: every request's prompt reaches it (the shortest has "
                         f"{shortest:,} tokens), so none would be served")
    return requests


def _check_pages(model, budget: int) -> None:
    """Refuse a budget whose pages the simulated pools could not index on the host (the ideal pool
    pages every sub-pool by `IDEAL_PAGE_TOKENS` tokens, the smallest page of all)."""
    from ..plan import plan_kv_storage
    from .baselines import IDEAL_PAGE_TOKENS

    smallest = min(p.page_bytes for p in plan_kv_storage(model.decls, page_size=IDEAL_PAGE_TOKENS).sub_pools)
    if budget // smallest > MAX_PAGES:
        raise InputError(f"--budget {budget:,} bytes is {budget // smallest:,} pages of {smallest:,} bytes; the "
                         f"simulated pools index at most {MAX_PAGES:,} (use a smaller budget)")


def _check_attention(model) -> None:
    """Refuse a model that keeps only recurrent state: the pools compared here size their pages,
    static splits and checkpoint grids by attention bytes, which such a model has none of."""
    if not any(part.is_attention for decl in model.decls for part in decl.parts):
        raise InputError(f"{model.name} keeps only recurrent state (no attention layer); simulate compares "
                         "pools by their attention pages: run `kvchain plan` for its state slots and concurrency")


def _checked_model(args: argparse.Namespace):
    """The model, once every flag it and the workload's source must agree with is checked (the
    context set to what the run plans for)."""
    if args.rate is not None and args.trace:
        raise InputError("--rate sets a generated workload's arrivals; a trace's timestamps set them")
    if args.closed_loop and args.trace:
        raise InputError("--closed-loop sets a generated workload's session arrivals; a trace's timestamps set them")
    if args.host_budget and args.no_prefix_cache:
        raise InputError("--host-budget backs kvchain's prefix tree, which --no-prefix-cache turns off")
    model = load_model(args)
    check_model_flags(model, args)
    _check_attention(model)
    args.context = check_context(model, args.context)
    _check_pages(model, args.budget)
    return model


def _checkpoint_every(args: argparse.Namespace) -> int | None:
    """The pools' checkpoint grid: `--checkpoint-every`, or the model flags' `--checkpoint-interval`
    (the same thing, named as `plan` and `generate` name it); both given, they must agree."""
    every, interval = args.checkpoint_every, args.checkpoint_interval
    if every is not None and interval is not None and every != interval:
        raise InputError(f"--checkpoint-every {every} and --checkpoint-interval {interval} name one grid: give one")
    return every if every is not None else interval


def run(args: argparse.Namespace) -> int:
    from ..units import format_bytes
    from .baselines import POOLS, PoolConfig
    from .compare import SchedulerConfig, compare
    from .report import comparison_json, plot_comparison, render_comparison
    from .runner import StepTimeModel

    args.checkpoint_every = _checkpoint_every(args)
    if args.pp > 1 or args.pp_partition is not None:
        return _run_stages(args)
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    unknown = [p for p in pools if p not in POOLS]
    if not pools or unknown:
        raise InputError(f"--pools: unknown pool(s) {', '.join(unknown) or '(none given)'} (known: {', '.join(POOLS)})")
    repeated = sorted({p for p in pools if pools.count(p) > 1})
    if repeated:
        raise InputError(f"--pools: {', '.join(repeated)} given more than once")
    step_time = StepTimeModel.parse(args.step_time) if args.step_time else None
    if args.plot:
        check_output_file(args.plot, "--plot", PLOT_SUFFIXES)
    model = _checked_model(args)
    decls, spec = model.decls, None
    if (args.spec_tokens is None) != (args.spec_acceptance is None):
        raise InputError("--spec-tokens and --spec-acceptance go together")
    decode_tokens = None
    if args.spec_tokens is not None:
        from .speculative import SpecSteps, fused_decls, spec_summary

        spec = spec_summary(model.decls, args.spec_tokens, args.spec_acceptance, args.page_size)
        decls = fused_decls(model.decls)
        decode_tokens = SpecSteps(args.spec_tokens, args.spec_acceptance, seed=args.seed)
    requests = _served_requests(args)
    cfg = PoolConfig(args.budget, page_size=args.page_size, context_len=args.context, max_running=args.max_running,
                     prefix_cache=not args.no_prefix_cache, checkpoint_interval=args.checkpoint_every,
                     strategy=None if args.strategy == "auto" else CheckpointStrategy(args.strategy),
                     admission=args.admission, waiting_order=args.waiting_order, host_budget=args.host_budget,
                     eviction=args.eviction)
    sched = SchedulerConfig(args.max_batched_tokens, args.max_running, step_time, priority=args.priority,
                            decode_tokens=decode_tokens)
    with progress(disable=args.json, unit="requests") as bar:
        task = bar.add_task(f"simulate {len(pools)} pools", total=None)
        result = compare(decls, cfg, requests, pools, sched, jobs=args.jobs,
                         progress=lambda done, total: bar.update(task, completed=done, total=total))
    if args.plot:
        plot_comparison(result, args.plot, title=f"{model.name}, {format_bytes(args.budget)}, {args.trace or args.workload}")
    if args.json:
        out = comparison_json(model, args, result)
        if spec is not None:
            out["speculative"] = spec
        print(dump_json(out, indent=2))
    else:
        render_comparison(model, args, result)
        if spec is not None:
            say(f"speculative: {spec['draft_layers']} draft layers fused into every pool "
                  f"({spec['token_bytes_with_draft']:,} KV bytes per token, {spec['token_bytes_target']:,} without); "
                  f"{spec['tokens_per_target_forward']:.2f} tokens per decode step per request at "
                  f"{spec['spec_acceptance']:.0%} acceptance of {spec['spec_tokens']} (seeded draws: the steps "
                  "above are speculative steps)")
    return 0



def _run_stages(args: argparse.Namespace) -> int:
    """`--pp N`: kvchain's pipeline stages side by side (`sim/pp_cli.py`)."""
    from .pp_cli import check_pp_flags, run_pp

    check_pp_flags(args, DEFAULT_POOLS)
    model = _checked_model(args)
    requests = _served_requests(args)
    return run_pp(model, args, requests)
