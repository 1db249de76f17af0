"""`kvchain bench pd`: PD transfer bandwidth of real page batches against the transfer engine's own
large-buffer bandwidth, measured in the same run between the same two processes.

Each process builds its own pool of one hybrid plan (full attention, a sliding window, recurrent
state), takes and frees rows until its free pages are scattered, then takes the request rows a
hand-off moves: the prefill side's are the sources, the decode side's the destinations. A batch is
what `dist/pd.py` sends for them: every full-attention page, the window rows decode keeps and the
state slots, as arena byte segments (adjacent pages merged). The baseline writes the same number of
bytes as one contiguous segment. Batch and baseline alternate, `repeats` times; the ratio is the
median of the per-repeat quotients (batch bandwidth over baseline bandwidth)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..build import build_kv_storage
from ..decl import MHA, State, StateTensor
from ..models.small import small_hybrid
from ..plan import plan_kv_storage
from ..sizing import size_plan

#: the bench's plan: 16-token pages of 4 layers of 8 KV heads x 64 (bf16), a 256-token window, state
PAGE_TOKENS = 16
HEADS, HEAD_DIM, BLOCKS, WINDOW = 8, 64, 4, 256
SCHEMA = ("engine", "repeats", "requests", "tokens", "bytes", "segments", "pages", "batch_gb_per_s",
          "large_gb_per_s", "ratio", "samples")


def bench_storage(budget: int, requests: int, tokens: int, device: str = "cpu"):
    state = State((StateTensor("conv", (4, 256)), StateTensor("ssm", (8, 64, 16), "float32")))
    decls = small_hybrid(MHA(HEADS, HEAD_DIM), (WINDOW,), state=state, blocks=BLOCKS)
    plan = plan_kv_storage(decls, page_size=PAGE_TOKENS)
    # the short filler requests run up to 4 pages, whatever `tokens` is
    context = max(tokens, 4 * PAGE_TOKENS) + PAGE_TOKENS
    sizing = size_plan(plan, budget, context_len=context, max_running_requests=4 * requests + 2)
    return build_kv_storage(plan, sizing, device)


def scattered_rows(storage, requests: int, tokens: int, seed: int) -> list[int]:
    """Request rows of `tokens` each, taken after fillers were taken and every other one freed, so
    their pages lie scattered over the band as a busy pool's do."""
    rng = np.random.default_rng(seed)
    fillers = []
    for _ in range(requests):
        row = storage.alloc_row()
        storage.alloc_extend(np.array([row]), np.array([int(rng.integers(PAGE_TOKENS, max(tokens // 2, PAGE_TOKENS + 1)))]))
        fillers.append(row)
    storage.free_rows(np.array(fillers[::2]))
    # then many short ones, every other freed: holes of a page or a few all over the band
    small = [storage.alloc_row() for _ in range(2 * requests)]
    for row in small:
        storage.alloc_extend(np.array([row]), np.array([int(rng.integers(1, 4 * PAGE_TOKENS))]))
    storage.free_rows(np.array(small[::2], dtype=np.int64))
    rows = []
    for _ in range(requests):
        row = storage.alloc_row()
        storage.alloc_extend(np.array([row]), np.array([tokens]))
        storage.advance(np.array([row]))
        rows.append(row)
    return rows


def summarize(engine: str, nbytes: int, samples: list[tuple[float, float]], **extra) -> dict:
    """Bandwidths (GB/s, 1e9 bytes) of the medians and the median of per-repeat ratios."""
    batch = statistics.median(s for s, _ in samples)
    large = statistics.median(s for _, s in samples)
    ratio = statistics.median((nbytes / b) / (nbytes / g) for b, g in samples)
    return {"engine": engine, "repeats": len(samples), **extra, "bytes": nbytes,
            "batch_gb_per_s": round(nbytes / batch / 1e9, 4), "large_gb_per_s": round(nbytes / large / 1e9, 4),
            "ratio": round(ratio, 4),
            "samples": [{"batch_s": round(b, 6), "large_s": round(g, 6)} for b, g in samples]}


def _timed(engine, link, initiator: bool, src, dst, tag: str, timeout_s: float = 60.0) -> float:
    link.all_gather(tag)  # both sides start together
    t0 = time.perf_counter()
    t = engine.write("peer", src, dst, tag) if initiator else engine.expect("peer", dst, tag)
    deadline = time.monotonic() + timeout_s
    while not engine.poll(t).quiescent:
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench transfer {tag} did not finish within {timeout_s} s")
    seconds = time.perf_counter() - t0
    if t.state.value != "done":
        raise RuntimeError(f"bench transfer {tag}: {t.state.value}")
    link.all_gather(tag)  # the target has its bytes before the next one starts
    return seconds


def bench_node(stage: int, n: int, port: int, kind: str, repeats: int, requests: int, tokens: int,
               budget: int) -> dict:
    from ..dist.pd import request_pages, segments_of
    from ..dist.pp import StageLink
    from ..dist.transfer import make_engine

    link = StageLink.join(stage, n, port, timeout_s=60.0)
    try:
        storage = bench_storage(budget, requests, tokens)
        rows = scattered_rows(storage, requests, tokens, seed=stage)
        pages: dict[str, list] = {}
        for row in rows:
            for name, ids in request_pages(storage, row).items():
                pages.setdefault(name, []).extend(int(p) for p in ids)
        segments = segments_of(storage, {k: np.asarray(v) for k, v in pages.items()})
        engine = make_engine(kind, "prefill" if stage == 0 else "decode")
        engine.register(storage.arena.data)
        descs = link.all_gather(engine.descriptor())
        engine.connect("peer", descs[1 - stage])
        theirs = link.all_gather(segments)[1 - stage]
        total = sum(n for _o, n in segments)
        initiator = stage == 0
        src, dst = (segments, theirs) if initiator else (theirs, segments)
        large = [(0, total)]
        samples = []
        _timed(engine, link, initiator, src, dst, "warm")
        for r in range(repeats):
            b = _timed(engine, link, initiator, src, dst, f"batch{r}")
            g = _timed(engine, link, initiator, large, large, f"large{r}")
            samples.append((b, g))
        engine.close()
        if not initiator:
            return {}
        return summarize(kind, total, samples, requests=requests, tokens=tokens,
                         segments=max(len(src), len(dst)), pages={k: len(v) for k, v in pages.items()})
    finally:
        link.close()


def run_pd_bench(engine: str = "nixl", repeats: int = 5, requests: int = 8, tokens: int = 2048,
                 budget: int = 256 * 2**20, timeout_s: float = 300.0) -> dict:
    """Two processes on the loopback interface; the prefill side's numbers."""
    from ..dist.pp import failures, run_stage_processes
    from ..errors import InputError, KVChainError

    # the rows each process lays out, first on a `meta` arena here: a budget or a size they cannot
    # hold is one line before any process starts
    try:
        scattered_rows(bench_storage(budget, requests, tokens, "meta"), requests, tokens, seed=0)
    except KVChainError as e:
        raise InputError(f"{requests} requests of {tokens} tokens do not fit a budget of {budget:,} bytes "
                         f"({type(e).__name__}: {e})") from None
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    out = run_stage_processes(bench_node, 2, (engine, repeats, requests, tokens, budget), timeout_s=timeout_s, env=env)
    bad = [f"process {s}: {text}" for s, _status, text in failures(out)]  # the first to fail first
    if bad:
        raise KVChainError("bench pd: " + "; ".join(bad))
    return out[0][1]
