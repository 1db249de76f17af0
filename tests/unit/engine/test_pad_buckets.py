"""Prefill chunks stepped together (`batch.pad_buckets`, `conv_state.state_groups`): the buckets
partition the chunks within the padding bound, a padded group's rows, pads and conv tails are
where the kernels expect them, and a pad leaves a recurrent state exactly as it was."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvchain.engine.batch import PAD_FACTOR, ForwardBatch, pad_buckets
from kvchain.engine.conv_state import causal_conv, state_groups
from kvchain.engine.deltanet import gated_delta_chunked, gated_delta_scan
from kvchain.engine.mamba2 import ssd_scan, ssd_step


@pytest.mark.parametrize("seed", range(20))
def test_buckets_partition_the_chunks_within_the_padding_bound(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 200, size=int(rng.integers(1, 24)))
    buckets = pad_buckets(lengths)
    assert sorted(np.concatenate(buckets).tolist()) == list(range(len(lengths)))
    for bucket in buckets:
        assert (np.diff(bucket) > 0).all()  # in batch order
        real = int(lengths[bucket].sum())
        assert len(bucket) * int(lengths[bucket].max()) <= PAD_FACTOR * real
    # longest first, and a bucket stops only where the next longest chunk would break the bound
    widths = [int(lengths[b].max()) for b in buckets]
    assert widths == sorted(widths, reverse=True)
    for this, after in itertools.pairwise(buckets):
        nxt = int(lengths[after].max())
        assert nxt <= int(lengths[this].min())
        assert (len(this) + 1) * int(lengths[this].max()) > PAD_FACTOR * (int(lengths[this].sum()) + nxt)


def test_equal_chunks_share_one_unpadded_bucket():
    assert [b.tolist() for b in pad_buckets(np.array([16, 16, 16]))] == [[0, 1, 2]]
    # 2 x 64 <= 2 x (64 + 4), but 3 x 64 > 2 x (68 + 2): the short chunk starts its own bucket
    assert [b.tolist() for b in pad_buckets(np.array([64, 4, 2]))] == [[0, 1], [2]]


def _batch(new: list[int]) -> ForwardBatch:
    new_a = np.array(new, dtype=np.int64)
    prefix = np.full(len(new), 5, dtype=np.int64)
    return ForwardBatch(q_starts=np.concatenate([[0], np.cumsum(new_a)]), prefix_lens=prefix, seq_lens=prefix + new_a,
                        page_size=4, views={}, layer_pool={}, state_slots=torch.arange(10, 10 + len(new)),
                        state_fresh=torch.tensor([False, True, False, False][:len(new)]))


def test_groups_pad_each_chunk_with_its_last_row_and_are_built_once():
    batch = _batch([3, 1, 5, 1])
    groups = state_groups(batch)
    assert state_groups(batch) is groups  # once per forward, for every recurrent layer
    decode, chunks = groups
    assert decode.requests.tolist() == [1, 3] and decode.pad is None and decode.rows.tolist() == [3, 9]
    assert decode.slots.tolist() == [11, 13] and decode.fresh.tolist() == [True, False]
    assert chunks.requests.tolist() == [0, 2] and chunks.length == 5
    # request 0's rows 0..2 then its last row twice; request 2's rows 4..8
    assert chunks.tokens.tolist() == [0, 1, 2, 2, 2, 4, 5, 6, 7, 8]
    assert chunks.pad.tolist() == [[False] * 3 + [True] * 2, [False] * 5]
    assert chunks.real_rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    out = torch.zeros(10)
    chunks.scatter(out, torch.arange(10, dtype=torch.float32) + 1)
    assert out.tolist() == [1, 2, 3, 0, 6, 7, 8, 9, 10, 0]  # pads dropped, decode rows untouched


def test_padded_conv_keeps_each_request_its_last_inputs_before_the_pads():
    batch = _batch([2, 5])
    (group,) = state_groups(batch)
    gen = torch.Generator().manual_seed(0)
    x, past = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 3, generator=gen)
    weight = torch.randn(3, 4, generator=gen)
    out, tails = causal_conv(x, past, weight, None, group)
    for b, n in enumerate([2, 5]):
        alone, tail = causal_conv(x[b:b + 1, :, :n], past[b:b + 1], weight, None)
        assert torch.allclose(out[b:b + 1, :, :n], alone) and torch.equal(tails[b:b + 1], tail)


def test_pads_leave_the_recurrent_states_as_they_were():
    """Pads as the mixers make them (Mamba2: dt = 0; DeltaNet: g = 0, beta = 0), after a chunk that
    ends mid-block: the final states equal the unpadded chunk's, bit for bit in the SSM's decay."""
    gen = torch.Generator().manual_seed(5)
    n, length, pads, heads, p, d = 2, 11, 7, 3, 5, 4

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    x, dt, b, c = rand(n, length + pads, heads, p), rand(n, length + pads, heads).exp(), \
        rand(n, length + pads, heads, d), rand(n, length + pads, heads, d)
    a, h0 = -rand(heads).abs(), rand(n, heads, p, d)
    want_y, want = ssd_scan(x[:, :length], dt[:, :length], a, b[:, :length], c[:, :length], h0, block=4)
    padded_dt = dt.clone()
    padded_dt[:, length:] = 0.0
    got_y, got = ssd_scan(x, padded_dt, a, b, c, h0, block=4)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_y[:, :length], want_y, atol=1e-5)

    q = torch.nn.functional.normalize(rand(n, length + pads, heads, d), dim=-1)
    k = torch.nn.functional.normalize(rand(n, length + pads, heads, d), dim=-1)
    v, g, beta = rand(n, length + pads, heads, p), -rand(n, length + pads, heads).abs(), \
        rand(n, length + pads, heads).sigmoid()
    s0 = rand(n, heads, d, p)
    want_o, want = gated_delta_chunked(q[:, :length], k[:, :length], v[:, :length], g[:, :length],
                                       beta[:, :length], s0, block=8)
    g, beta = g.clone(), beta.clone()
    g[:, length:], beta[:, length:] = 0.0, 0.0
    got_o, got = gated_delta_chunked(q, k, v, g, beta, s0, block=8)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_o[:, :length], want_o, atol=1e-5)


def test_ssd_step_is_one_token_of_the_scan():
    gen = torch.Generator().manual_seed(6)
    n, heads, p, d = 3, 4, 5, 6
    x, dt = torch.randn(n, 1, heads, p, generator=gen), torch.randn(n, 1, heads, generator=gen).exp()
    b, c = torch.randn(n, 1, heads, d, generator=gen), torch.randn(n, 1, heads, d, generator=gen)
    a, h0 = -torch.randn(heads, generator=gen).abs(), torch.randn(n, heads, p, d, generator=gen)
    want_y, want = ssd_scan(x, dt, a, b, c, h0, block=1)
    got_y, got = ssd_step(x, dt, a, b, c, h0)
    assert torch.allclose(got_y, want_y, atol=1e-5) and torch.allclose(got, want, atol=1e-5)


def test_grouped_delta_step_is_the_repeated_heads_step():
    """A decode's key heads broadcast over their value heads (`gated_delta_scan` with G < H): the
    same numbers as repeating each key head to its value heads."""
    gen = torch.Generator().manual_seed(7)
    n, length, groups, rep, dk, dv = 3, 2, 2, 3, 4, 5
    q = torch.nn.functional.normalize(torch.randn(n, length, groups, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, length, groups, dk, generator=gen), dim=-1)
    v = torch.randn(n, length, groups * rep, dv, generator=gen)
    g = -torch.randn(n, length, groups * rep, generator=gen).abs()
    beta = torch.randn(n, length, groups * rep, generator=gen).sigmoid()
    s0 = torch.randn(n, groups * rep, dk, dv, generator=gen)
    want_o, want = gated_delta_scan(q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v, g, beta, s0)
    got_o, got = gated_delta_scan(q, k, v, g, beta, s0)
    assert torch.allclose(got_o, want_o, atol=1e-6) and torch.allclose(got, want, atol=1e-6)
