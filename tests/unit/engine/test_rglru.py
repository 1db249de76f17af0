"""kvchain's RG-LRU block (`engine/rglru.py`) against transformers' own RecurrentGemma modules on the
same weights, in fp32. Three requests packed in one batch (prompts in two chunks of different
lengths, one opening with a single token, then batched decodes), their conv and RG-LRU state in a
real pool whose slots start as NaN bytes, must give transformers' output of each whole sequence in
one forward, at the block and at the logits (local attention through the pool beside it); a state
checkpoint copied to another slot continues the request from there."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvchain.engine.mixers import check_state_layers_served, install_state_mixers
from kvchain.engine.rglru import linear_recurrence, rglru_forward, rglru_module_types
from kvchain.engine.tiny import make_model
from support.mixer_pool import (
    Schedule,
    assert_bucket_leaves_each_state_alone,
    checkpoint_gap,
    diff,
    mixer_gap,
    runner_logits_gap,
)

pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")

TOL = 1e-5
# per request: two prompt chunks (the third opens with one token: a reset in the decode group),
# then decodes; the sequences run past the tiny model's attention window of 16
SCHEDULE = Schedule(((3, 17), (21, 2), (1, 12)))


@pytest.fixture(scope="module")
def model():
    return make_model("recurrent_gemma", seed=0)


@pytest.fixture(scope="module")
def blocks(model):
    """layer -> (the block with kvchain's forward installed, transformers' block), by layer."""
    ours = copy.deepcopy(model)
    install_state_mixers(ours)
    pairs = {m.layer_idx: m for m in ours.modules() if isinstance(m, rglru_module_types())}
    refs = [layer.temporal_block for layer in model.model.layers]
    assert sorted(pairs) == [0, 1, 3]
    return {layer: (block, refs[layer]) for layer, block in pairs.items()}


def _whole(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' block over one whole sequence `[L, hidden]`, no cache."""
    positions = torch.arange(x.shape[0])[None]
    out, _ = block(x[None], position_ids=positions, attention_mask=None, use_cache=False)
    return out[0]


def test_block_matches_transformers_on_each_sequence(model, blocks):
    runs = [(functools.partial(rglru_forward, ours), functools.partial(_whole, ref))
            for ours, ref in blocks.values()]
    _worst, relative = mixer_gap(model.config, runs, model.config.hidden_size, SCHEDULE)
    assert relative < TOL


def test_logits_match_one_whole_forward(model, blocks):
    assert runner_logits_gap(model, len(blocks), SCHEDULE) < 1e-4


def test_checkpoint_copy_continues_the_request(model, blocks):
    ours, ref = blocks[0]
    worst, scale = checkpoint_gap(model.config, functools.partial(rglru_forward, ours),
                                  functools.partial(_whole, ref), model.config.hidden_size, first=5, second=7)
    assert worst < TOL * scale


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(model, blocks):
    """Two prompt chunks of different lengths stepped in one padded bucket: the conv and RG-LRU
    states left in their slots are those of each chunk run alone."""
    layer = 1
    ours, _ref = blocks[layer]
    assert_bucket_leaves_each_state_alone(model.config, functools.partial(rglru_forward, ours), layer,
                                          ("conv", "rg_lru"), model.config.hidden_size, rel_tol=1e-6)


def test_the_doubling_scan_is_the_token_by_token_recurrence():
    """`linear_recurrence` over a length that crosses several blocks and ends mid-block, from a
    non-zero state, against h_t = a_t h_(t-1) + u_t stepped one token at a time."""
    gen = torch.Generator().manual_seed(4)
    decay = torch.rand(2, 37, 6, generator=gen)
    inputs, h = torch.randn(2, 37, 6, generator=gen), torch.randn(2, 6, generator=gen)
    want, state = [], h
    for t in range(37):
        state = decay[:, t] * state + inputs[:, t]
        want.append(state)
    for block in (1, 8, 128):
        assert diff(linear_recurrence(decay, inputs, h, block), torch.stack(want, 1)) < 1e-5


def test_the_blocks_are_numbered_and_served(model, blocks):
    """transformers' recurrent block keeps no layer index: installing numbers it by its decoder
    layer, so the plan's state layers find their mixers."""
    assert not hasattr(model.model.layers[0].temporal_block, "layer_idx")
    ours = copy.deepcopy(model)
    assert install_state_mixers(ours) == 3
    check_state_layers_served(ours, {0, 1, 3})
    numbered = {m.layer_idx for m in ours.modules() if isinstance(m, rglru_module_types())}
    assert numbered == {0, 1, 3}
