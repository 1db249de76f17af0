"""`kvchain bench engine`: kvchain's serving engine against transformers' own ways to serve the same
tiny checkpoint, on one seeded shared-prefix workload, measured in the same run.

Peers (each on its own copy of the model, loaded by `load_checkpoint`):
- `generate_batch`: transformers' continuous batching with its paged cache, driven through the
  manager `generate_batch` itself uses, so each request keeps its own max_new_tokens. Its cache gets
  kvchain's KV bytes (the arena, without kvchain's fixed tables): transformers sizes a cache by
  `num_blocks` whole-model blocks of `page_size` tokens, a block being layers x 2 (K, V) x kv_heads x
  head_dim x dtype bytes x page_size, so num_blocks = kv_bytes // that (`cb_num_blocks`); page size
  16, 16 requests and 512 tokens a batch, as kvchain. It refuses models with recurrent layers; the
  refusal is recorded, not hidden.
- `generate`: plain `generate`, batched with left padding in input order, `max_running` requests a
  batch, each batch run to its longest max_new_tokens and each output trimmed to its request's.

kvchain runs twice: on worker-thread streams (`ThreadDevice`, the cpu default, under the overlap
loop) and `inline` (every stream's work on the host thread, `ImmediateDevice`), the way
`generate_batch` runs its loop on one thread.

Timing is wall clock around serving the requests only (engines and managers are built and warmed up
before the clock starts), with the process's CPU seconds over the same span. A fresh kvchain engine
and a fresh continuous-batching manager serve each repeat so neither starts with the previous
repeat's prompts in its prefix cache. The engines run round robin; the median over the repeats is
reported, and each repeat's ratio against each peer (neighbouring runs, so load that drifts falls on
both) gives the spread and the worst case. Greedy outputs are compared per request with kvchain's,
token for token."""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BudgetError, InputError

FAMILIES = ("gemma3", "gpt_oss", "qwen3_next", "nemotron_h")
#: Families whose layers are all attention: the only ones transformers' continuous batching serves.
ATTENTION_ONLY = frozenset({"gemma3", "gpt_oss"})
PEERS = ("generate_batch", "generate")
#: kvchain's two ways to run a cpu engine's streams: the key its figures go under, `EngineConfig.inline`
KVCHAIN = {"kvchain": False, "kvchain_inline": True}
DEFAULT_BUDGET = 4 * 2**20
PAGE_SIZE = 16
MAX_RUNNING = 16
MAX_BATCHED_TOKENS = 512
#: Pad id for left-padded `generate`; the tiny byte vocab has no pad token and the mask hides it.
PAD_ID = 0


@dataclass(frozen=True)
class BenchPrompt:
    token_ids: list[int]
    max_new_tokens: int


def shared_prefix_workload(n: int, seed: int, *, vocab: int = 256, prefixes: int = 4, prefix_len: int = 32,
                           suffix: tuple[int, int] = (8, 64), new: tuple[int, int] = (16, 32)) -> list[BenchPrompt]:
    """Chat-like prompts: one of `prefixes` system prefixes, then a random suffix; every length is
    drawn from `seed`, so every engine serves the same prompts."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, vocab, prefix_len).tolist() for _ in range(prefixes)]
    out = []
    for _ in range(n):
        head = heads[int(rng.integers(prefixes))]
        tail = rng.integers(0, vocab, int(rng.integers(suffix[0], suffix[1] + 1))).tolist()
        out.append(BenchPrompt(head + tail, int(rng.integers(new[0], new[1] + 1))))
    return out


def _warmup_workload() -> list[BenchPrompt]:
    """Two short prompts: enough to run every code path (prefill, decode, a batch of two) once."""
    return [BenchPrompt(list(range(5, 5 + 12)), 4), BenchPrompt(list(range(40, 40 + 9)), 3)]


# -- the engines ---------------------------------------------------------------------------------------


Outputs = list[list[int]]


def run_kvchain(path: Path, prompts: Sequence[BenchPrompt], budget: int,
                inline: bool = False) -> tuple[Outputs, float, dict[str, Any]]:
    """Serve `prompts` on a fresh engine (`inline`: streams on the host thread); seconds cover
    `generate` alone."""
    from ..engine.serve import Engine, EngineConfig, GenerateRequest

    config = EngineConfig(budget_bytes=budget, page_size=PAGE_SIZE, max_running=MAX_RUNNING,
                          max_batched_tokens=MAX_BATCHED_TOKENS, inline=inline)
    with Engine(path, config) as engine:
        reqs = [GenerateRequest(p.token_ids, p.max_new_tokens) for p in prompts]
        cpu0, t0 = time.process_time(), time.perf_counter()
        result = engine.generate(reqs)
        seconds = time.perf_counter() - t0
        stats = result.stats
        info = {"cpu_seconds": time.process_time() - cpu0, "kv_bytes": int(engine.storage.sizing.arena_bytes),
                "peak_running": stats.peak_running, "prefix_hit_rate": round(stats.prefix_hit_rate, 4),
                "forwards": stats.forwards, "streams": "inline" if inline else "threads"}
    return [o.token_ids for o in result.outputs], seconds, info


def cb_bytes_per_block(config: Any, dtype: torch.dtype) -> int:
    """Bytes of one continuous-batching block: `page_size` tokens of K and V for every layer, the
    unit transformers converts `num_blocks` to bytes with (sliding layers are counted as full)."""
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return layers * 2 * kv_heads * head_dim * dtype.itemsize * PAGE_SIZE


def cb_num_blocks(kv_bytes: int, config: Any, dtype: torch.dtype) -> int:
    """The `num_blocks` that gives the continuous-batching cache kvchain's KV bytes: transformers
    allocates ceil(num_blocks * bytes_per_block / bytes_per_sector) sectors, so floor here lands
    within one sector of `kv_bytes` (the two trash sectors it adds are not cache)."""
    return max(1, kv_bytes // cb_bytes_per_block(config, dtype))


def run_generate_batch(model: torch.nn.Module, prompts: Sequence[BenchPrompt],
                       num_blocks: int) -> tuple[Outputs, float, dict[str, Any]]:
    """Serve `prompts` on a fresh continuous-batching manager (paged cache of `num_blocks` blocks);
    seconds run from the first request submitted to the last one finished."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(p.max_new_tokens for p in prompts), do_sample=False,
                           eos_token_id=-1, pad_token_id=None, bos_token_id=None)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=MAX_BATCHED_TOKENS,
                                  max_requests_per_batch=MAX_RUNNING, auto_switch_to_flash=False)
    with contextlib.ExitStack() as stack:
        try:
            manager = stack.enter_context(model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, warmup=True))
        except MemoryError as e:  # it sizes its buffers by the cache and checks them against free memory
            raise BudgetError(f"transformers generate_batch cannot hold the same KV budget ({num_blocks} blocks) "
                              f"on this machine: {e}; pass a smaller --budget") from None
        cpu0, t0 = time.process_time(), time.perf_counter()
        ids = [manager.add_request(p.token_ids, request_id=f"r{i}", max_new_tokens=p.max_new_tokens)
               for i, p in enumerate(prompts)]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise InputError(f"transformers generate_batch stopped after {len(done)} of {len(ids)} requests")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise InputError(f"transformers generate_batch failed request {result.request_id}: {result.error}")
                done[result.request_id] = result
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        cache = manager.batch_processor.cache
        info = {"cpu_seconds": cpu, "kv_bytes": int(cache.num_sectors * cache.bytes_per_sector), "num_blocks": num_blocks,
                "page_size": PAGE_SIZE, "attn_implementation": model.config._attn_implementation,
                "prefix_sharing": bool(cache.use_prefix_sharing)}
    return [list(done[i].generated_tokens) for i in ids], seconds, info


def run_generate(model: torch.nn.Module, prompts: Sequence[BenchPrompt]) -> tuple[Outputs, float, dict[str, Any]]:
    """Plain `generate` in batches of `MAX_RUNNING`, left padded; outputs trimmed per request."""
    from transformers import GenerationConfig

    outputs: Outputs = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for lo in range(0, len(prompts), MAX_RUNNING):
        batch = prompts[lo: lo + MAX_RUNNING]
        width = max(len(p.token_ids) for p in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p.token_ids):] = torch.tensor(p.token_ids)
            mask[i, width - len(p.token_ids):] = 1
        new = max(p.max_new_tokens for p in batch)
        gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=PAD_ID, bos_token_id=None)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        for i, p in enumerate(batch):
            outputs.append(out[i, width: width + p.max_new_tokens].tolist())
    seconds = time.perf_counter() - t0
    return outputs, seconds, {"cpu_seconds": time.process_time() - cpu0, "batch": MAX_RUNNING, "padding": "left"}


# -- the bench -----------------------------------------------------------------------------------------


def mismatches(ours: Outputs, theirs: Outputs) -> int:
    """Requests whose token ids differ anywhere (length included)."""
    return sum(a != b for a, b in zip(ours, theirs, strict=True))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers logs a line per fallback kernel and per CPU memory probe, and draws a bar per
    checkpoint written; they would bury the table (and stderr's own bar). Restored on exit."""
    from transformers.utils import logging as hf_logging

    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level, cb_level, bars = hf_logging.get_verbosity(), cb_logger.level, hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cb_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        cb_logger.setLevel(cb_level)
        if bars:
            hf_logging.enable_progress_bar()


Timed = tuple[Outputs, list[float], list[float], dict]


def _interleaved(runners: dict[str, Callable[[], tuple[Outputs, float, dict]]], repeats: int,
                 tick: Callable[[], None]) -> dict[str, Timed]:
    """Time every engine `repeats` times, round robin (kvchain, then each peer, then again), so load
    that drifts during the run falls on all of them alike: per engine the first run's outputs, every
    run's wall and CPU seconds, the last run's info."""
    out: dict[str, Timed] = {}
    for _ in range(repeats):
        for name, fn in runners.items():
            outputs, seconds, info = fn()
            info = dict(info)
            cpu = info.pop("cpu_seconds")
            kept = out.get(name)
            if kept is None:
                out[name] = (outputs, [seconds], [cpu], info)
            else:
                out[name] = (kept[0], kept[1] + [seconds], kept[2] + [cpu], info)
            tick()
    return out


def _throughput(tokens: int, runs: list[float], cpu: list[float]) -> dict[str, Any]:
    """Seconds to microseconds: a run of a tiny model takes tens of milliseconds, and the paired
    ratios printed beside are recomputed from these runs to 1e-3."""
    seconds = statistics.median(runs)
    return {"seconds": round(seconds, 6), "tokens_per_second": round(tokens / seconds, 2),
            "runs": [round(s, 6) for s in runs], "cpu_seconds": round(statistics.median(cpu), 6),
            "cpu_runs": [round(c, 6) for c in cpu]}


def _paired(ours: tuple[int, list[float]], theirs: tuple[int, list[float]]) -> dict[str, float]:
    """Per repeat, our tokens/s over theirs from neighbouring runs: the median, the worst (min) and
    the best (max)."""
    (our_tokens, our_runs), (their_tokens, their_runs) = ours, theirs
    ratios = sorted((our_tokens / a) / (their_tokens / b) for a, b in zip(our_runs, their_runs, strict=True))
    return {"median": round(statistics.median(ratios), 4), "min": round(ratios[0], 4), "max": round(ratios[-1], 4)}


def bench_family(family: str, prompts: Sequence[BenchPrompt], *, budget: int, repeats: int, workdir: Path,
                 tick: Callable[[], None]) -> dict[str, Any]:
    """One family: kvchain (both ways to run its streams) and each peer it can run, each warmed up
    once, then timed `repeats` times round robin."""
    from ..engine.checkpoint import load_checkpoint
    from ..engine.tiny import make_checkpoint

    path = make_checkpoint(family, workdir / family, seed=0)
    warm = _warmup_workload()
    loaded = load_checkpoint(path)
    cb_model = loaded.model
    plain_model = load_checkpoint(path).model
    refused: dict[str, str] = {}
    runners: dict[str, Callable[[], tuple[Outputs, float, dict]]] = {}
    for name, inline in KVCHAIN.items():
        run_kvchain(path, warm, budget, inline)
        runners[name] = lambda inline=inline: run_kvchain(path, prompts, budget, inline)
    if family in ATTENTION_ONLY:
        kv_bytes = run_kvchain(path, warm, budget)[2]["kv_bytes"]
        blocks = cb_num_blocks(kv_bytes, cb_model.config, loaded.dtype)
        run_generate_batch(cb_model, warm, blocks)
        runners["generate_batch"] = lambda: run_generate_batch(cb_model, prompts, blocks)
    else:
        refused["generate_batch"] = _cb_refusal(cb_model)
    run_generate(plain_model, warm)
    runners["generate"] = lambda: run_generate(plain_model, prompts)
    timed = _interleaved(runners, repeats, tick)
    for _ in range(repeats * (len(PEERS) + len(KVCHAIN) - len(runners))):
        tick()  # the refused peer's share of the progress bar
    ours = timed["kvchain"][0]
    tokens = sum(len(o) for o in ours)
    result: dict[str, Any] = {"output_tokens": tokens, "kv_bytes": timed["kvchain"][3]["kv_bytes"]}
    for name in KVCHAIN:
        _outputs, runs, cpu, info = timed[name]
        result[name] = {**_throughput(tokens, runs, cpu), **info}
    result["kvchain_inline"]["mismatches"] = mismatches(ours, timed["kvchain_inline"][0])
    for peer in PEERS:
        if peer not in timed:
            continue
        theirs, runs, cpu, peer_info = timed[peer]
        entry = result[peer] = _peer(tokens, theirs, runs, cpu, peer_info, ours)
        for name, prefix in (("kvchain", ""), ("kvchain_inline", "inline_")):
            entry[f"{prefix}ratio"] = round(result[name]["tokens_per_second"] / entry["tokens_per_second"], 4)
            entry[f"{prefix}paired"] = _paired((tokens, timed[name][1]), (entry["output_tokens"], runs))
    result["generate"]["mismatches_alone"] = _mismatches_alone(plain_model, prompts, ours, timed["generate"][0])
    if refused:
        result["refused"] = refused
    return result


def _peer(tokens: int, theirs: Outputs, runs: list[float], cpu: list[float], info: dict,
          ours: Outputs) -> dict[str, Any]:
    peer_tokens = sum(len(o) for o in theirs)
    return {**_throughput(peer_tokens, runs, cpu), "output_tokens": peer_tokens,
            "mismatches": mismatches(ours, theirs), **info}


def _mismatches_alone(model: torch.nn.Module, prompts: Sequence[BenchPrompt], ours: Outputs,
                      theirs: Outputs) -> int | None:
    """Of the requests padded `generate` disagrees on, how many still disagree when generated alone
    without padding (untimed): tells padding effects from a real difference."""
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    if not differ:
        return None
    return sum(run_generate(model, [prompts[i]])[0][0] != ours[i] for i in differ)


def _cb_refusal(model: torch.nn.Module) -> str:
    """Why transformers' continuous batching will not serve `model`, in its own words, found by
    building the cache it would need (a model it accepts would be a bug in `ATTENTION_ONLY`)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    try:
        group_layers_by_attn_type(model.config)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    raise InputError(f"{model.config.model_type}: transformers' continuous batching accepts this model; "
                     "add its family to ATTENTION_ONLY")


def run_engine_bench(*, families: Sequence[str] = FAMILIES, requests: int = 64, seed: int = 0, repeats: int = 3,
                     budget: int = DEFAULT_BUDGET, threads: int = 1,
                     progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Every family in `families` on the same workload; a JSON-ready dict, the headline first.
    `threads`: torch's intra-op threads for every engine alike (restored after); one by default,
    since these models are too small to split and a busy core stalls a spinning thread pool."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise InputError(f"unknown family {unknown[0]!r} (known: {', '.join(FAMILIES)})")
    if not families:
        raise InputError("name at least one family")
    if requests < 1 or repeats < 1 or threads < 1:
        raise InputError("requests, repeats and threads must be positive")
    prompts = shared_prefix_workload(requests, seed)

    def tick() -> None:
        if progress is not None:
            progress(1)

    per_family: dict[str, Any] = {}
    torch.manual_seed(seed)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="kvchain-bench-") as tmp, _quiet_transformers():
            for family in families:
                per_family[family] = bench_family(family, prompts, budget=budget, repeats=repeats,
                                                  workdir=Path(tmp), tick=tick)
    finally:
        torch.set_num_threads(threads_before)
    headline = {family: _headline(r) for family, r in per_family.items()}
    return {
        "headline": headline,
        "workload": {"requests": requests, "seed": seed, "prompt_tokens": sum(len(p.token_ids) for p in prompts),
                     "max_new_tokens": sum(p.max_new_tokens for p in prompts), "shared_prefixes": 4,
                     "prefix_len": 32},
        "config": {"budget_bytes": budget, "page_size": PAGE_SIZE, "max_running": MAX_RUNNING,
                   "max_batched_tokens": MAX_BATCHED_TOKENS, "repeats": repeats, "torch_threads": threads},
        "families": per_family,
    }


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    """One family's headline: kvchain's seconds and tokens/s on each way to run its streams, its
    ratio to each peer (of the medians) and the worst repeat's, and the peers' mismatches."""
    out: dict[str, Any] = {}
    for name, prefix in (("kvchain", ""), ("kvchain_inline", "inline_")):
        out[f"{prefix}seconds"] = r[name]["seconds"]
        out[f"{prefix}tokens_per_second"] = r[name]["tokens_per_second"]
        for peer in PEERS:
            if peer in r:
                out[f"{prefix}ratio_vs_{peer}"] = r[peer][f"{prefix}ratio"]
                out[f"{prefix}worst_vs_{peer}"] = r[peer][f"{prefix}paired"]["min"]
    for peer in PEERS:
        if peer in r:
            out[f"mismatches_vs_{peer}"] = r[peer]["mismatches"]
    out["mismatches_inline"] = r["kvchain_inline"]["mismatches"]
    return out


def progress_total(families: Sequence[str], repeats: int) -> int:
    """Timed runs the bench reports through `progress`: kvchain twice and each peer, per family."""
    return len(families) * (len(KVCHAIN) + len(PEERS)) * repeats


def _ratio_cell(peer: dict[str, Any], prefix: str) -> str:
    paired = peer[f"{prefix}paired"]
    return f"[bold]{peer[f'{prefix}ratio']:.3f}[/] ({paired['min']:.2f}-{paired['max']:.2f})"


def render_engine_bench(result: dict[str, Any], console: Any) -> None:
    """The headline table (every family: kvchain's whole-run seconds and tokens/s on each way to run
    its streams, its ratio to each peer with the repeats' spread), then one table per family with
    each engine's own figures (seconds, tokens/s, CPU seconds, mismatches, KV bytes). On a narrow
    terminal the headline table stacks its columns and the notes wrap: no name or figure is split."""
    from rich.table import Table

    from ..cli_common import print_fitted
    from ..units import format_bytes

    cfg, work = result["config"], result["workload"]
    rows = []
    for family, r in result["families"].items():
        miss = "/".join(str(r[p]["mismatches"]) if p in r else "-" for p in PEERS)
        for name, prefix, label in (("kvchain", "", "threads"), ("kvchain_inline", "inline_", "inline")):
            ratios = [_ratio_cell(r[p], prefix) if p in r else "refused" for p in PEERS]
            k = r[name]
            rows.append([family if not prefix else "", label, f"{k['seconds']:.3f}",
                         f"[bold]{k['tokens_per_second']:.1f}[/]", *ratios, miss if not prefix else ""])
    print_fitted(console, f"kvchain bench engine: {work['requests']} requests, seed {work['seed']}, median of "
                          f"{cfg['repeats']}, budget {format_bytes(cfg['budget_bytes'])}",
                 ["family", "kvchain", "s", "tok/s", *(f"/{p}" for p in PEERS), "mismatch"], rows, lead=2,
                 caption="ratio: kvchain tok/s / peer tok/s, of the medians (in brackets the worst and best "
                         "repeat, each against its neighbouring run); threads: kvchain's streams on worker "
                         "threads (the cpu default), inline: on the host thread; mismatch: requests whose "
                         "tokens differ, per peer")
    for family, r in result["families"].items():
        # the ratios are the headline table's; this one has each engine's own figures
        table = Table(title=f"{family}: {r['output_tokens']} output tokens", title_justify="left")
        table.add_column("engine", no_wrap=True)  # names stay whole; the notes fold first
        for name in ("s", "tok/s", "cpu s", "mismatch", "KV"):
            table.add_column(name, justify="right", no_wrap=True, overflow="fold")
        table.add_column("notes", overflow="fold")
        for name in KVCHAIN:
            k = r[name]
            table.add_row(name, f"{k['seconds']:.3f}", f"{k['tokens_per_second']:.1f}", f"{k['cpu_seconds']:.3f}",
                          str(k.get("mismatches", "")), format_bytes(k["kv_bytes"]),
                          f"streams {k['streams']}, peak running {k['peak_running']}, "
                          f"prefix hits {k['prefix_hit_rate']:.0%}")
        for peer in PEERS:
            if peer not in r:
                table.add_row(peer, "", "", "", "", "", f"refused: {r.get('refused', {}).get(peer, '?')}")
                continue
            p = r[peer]
            if peer == "generate_batch":
                notes = (f"{p['attn_implementation']}, {p['num_blocks']} blocks, prefix sharing "
                         f"{'on' if p['prefix_sharing'] else 'off'}")
            else:
                notes = f"batches of {p['batch']}, {p['padding']} padded"
            if p.get("mismatches_alone") is not None:
                notes += f"; {p['mismatches_alone']} differ unpadded"
            table.add_row(peer, f"{p['seconds']:.3f}", f"{p['tokens_per_second']:.1f}", f"{p['cpu_seconds']:.3f}",
                          str(p["mismatches"]), format_bytes(p["kv_bytes"]) if "kv_bytes" in p else "", notes)
        console.print(table)
