"""kvchain's lightning attention (`engine/lightning.py`) against transformers' own MiniMax modules on
the same weights, in fp32. Three requests packed in one batch (prompts in two chunks of different
lengths, one opening with a single token, then batched decodes), their KV state in a real pool
whose slots start as NaN bytes, must give transformers' output of each whole sequence in one
forward (its own blocks of 16 crossed within a sequence), at the mixer and at the logits (softmax
attention through the pool beside it); a state checkpoint copied to another slot continues the
request from there."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.conv_state import state_groups
from kvchain.engine.lightning import (
    lightning_chunked,
    lightning_forward,
    lightning_module_types,
    lightning_step,
)
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.runner import ModelRunner
from kvchain.engine.tiny import make_model
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

pytest.importorskip("transformers.models.minimax.modeling_minimax")

TOL = 1e-5
PAGE = 4
# per request: two prompt chunks (the third opens with one token, a decode-group step from zeros),
# then decodes; the first chunks end inside transformers' first block of 16, the sequences past it
CHUNKS = [(3, 17), (21, 2), (1, 12)]
DECODES = 4


@pytest.fixture(scope="module")
def model():
    return make_model("minimax", seed=0)


@pytest.fixture(scope="module")
def mixers(model):
    found = {m.layer_idx: m for m in model.modules() if isinstance(m, lightning_module_types())}
    assert sorted(found) == [0, 2, 3]
    return found


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


def _whole(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' lightning attention over one whole sequence `[L, hidden]`, no cache."""
    out, _state = module(hidden_states=x[None], position_embeddings=None, attention_mask=None)
    return out[0]


def test_mixer_matches_transformers_on_each_sequence(model, mixers):
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(_total(b), model.config.hidden_size, generator=gen) for b in range(len(CHUNKS))]
    worst = 0.0
    with torch.no_grad():
        for module in mixers.values():
            served = _serve(Server(model.config), lambda h, batch, m=module: lightning_forward(m, h, batch), inputs)
            for b, x in enumerate(inputs):
                want = _whole(module, x)
                worst = max(worst, _diff(served[b], want) / want.abs().max().item())
    print(f"mixer max diff {worst:.2e} of the largest output")
    assert worst < TOL


def test_logits_match_one_whole_forward(model, mixers):
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, model.config.vocab_size, (_total(b),), generator=gen) for b in range(len(CHUNKS))]
    server = Server(model.config)
    runner = ModelRunner(copy.deepcopy(model), server.plan)
    assert runner.mixers == len(mixers)

    def run(packed, batch):
        positions = torch.cat([torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)])
        return runner.logits(batch, packed[0], positions, torch.arange(packed.shape[1]))[None]

    with torch.no_grad():
        ours = _serve(server, run, seqs)
        worst = max(_diff(ours[b], model(input_ids=ids[None], use_cache=False).logits[0])
                    for b, ids in enumerate(seqs))
    print(f"logits max abs diff {worst:.2e}")
    assert worst < 1e-4


def test_checkpoint_copy_continues_the_request(model, mixers):
    module = mixers[0]
    server = Server(model.config)
    storage = server.storage
    first, second = 5, 19
    x = torch.randn(first + second + 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _whole(module, x)
        row = storage.alloc_row()
        lightning_forward(module, x[None, :first], server.step([row], [0], [first], [True]))
        checkpoint = storage.alloc_state_slots(1)
        storage.copy_state(storage.table.state_slot[[row]], checkpoint)
        # the original request runs on and overwrites its own slot; the checkpoint must not move
        lightning_forward(module, x[None, first:], server.step([row], [first], [second + 1], [False]))
        restored = storage.alloc_row()
        batch = server.step([restored], [first], [second], [False])
        storage.copy_state(checkpoint, storage.table.state_slot[[restored]])
        out = lightning_forward(module, x[None, first:first + second], batch)[0]
        decode = lightning_forward(module, x[None, first + second:],
                                   server.step([restored], [first + second], [1], [False]))
    worst = max(_diff(out, want[first:first + second]), _diff(decode[0], want[-1:]))
    assert worst < TOL * want.abs().max().item()


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(model, mixers):
    """Two prompt chunks of different lengths stepped in one padded bucket: the KV state left in
    each slot is that of its chunk run alone (the pads neither decay it nor add to it)."""
    layer = 0
    module = mixers[layer]
    lengths = [3, 9]
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(n, model.config.hidden_size, generator=gen) for n in lengths]

    def state(batch: ForwardBatch) -> torch.Tensor:
        return batch.pool_of(layer).state(layer, "ssm")[batch.state_slots].clone()

    with torch.no_grad():
        server = Server(model.config)
        together = server.step([server.storage.alloc_row() for _ in lengths], [0, 0], lengths, [True, True])
        assert [g.length for g in state_groups(together)] == [9]  # one bucket, the short chunk padded
        lightning_forward(module, torch.cat(inputs)[None], together)
        got = state(together)
        for b, x in enumerate(inputs):
            alone_server = Server(model.config)
            alone = alone_server.step([alone_server.storage.alloc_row()], [0], [lengths[b]], [True])
            lightning_forward(module, x[None], alone)
            want = state(alone)
            assert _diff(got[b], want[0]) < 1e-6 * want[0].abs().max().item()


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
        assert max(_diff(got, torch.cat(want, 1)), _diff(got_state, stepped)) < 1e-4


def test_install_pairs_the_output_as_the_layer_unpacks_it(model, mixers):
    ours = copy.deepcopy(model)
    assert install_state_mixers(ours) == len(mixers)
    server = Server(model.config)
    batch = server.step([server.storage.alloc_row()], [0], [4], [True])
    x = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out, weights = ours.model.layers[0].self_attn(hidden_states=x, position_embeddings=None,
                                                      attention_mask=None, kvchain_batch=batch)
    assert weights is None and _diff(out, _whole(mixers[0], x[0])[None]) < TOL
