"""The default checkpoint interval: how many tokens apart the prefix tree caches recurrent state
(`extra_buffer`, `extra_buffer_lazy`) when no interval is given.

A match on a model with state lands on the latest checkpoint at or before where the cached
sequence ends, so the grid costs a hit about half an interval: in multi-turn chat, turn k+1
recomputes turn k's tokens past the last grid point besides its own new message. A checkpoint
costs one state slot while the tree keeps it and one state copy when it is taken. The tree
evicts a checkpoint by the state's own last use, so one that a deeper checkpoint of the same
conversation has superseded goes before the pages and states still in use: a finer grid costs
copies and short-lived slots, not a slot per grid point for the conversation's lifetime.

The rule, from two explicit inputs:

* **the state's cost**: `state_bytes` against `token_bytes` (full-attention KV per token): the
  grid is as fine as it can be while a checkpoint weighs at most the KV of `STATE_COST_INTERVALS`
  intervals: a tenth of the tokens whose KV weighs one slot. A finer grid keeps more of every hit (the page
  grid is best when memory is unlimited) but holds and copies more states;
* **the traffic's turn structure**: `turn_tokens`, what a turn appends before the next one can
  match it (a user message and its answer; the median of multi-turn chat by default). The grid
  is never coarser than half a turn, whatever the state costs, so it costs a hit at most about
  a quarter of a turn on average and every turn takes a checkpoint.

The interval is the smaller of the two, rounded up to whole pages and at least one page. The
factor of ten is measured: on multi-turn chat at 80 GiB, Jamba (a slot weighs about 980 tokens of
its KV) hits most at 128 tokens and Qwen3-Next (about 3,100) at 256."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:
    from ..plan import KVStoragePlan

#: A checkpoint may weigh the full-attention KV of this many intervals.
STATE_COST_INTERVALS = 10

#: Tokens a chat turn appends: the median user message (200) plus the median answer (300) of the
#: multi-turn chat workload (`kvchain.sim.workloads.multi_turn`).
CHAT_TURN_TOKENS = 500


def checkpoint_interval_for(*, page_size: int, state_bytes: int, token_bytes: int,
                            turn_tokens: int = CHAT_TURN_TOKENS) -> int:
    """Tokens between checkpoints: a tenth of the tokens whose full-attention KV weighs one state
    slot, or half a turn when that is fewer; whole pages, at least one. A model that keeps no KV
    per token (`token_bytes` 0: state only, Mamba) has only the turn rule."""
    for name, value in (("page_size", page_size), ("state_bytes", state_bytes), ("turn_tokens", turn_tokens)):
        if value < 1:
            raise InputError(f"checkpoint interval: {name} must be >= 1, got {value}")
    if token_bytes < 0:
        raise InputError(f"checkpoint interval: token_bytes must be >= 0, got {token_bytes}")
    tokens = turn_tokens // 2
    if token_bytes:
        tokens = min(tokens, state_bytes // token_bytes // STATE_COST_INTERVALS)
    return max(1, -(-tokens // page_size)) * page_size


def default_checkpoint_interval(plan: KVStoragePlan, turn_tokens: int = CHAT_TURN_TOKENS) -> int:
    """`checkpoint_interval_for` with the plan's page size, state slot bytes and full-attention
    bytes per token (the plan must have a state sub-pool). A token-id owner holds no KV: the
    windows' bytes per token stand in (RecurrentGemma), and with no window either (Mamba) there
    is none."""
    if plan.state is None:
        raise InputError("a checkpoint interval needs a plan with a state sub-pool")
    token_bytes = plan.owner.unit_bytes or sum(w.unit_bytes for w in plan.windows)
    return checkpoint_interval_for(page_size=plan.page_size, state_bytes=plan.state.page_bytes,
                                   token_bytes=token_bytes, turn_tokens=turn_tokens)
