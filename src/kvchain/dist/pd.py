"""Prefill/decode disaggregation across processes: a prefill node hands a request's KV and state to a
decode node, each with its own arena (`KVStorage`).

What crosses, per request, in this order (docs/pd.md):
1. offer (control plane): the request's id, length and page counts per sub-pool;
2. the decode node checks its preallocation (`DecodePreallocQueue.prealloc_fits`, ADM-13), takes a
   row of that length, retires the window rows its windows no longer need, holds the receive pages
   (`hold_receive_rows`, PD-8), records the receive (one NETWORK use, PD-1) and posts it to the
   transfer engine; it waits the schedule stream, so every earlier use of those pages is over,
   then reads the ids and publishes them (PD-10), again if a page moved since the take (PD-17);
3. the prefill node reads its pages' ids again just before the send goes (PD-18), records the send
   and posts the write: every full-attention page, the window rows the decode side keeps, and the
   state slot, byte for byte;
4. both nodes poll their own engine and MIN-reduce the judgements each round (PD-3); past the wait
   deadline every node raises in the same round, naming the transfers in flight (PD-4).

A failed or timed-out transfer releases its pages only on proof that the remote engine stopped
touching them (LIM-1, LIM-2): the engine's own completion or abort status, an epoch fence the peer
acknowledges (`fence`), or the peer's process known gone; never on a timer. Until then the pages
stay with a deferred release, and a decode node holding one skips its idle checks (CHK-16)."""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import env
from ..advance import window_first_page
from ..alloc.demand import DemandPurpose, KVDemand, request_demand
from ..alloc.signals import NetworkTransfer, ReceiveHold
from ..device.base import Device, Event, PageAccess, Stream
from ..device.cuda import CudaDevice
from ..device.threads import ThreadDevice
from ..errors import CapacityError, InputError, InvariantError, KVChainError, TransferTimeoutError
from ..plan import PoolKind
from ..sizing import pages_for
from ..storage import KVStorage
from .pd_link import PDLink, PeerLost, RankGroup
from .transfer import (
    Place,
    Segments,
    Transfer,
    TransferEngine,
    TransferError,
    TransferState,
    coalesce,
    page_segments,
    place_on_host,
)

log = logging.getLogger("kvchain.pd")

#: the protocol's own timeouts (seconds): the handshake, a transfer's wait deadline, a fence's
#: acknowledgement. A host wait for transfers (`KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT`) outlasts their sum (PD-5).
PROTOCOL_TIMEOUTS = {"handshake": 30.0, "transfer": 120.0, "fence": 60.0}


class TransferFailed(KVChainError):
    """A transfer's engine reported an error on some node; every node raises in the same round."""


class DeferredPublishError(InputError):
    """Deferred publication was asked for where it is not allowed (PD-12): without the overlap
    scheduler, on a device whose streams do not run apart from the host, or under pipeline
    parallelism."""


#: devices whose streams really run apart from the host: CUDA, and its CPU stand-in whose streams are
#: worker threads. Only there can a readback on a stream of its own overlap anything (PD-12).
ASYNC_DEVICES = (CudaDevice, ThreadDevice)

#: the stream a deferred publication reads the destination ids back on (PD-13)
PUBLISH_STREAM = "publish"


def deferred_publication(device: Device | None, *, overlap: bool, pipeline_stages: int = 1) -> bool:
    """Whether a decode node defers publication: `KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH` is
    on. Then only under the overlap scheduler, on a device of `ASYNC_DEVICES`, without pipeline
    parallelism (PD-12); anything else is refused, never silently served synchronously. A `device`
    of None (not built yet: asked before the nodes start) is judged by the rest alone."""
    if not env.get("KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH"):
        return False
    why = []
    if not overlap:
        why.append("the overlap scheduler is off")
    if device is not None and not isinstance(device, ASYNC_DEVICES):
        why.append(f"the {type(device).__name__} runs no stream apart from the host")
    if pipeline_stages > 1:
        why.append(f"pipeline parallelism is on ({pipeline_stages} stages)")
    if why:
        raise DeferredPublishError("KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH needs the overlap scheduler, "
                                   "CUDA (or ThreadDevice) and no pipeline parallelism: " + "; ".join(why))
    return True


def layout_digest(storage: KVStorage) -> str:
    """What both nodes must share for a page of one to be a page of the other: the plan's sub-pools
    (name, kind, page bytes) and the page size."""
    parts = [f"{p.name}:{p.kind.value}:{p.page_bytes}" for p in storage.plan.sub_pools]
    return hashlib.sha256(f"{storage.page_size}|{'|'.join(parts)}".encode()).hexdigest()[:32]


def request_pages(storage: KVStorage, row: int) -> dict[str, np.ndarray]:
    """A row's physical pages per sub-pool, read now: its full-attention pages, each window's rows
    from the first its next token reads (`window_los`), its state slot."""
    table = storage.table
    vpages = table.pages_of(row)
    out: dict[str, np.ndarray] = {}
    los = iter(window_los(storage, row))
    for pool in storage.plan.sub_pools:
        if pool.kind is PoolKind.FULL:
            out[pool.name] = storage.physical_pages(pool.name, vpages)
        elif pool.kind is PoolKind.WINDOW:
            out[pool.name] = storage.physical_pages(pool.name, vpages[next(los):])
        else:
            slot = int(table.state_slot[row])
            out[pool.name] = storage.physical_pages(pool.name, np.array([slot])) if slot >= 0 else np.zeros(0, np.int64)
    return out


def window_los(storage: KVStorage, row: int) -> list[int]:
    """Per window, the first page of the row its next token reads: where a fresh row of its length
    starts its window (`advance` with no checkpoint), which is what the decode node's take keeps.
    A row whose prefix the tree shares may bind less itself (the tree binds the window rows of the
    prefix) or keep more (rows behind a checkpoint): the hand-off sends exactly these."""
    seq = np.array([storage.table.seq_lens[row]])
    return [int(window_first_page(seq, pool.window, pool.lifetime.chunked, storage.page_size)[0])
            for pool in storage.plan.sub_pools if pool.kind is PoolKind.WINDOW]


def segments_of(storage: KVStorage, pages: dict[str, np.ndarray]) -> Segments:
    """The arena byte segments of `pages`, sub-pools in plan order, adjacent pages merged."""
    grids = storage.arena.layout.grids
    ordered = {storage.plan.by_name(name).index: ids for name, ids in pages.items()}
    return coalesce(page_segments(grids, dict(sorted(ordered.items()))))


def state_on_consumer_stream(storage: KVStorage, allocated: Event, consumer: Stream | None = None) -> Place:
    """How a staged receive lands on a decode node (PD-16). Attention bytes are copied on the host
    at once: they arrive only after publication, which followed every earlier use of their pages.
    A state slot's bytes are copied on the stream of their consumer, the forward stream that reads
    the slot next (`consumer`), after the allocation's event; the schedule stream then waits the
    copy, so a later take or move of the slot follows it. Nothing blocks the host."""
    pool = storage.plan.state
    if pool is None:
        return place_on_host
    device = storage.device
    stream = consumer or device.forward_stream
    grid = storage.arena.layout.grids[pool.index]
    lo, hi = grid.origin, grid.origin + grid.n_grid * grid.page_bytes

    def place(data: torch.Tensor, staged: torch.Tensor, dst: Segments) -> None:
        at, state = 0, []
        for o, n in dst:
            if lo <= o < hi:
                state.append((o, at, n))
            else:
                data[o:o + n].copy_(staged[at:at + n])
            at += n
        if not state:
            return
        slots = np.array([(o - lo) // grid.page_bytes for o, _a, _n in state], dtype=np.int64)

        def copy() -> None:
            for o, a, n in state:
                data[o:o + n].copy_(staged[a:a + n])

        device.stream_wait(stream, allocated)
        device.launch(stream, copy, writes=[PageAccess(pool.index, slots)], label="received state")
        device.stream_wait(device.schedule_stream, device.record(stream, "received state copied"))

    return place


def _ids(pages: dict[str, np.ndarray]) -> dict[str, list[int]]:
    return {k: [int(x) for x in v] for k, v in pages.items()}


@dataclass
class Deferred:
    """A failed or timed-out transfer whose pages wait for proof that the peer's engine is done."""

    rid: str
    row: int
    network: NetworkTransfer
    transfer: Transfer | None
    reason: str


@dataclass
class Received:
    """A request whose KV and state landed: its row on the decode node, its length, and what the
    prefill node sent along (the first output token, for an engine)."""

    rid: str
    row: int
    seq_len: int
    extra: dict = field(default_factory=dict)


@dataclass
class Refused:
    """An offer the decode node had no room for (its preallocation did not fit)."""

    rid: str
    reason: str
    extra: dict = field(default_factory=dict)
    #: room was coming (the node serves requests that will finish): the prefill node may offer again
    retry: bool = False


class PDNode(ABC):
    """What both nodes share: the storage, the control plane, the transfer engine, the deadline."""

    peer_name: str

    def __init__(self, storage: KVStorage, link: PDLink, engine: TransferEngine, *,
                 timeout_s: float = PROTOCOL_TIMEOUTS["transfer"], fence_timeout_s: float = PROTOCOL_TIMEOUTS["fence"],
                 poll_s: float = 0.001, ranks: RankGroup | None = None) -> None:
        self.storage = storage
        #: the node's other ranks that share its layout, if any: a wait's judgements are reduced
        #: across them before the link (PD-3)
        self.ranks = ranks
        #: rounds the last transfer wait took (every rank of both nodes took as many)
        self.last_rounds = 0
        self.link = link
        self.engine = engine
        self.timeout_s = timeout_s
        self.fence_timeout_s = fence_timeout_s
        self.poll_s = poll_s
        if link.peer.get("layout") != layout_digest(storage):
            raise TransferError("the peer's pool layout differs from this node's: its pages are not this node's pages")
        descriptor = struct.pack("<q", 1 - link.rank) if engine.kind == "gloo" else bytes.fromhex(link.peer["engine"])
        engine.connect(self.peer_name, descriptor)
        #: failed or timed-out transfers whose pages are not released yet, by request id
        self.deferred: dict[str, Deferred] = {}
        #: how many fences this node asked or answered (each one an epoch the peer acknowledged)
        self.fence_epoch = 0

    def _wait(self, rid: str, t: Transfer) -> None:
        """Poll this node's engine; each round this rank's judgements (done, no error, in time) are
        MIN-reduced across the node's ranks (`ranks`), then across the link, so every rank of both
        nodes leaves, or raises, in the same round (PD-3, PD-4)."""
        deadline = time.monotonic() + self.timeout_s
        rounds = 0
        while True:
            state = self.engine.poll(t)
            flags = (state is TransferState.DONE, state is not TransferState.FAILED, time.monotonic() < deadline)
            if self.ranks is not None:
                flags = self.ranks.min(*flags)
            done, ok, in_time = self.link.round(*flags)
            rounds += 1
            self.last_rounds = rounds
            if done:
                return
            if not ok:
                raise TransferFailed(f"the transfer of {rid} failed on a node (here: {state.value}) in round {rounds}")
            if not in_time:
                raise TransferTimeoutError(f"page move waited past {self.timeout_s:g} s for transfers still in "
                                           f"flight: {rid} ({'send' if t.sends else 'receive'}, here {state.value}), "
                                           f"raised in round {rounds}")
            time.sleep(self.poll_s)

    def _defer(self, rid: str, row: int, network: NetworkTransfer, t: Transfer | None, reason: str) -> None:
        self.deferred[rid] = Deferred(rid, row, network, t, reason)
        log.warning("pd: %s of %s deferred: %s", "send" if network.sends else "receive", rid, reason)

    def _release(self, d: Deferred, why: str) -> None:
        """The proof is in: the pages go."""
        self.storage.end_network_transfer(d.network)
        self.storage.free_rows(np.array([d.row]))
        del self.deferred[d.rid]
        log.info("pd: released the pages of %s (%s)", d.rid, why)

    def settle(self) -> list[str]:
        """Release every deferred transfer this node's own engine now proves quiescent (done,
        failed or aborted by the engine). Returns the request ids released."""
        out = []
        for d in list(self.deferred.values()):
            if d.transfer is None or self._quiesce(d.transfer).quiescent:
                self._release(d, "the engine is done with the pages" if d.transfer else "nothing was posted")
                out.append(d.rid)
        return out

    def _quiesce(self, t: Transfer) -> TransferState:
        return self.engine.poll(t)

    def peer_lost(self) -> list[str]:
        """The control plane failed: if the peer's process is proven gone, every deferred transfer's
        pages go (its engine died with it). Otherwise they stay. Returns the ids released."""
        if not self.link.peer_gone():
            log.warning("pd: the peer is unreachable but not proven gone: %d transfers stay deferred",
                        len(self.deferred))
            return []
        out = []
        for d in list(self.deferred.values()):
            if d.transfer is not None:
                self.engine.abort(d.transfer)
            self._release(d, "the peer's process is gone")
            out.append(d.rid)
        forget = getattr(self.engine, "forget", None)
        if forget is not None:
            forget(self.peer_name)
        self.link.close()  # a control plane to a gone process carries nothing more; `rejoin` makes a new one
        return out

    def fence(self) -> list[str]:
        """One epoch fence, called by both nodes in the same round. The decode node names its
        deferred receives; the prefill node stops its sends of them (the engine's abort, or their
        completion) and acknowledges each one its engine proves quiescent; the decode node releases
        exactly those. Returns the ids this node released."""
        self.fence_epoch += 1
        return self._fence()

    @abstractmethod
    def _fence(self) -> list[str]:
        """This node's side of one fence (the epoch is `fence_epoch`)."""

    def rejoin(self, link: PDLink) -> None:
        """Carry on over a new control plane (a restarted peer): deferred transfers stay."""
        self.link.close()
        self.link = link
        descriptor = struct.pack("<q", 1 - link.rank) if self.engine.kind == "gloo" else bytes.fromhex(link.peer["engine"])
        self.engine.connect(self.peer_name, descriptor)

    def close(self) -> None:
        self.engine.close()
        self.link.close()


class PrefillNode(PDNode):
    peer_name = "decode"

    def offer(self, rid: str, row: int, extra: dict | None = None) -> dict:
        """Offer the request in `row` to the decode node; returns its answer: accepted, with the
        destination ids it published, or refused (no room), with why."""
        storage = self.storage
        pages = request_pages(storage, row)
        msg = {"op": "offer", "rid": rid, "seq_len": storage.seq_len(row), "window_lo": window_los(storage, row),
               "counts": {k: len(v) for k, v in pages.items()}, "extra": extra or {}}
        self.link.post("offers")  # a decode node between its iterations learns an offer waits
        self.link.exchange(msg)
        answer = self.link.exchange({"op": "wait", "rid": rid})
        if answer.get("rid") != rid or answer.get("op") not in ("accept", "refuse"):
            raise TransferError(f"the decode node answered {answer.get('op')!r} for {answer.get('rid')!r} to "
                                f"the offer of {rid}")
        return answer

    def send(self, rid: str, row: int, answer: dict) -> None:
        """Send the accepted request's pages onto the published destinations and wait for both
        engines. The ids are read here, just before the send goes (PD-18). On a failure or past
        the deadline it raises (on both nodes in the same round) and the send is deferred: its row
        stays until `settle`, `fence` or `peer_lost` has proof the engine is done (LIM-2)."""
        storage = self.storage
        src = request_pages(storage, row)
        dst = {k: np.asarray(v, dtype=np.int64) for k, v in answer["dst"].items()}
        if {k: len(v) for k, v in src.items()} != {k: len(v) for k, v in dst.items()}:
            raise TransferError(f"{rid}: the decode node published {({k: len(v) for k, v in dst.items()})} pages "
                                f"for {({k: len(v) for k, v in src.items()})}")
        network = NetworkTransfer(rid, sends=True)
        storage.record_network_transfer(network, src)
        t = None
        try:
            t = self.engine.write(self.peer_name, segments_of(storage, src), answer["segments"], rid)
            self._wait(rid, t)
        except (TransferTimeoutError, TransferFailed, TransferError, PeerLost) as e:
            self._defer(rid, row, network, t, str(e))
            raise
        storage.end_network_transfer(network)

    def end(self) -> None:
        """No more offers: the decode node's `receive` returns None."""
        self.link.post("offers")
        self.link.exchange({"op": "end"})
        self.link.exchange({"op": "end"})

    def hand_off(self, rid: str, row: int, extra: dict | None = None) -> bool:
        """Offer, then send when accepted, then free the row (its pages are the decode node's now).
        False when the decode node refused (the row stays)."""
        answer = self.offer(rid, row, extra)
        if answer["op"] == "refuse":
            return False
        self.send(rid, row, answer)
        self.storage.free_rows(np.array([row]))
        return True

    def _quiesce(self, t: Transfer) -> TransferState:
        return self.engine.abort(t)  # a send this node gave up on: stop it, or learn it is done

    def _fence(self) -> list[str]:
        ask = self.link.exchange({"op": "fence", "epoch": self.fence_epoch})
        states = {}
        for rid in ask.get("rids", []):
            d = self.deferred.get(rid)
            # not deferred here (never posted, or released already), never posted, or stopped: quiescent
            if d is None or d.transfer is None or self.engine.abort(d.transfer).quiescent:
                states[rid] = "quiescent"
            else:
                states[rid] = "in flight"
        self.link.exchange({"op": "fenced", "epoch": self.fence_epoch, "states": states})
        return self.settle()


@dataclass(eq=False)
class PendingPublication:
    """Receive pages taken in one iteration whose ids go to the peer in a later one (PD-13)."""

    rid: str
    row: int
    hold: ReceiveHold
    #: the ids as the take left them (per sub-pool), and `move_epoch` then
    pages: dict[str, np.ndarray]
    epoch: int
    #: the allocation's event: the schedule stream after the take's waits and its zeroing
    allocated: Event
    iteration: int
    seq_len: int = 0
    output_len: int = 0
    extra: dict = field(default_factory=dict)
    #: the readback's event on the publish stream, and the ids it read
    read: Event | None = None
    ids: dict[str, np.ndarray] = field(default_factory=dict)


class DecodePreallocQueue:
    """The decode node's preallocation check (ADM-13): a request is preallocated only if its own
    demand (`DECODE_PREALLOC`: its whole lifetime) fits together with what the node holds back for
    pending work: the growth still to come of every request it already took.

    Under deferred publication (`deferred`, PD-12) it also holds the allocations whose ids are not
    published yet: `allocate` records the allocation's event and launches the ids' readback on the
    publish stream gated on it; `publish_pending_destinations`, in a later iteration, publishes them
    (PD-13), reading again after the schedule stream when a page moved since (PD-17)."""

    def __init__(self, storage: KVStorage, deferred: bool = False) -> None:
        self.storage = storage
        self.deferred = deferred
        #: per request id: (length now, output tokens still to come)
        self.pending: dict[str, tuple[int, int]] = {}
        #: allocations whose ids are not published yet, oldest first
        self.unpublished: list[PendingPublication] = []
        #: one per `publish_pending_destinations` call: an allocation publishes in a later one
        self.iteration = 0

    def allocate(self, rid: str, row: int, pages: dict[str, np.ndarray], hold: ReceiveHold, *, seq_len: int = 0,
                 output_len: int = 0, extra: dict | None = None) -> PendingPublication:
        """The take of `row` is done (its waits and its zeroing are queued on the schedule stream):
        record the allocation's event there and read the ids back on the publish stream behind it.
        Nothing blocks the host; the ids go out in a later iteration."""
        device = self.storage.device
        allocated = device.record(device.schedule_stream, f"{rid} allocated")
        p = PendingPublication(rid, row, hold, {k: v.copy() for k, v in pages.items()}, self.storage.move_epoch,
                               allocated, self.iteration, seq_len, output_len, dict(extra or {}))
        self._read_back(p, allocated)
        self.unpublished.append(p)
        return p

    def _read_back(self, p: PendingPublication, gate: Event) -> None:
        """Read `p`'s ids on the publish stream once `gate` fired: the peer may write them as soon as
        it learns them, so the read is ordered after what `gate` closes (PD-10). The ids are host
        arrays here; what the readback orders is the moment they may go out."""
        device = self.storage.device
        stream = device.stream(PUBLISH_STREAM)
        device.stream_wait(stream, gate)
        snapshot = {k: v.copy() for k, v in p.pages.items()}
        ids: dict[str, np.ndarray] = {}
        device.launch(stream, lambda: ids.update(snapshot), label=f"{p.rid} ids readback")
        p.ids = ids
        p.read = device.record(stream, f"{p.rid} ids read")

    def publish_pending_destinations(self, publish, timeout: float | None = None) -> list[PendingPublication]:
        """Publish every allocation of an earlier iteration, oldest first: `publish(p)` sends `p.ids`
        to the peer, then the receive hold ends. If a page moved since the allocation (`move_epoch`
        changed), the ids are read again now and the readback waits the schedule stream, which holds
        the moves' copies, instead of the allocation's event (PD-17). Blocks the host only on a
        readback not done yet (bounded by `KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT`)."""
        self.iteration += 1
        storage, device = self.storage, self.storage.device
        if timeout is None:
            timeout = float(env.get("KVCHAIN_PAGE_MOVE_WAIT_TIMEOUT"))
        ready = [p for p in self.unpublished if p.iteration < self.iteration]
        for p in ready:
            if storage.move_epoch != p.epoch:
                p.pages, p.epoch = request_pages(storage, p.row), storage.move_epoch
                self._read_back(p, device.record(device.schedule_stream, f"{p.rid} moved"))
            device.host_wait(p.read, timeout)
            self.unpublished.remove(p)
            publish(p)
            storage.published(p.hold)
        return ready

    def held_back(self) -> KVDemand:
        plan = self.storage.plan
        ps = self.storage.page_size
        full = sum(pages_for(n + out, ps) - pages_for(n, ps) for n, out in self.pending.values())
        window = sum(min(pages_for(n + out, ps) - pages_for(n, ps), 1) for n, out in self.pending.values())
        pages = tuple(full if p.kind is PoolKind.FULL else window if p.kind is PoolKind.WINDOW else 0
                      for p in plan.sub_pools)
        return KVDemand(pages, full, 0)

    def demand(self, seq_len: int, output_len: int) -> KVDemand:
        return request_demand(self.storage.plan, DemandPurpose.DECODE_PREALLOC, input_len=seq_len, output_len=output_len)

    def prealloc_fits(self, seq_len: int, output_len: int) -> bool:
        return self.storage.allocator.admits(self.demand(seq_len, output_len) + self.held_back())

    def took(self, rid: str, seq_len: int, output_len: int) -> None:
        self.pending[rid] = (seq_len, output_len)

    def grew(self, rid: str, seq_len: int, output_left: int) -> None:
        if rid in self.pending:
            self.pending[rid] = (seq_len, output_left)

    def done(self, rid: str) -> None:
        self.pending.pop(rid, None)


class DecodeNode(PDNode):
    """`overlap` and `pipeline_stages` describe the scheduler the node serves; with
    `KVCHAIN_ENABLE_DISAGG_DECODE_DEFERRED_PUBLISH` on they decide whether it may defer publication
    (PD-12). Deferred, `receive` takes an offer's pages and returns a `PendingPublication`; the
    next iteration's `publish_pending` sends their ids and waits the transfer."""

    peer_name = "prefill"

    def __init__(self, storage: KVStorage, link: PDLink, engine: TransferEngine, *, overlap: bool = False,
                 pipeline_stages: int = 1, **kwargs) -> None:
        deferred = deferred_publication(storage.device, overlap=overlap, pipeline_stages=pipeline_stages)
        super().__init__(storage, link, engine, **kwargs)
        self.queue = DecodePreallocQueue(storage, deferred=deferred)
        #: after a receive's take, before its ids go out (tests move pages here: PD-17)
        self.before_publish = None
        #: offers (and the end) this node took from the current link
        self.offers_taken = 0
        #: whether room is coming (the node serves requests that will finish): a refusal for want of
        #: room then tells the prefill node to offer again later, instead of giving the request up
        self.room_coming: Callable[[], bool] = lambda: False

    def offer_waiting(self) -> bool:
        """Whether the prefill node posted an offer (or its end) this node has not taken: `receive`
        would not block on it. No collective: a node serving requests asks between iterations."""
        return self.link.posted("offers") > self.offers_taken

    def rejoin(self, link: PDLink) -> None:
        super().rejoin(link)
        self.offers_taken = 0

    @property
    def deferred_publication(self) -> bool:
        return self.queue.deferred

    def _take(self, offer: dict) -> tuple[int, dict[str, np.ndarray]]:
        """A row of the offered length, its windows retired past what decode needs."""
        storage = self.storage
        row = storage.alloc_row()
        try:
            storage.alloc_extend(np.array([row]), np.array([int(offer["seq_len"])]))
            storage.advance(np.array([row]))
        except BaseException:
            storage.free_rows(np.array([row]))
            raise
        return row, request_pages(storage, row)

    def receive(self) -> Received | Refused | PendingPublication | None:
        """Take the next offer: the received request once its pages landed, `Refused` when there
        was no room for it, None when the prefill node has no more (`PrefillNode.end`). Under
        deferred publication, the `PendingPublication` of its taken pages: `publish_pending` in a
        later iteration finishes it. Raises as `PrefillNode.send` does, on both nodes in the same
        round; the receive is deferred then, its pages held until proof (LIM-1)."""
        storage = self.storage
        if self.queue.unpublished:
            raise TransferError(f"{self.queue.unpublished[0].rid} waits its publication: publish_pending first "
                                "(the prefill node waits its answer)")
        offer = self.link.exchange({"op": "listen"})
        self.offers_taken += 1
        if offer.get("op") == "end":
            self.link.exchange({"op": "end"})
            return None
        if offer.get("op") != "offer":
            raise TransferError(f"expected an offer from the prefill node, got {offer.get('op')!r}")
        rid, seq_len = str(offer["rid"]), int(offer["seq_len"])
        output = int(offer.get("extra", {}).get("output_len", 0))
        row = -1
        reason = ""
        retry = False  # a refusal for want of room, while room is coming: the offer may come again
        if not self.queue.prealloc_fits(seq_len, output):
            reason = "the preallocation does not fit with the work already held back"
            retry = self.room_coming()
        else:
            try:
                row, dst = self._take(offer)
            except CapacityError as e:
                reason = f"no room: {e}"
                retry = self.room_coming()
        if row >= 0 and ({k: len(v) for k, v in dst.items()} != offer["counts"]
                         or window_los(storage, row) != offer["window_lo"]):
            storage.free_rows(np.array([row]))
            row, reason = -1, f"the offered pages {offer['counts']} do not match this node's take"
        if row < 0:
            self.link.exchange({"op": "refuse", "rid": rid, "reason": reason, "retry": retry})
            return Refused(rid, reason, dict(offer.get("extra", {})), retry)
        hold = storage.hold_receive_rows(rid, dst)
        extra = dict(offer.get("extra", {}))
        if self.queue.deferred:
            self.queue.took(rid, seq_len, output)
            return self.queue.allocate(rid, row, dst, hold, seq_len=seq_len, output_len=output, extra=extra)
        device = storage.device
        allocated = device.record(device.schedule_stream, f"{rid} allocated")
        epoch = storage.move_epoch
        if self.before_publish is not None:
            self.before_publish(row, hold)
        dst = self._readback(row, dst, epoch)
        self.queue.took(rid, seq_len, output)
        return self._finish_receive(PendingPublication(rid, row, hold, dst, epoch, allocated, self.queue.iteration,
                                                       seq_len, output, extra, ids=dst))

    def publish_pending(self) -> list[Received]:
        """This iteration's deferred publications (`DecodePreallocQueue.publish_pending_destinations`):
        each taken in an earlier iteration has its ids sent now and its transfer waited."""
        posted: list[tuple[PendingPublication, NetworkTransfer, Transfer]] = []
        self.queue.publish_pending_destinations(lambda p: posted.append((p, *self._post(p))))
        return [self._await(p, network, t) for p, network, t in posted]

    def _finish_receive(self, p: PendingPublication) -> Received:
        network, t = self._post(p)
        self._publish(p.hold)
        return self._await(p, network, t)

    def _post(self, p: PendingPublication) -> tuple[NetworkTransfer, Transfer]:
        """Record the receive (before the peer may write: it learns the ids next), post it to the
        engine (a staged state slot lands on its consumer's stream, PD-16) and send the ids."""
        storage = self.storage
        network = NetworkTransfer(p.rid, sends=False)
        storage.record_network_transfer(network, p.ids)
        t = None
        segments = segments_of(storage, p.ids)
        try:
            t = self.engine.expect(self.peer_name, segments, p.rid, state_on_consumer_stream(storage, p.allocated))
            self.link.exchange({"op": "accept", "rid": p.rid, "dst": _ids(p.ids), "segments": segments})
        except (TransferError, PeerLost) as e:
            self._fail(p, network, t, e)
        return network, t

    def _await(self, p: PendingPublication, network: NetworkTransfer, t: Transfer) -> Received:
        try:
            self._wait(p.rid, t)
        except (TransferTimeoutError, TransferFailed, TransferError, PeerLost) as e:
            self._fail(p, network, t, e)
        self.storage.end_network_transfer(network)
        return Received(p.rid, p.row, p.seq_len, p.extra)

    def _fail(self, p: PendingPublication, network: NetworkTransfer, t: Transfer | None, e: Exception) -> None:
        self._publish(p.hold)
        self.queue.done(p.rid)
        self._defer(p.rid, p.row, network, t, str(e))
        raise e

    def _readback(self, row: int, dst: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
        """The ids to publish: after the schedule stream, so every earlier use of the pages (a
        forward the take waited for) is over before the peer may write them (PD-10); read again
        if a page moved since the take (PD-17)."""
        device = self.storage.device
        device.host_wait(device.record(device.schedule_stream, "pd readback"))
        if self.storage.move_epoch != epoch:
            return request_pages(self.storage, row)
        return dst

    def _publish(self, hold: ReceiveHold) -> None:
        self.storage.published(hold)

    def _fence(self) -> list[str]:
        names = sorted(self.deferred)
        self.link.exchange({"op": "fence", "epoch": self.fence_epoch, "rids": names})
        ack = self.link.exchange({"op": "wait"})
        if ack.get("op") != "fenced" or ack.get("epoch") != self.fence_epoch:
            raise TransferError(f"fence {self.fence_epoch}: the prefill node answered {ack.get('op')!r}")
        out = []
        for rid, state in ack.get("states", {}).items():
            d = self.deferred.get(rid)
            if d is not None and state == "quiescent":
                if d.transfer is not None:
                    self.engine.abort(d.transfer)  # a receive this node gave up on: never scattered
                self._release(d, f"the prefill node acknowledged fence {self.fence_epoch}")
                out.append(rid)
        return out

    def finish(self, received: Received) -> None:
        """The request is done here: its row goes."""
        self.queue.done(received.rid)
        self.storage.free_rows(np.array([received.row]))

    def check_idle(self) -> bool:
        """The idle checks (no row in use, no leaked page, byte accounting); skipped, returning
        False, while the node holds deferred releases (CHK-16): their rows are in use on purpose."""
        if self.deferred:
            log.info("pd: idle checks skipped: %d deferred releases held", len(self.deferred))
            return False
        active = int(self.storage.table.active.sum())
        if active:
            raise InvariantError("pd.idle_rows", f"{active} request rows in use on an idle decode node")
        self.storage.check_idle()
        return True
