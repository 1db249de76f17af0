"""The default checkpoint interval: a tenth of the tokens whose KV weighs one state slot, never
coarser than half a turn of the traffic, whole pages."""

from __future__ import annotations

import pytest

from kvchain.cache.checkpoints import CHAT_TURN_TOKENS, checkpoint_interval_for, default_checkpoint_interval
from kvchain.errors import InputError
from kvchain.models import model_from_preset
from kvchain.plan import plan_kv_storage


def test_half_a_turn_when_the_state_is_dear():
    """A slot that weighs the KV of 4,000 tokens would allow 400-token intervals: half a 500-token
    turn is finer (250, rounded up to whole pages)."""
    kib = 1024
    assert checkpoint_interval_for(page_size=64, state_bytes=4000 * kib, token_bytes=kib, turn_tokens=500) == 256
    assert checkpoint_interval_for(page_size=16, state_bytes=4000 * kib, token_bytes=kib, turn_tokens=500) == 256
    assert checkpoint_interval_for(page_size=100, state_bytes=4000 * kib, token_bytes=kib, turn_tokens=500) == 300


def test_a_tenth_of_the_state_when_that_is_finer():
    """The same state with 4,000-token turns: a tenth of its 4,000 tokens (400, 7 pages of 64); a
    state of 1,000 tokens checkpoints every 100 (2 pages) even with chat turns."""
    assert checkpoint_interval_for(page_size=64, state_bytes=4000, token_bytes=1, turn_tokens=4000) == 448
    assert checkpoint_interval_for(page_size=64, state_bytes=1000, token_bytes=1, turn_tokens=500) == 128


def test_at_least_one_page():
    assert checkpoint_interval_for(page_size=64, state_bytes=10, token_bytes=1, turn_tokens=500) == 64
    assert checkpoint_interval_for(page_size=64, state_bytes=4000, token_bytes=1, turn_tokens=1) == 64


@pytest.mark.parametrize("name", ["page_size", "state_bytes", "turn_tokens"])
def test_inputs_below_one_are_refused(name):
    args = {"page_size": 64, "state_bytes": 4000, "token_bytes": 1, "turn_tokens": 500, name: 0}
    with pytest.raises(InputError, match=f"{name} must be >= 1, got 0"):
        checkpoint_interval_for(**args)


def test_a_model_without_kv_per_token_has_only_the_turn_rule():
    """A state-only model (Mamba) holds no KV a checkpoint could be weighed against: half a turn,
    in whole pages; a negative byte count is refused."""
    assert checkpoint_interval_for(page_size=64, state_bytes=4000, token_bytes=0, turn_tokens=500) == 256
    assert checkpoint_interval_for(page_size=100, state_bytes=4000, token_bytes=0, turn_tokens=500) == 300
    with pytest.raises(InputError, match="token_bytes must be >= 0, got -1"):
        checkpoint_interval_for(page_size=64, state_bytes=4000, token_bytes=-1, turn_tokens=500)


def test_a_state_only_preset_gets_the_turn_grid():
    """falcon-mamba-7b plans state and the token-id owner only: `kvchain generate` and `simulate` on
    such a model used to stop at the default interval's division by its zero KV bytes."""
    plan = plan_kv_storage(model_from_preset("falcon-mamba-7b").decls, page_size=64)
    assert default_checkpoint_interval(plan) == 256


@pytest.mark.parametrize(("preset", "interval"), [
    ("qwen3-next-80b", 256), ("nemotron-h-8b", 256), ("falcon-h1-7b", 256),  # half a chat turn
    ("jamba-mini", 128), ("hymba-1.5b", 128),  # a tenth of a cheap state
])
def test_chat_traffic_on_every_state_preset(preset, interval):
    """Multi-turn chat on every state preset gets a grid of 128-256 tokens, not the 512-3,136
    tokens the state's cost alone gave before."""
    plan = plan_kv_storage(model_from_preset(preset).decls, page_size=64)
    assert default_checkpoint_interval(plan) == interval
    assert default_checkpoint_interval(plan, turn_tokens=CHAT_TURN_TOKENS) == interval


def test_a_plan_without_state_has_no_interval():
    plan = plan_kv_storage(model_from_preset("llama-3.1-8b").decls, page_size=64)
    with pytest.raises(InputError, match="state sub-pool"):
        default_checkpoint_interval(plan)
