"""The default checkpoint interval: half a turn of the traffic, finer when a state slot weighs less
than that much KV, whole pages."""

from __future__ import annotations

import pytest

from kvchain.cache.checkpoints import CHAT_TURN_TOKENS, checkpoint_interval_for, default_checkpoint_interval
from kvchain.errors import InputError
from kvchain.models import model_from_preset
from kvchain.plan import plan_kv_storage

STATE_PRESETS = ("qwen3-next-80b", "nemotron-h-8b", "jamba-mini", "falcon-h1-7b", "hymba-1.5b")


def test_half_a_turn_in_whole_pages():
    kib = 1024
    # a state of 4,000 tokens' KV: the turn decides (250 tokens, rounded up to 4 pages of 64)
    assert checkpoint_interval_for(page_size=64, state_bytes=4000 * kib, token_bytes=kib, turn_tokens=500) == 256
    assert checkpoint_interval_for(page_size=16, state_bytes=4000 * kib, token_bytes=kib, turn_tokens=500) == 256
    assert checkpoint_interval_for(page_size=64, state_bytes=4000 * kib, token_bytes=kib, turn_tokens=4000) == 2048


def test_a_cheap_state_checkpoints_more_often():
    """A slot that weighs the KV of 300 tokens: checkpoints every 150 (3 pages of 64) even with
    long turns."""
    assert checkpoint_interval_for(page_size=64, state_bytes=300, token_bytes=1, turn_tokens=4000) == 192


def test_at_least_one_page():
    assert checkpoint_interval_for(page_size=64, state_bytes=10, token_bytes=1, turn_tokens=500) == 64
    assert checkpoint_interval_for(page_size=64, state_bytes=4000, token_bytes=1, turn_tokens=1) == 64


@pytest.mark.parametrize("name", ["page_size", "state_bytes", "token_bytes", "turn_tokens"])
def test_inputs_below_one_are_refused(name):
    args = {"page_size": 64, "state_bytes": 4000, "token_bytes": 1, "turn_tokens": 500, name: 0}
    with pytest.raises(InputError, match=f"{name} must be >= 1, got 0"):
        checkpoint_interval_for(**args)


@pytest.mark.parametrize("preset", STATE_PRESETS)
def test_chat_traffic_on_every_state_preset_gets_a_quarter_turn_grid(preset):
    """Every state preset's slot weighs more than half a chat turn of KV, so multi-turn chat gets
    the half-turn grid (256 tokens at 64-token pages), not the 512-3,136 tokens the state's cost
    alone gave."""
    plan = plan_kv_storage(model_from_preset(preset).decls, page_size=64)
    assert plan.state.page_bytes // plan.owner.unit_bytes // 2 > CHAT_TURN_TOKENS // 2
    assert default_checkpoint_interval(plan) == 256


def test_a_plan_without_state_has_no_interval():
    plan = plan_kv_storage(model_from_preset("llama-3.1-8b").decls, page_size=64)
    with pytest.raises(InputError, match="state sub-pool"):
        default_checkpoint_interval(plan)
