"""kvchain's lightning attention (`engine/lightning.py`) against transformers' own MiniMax modules on
the same weights, in fp32. Three requests packed in one batch (prompts in two chunks of different
lengths, one opening with a single token, then batched decodes), their KV state in a real pool
whose slots start as NaN bytes, must give transformers' output of each whole sequence in one
forward (its own blocks of 16 crossed within a sequence), at the mixer and at the logits (softmax
attention through the pool beside it); a state checkpoint copied to another slot continues the
request from there."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvchain.engine.lightning import (
    lightning_chunked,
    lightning_forward,
    lightning_module_types,
    lightning_step,
)
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.tiny import make_model
from support.mixer_pool import (
    MixerPool,
    Schedule,
    assert_bucket_leaves_each_state_alone,
    checkpoint_gap,
    diff,
    mixer_gap,
    runner_logits_gap,
)

pytest.importorskip("transformers.models.minimax.modeling_minimax")

TOL = 1e-5
# per request: two prompt chunks (the third opens with one token, a decode-group step from zeros),
# then decodes; the first chunks end inside transformers' first block of 16, the sequences past it
SCHEDULE = Schedule(((3, 17), (21, 2), (1, 12)))


@pytest.fixture(scope="module")
def model():
    return make_model("minimax", seed=0)


@pytest.fixture(scope="module")
def mixers(model):
    found = {m.layer_idx: m for m in model.modules() if isinstance(m, lightning_module_types())}
    assert sorted(found) == [0, 2, 3]
    return found


def _whole(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' lightning attention over one whole sequence `[L, hidden]`, no cache."""
    out, _state = module(hidden_states=x[None], position_embeddings=None, attention_mask=None)
    return out[0]


def test_mixer_matches_transformers_on_each_sequence(model, mixers):
    runs = [(functools.partial(lightning_forward, m), functools.partial(_whole, m)) for m in mixers.values()]
    _worst, relative = mixer_gap(model.config, runs, model.config.hidden_size, SCHEDULE)
    assert relative < TOL


def test_logits_match_one_whole_forward(model, mixers):
    assert runner_logits_gap(model, len(mixers), SCHEDULE) < 1e-4


def test_checkpoint_copy_continues_the_request(model, mixers):
    module = mixers[0]
    worst, scale = checkpoint_gap(model.config, functools.partial(lightning_forward, module),
                                  functools.partial(_whole, module), model.config.hidden_size,
                                  first=5, second=19)
    assert worst < TOL * scale


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(model, mixers):
    """Two prompt chunks of different lengths stepped in one padded bucket: the KV state left in
    each slot is that of its chunk run alone (the pads neither decay it nor add to it)."""
    layer = 0
    run = functools.partial(lightning_forward, mixers[layer])
    assert_bucket_leaves_each_state_alone(model.config, run, layer, ("ssm",), model.config.hidden_size,
                                          rel_tol=1e-6)


def test_the_blocked_form_is_the_token_by_token_recurrence():
    """`lightning_chunked` over a length that crosses several blocks and ends mid-block, from a
    non-zero state, against `lightning_step` one token at a time."""
    gen = torch.Generator().manual_seed(4)
    n, length, heads, dim = 2, 37, 3, 5
    q, k, v = (torch.randn(n, length, heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(n, length, heads, generator=gen)
    state = torch.randn(n, heads, dim, dim, generator=gen)
    want, stepped = [], state
    for t in range(length):
        out, stepped = lightning_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], stepped)
        want.append(out)
    for block in (1, 8, 64):
        got, got_state = lightning_chunked(q, k, v, g, state, block)
        assert max(diff(got, torch.cat(want, 1)), diff(got_state, stepped)) < 1e-4


def test_install_pairs_the_output_as_the_layer_unpacks_it(model, mixers):
    ours = copy.deepcopy(model)
    assert install_state_mixers(ours) == len(mixers)
    pool = MixerPool(model.config)
    batch = pool.step([pool.storage.alloc_row()], [0], [4], [True])
    x = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out, weights = ours.model.layers[0].self_attn(hidden_states=x, position_embeddings=None,
                                                      attention_mask=None, kvchain_batch=batch)
    assert weights is None and diff(out, _whole(mixers[0], x[0])[None]) < TOL
