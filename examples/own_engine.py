"""Put kvchain under your own engine: a complete serving loop in one file, checked token for token.

The model is yours: here a toy hybrid written in plain torch, with one full-attention layer, one
sliding-window layer and one recurrent layer (a diagonal linear recurrence, the shape of a Mamba
state). What kvchain brings is the memory: every K/V row and every recurrent state lives in one
`KVStorage`, and the loop below is what an engine does around it each step:

1. schedule on the host: admit waiting requests while their first chunk fits (`alloc_extend`
   refuses with nothing changed when it does not), give each running request its next chunk or
   one decode token, and preempt the newest request by recompute when a decode cannot grow;
2. translate the step once: `iteration_ids` (where each new token's K/V and each state goes) and
   `runner_ids` (each request's physical page table per sub-pool);
3. launch the forward on the device's forward stream (`StepSequence.launch`: launch record,
   forward, `record_forward`, write-after-read barrier), while the previous forward is still
   running: the overlap scheduler;
4. process the previous forward (host wait, `forward_processed`, then its sampled tokens reach
   their requests), free the requests that ended, retire window rows (`advance`);
5. flush: the pool closes holes between steps, moving pages (and relocating the window band
   when it must) while forwards run; the next step translates again.

A decode's input token is the one the previous forward sampled, which the host has not read yet
when it schedules: the forward reads it from a device-side buffer the previous forward wrote
(`next_token`), ordered by the forward stream. On a CPU, `ThreadDevice` runs each stream on a
worker thread, so a missing wait would corrupt real bytes. On a GPU the loop is the same with
`CudaDevice("cuda")`, the arena on "cuda", and the step's ids moved to the device
(`IterationIds.to`, `RunnerIds.to`); this file runs on the CPU. At the end every request's tokens are compared with the same model run densely (no paging,
no batching, one request at a time), and the pool is checked idle: nothing leaked or pending.

    python examples/own_engine.py --requests 24 --budget-kib 520
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvchain import (
    MHA,
    CapacityError,
    Forward,
    FullLifetime,
    KVChainError,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    StepSequence,
    ThreadDevice,
    WindowLifetime,
    build_kv_storage,
    kv_layer_decls,
    plan_kv_storage,
    size_plan,
)
from kvchain.engine import Launched

VOCAB, DIM, HEADS, HEAD_DIM, WINDOW = 96, 32, 2, 16, 40
FULL_LAYER, WINDOW_LAYER, STATE_LAYER = 0, 1, 2


# -- the model: weights, and the same math dense (the reference) and paged (through the pool) ------


class ToyHybrid:
    """Embedding, then full attention, sliding-window attention and a recurrent layer, each with a
    residual; logits tied to the embedding. Float32 throughout."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, scale: float = 0.3) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * scale

        self.emb = w(VOCAB, DIM, scale=1.0)
        self.attn = {layer: (w(DIM, 3 * DIM), w(DIM, DIM)) for layer in (FULL_LAYER, WINDOW_LAYER)}
        self.decay = torch.rand(DIM, generator=g) * 0.9
        self.b_in, self.c_out = w(DIM, DIM), w(DIM, DIM)

    def decls(self):
        """What the pool must hold per layer: the declarations `plan_kv_storage` lays out."""
        kv = MHA(HEADS, HEAD_DIM, dtype="float32")
        return kv_layer_decls([
            KVPart(kv, FullLifetime()),
            KVPart(kv, WindowLifetime(WINDOW)),
            KVPart(State((StateTensor("h", (DIM,), "float32"),)), StateLifetime()),
        ])

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (torch.nn.functional.layer_norm(x, (DIM,)) @ self.attn[layer][0]).split(DIM, dim=-1)
        shape = (-1, HEADS, HEAD_DIM)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               k_pos: torch.Tensor) -> torch.Tensor:
        """Queries at positions `q_pos` over keys at `k_pos`: causal, and windowed on the window
        layer. Keys are selected by position, so a key slot outside the mask never reaches the
        output, whatever bytes it holds."""
        visible = k_pos[None, :] <= q_pos[:, None]
        if layer == WINDOW_LAYER:
            visible &= k_pos[None, :] > q_pos[:, None] - WINDOW
        scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        v = torch.where(visible.any(0)[:, None, None], v, 0.0)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(-1, DIM)
        return out @ self.attn[layer][1]

    def recur(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrent layer over a run of tokens from state `h`: returns outputs and the new state."""
        u = torch.nn.functional.layer_norm(x, (DIM,)) @ self.b_in
        out = []
        for t in range(len(x)):
            h = self.decay * h + u[t]
            out.append(h @ self.c_out)
        return torch.stack(out), h

    def dense_logits(self, tokens: list[int]) -> torch.Tensor:
        """The reference: the whole sequence at once, no pool."""
        x = self.emb[torch.tensor(tokens)]
        pos = torch.arange(len(tokens))
        for layer in (FULL_LAYER, WINDOW_LAYER):
            q, k, v = self.qkv(layer, x)
            x = x + self.attend(layer, q, k, v, pos, pos)
        y, _ = self.recur(torch.zeros(DIM), x)
        return (x + y) @ self.emb.T

    def generate_dense(self, prompt: list[int], max_new: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_new):
            tokens.append(int(self.dense_logits(tokens)[-1].argmax()))
        return tokens[len(prompt):]


@dataclass
class StepBatch:
    """One step's work, built on the host: per request, its row, first position and token count;
    the packed input tokens (decodes: -1, read from `next_token` on the forward stream); and the
    ids `KVStorage` translated for it."""

    rows: np.ndarray
    starts: list[int]
    counts: list[int]
    tokens: torch.Tensor
    decode: torch.Tensor
    write_locs: dict[str, torch.Tensor]
    page_tables: dict[str, np.ndarray]
    state_slots: np.ndarray
    sampled: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class PagedForward:
    """The model's forward over the pool: writes each new token's K/V at the locations
    `iteration_ids` gave, reads each request's keys through its page table, and reads and writes
    the recurrent state by slot. It never translates an id itself."""

    def __init__(self, model: ToyHybrid, storage, next_token: torch.Tensor) -> None:
        self.model, self.storage, self.next_token = model, storage, next_token
        self.page_size = storage.page_size
        self.pool_of = {layer: p.name for p in storage.plan.sub_pools for layer in p.layer_ids}

    def __call__(self, b: StepBatch) -> None:
        m, ps = self.model, self.page_size
        tokens = torch.where(b.decode, self.next_token[torch.from_numpy(b.rows)].repeat_interleave(
            torch.tensor(b.counts)), b.tokens)
        x = m.emb[tokens]
        bounds = np.cumsum([0, *b.counts])
        for layer in (FULL_LAYER, WINDOW_LAYER):
            name = self.pool_of[layer]
            view = self.storage.view(name)
            k_cache, v_cache = view.k(layer), view.v(layer)  # [pages, page_size, heads, head_dim]
            q, k, v = m.qkv(layer, x)
            locs = b.write_locs[name]  # physical token ids: page * page_size + offset
            k_cache[locs // ps, locs % ps] = k
            v_cache[locs // ps, locs % ps] = v
            out = torch.empty_like(x)
            for i, (start, n) in enumerate(zip(b.starts, b.counts)):
                end = start + n
                # the first page the window needs: pages before it may be retired (they read as the
                # sub-pool's sink), so they are never read
                first = max(0, start - WINDOW + 1) // ps if layer == WINDOW_LAYER else 0
                pages = torch.from_numpy(b.page_tables[name][i, first:-(-end // ps)])
                keys = k_cache[pages].reshape(-1, HEADS, HEAD_DIM)
                values = v_cache[pages].reshape(-1, HEADS, HEAD_DIM)
                k_pos = torch.arange(first * ps, first * ps + len(keys))
                rows = slice(bounds[i], bounds[i + 1])
                out[rows] = m.attend(layer, q[rows], keys, values, torch.arange(start, end), k_pos)
            x = x + out
        state = self.storage.view(self.pool_of[STATE_LAYER]).state(STATE_LAYER, "h")  # [slots, DIM]
        y = torch.empty_like(x)
        for i, (start, slot) in enumerate(zip(b.starts, b.state_slots.tolist())):
            rows = slice(bounds[i], bounds[i + 1])
            h0 = torch.zeros(DIM) if start == 0 else state[slot]  # a fresh request starts from zeros
            y[rows], state[slot] = m.recur(h0, x[rows])
        logits = (x + y)[torch.from_numpy(bounds[1:] - 1)] @ m.emb.T
        b.sampled = logits.argmax(-1)
        self.next_token[torch.from_numpy(b.rows)] = b.sampled


# -- the host side: requests and the scheduler ----------------------------------------------------


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    #: the tokens sampled so far, as the host learns them (one step late under overlap)
    output: list[int] = field(default_factory=list)
    row: int = -1
    #: tokens in the pool: the next forward's first position
    pos: int = 0
    #: what it prefills: its prompt, and after a preemption what it had generated too (recomputed)
    fed: list[int] = field(default_factory=list)
    #: forwards launched for it and not yet processed, and how many of them sample a token
    in_flight: int = 0
    samples_coming: int = 0

    @property
    def needs_more(self) -> bool:
        return len(self.output) + self.samples_coming < self.max_new


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    refused_admissions: int = 0
    retired_window_pages: int = 0
    peak_running: int = 0


class OwnEngine:
    """Continuous batching with chunked prefill over one `KVStorage`, forwards overlapped by one."""

    def __init__(self, model: ToyHybrid, budget_bytes: int, *, page_size: int = 16, context_len: int = 512,
                 max_running: int = 16, token_budget: int = 96, overlap: bool = True) -> None:
        plan = plan_kv_storage(model.decls(), page_size=page_size)
        sizing = size_plan(plan, budget_bytes, context_len=context_len, max_running_requests=max_running)
        self.device = ThreadDevice()
        self.storage = build_kv_storage(plan, sizing, "cpu", backend=self.device)
        self.next_token = torch.zeros(self.storage.table.rows, dtype=torch.long)
        self.forward = PagedForward(model, self.storage, self.next_token)
        self.steps = StepSequence(self.storage, depth=1 if overlap else 0, on_processed=self._processed)
        self.max_running, self.token_budget = max_running, token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = Stats()

    # -- 1: schedule -------------------------------------------------------------------------------

    def _grow(self, req: Request, n: int, shrink: bool = True) -> tuple[int, np.ndarray] | None:
        """`n` more tokens for a request with a row, or with `shrink`, for a prefill chunk the pool
        refuses, as many as fit (halving: the chunk's KV and its window rows grow with it).
        Returns the tokens taken and their virtual token ids, or None when none fit (each refused
        take changed nothing)."""
        while n:
            try:
                return n, self.storage.alloc_extend(np.array([req.row]), np.array([req.pos + n]))
            except CapacityError:
                n = n // 2 if shrink else 0
        return None

    def _preempt_newest(self) -> Request:
        """The newest running request leaves and returns first, to recompute what it had. Its pages
        pend under the forward in flight, which still reads them; it is readmitted once what that
        forward samples is known."""
        req = self.running.pop()
        self.storage.free_rows(np.array([req.row]))
        req.row, req.pos = -1, 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1
        return req

    def _schedule(self) -> list[tuple[Request, int, np.ndarray]]:
        """Running requests first, oldest first: the rest of their prompt (up to the token budget)
        or one decode token, preempting the newest when one cannot grow. Then arrivals, in order,
        while their first chunk fits. Returns (request, tokens, their virtual token ids)."""
        plan: dict[int, tuple[Request, int, np.ndarray]] = {}
        budget = self.token_budget
        for req in list(self.running):
            if req.row == -1 or not req.needs_more or budget <= 0:
                continue
            n = min(len(req.fed) - req.pos, budget) if req.pos < len(req.fed) else 1
            grown = self._grow(req, n)
            while grown is None and req.row != -1:
                if len(self.running) == 1:
                    raise CapacityError(f"request {req.rid} at {req.pos + 1} tokens does not fit the pool even "
                                        "alone: raise the budget")
                plan.pop(self._preempt_newest().rid, None)
                if req.row != -1:
                    grown = self._grow(req, n)
            if grown is not None:
                plan[req.rid] = (req, *grown)
                budget -= grown[0]
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            if req.in_flight:  # a forward still samples for it: recompute once that token is known
                break
            req.fed = req.prompt + req.output
            req.row, req.pos = self.storage.alloc_row(), 0
            # an arrival's first chunk shrinks to fit only an idle pool: beside running requests it
            # waits, rather than squeeze in and make them preempt each other
            idle = not self.running and not self.steps.in_flight
            grown = self._grow(req, min(len(req.fed), budget), shrink=idle)
            if grown is None:
                self.storage.free_rows(np.array([req.row]))
                req.row = -1
                self.stats.refused_admissions += 1
                if idle:
                    raise CapacityError(f"request {req.rid}'s first token does not fit the empty pool: "
                                        "raise the budget")
                break
            self.waiting.popleft()
            self.running.append(req)
            plan[req.rid] = (req, *grown)
            budget -= grown[0]
        return list(plan.values())

    # -- 2, 3: translate and launch ----------------------------------------------------------------

    def _batch(self, plan: list[tuple[Request, int, np.ndarray]]):
        """The step's packed inputs and its ids, translated once, after every take of the step
        (a take may move pages: ids translated before it could be stale)."""
        rows = np.array([r.row for r, _, _ in plan], dtype=np.int64)
        tokens, decode = [], []
        for req, n, _ in plan:
            prefill = req.pos < len(req.fed)
            tokens += req.fed[req.pos:req.pos + n] if prefill else [-1]
            decode += [not prefill] * n
        ids = self.storage.iteration_ids(np.concatenate([v for _, _, v in plan]), rows)
        read = self.storage.runner_ids(rows)
        batch = StepBatch(rows, [r.pos for r, _, _ in plan], [n for _, n, _ in plan], torch.tensor(tokens),
                          torch.tensor(decode), {k: torch.from_numpy(v) for k, v in ids.locs.items()},
                          read.page_tables, ids.state_slots)
        return batch, ids

    def step(self) -> bool:
        """One step of the overlap loop; False once everything is served and processed."""
        plan = self._schedule()
        launched = None
        if plan:
            batch, ids = self._batch(plan)
            samples = []
            for req, n, _ in plan:
                req.pos += n
                req.in_flight += 1
                samples.append(req.pos >= len(req.fed))  # this forward samples its next token
                req.samples_coming += samples[-1]
            device = self.device
            forward = Forward(lambda step: device.launch(device.forward_stream, lambda: self.forward(batch),
                                                          label=f"forward:{step}"), None, ids)
            launched = self.steps.launch(forward, (batch, [r for r, _, _ in plan], samples))
            self.stats.steps += 1
            self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        # 4: process until one forward is left in flight (none when nothing was launched)
        self.steps.process_until(self.steps.depth if launched is not None else 0)
        # 5: close holes between steps
        self.steps.flush()
        return bool(self.waiting or self.running or self.steps.in_flight)

    # -- 4: processing a result --------------------------------------------------------------------

    def _processed(self, launched: Launched) -> None:
        """After `forward_processed`: sampled tokens reach their requests (a preempted request's
        too: the forward read its pages before they were freed), finished requests are freed, and
        the rest retire the window rows their windows left behind."""
        batch, reqs, samples = launched.payload
        for req, sampled, token in zip(reqs, samples, batch.sampled.tolist()):
            req.in_flight -= 1
            if sampled:
                req.output.append(token)
                req.samples_coming -= 1
        finished = [r for r in self.running if len(r.output) >= r.max_new]
        if finished:
            self.storage.free_rows(np.array([r.row for r in finished]))
            for r in finished:
                self.running.remove(r)
                r.row = -1
        if self.running:
            self.stats.retired_window_pages += self.storage.advance(np.array([r.row for r in self.running]))

    def serve(self, requests: list[Request]) -> Stats:
        self.waiting.extend(requests)
        idle, launched = 0, -1  # loop turns in a row that launched nothing: a stuck scheduler, not a slow one
        while self.step():
            idle = idle + 1 if self.steps.stats.launched == launched else 0
            launched = self.steps.stats.launched
            if idle > 100:
                raise RuntimeError(f"no forward launched in {idle} turns with {len(self.waiting)} requests waiting")
        self.device.synchronize()
        self.steps.check_idle()  # nothing in flight, no page pending or leaked, byte accounting holds
        return self.stats


def make_requests(n: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 48).tolist()  # a system prompt half the requests start with
    out = []
    for i in range(n):
        own = rng.integers(0, VOCAB, int(rng.integers(8, 120))).tolist()
        prompt = shared + own if i % 2 else own
        out.append(Request(i, prompt, int(rng.integers(4, 40))))
    return out


def run(requests: int = 24, budget_kib: int = 520, seed: int = 0, overlap: bool = True) -> dict:
    """Serve `requests` through the pool and compare each with the dense reference; returns the
    run's figures. Raises AssertionError on the first request whose tokens differ."""
    model = ToyHybrid(seed)
    reqs = make_requests(requests, seed)
    engine = OwnEngine(model, budget_kib * 1024, overlap=overlap)
    t0 = time.perf_counter()
    try:
        stats = engine.serve(reqs)
    finally:
        engine.device.close()  # the stream workers stop, whatever happened
    seconds = time.perf_counter() - t0
    for req in reqs:
        want = model.generate_dense(req.prompt, req.max_new)
        assert req.output == want, f"request {req.rid}: pool {req.output} != dense {want}"
    storage = engine.storage.stats()
    return {"requests": requests, "steps": stats.steps, "seconds": round(seconds, 2),
            "preemptions": stats.preemptions, "refused_admissions": stats.refused_admissions,
            "peak_running": stats.peak_running, "window_pages_retired": stats.retired_window_pages,
            "pages_moved": storage.moves, "float_relocations": storage.relocations,
            "chain_bytes": storage.chain_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--budget-kib", type=int, default=520,
                        help="the pool's whole budget; at 520 pages move, the window band relocates and "
                             "requests are preempted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-overlap", action="store_true")
    args = parser.parse_args()
    try:
        figures = run(args.requests, args.budget_kib, args.seed, overlap=not args.no_overlap)
    except KVChainError as e:  # a budget below the floor, a request that alone does not fit
        parser.exit(2, f"own_engine: error: {e}\n")
    print("every request's tokens equal the dense reference's;", ", ".join(f"{k} {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
