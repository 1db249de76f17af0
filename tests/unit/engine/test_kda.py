"""kvchain's Kimi Delta Attention (`engine/kda.py`) against transformers' own Kimi Linear KDA layers on
the same weights (the tiny `kimi_linear` of `engine/tiny.py`, fp32). Three requests packed in one
batch (prompts in two chunks of different lengths, one opening with a single token, one long enough
to cross a 64-token block, then batched decodes), their conv and recurrent state in a real pool
planned from the model's config whose slots start as NaN bytes, must give the layer's output on
each whole sequence alone; a state checkpoint copied to another slot continues the request, and a
padded bucket leaves each request's state as its own chunk would. The logits through the whole
model need kvchain's MLA attention beside these layers, so they are left to the family tests."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvchain.engine.deltanet import gated_delta_chunked, gated_delta_scan
from kvchain.engine.kda import kda_forward, kda_module_types
from kvchain.engine.mixers import check_state_layers_served, install_state_mixers
from kvchain.engine.tiny import make_model
from support.mixer_pool import (
    MixerPool,
    Schedule,
    assert_bucket_leaves_each_state_alone,
    assert_needs_the_batch,
    checkpoint_gap,
    delta_inputs,
    diff,
    mixer_gap,
)

pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOL = 1e-4
# per request: two prompt chunks (the first crossing the conv window and transformers' 64-token
# chunk, the third opening with one token, a decode-group step from zeros), then decodes
SCHEDULE = Schedule(((3, 70), (9, 2), (1, 5)))


@pytest.fixture(scope="module")
def model():
    return make_model("kimi_linear", seed=0)


@pytest.fixture(scope="module")
def mixers(model):
    found = {m.layer_idx: m for m in model.modules() if isinstance(m, kda_module_types())}
    assert sorted(found) == [0, 1, 2]
    return found


def _whole(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' KDA over one whole sequence `[L, hidden]`, no cache."""
    return module(x[None])[0]


def test_every_kda_layer_is_installed_and_served(model, mixers):
    ours = copy.deepcopy(model)
    assert install_state_mixers(ours) == len(mixers)
    check_state_layers_served(ours, set(mixers))


def test_the_plan_keeps_what_the_layer_keeps(model, mixers):
    """The planned state is the layer's: its conv's last kernel-1 inputs over q, k and v side by side,
    and one head_dim x head_dim state per head."""
    pool = MixerPool(model.config)
    for layer, module in mixers.items():
        view = pool.views[pool.layer_pool[layer]]
        conv, ssm = view.state(layer, "conv"), view.state(layer, "ssm")
        assert conv.shape[1:] == (module.conv1d.in_channels, module.conv_kernel_size - 1)
        assert module.conv1d.in_channels == 3 * module.num_heads * module.head_dim
        assert ssm.shape[1:] == (module.num_heads, module.head_dim, module.head_dim)


def test_mixer_matches_transformers_on_each_sequence(model, mixers):
    runs = [(functools.partial(kda_forward, m), functools.partial(_whole, m)) for m in mixers.values()]
    worst, relative = mixer_gap(model.config, runs, model.config.hidden_size, SCHEDULE)
    assert worst < TOL and relative < TOL, (worst, relative)


def test_checkpoint_copy_continues_the_request(model, mixers):
    module = mixers[1]
    worst, scale = checkpoint_gap(model.config, functools.partial(kda_forward, module),
                                  functools.partial(_whole, module), model.config.hidden_size,
                                  first=5, second=11)
    assert worst < TOL * scale


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(model, mixers):
    """Two prompt chunks of different lengths in one padded bucket: the conv and recurrent states
    left in each slot are those of its chunk alone (the pads neither decay nor correct the state)."""
    layer = 0
    run = functools.partial(kda_forward, mixers[layer])
    assert_bucket_leaves_each_state_alone(model.config, run, layer, ("conv", "ssm"), model.config.hidden_size,
                                          rel_tol=1e-5)


def test_needs_the_batch(model):
    assert_needs_the_batch(model)


def test_per_channel_blocked_scan_is_the_token_by_token_recurrence():
    """`gated_delta_chunked` with a decay per key channel, over a length that crosses several blocks
    and ends mid-block, from a non-zero state, against `gated_delta_scan` one token at a time; and a
    per-channel decay equal across channels is the scalar one."""
    q, k, v, g, beta, state = delta_inputs(4, per_channel=True)
    want, want_state = gated_delta_scan(q, k, v, g, beta, state)
    for block in (1, 8, 64):
        got, got_state = gated_delta_chunked(q, k, v, g, beta, state, block=block)
        assert max(diff(got, want), diff(got_state, want_state)) < 1e-5

    scalar = g[..., 0]
    want, want_state = gated_delta_chunked(q, k, v, scalar, beta, state, block=8)
    got, got_state = gated_delta_chunked(q, k, v, scalar[..., None].expand_as(g), beta, state, block=8)
    assert max(diff(got, want), diff(got_state, want_state)) < 1e-5
