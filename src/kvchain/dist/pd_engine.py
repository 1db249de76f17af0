"""`kvchain generate --pd`: one checkpoint served by a prefill process and a decode process.

Each process loads the checkpoint and builds its own `Engine` (its own arena, pool and device).
The prefill process serves every request to its first output token (without overlap, so that
token and the KV behind it are on the host when the request finishes) and, as each finishes,
hands its row to the decode node (`PrefillNode.offer` / `send`): full-attention pages, the window
rows decode keeps, the state slot, and the first token. The decode process decodes while hand-offs
still arrive: between two of its steps it takes an offer that waits (`DecodeNode.offer_waiting`,
`receive`) into a row of its own, and the request joins its scheduler as a running decode from
the token after the first, while the prefill node goes on with the others. Outputs are the single-process
engine's (tests/unit/distributed/test_pd_engine.py).

The prefill node keeps the prefix cache (and a host tier behind it, `host_budget`): a prompt whose
prefix is cached is prefilled from it, and its hand-off sends the whole row, the tree's pages with
its own; the window rows sent are those a fresh row of its length keeps (`pd.window_los`), which is
what the decode node's take keeps (`advance` with no checkpoint). The decode node keeps none. A
decode node with no room for an offer while it serves requests that will finish says so
(`Refused.retry`); the prefill node keeps the row and offers again (`offer_until_placed`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..engine.request import Phase, ScheduledRequest
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Scheduler
from ..engine.serve import (
    Engine,
    EngineConfig,
    GenerateOutput,
    GenerateRequest,
    GenerateResult,
    GenerateStats,
    check_host_tier,
    finish_reason,
    handed_out,
)
from ..errors import InputError, InvariantError, KVChainError
from .pd import DecodeNode, PrefillNode, Received, Refused, deferred_publication, layout_digest
from .pd_auth import PDListener
from .pd_link import PDLink, hello
from .pp import failures, run_stage_processes
from .transfer import make_engine


class _DecodeScheduler(Scheduler):
    """The decode node's scheduler: received requests join as running decodes."""

    def inject(self, req: ScheduledRequest) -> None:
        req.phase = Phase.RUNNING
        req.admitted_step = self.step_no
        self.running.append(req)

    def _preempt(self, req: ScheduledRequest) -> None:
        """Never: a received request's prompt ids stayed on the prefill node (this node holds its KV,
        not its tokens), so recomputing it would prefill placeholders and decode garbage. The
        preallocation check leaves room for every received request's growth (ADM-13); a step that
        cannot grow them breaks it, and says so."""
        raise InvariantError("pd.decode_retraction", f"the decode node cannot grow its {len(self.running)} "
                             f"running requests and would retract request {req.rid}, whose prompt it does not hold")


def _prefill(port: int, path: str, config: EngineConfig, requests: list[GenerateRequest], kind: str,
             secret: bytes) -> dict:
    # the prefill node keeps the prefix cache (and the host tier behind it): prompts that share a
    # prefix are prefilled once; each hand-off sends the whole row, the tree's pages with its own
    engine = Engine(path, replace(config, overlap=False))
    storage = engine.storage
    data = make_engine(kind, "prefill")
    data.register(storage.arena.data)
    listener = PDListener(secret, port=port)
    link = PDLink.accept(listener, hello(data.descriptor(), layout_digest(storage)), timeout_s=60)
    listener.close()
    node = PrefillNode(storage, link, data)
    pool = engine.pool
    base_finish = pool.finish
    refused: dict[int, str] = {}
    index = {}

    def finish(req: ScheduledRequest) -> None:
        i = index[req.rid]
        extra = {"index": i, "first": int(req.output[0]), "max_new": requests[i].max_new_tokens,
                 "output_len": requests[i].max_new_tokens - 1,
                 "sampling": None if req.sampling is None else req.sampling.to_dict(),
                 "stop": sorted(req.stop), "logprobs": req.logprobs,
                 "first_logprobs": pool.counters.logprobs.get((req.rid, 0))}
        answer = offer_until_placed(node, str(req.rid), req.row, extra)
        if answer["op"] == "refuse":
            refused[i] = answer.get("reason", "")
        else:
            node.send(str(req.rid), req.row, answer)
        base_finish(req)

    pool.finish = finish
    first = [GenerateRequest(r.prompt_token_ids, 1, r.sampling, r.stop_token_ids, r.logprobs) for r in requests]
    rid0 = engine._rid
    index.update({rid0 + i: i for i in range(len(first))})
    try:
        result = engine.generate(first)
        node.end()
    finally:
        node.close()
        engine.close()
    st = result.stats
    figures = {key: getattr(st, key) for key in HOST_FIGURES}
    return {"outputs": [o.to_dict() for o in result.outputs], "refused": refused, "seconds": st.seconds,
            "host": figures,
            "figures": {"forwards": st.forwards, "cached_tokens": st.cached_tokens,
                        "compaction_moves": st.compaction_moves, "checkpoints": st.checkpoints,
                        "window_pages_retired": st.window_pages_retired, "float_relocations": st.float_relocations,
                        "peak_utilisation": st.peak_utilisation,
                        **{key: getattr(st, key) for key in SPEC_FIGURES}}}


#: how long a prefill node offers a request again while the decode node, full, serves others (seconds)
PLACE_TIMEOUT_S = 120.0
#: the first wait between two offers of one request; it doubles up to `RETRY_MAX_S`
RETRY_FIRST_S = 0.001
RETRY_MAX_S = 0.05


def offer_until_placed(node: PrefillNode, rid: str, row: int, extra: dict,
                       timeout_s: float = PLACE_TIMEOUT_S) -> dict:
    """Offer a finished prefill to the decode node until it takes it: a refusal for want of room
    while the decode node serves requests that will finish (`retry`) is offered again after a
    wait, the row kept meanwhile, so a busy decode node holds prefills back instead of losing
    them. A refusal with no room coming, or past `timeout_s`, is the answer."""
    deadline = time.monotonic() + timeout_s
    wait = RETRY_FIRST_S
    while True:
        answer = node.offer(rid, row, extra)
        if answer["op"] != "refuse" or not answer.get("retry") or time.monotonic() > deadline:
            return answer
        time.sleep(wait)
        wait = min(2 * wait, RETRY_MAX_S)


def _decode(port: int, path: str, config: EngineConfig, kind: str, secret: bytes) -> dict:
    # the decode node keeps no prefix cache: its rows come whole from the prefill node
    engine = Engine(path, replace(config, prefix_cache=False, host_budget=None))
    try:
        storage = engine.storage
        data = make_engine(kind, "decode")
        data.register(storage.arena.data)
        link = PDLink.connect(secret, "127.0.0.1", port, hello(data.descriptor(), layout_digest(storage)),
                              timeout_s=60)
        node = DecodeNode(storage, link, data, overlap=engine.config.overlap)
        return _serve(engine, node)
    finally:
        engine.close()


def received_request(rid: int, row: int, prompt_len: int, first: int, max_new: int) -> ScheduledRequest:
    """A received request as the decode node's scheduler runs it: its prompt computed (in `row`,
    its ids left on the prefill node: placeholders here) and its first output known."""
    req = ScheduledRequest(rid=rid, arrival=0, prompt=np.zeros(prompt_len, np.int64), max_new=max_new,
                           output_len=max_new, output=np.zeros(max_new, dtype=np.int64))
    req.output[0] = first
    req.row, req.computed, req.generated, req.first_token_step = row, prompt_len, 1, 0
    req.pool_state = {"node": None, "window_lock": None, "tracking": -1, "checkpoint": 0, "kv_len": prompt_len}
    return req


class _Decoding:
    """The decode node's requests: each received one joins the scheduler as a running decode from
    its second token; outputs by request index."""

    def __init__(self, engine: Engine, node: DecodeNode) -> None:
        cfg = engine.config
        self.engine, self.node, self.pool = engine, node, engine.pool
        self.scheduler = _DecodeScheduler(self.pool, max_batched_tokens=cfg.max_batched_tokens,
                                          max_running=cfg.max_running)
        self.out: dict[int, dict] = {}
        self.reqs: list[tuple[int, ScheduledRequest]] = []
        #: the prefill node's id of each received request still served here, by its id here: its
        #: growth still to come is held back from later offers until it finishes (`settle`)
        self.offered: dict[int, str] = {}

    def admit(self, got: Received) -> None:
        engine, pool = self.engine, self.pool
        i, first, max_new = int(got.extra["index"]), int(got.extra["first"]), int(got.extra["max_new"])
        stop = frozenset(int(t) for t in got.extra.get("stop", ()))
        first_logprobs = got.extra.get("first_logprobs")
        if max_new == 1 or first in pool._eos_set or first in stop:
            self.node.finish(got)
            self.out[i] = {"token_ids": [first], "finish_reason": finish_reason([first], max_new, stop),
                           "logprobs": None if first_logprobs is None else [first_logprobs]}
            return
        rid = engine._rid
        engine._rid += 1
        req = received_request(rid, got.row, got.seq_len, first, max_new)
        req.stop = stop
        req.logprobs = got.extra.get("logprobs")
        if req.logprobs is not None:  # the first output's, computed on the prefill node
            pool.counters.logprobs[(rid, 0)] = first_logprobs
        sampling = got.extra.get("sampling")
        req.sampling = None if sampling is None else SamplingParams(**sampling)  # draws seeded as the prefill node's
        pool._known[rid] = 1  # its first output came with it: the next forward reads it from the host
        self.scheduler.max_running = max(self.scheduler.max_running, len(self.scheduler.running) + 1)
        self.scheduler.inject(req)
        self.reqs.append((i, req))
        self.offered[rid] = got.rid

    def settle(self) -> None:
        """After a step: each received request's growth still to come, held back from later offers
        (`DecodePreallocQueue.held_back`), is what it has left to write; a finished one holds none.
        Kept at what they held on arrival, finished requests held back their whole outputs for
        good: the node refused ever more offers and at last every one, with nothing running."""
        queue, table = self.node.queue, self.pool.storage.table
        running = {req.rid: req for req in self.scheduler.running}
        waiting = {req.rid for req in self.scheduler.waiting}
        for rid, offered in list(self.offered.items()):
            req = running.get(rid)
            if req is not None:
                queue.grew(offered, int(table.seq_lens[req.row]), max(req.output_len - req.generated, 0))
            elif rid not in waiting:
                queue.done(offered)
                del self.offered[rid]

    def outputs(self) -> dict[int, dict]:
        for i, req in self.reqs:
            n = min(req.generated, req.output_len)
            logprobs = None
            if req.logprobs is not None:
                counters = self.pool.counters.logprobs
                logprobs = [counters.pop((req.rid, j)) for j in range(n)]
            self.out[i] = {"token_ids": [int(t) for t in req.output[:n]],
                           "finish_reason": finish_reason(req.output[:n], req.max_new, req.stop),
                           "logprobs": logprobs}
        return self.out


#: how long a decode node that just took an offer looks for the prefill node's next one before it
#: steps (seconds): the requests one prefill step finishes are handed off back to back
OFFER_GRACE_S = 0.002


def _offer_soon(node: DecodeNode) -> bool:
    deadline = time.monotonic() + OFFER_GRACE_S
    while not node.offer_waiting():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True


def _serve(engine: Engine, node: DecodeNode) -> dict:
    """Decode while hand-offs still arrive: between two steps the node takes an offer that waits
    (`offer_waiting`, no collective) and the received request decodes from the next step, while
    the prefill node goes on with the others. With nothing to decode it blocks on the next offer.
    Under deferred publication an offer's ids go out in the iteration after its take (PD-13)."""
    decoding = _Decoding(engine, node)
    scheduler, pool, storage = decoding.scheduler, engine.pool, engine.storage
    node.room_coming = lambda: not scheduler.idle  # its running requests will finish and free room
    before = (pool.counters.forwards, storage.stats(), dict(pool.stats_counters))
    refused: list[Refused] = []
    ended = False
    overlapped = 0  # decode steps run before the prefill node's last hand-off
    t0 = time.perf_counter()
    try:
        while True:
            for got in node.publish_pending() if node.deferred_publication else ():
                decoding.admit(got)
            # every offer that waits, and those the prefill node makes right after (the requests its
            # step finished together), are taken before the next step
            took = False
            while not ended and not node.queue.unpublished and (
                    scheduler.idle or (_offer_soon(node) if took else node.offer_waiting())):
                got, took = node.receive(), True
                if got is None:
                    ended = True
                    overlapped = scheduler.stats.steps
                    node.close()
                elif isinstance(got, Refused):
                    refused.append(got)
                elif isinstance(got, Received):
                    decoding.admit(got)
            if not scheduler.idle:
                scheduler.step()
                decoding.settle()
            elif ended and not node.queue.unpublished:
                break
    finally:
        if not ended:
            node.close()
    pool.drain()
    pool.steps.flush()
    storage.device.synchronize()
    pool.check_idle()
    forwards0, storage0, counters0 = before
    after = storage.stats()
    spec = getattr(pool, "spec", None)
    figures = {"forwards": pool.counters.forwards - forwards0, "cached_tokens": 0,
               "compaction_moves": after.moves - storage0.moves,
               "checkpoints": pool.stats_counters["checkpoints"] - counters0["checkpoints"],
               "window_pages_retired": pool.stats_counters["window_retired"] - counters0["window_retired"],
               "float_relocations": after.relocations - storage0.relocations,
               "peak_utilisation": max((h.utilisation for h in scheduler.stats.history), default=0.0),
               # a fresh engine's counters: the run's own
               **{key: 0 if spec is None else getattr(spec, SPEC_COUNTERS[key]) for key in SPEC_FIGURES}}
    return {"outputs": decoding.outputs(), "steps": scheduler.stats.steps, "seconds": time.perf_counter() - t0,
            "peak_running": scheduler.stats.peak_running, "overlapped_steps": overlapped,
            "deferred_publication": node.deferred_publication, "figures": figures}


def _node(stage: int, n: int, port: int, path: str, config: EngineConfig, requests: list[GenerateRequest],
          kind: str, secret: bytes) -> dict:
    if stage == 0:
        return _prefill(port, path, config, requests, kind, secret)
    return _decode(port, path, config, kind, secret)


#: speculative decoding's figures, summed over the nodes (the prefill node's draft runs over the
#: prompts, so the decode node's proposals read draft KV that came with the hand-off), and the
#: `SpecCounters` field of each
SPEC_COUNTERS = {"spec_rounds": "rounds", "spec_proposed": "proposed", "spec_accepted": "accepted",
                 "draft_forwards": "draft_forwards", "spec_dropped": "dropped"}
SPEC_FIGURES = tuple(SPEC_COUNTERS)


#: the host tier's figures, the prefill node's (the decode node keeps no prefix cache)
HOST_FIGURES = ("host_hits", "host_backups", "host_loads", "host_bytes")


#: the PD processes by their stage index
NODE_NAMES = ("prefill", "decode")


def check_pd_draft(config: EngineConfig) -> None:
    """A draft on PD nodes, checked before any node starts: the prefill node runs the draft over the
    prompts with the target, so its KV (pages of the same fused plan) goes to the decode node with
    the target's, and the decode node's rounds read it. A draft with recurrent layers steps its
    state on the prefix cache's checkpoint grid, which the decode node does not keep: refused in one
    line."""
    if config.draft_model_path is None:
        return
    from ..engine.checkpoint import read_config
    from ..models.registry import model_from_config
    from ..plan import plan_kv_storage

    draft = Path(config.draft_model_path)
    if not draft.is_dir():
        raise InputError(f"draft checkpoint {draft}: no such directory")
    plan = plan_kv_storage(model_from_config(read_config(draft)).decls, page_size=config.page_size)
    if plan.state is not None:
        raise InputError(f"a draft with recurrent layers ({draft}) on PD nodes: its state steps on the prefix "
                         "cache's checkpoint grid, which the decode node does not keep; give an attention-only "
                         "draft (make-checkpoint --draft-layers) or serve it without --pd")


def generate_pd(path: str, config: EngineConfig, requests: Sequence[GenerateRequest], kind: str = "nixl",
                timeout_s: float = 600.0, report: dict | None = None) -> GenerateResult:
    """Serve `requests` with a prefill process and a decode process on this machine (loopback);
    outputs in input order, as `Engine.generate` gives them. `report`, when given, receives what
    each node measured: `prefill_seconds`, `decode_seconds`, `decode_steps`, `overlapped_steps`
    (decode steps run while the prefill node still had hand-offs to make) and whether the decode
    node deferred publication (`deferred_publication`)."""
    requests = handed_out(path, requests)  # checked and seeded once, here: both nodes sample alike
    deferred_publication(None, overlap=config.overlap)  # refused here, before any node starts
    check_pd_draft(config)
    check_host_tier(config, "the prefill node's prefix cache")
    secret = os.urandom(32)
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    t0 = time.perf_counter()
    out = run_stage_processes(_node, 2, (str(path), config, requests, kind, secret), timeout_s=timeout_s, env=env)
    bad = failures(out)
    if bad:  # one line: each failed node's first line, the first to fail first (the others failed after it)
        raise KVChainError("generate --pd: " + "; ".join(f"the {NODE_NAMES[s]} node: {text}"
                                                         for s, _status, text in bad))
    pre, dec = out[0][1], out[1][1]
    if report is not None:
        report.update(prefill_seconds=pre["seconds"], decode_seconds=dec["seconds"], decode_steps=dec["steps"],
                      overlapped_steps=dec["overlapped_steps"], deferred_publication=dec["deferred_publication"])
    outputs = []
    for i in range(len(requests)):
        first = GenerateOutput(**{k: v for k, v in pre["outputs"][i].items()})
        if i in dec["outputs"]:
            o = dec["outputs"][i]
            outputs.append(GenerateOutput(i, o["token_ids"], o["finish_reason"], logprobs=o.get("logprobs")))
        elif str(i) in pre["refused"] or i in pre["refused"]:
            reason = pre["refused"].get(i, pre["refused"].get(str(i), ""))
            outputs.append(GenerateOutput(i, [], "rejected", reason=f"the decode node refused it: {reason}"))
        else:  # rejected or aborted on the prefill node
            outputs.append(GenerateOutput(i, [], first.finish_reason, reason=first.reason))
    # both nodes' pools: work summed, the peak the higher of the two; steps are the decode node's
    both = [pre["figures"], dec["figures"]]
    summed = {key: sum(f[key] for f in both) for key in ("forwards", "cached_tokens", "compaction_moves",
                                                          "checkpoints", "window_pages_retired", "float_relocations",
                                                          *SPEC_FIGURES)}
    stats = GenerateStats(requests=len(requests), steps=dec["steps"], prompt_tokens=sum(len(r.prompt_token_ids)
                                                                                       for r in requests),
                          output_tokens=sum(len(o.token_ids) for o in outputs), seconds=time.perf_counter() - t0,
                          peak_running=dec["peak_running"], **summed, **pre["host"],
                          peak_utilisation=max(f["peak_utilisation"] for f in both))
    return GenerateResult(outputs, stats)
