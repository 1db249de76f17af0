"""kvchain's Mamba1 mixer (`engine/mamba1.py`) against transformers' own modules on the same weights,
in fp32: Mamba, Falcon-Mamba (RMS norms on dt, B and C) and Jamba (norms with weights, between
attention layers). Three requests packed in one batch (prompts in two chunks of different lengths,
then batched decodes), their conv and SSM state in a real pool whose slots start as NaN bytes,
must give transformers' output of each whole sequence in one forward, at the mixer and at the
logits; a state checkpoint copied to another slot continues the request from there."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.conv_state import state_groups
from kvchain.engine.mamba1 import linear_scan, mamba1_forward, mamba1_module_types, selective_scan
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.runner import ModelRunner
from kvchain.engine.tiny import make_model
from kvchain.errors import InputError
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

FAMILIES = ("mamba", "falcon_mamba", "jamba")
TOL = 1e-4
PAGE = 4
# per request: the two prompt chunks (one of a single token, shorter than the conv window), then decodes
CHUNKS = [(3, 6), (9, 2), (1, 5)]
DECODES = 4


@pytest.fixture(params=FAMILIES)
def case(request):
    model = make_model(request.param, seed=0)
    mixers = {m.layer_idx: m for m in model.modules() if isinstance(m, mamba1_module_types())}
    assert mixers and all(p.dtype == torch.float32 for p in model.parameters())
    return model.config, model, mixers


class Server:
    """A real pool planned from the model's config, its state slots filled with NaN bytes, and the
    steps that pack requests into `ForwardBatch`es."""

    def __init__(self, config) -> None:
        spec = model_from_config(config.to_dict(), kv_dtype="float32")
        self.plan = plan_kv_storage(list(spec.decls), page_size=PAGE)
        sizing = size_plan(self.plan, 64 * 2**20, context_len=256, max_running_requests=8, state_slots=8)
        self.storage = build_kv_storage(self.plan, sizing, "cpu")
        self.views = {sp.name: self.storage.view(sp.name) for sp in self.plan.sub_pools}
        self.layer_pool = {layer: sp.name for sp in self.plan.sub_pools for layer in sp.layer_ids}
        for sp in self.plan.sub_pools:
            if sp.kind is PoolKind.STATE:
                self.views[sp.name].pages.fill_(0xFF)  # every float read of these bytes is NaN

    def step(self, rows: list[int], prefix: list[int], new: list[int], fresh: list[bool]) -> ForwardBatch:
        rows_a, prefix_a, new_a = (np.array(v, dtype=np.int64) for v in (rows, prefix, new))
        table_lens = self.storage.table.seq_lens[rows_a]
        vtok = self.storage.alloc_extend(rows_a, table_lens + new_a)
        ids = self.storage.iteration_ids(vtok, rows_a)
        runner = self.storage.runner_ids(rows_a)
        return ForwardBatch(
            q_starts=np.concatenate([[0], np.cumsum(new_a)]), prefix_lens=prefix_a, seq_lens=prefix_a + new_a,
            page_size=PAGE, views=self.views, layer_pool=self.layer_pool,
            page_tables={k: torch.as_tensor(v) for k, v in runner.page_tables.items()},
            write_locs={k: torch.as_tensor(v) for k, v in ids.locs.items()},
            state_slots=torch.as_tensor(ids.state_slots, dtype=torch.long), state_fresh=torch.tensor(fresh))


def _schedule() -> list[tuple[list[int], list[int], list[bool]]]:
    """(prefix lens, new lens, fresh) of each step serving all three requests."""
    steps = [([0, 0, 0], [c[0] for c in CHUNKS], [True] * 3),
             ([c[0] for c in CHUNKS], [c[1] for c in CHUNKS], [False] * 3)]
    prompt = [sum(c) for c in CHUNKS]
    steps += [([p + i for p in prompt], [1, 1, 1], [False] * 3) for i in range(DECODES)]
    return steps


def _total(b: int) -> int:
    return sum(CHUNKS[b]) + DECODES


def _diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference; NaN (a garbage slot read) fails here, since max() would drop it."""
    assert ours.shape == ref.shape and torch.isfinite(ours).all() and torch.isfinite(ref).all()
    return (ours - ref).abs().max().item()


def _serve(server: Server, run, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run `run(packed [1, T, ...], batch)` over the schedule; each request's outputs, in order."""
    rows = [server.storage.alloc_row() for _ in CHUNKS]
    outs: list[list[torch.Tensor]] = [[] for _ in CHUNKS]
    for prefix, new, fresh in _schedule():
        batch = server.step(rows, prefix, new, fresh)
        packed = torch.cat([inputs[b][p:p + n] for b, (p, n) in enumerate(zip(prefix, new))])[None]
        out = run(packed, batch)[0]
        for b in range(len(CHUNKS)):
            outs[b].append(out[batch.q_starts[b]:batch.q_starts[b + 1]])
    return [torch.cat(o) for o in outs]


def test_mixer_matches_transformers_on_each_sequence(case):
    config, _model, mixers = case
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(_total(b), config.hidden_size, generator=gen) for b in range(len(CHUNKS))]
    worst, relative = 0.0, 0.0
    with torch.no_grad():
        for module in mixers.values():
            ours = _serve(Server(config), lambda h, batch, m=module: mamba1_forward(m, h, batch), inputs)
            for b, x in enumerate(inputs):
                ref = module(x[None])[0]  # transformers' forward of the whole sequence, no cache
                diff = _diff(ours[b], ref)
                worst, relative = max(worst, diff), max(relative, diff / ref.abs().max().item())
    print(f"mixer max abs diff {worst:.2e} ({relative:.2e} of the largest output)")
    assert relative < TOL


def test_logits_match_one_whole_forward(case):
    config, model, mixers = case
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (_total(b),), generator=gen) for b in range(len(CHUNKS))]
    server = Server(config)
    runner = ModelRunner(copy.deepcopy(model), server.plan)  # kvchain's attention on Jamba's attention layers
    assert runner.mixers == len(mixers)

    def run(packed, batch):
        positions = torch.cat([torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)])
        return runner.logits(batch, packed[0], positions, torch.arange(packed.shape[1]))[None]

    with torch.no_grad():
        ours = _serve(server, run, seqs)
        worst = max(_diff(ours[b], model(input_ids=ids[None], use_cache=False).logits[0])
                    for b, ids in enumerate(seqs))
    print(f"logits max abs diff {worst:.2e}")
    assert worst < TOL


def test_checkpoint_copy_continues_the_request(case):
    config, _model, mixers = case
    module = next(iter(mixers.values()))
    server = Server(config)
    storage = server.storage
    first, second = CHUNKS[1]
    x = torch.randn(first + second + 1, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = module(x[None])[0]
        row = storage.alloc_row()
        mamba1_forward(module, x[None, :first], server.step([row], [0], [first], [True]))
        checkpoint = storage.alloc_state_slots(1)
        storage.copy_state(storage.table.state_slot[[row]], checkpoint)
        # the original request runs on and overwrites its own slot; the checkpoint must not move
        mamba1_forward(module, x[None, first:], server.step([row], [first], [second + 1], [False]))
        restored = storage.alloc_row()
        batch = server.step([restored], [first], [second], [False])
        storage.copy_state(checkpoint, storage.table.state_slot[[restored]])
        out = mamba1_forward(module, x[None, first:first + second], batch)[0]
        decode = mamba1_forward(module, x[None, first + second:],
                                server.step([restored], [first + second], [1], [False]))
    worst = max(_diff(out, ref[first:first + second]), _diff(decode[0], ref[-1:]))
    assert worst < TOL * ref.abs().max().item()


def test_a_call_without_the_batch_is_an_input_error(case):
    _config, model, _mixers = case
    ours_model = copy.deepcopy(model)
    install_state_mixers(ours_model)
    with torch.no_grad(), pytest.raises(InputError, match="kvchain_batch"):
        ours_model(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)


def test_the_batch_reaches_a_mixer_its_block_does_not_pass_it_to(case):
    """transformers' Mamba1 blocks call the mixer without the model's keywords: the batch of the
    model call is relayed, and only while that call runs."""
    config, model, _mixers = case
    ours_model = copy.deepcopy(model)
    install_state_mixers(ours_model)
    server = Server(config)
    batch = server.step([server.storage.alloc_row()], [0], [5], [True])
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
        assert max(_diff(got, torch.stack(want, 1)), _diff(got_state, h)) < 1e-5
    dt[:, -3:] = 0.0
    _, padded = selective_scan(x, dt, a, b, c, h0)
    _, unpadded = selective_scan(x[:, :-3], dt[:, :-3], a, b[:, :-3], c[:, :-3], h0)
    assert _diff(padded, unpadded) < 1e-6
    ones = torch.ones(1, 5, 1)
    assert linear_scan(ones, ones).flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(case):
    """Two prompt chunks of different lengths stepped in one padded bucket: the conv and SSM states
    left in their slots are those of each chunk run alone."""
    config, _model, mixers = case
    layer, module = next(iter(mixers.items()))
    lengths = [3, 9]
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(n, config.hidden_size, generator=gen) for n in lengths]

    def states(batch: ForwardBatch) -> list[torch.Tensor]:
        view = batch.pool_of(layer)
        return [view.state(layer, name)[batch.state_slots].clone() for name in ("conv", "ssm")]

    with torch.no_grad():
        server = Server(config)
        together = server.step([server.storage.alloc_row() for _ in lengths], [0, 0], lengths, [True, True])
        assert [g.length for g in state_groups(together)] == [9]  # one bucket, the short chunk padded
        mamba1_forward(module, torch.cat(inputs)[None], together)
        got = states(together)
        for b, x in enumerate(inputs):
            alone_server = Server(config)
            alone = alone_server.step([alone_server.storage.alloc_row()], [0], [lengths[b]], [True])
            mamba1_forward(module, x[None], alone)
            for ours, want in zip(got, states(alone), strict=True):
                assert _diff(ours[b], want[0]) < 1e-5 * want[0].abs().max().item()
