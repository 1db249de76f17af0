"""Speculative decoding on pipeline stages: the relayed verify commit (LIFE-15).

Every stage runs the whole draft (its layers fused into each stage's plan, `stage_draft_planner`),
so every stage holds the same proposals and the same sub-pools. The verify forward runs stage by
stage; only the last stage has the logits, so only it can accept. There the round is what it is in
one process: acceptance and the post-verify commit run inside its forward, from the state slots
resolved at metadata time (LIFE-11, LIFE-12).

A stage before the last does not wait for them inside its forward: its forward ends once it has
sent its hidden states on, and the stage goes on with its own work, the early-processing flush
among it, which may move pages of the state band now that the forward has retired (LIFE-36 holds
moves back only while it is in flight). The last stage's logits come later, relayed; the stage
accepts from them and commits each round's state, the state after its accepted prefix. Its
requests still own their rows (nothing was scheduled since the forward), but the slots the forward
resolved at metadata time may name pages a move has emptied, so the relayed commit resolves the
rows' state slots and the rounds' scratch slots when it runs (`relayed_commit_state_slots`), and
follows the move. `EngineConfig.relayed_commit_slots_from_metadata` is the deliberate fault that
commits through the metadata-time slots instead, for the test that shows what it breaks."""

from __future__ import annotations

from ..engine.request import ScheduledRequest
from ..engine.speculative import SpeculativePool
from ..engine.speculative_round import SpecPayload, accept, chain_slots, host_tensor
from ..engine.speculative_state import ForwardStateSlots, commit_states_after_verify
from ..engine.steps import Launched
from ..errors import InvariantError
from ..storage import KVStorage


def relayed_commit_state_slots(storage: KVStorage, payload: SpecPayload) -> ForwardStateSlots:
    """The physical state slots of a forward's rounds as they are now (LIFE-15): each round row's
    own slot, looked up in the request table (its request still owns the row), and its scratch
    slots, each translated from the virtual slot the round holds, so a move since the forward is
    followed."""
    how = payload.how
    device = payload.slots.own.device
    own = storage.physical_pages(storage.plan.state.name, storage.table.state_slot[how.rows])
    chain = chain_slots(storage, payload.spec.rounds, how.kmax)
    return ForwardStateSlots(host_tensor(own, device), host_tensor(chain, device))


class RelayedSpeculativePool(SpeculativePool):
    """A `SpeculativePool` on a pipeline stage before the last, whose runner relays its logits
    (`StageRunner.relays_logits`): a step launches the forward and processes it when it ends,
    flushes, then takes the relayed logits, accepts and commits (`_relay`), in the order the last
    stage's pool processes its rounds, so both take the same capacity decisions."""

    name = "kvchain-engine-speculative-stage"

    def __init__(self, *args, relayed_commit_slots_from_metadata: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.runner.relays_logits:
            raise InvariantError("pp_spec.relay", "a relayed speculative pool needs a runner that relays its logits")
        if self.steps.depth:
            raise InvariantError("pp_spec.relay", "a pipeline stage processes each forward in its own step")
        self.relayed_commit_slots_from_metadata = relayed_commit_slots_from_metadata
        self._awaiting: Launched[SpecPayload] | None = None
        #: relayed commits run, and those whose slots a move had changed since the forward's metadata
        self.relayed_commits = 0
        self.relayed_commits_moved = 0

    def forward(self, reqs: list[ScheduledRequest]) -> None:
        forward, payload = self._prepare(reqs)
        steps = self.steps
        steps.launch(forward, payload)
        steps.process_until(0)  # the forward ended and retired; its result waits for the relay
        steps.flush()  # the stage's own work while the last stage computes: it may move state pages
        self._relay()
        self.processed(reqs)

    def _record_outputs(self, launched: Launched[SpecPayload]) -> None:
        self._awaiting = launched

    def _relay(self) -> None:
        """The last stage's logits of the awaited forward: greedy acceptance, the relayed commit,
        then what processing a result means (`SpeculativePool._record_outputs`)."""
        launched, self._awaiting = self._awaiting, None
        if launched is None:
            raise InvariantError("pp_spec.relay", "no forward awaits its relayed logits")
        payload = launched.payload
        logits = self.runner.relayed_logits(payload.how.n_sample)
        accept(logits, payload.proposed, payload.outputs, payload.spec, payload.how, self.keep_logits)
        if payload.slots is not None and payload.spec.rounds:
            self._commit(payload)
        super()._record_outputs(launched)

    def _commit(self, payload: SpecPayload) -> None:
        """The relayed verify commit, on the schedule stream behind the flush's moves, waited on the
        host before the rounds' scratch slots are freed."""
        now = relayed_commit_state_slots(self.storage, payload)
        moved = not (now.own.equal(payload.slots.own) and now.chain.equal(payload.slots.chain))
        slots = payload.slots if self.relayed_commit_slots_from_metadata else now
        stores, accepted = self._stores, payload.spec.accepted
        device = self.storage.device

        def commit() -> None:
            commit_states_after_verify(stores, slots, accepted)

        device.launch(device.schedule_stream, commit, label="relayed verify commit")
        device.host_wait(device.record(device.schedule_stream, "relayed_commit_done"))
        self.relayed_commits += 1
        self.relayed_commits_moved += int(moved)


__all__ = ["RelayedSpeculativePool", "relayed_commit_state_slots"]
