"""kvchain's RG-LRU block (`engine/rglru.py`) against transformers' own RecurrentGemma modules on the
same weights, in fp32. Three requests packed in one batch (prompts in two chunks of different
lengths, one opening with a single token, then batched decodes), their conv and RG-LRU state in a
real pool whose slots start as NaN bytes, must give transformers' output of each whole sequence in
one forward, at the block and at the logits (local attention through the pool beside it); a state
checkpoint copied to another slot continues the request from there."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.conv_state import state_groups
from kvchain.engine.mixers import check_state_layers_served, install_state_mixers
from kvchain.engine.rglru import linear_recurrence, rglru_forward, rglru_module_types
from kvchain.engine.runner import ModelRunner
from kvchain.engine.tiny import make_model
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")

TOL = 1e-5
PAGE = 4
# per request: two prompt chunks (the third opens with one token: a reset in the decode group),
# then decodes; the sequences run past the tiny model's attention window of 16
CHUNKS = [(3, 17), (21, 2), (1, 12)]
DECODES = 4


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
        vtok = self.storage.alloc_extend(rows_a, self.storage.table.seq_lens[rows_a] + new_a)
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
    return steps + [([p + i for p in prompt], [1, 1, 1], [False] * 3) for i in range(DECODES)]


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


def _whole(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' block over one whole sequence `[L, hidden]`, no cache."""
    positions = torch.arange(x.shape[0])[None]
    out, _ = block(x[None], position_ids=positions, attention_mask=None, use_cache=False)
    return out[0]


def test_block_matches_transformers_on_each_sequence(model, blocks):
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(_total(b), model.config.hidden_size, generator=gen) for b in range(len(CHUNKS))]
    worst = 0.0
    with torch.no_grad():
        for ours, ref in blocks.values():
            served = _serve(Server(model.config), lambda h, batch, m=ours: rglru_forward(m, h, batch), inputs)
            for b, x in enumerate(inputs):
                want = _whole(ref, x)
                worst = max(worst, _diff(served[b], want) / want.abs().max().item())
    print(f"block max diff {worst:.2e} of the largest output")
    assert worst < TOL


def test_logits_match_one_whole_forward(model, blocks):
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, model.config.vocab_size, (_total(b),), generator=gen) for b in range(len(CHUNKS))]
    server = Server(model.config)
    runner = ModelRunner(copy.deepcopy(model), server.plan)
    assert runner.mixers == len(blocks)

    def run(packed, batch):
        positions = torch.cat([torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)])
        return runner.logits(batch, packed[0], positions, torch.arange(packed.shape[1]))[None]

    with torch.no_grad():
        ours = _serve(server, run, seqs)
        worst = max(_diff(ours[b], model(input_ids=ids[None], use_cache=False).logits[0])
                    for b, ids in enumerate(seqs))
    print(f"logits max abs diff {worst:.2e}")
    assert worst < 1e-4


def test_checkpoint_copy_continues_the_request(model, blocks):
    ours, ref = blocks[0]
    server = Server(model.config)
    storage = server.storage
    first, second = 5, 7
    x = torch.randn(first + second + 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _whole(ref, x)
        row = storage.alloc_row()
        rglru_forward(ours, x[None, :first], server.step([row], [0], [first], [True]))
        checkpoint = storage.alloc_state_slots(1)
        storage.copy_state(storage.table.state_slot[[row]], checkpoint)
        # the original request runs on and overwrites its own slot; the checkpoint must not move
        rglru_forward(ours, x[None, first:], server.step([row], [first], [second + 1], [False]))
        restored = storage.alloc_row()
        batch = server.step([restored], [first], [second], [False])
        storage.copy_state(checkpoint, storage.table.state_slot[[restored]])
        out = rglru_forward(ours, x[None, first:first + second], batch)[0]
        decode = rglru_forward(ours, x[None, first + second:], server.step([restored], [first + second], [1], [False]))
    worst = max(_diff(out, want[first:first + second]), _diff(decode[0], want[-1:]))
    assert worst < TOL * want.abs().max().item()


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(model, blocks):
    """Two prompt chunks of different lengths stepped in one padded bucket: the conv and RG-LRU
    states left in their slots are those of each chunk run alone."""
    layer = 1
    ours, _ref = blocks[layer]
    lengths = [3, 9]
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(n, model.config.hidden_size, generator=gen) for n in lengths]

    def states(batch: ForwardBatch) -> list[torch.Tensor]:
        view = batch.pool_of(layer)
        return [view.state(layer, name)[batch.state_slots].clone() for name in ("conv", "rg_lru")]

    with torch.no_grad():
        server = Server(model.config)
        together = server.step([server.storage.alloc_row() for _ in lengths], [0, 0], lengths, [True, True])
        assert [g.length for g in state_groups(together)] == [9]  # one bucket, the short chunk padded
        rglru_forward(ours, torch.cat(inputs)[None], together)
        got = states(together)
        for b, x in enumerate(inputs):
            alone_server = Server(model.config)
            alone = alone_server.step([alone_server.storage.alloc_row()], [0], [lengths[b]], [True])
            rglru_forward(ours, x[None], alone)
            for mine, want in zip(got, states(alone), strict=True):
                assert _diff(mine[b], want[0]) < 1e-6 * want[0].abs().max().item()


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
        assert _diff(linear_recurrence(decay, inputs, h, block), torch.stack(want, 1)) < 1e-5


def test_the_blocks_are_numbered_and_served(model, blocks):
    """transformers' recurrent block keeps no layer index: installing numbers it by its decoder
    layer, so the plan's state layers find their mixers."""
    assert not hasattr(model.model.layers[0].temporal_block, "layer_idx")
    ours = copy.deepcopy(model)
    assert install_state_mixers(ours) == 3
    check_state_layers_served(ours, {0, 1, 3})
    numbered = {m.layer_idx for m in ours.modules() if isinstance(m, rglru_module_types())}
    assert numbered == {0, 1, 3}
