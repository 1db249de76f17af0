"""kvchain's Mamba1 mixer (`engine/mamba1.py`) against transformers' own modules on the same weights,
in fp32: Mamba, Falcon-Mamba (RMS norms on dt, B and C) and Jamba (norms with weights, between
attention layers). Three requests packed in one batch (prompts in two chunks of different lengths,
then batched decodes), their conv and SSM state in a real pool whose slots start as NaN bytes,
must give transformers' output of each whole sequence in one forward, at the mixer and at the
logits; a state checkpoint copied to another slot continues the request from there."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvchain.engine.mamba1 import linear_scan, mamba1_forward, mamba1_module_types, selective_scan
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.tiny import make_model
from kvchain.errors import InputError
from support.mixer_pool import (
    CONV_SCHEDULE,
    MixerPool,
    assert_bucket_leaves_each_state_alone,
    assert_needs_the_batch,
    checkpoint_gap,
    diff,
    mixer_gap,
    runner_logits_gap,
)

FAMILIES = ("mamba", "falcon_mamba", "jamba")
TOL = 1e-4
SCHEDULE = CONV_SCHEDULE


@pytest.fixture(params=FAMILIES)
def case(request):
    model = make_model(request.param, seed=0)
    mixers = {m.layer_idx: m for m in model.modules() if isinstance(m, mamba1_module_types())}
    assert mixers and all(p.dtype == torch.float32 for p in model.parameters())
    return model.config, model, mixers


def test_mixer_matches_transformers_on_each_sequence(case):
    config, _model, mixers = case
    # transformers' forward of the whole sequence, no cache
    runs = [(functools.partial(mamba1_forward, m), lambda x, m=m: m(x[None])[0]) for m in mixers.values()]
    _worst, relative = mixer_gap(config, runs, config.hidden_size, SCHEDULE)
    assert relative < TOL


def test_logits_match_one_whole_forward(case):
    _config, model, mixers = case
    # kvchain's attention on Jamba's attention layers
    assert runner_logits_gap(model, len(mixers), SCHEDULE) < TOL


def test_checkpoint_copy_continues_the_request(case):
    config, _model, mixers = case
    module = next(iter(mixers.values()))
    first, second = SCHEDULE.chunks[1]
    worst, scale = checkpoint_gap(config, functools.partial(mamba1_forward, module),
                                  lambda x: module(x[None])[0], config.hidden_size, first, second)
    assert worst < TOL * scale


def test_a_call_without_the_batch_is_an_input_error(case):
    _config, model, _mixers = case
    assert_needs_the_batch(model)


def test_the_batch_reaches_a_mixer_its_block_does_not_pass_it_to(case):
    """transformers' Mamba1 blocks call the mixer without the model's keywords: the batch of the
    model call is relayed, and only while that call runs."""
    config, model, _mixers = case
    ours_model = copy.deepcopy(model)
    install_state_mixers(ours_model)
    pool = MixerPool(config)
    batch = pool.step([pool.storage.alloc_row()], [0], [5], [True])
    ids = torch.arange(5)[None]
    with torch.no_grad():
        ours_model(input_ids=ids, position_ids=ids, use_cache=False, kvchain_batch=batch)
        with pytest.raises(InputError, match="kvchain_batch"):  # the last call's batch is not kept
            ours_model(input_ids=ids, use_cache=False)


def test_the_parallel_scan_is_the_token_by_token_recurrence():
    """`selective_scan` over a length that crosses several blocks and ends mid-block, from a
    non-zero state, against h_t = exp(dt A) h + dt x B stepped one token at a time; zero dt leaves
    the state unchanged (a pad)."""
    gen = torch.Generator().manual_seed(4)
    n, length, inner, d_state = 2, 37, 6, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x, dt = rand(n, length, inner), rand(n, length, inner).exp() * 0.3
    b, c, a, h0 = rand(n, length, d_state), rand(n, length, d_state), -rand(inner, d_state).exp(), rand(n, inner, d_state)
    h, want = h0, []
    for t in range(length):
        h = (dt[:, t, :, None] * a).exp() * h + (dt[:, t] * x[:, t])[..., None] * b[:, t, None, :]
        want.append((h * c[:, t, None, :]).sum(-1))
    for block in (1, 8, 64):
        got, got_state = selective_scan(x, dt, a, b, c, h0, block)
        assert max(diff(got, torch.stack(want, 1)), diff(got_state, h)) < 1e-5
    dt[:, -3:] = 0.0
    _, padded = selective_scan(x, dt, a, b, c, h0)
    _, unpadded = selective_scan(x[:, :-3], dt[:, :-3], a, b[:, :-3], c[:, :-3], h0)
    assert diff(padded, unpadded) < 1e-6
    ones = torch.ones(1, 5, 1)
    assert linear_scan(ones, ones).flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(case):
    """Two prompt chunks of different lengths stepped in one padded bucket: the conv and SSM states
    left in their slots are those of each chunk run alone."""
    config, _model, mixers = case
    layer, module = next(iter(mixers.items()))
    assert_bucket_leaves_each_state_alone(config, functools.partial(mamba1_forward, module), layer,
                                          ("conv", "ssm"), config.hidden_size, rel_tol=1e-5)
