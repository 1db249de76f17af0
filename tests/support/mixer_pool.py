"""The harness the recurrent-mixer tests share (`tests/unit/engine/test_state_mixers.py`,
`test_deltanet_families.py`, `test_mamba1.py`, `test_mamba2_families.py`, `test_rglru.py`,
`test_lightning.py`): a real pool whose state slots start as NaN bytes, requests packed into
`ForwardBatch` steps over a schedule of chunked prompts then decodes, and the checks every family
is held to against transformers on the same weights (each sequence served batched, a copied state
checkpoint, a padded bucket). What differs between families (the model, its mixers and forward, the
reference, the chunk lengths, the tolerances) is a parameter, so each test file keeps its own bounds."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.conv_state import state_groups
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.runner import ModelRunner
from kvchain.errors import InputError
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

PAGE = 4

#: kvchain's forward of one mixer: packed hidden states `[1, T, hidden]` and the step's batch to its output
Run = Callable[[torch.Tensor, ForwardBatch], torch.Tensor]
#: transformers' output for one whole sequence `[L, hidden]`, no cache
Reference = Callable[[torch.Tensor], torch.Tensor]


class MixerPool:
    """A real pool planned from a model's config, its state slots filled with NaN bytes, and the
    steps that pack requests into `ForwardBatch`es. NaN rather than zeros, so a mixer that reads a
    fresh request's slot instead of starting from zero, or a slot it never wrote, fails `diff`
    instead of passing by luck; every state tensor is float32, so fp32 references hold it to fp32
    tolerances. Each layer names one sub-pool in `layer_pool`, as `ModelRunner` builds it: a
    Falcon-H1 layer (attention and state) names its attention sub-pool.

    `config` is a transformers config, or the dict to plan from where that is not the model's own
    (`test_state_mixers.py` appends an attention layer to own the page ids)."""

    def __init__(self, config) -> None:
        spec = model_from_config(config if isinstance(config, dict) else config.to_dict(), kv_dtype="float32")
        self.plan = plan_kv_storage(list(spec.decls), page_size=PAGE)
        sizing = size_plan(self.plan, 64 * 2**20, context_len=256, max_running_requests=8, state_slots=8)
        self.storage = build_kv_storage(self.plan, sizing, "cpu")
        self.views = {sp.name: self.storage.view(sp.name) for sp in self.plan.sub_pools}
        self.layer_pool = {layer: sp.name for sp in self.plan.sub_pools for layer in sp.layer_ids}
        for sp in self.plan.sub_pools:
            if sp.kind is PoolKind.STATE:
                self.views[sp.name].pages.fill_(0xFF)  # every float read of these bytes is NaN
                for comp in sp.envelope.components:
                    assert self.views[sp.name].state(comp.layer_id, comp.name).dtype == torch.float32

    def step(self, rows: list[int], prefix: list[int], new: list[int], fresh: list[bool]) -> ForwardBatch:
        """The batch of one step: `new` tokens after `prefix` for each of `rows`; a `fresh` request's
        state starts from zeros, not from its slot."""
        rows_a, prefix_a, new_a = (np.array(v, dtype=np.int64) for v in (rows, prefix, new))
        vtok = self.storage.alloc_extend(rows_a, self.storage.table.seq_lens[rows_a] + new_a)
        ids = self.storage.iteration_ids(vtok, rows_a)
        runner = self.storage.runner_ids(rows_a)
        return ForwardBatch(
            q_starts=np.concatenate([[0], np.cumsum(new_a)]), prefix_lens=prefix_a, seq_lens=prefix_a + new_a,
            page_size=PAGE, views=self.views, layer_pool=self.layer_pool,
            page_tables={k: torch.as_tensor(v) for k, v in runner.page_tables.items()},
            write_locs={k: torch.as_tensor(v) for k, v in ids.locs.items()},
            state_slots=torch.as_tensor(ids.state_slots, dtype=torch.long),
            state_fresh=torch.tensor(fresh),
        )


@dataclass(frozen=True)
class Schedule:
    """Requests served together in one batch: each prompt in the two chunks of `chunks` (the first
    step fresh, the second carrying its state on), then `decodes` steps of one token each. The chunk
    lengths are the family's: what they must cross (a conv window, an attention window, a block)."""

    chunks: tuple[tuple[int, int], ...]
    decodes: int = 4

    def steps(self) -> list[tuple[list[int], list[int], list[bool]]]:
        """(prefix lens, new lens, fresh) of each step serving every request."""
        n = len(self.chunks)
        steps = [([0] * n, [c[0] for c in self.chunks], [True] * n),
                 ([c[0] for c in self.chunks], [c[1] for c in self.chunks], [False] * n)]
        prompt = [sum(c) for c in self.chunks]
        return steps + [([p + i for p in prompt], [1] * n, [False] * n) for i in range(self.decodes)]

    def total(self, b: int) -> int:
        """Tokens request `b` holds at the end."""
        return sum(self.chunks[b]) + self.decodes

    def hidden_inputs(self, hidden: int, seed: int) -> list[torch.Tensor]:
        """One random `[total, hidden]` input per request, for a mixer alone."""
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(self.total(b), hidden, generator=gen) for b in range(len(self.chunks))]

    def token_inputs(self, vocab: int, seed: int) -> list[torch.Tensor]:
        """One random `[total]` token sequence per request, for the whole model."""
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (self.total(b),), generator=gen) for b in range(len(self.chunks))]


#: prompt chunks around the conv window: one of a single token, several shorter than the window
CONV_SCHEDULE = Schedule(((3, 6), (9, 2), (1, 5)))


def diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference; NaN (a garbage slot read) fails here, since max() would drop it."""
    assert ours.shape == ref.shape and torch.isfinite(ours).all() and torch.isfinite(ref).all()
    return (ours - ref).abs().max().item()


def positions(batch: ForwardBatch) -> torch.Tensor:
    """The packed tokens' positions: each request's from its prefix length on."""
    return torch.cat([torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)])


def serve(pool: MixerPool, run: Run, inputs: Sequence[torch.Tensor],
          schedule: Schedule) -> list[torch.Tensor]:
    """`run` over the schedule, the requests packed in each step's batch; each request's outputs,
    in order. `inputs[b]` holds request `b`'s whole sequence (hidden states or token ids)."""
    rows = [pool.storage.alloc_row() for _ in schedule.chunks]
    outs: list[list[torch.Tensor]] = [[] for _ in schedule.chunks]
    for prefix, new, fresh in schedule.steps():
        batch = pool.step(rows, prefix, new, fresh)
        packed = torch.cat([inputs[b][p:p + n] for b, (p, n) in enumerate(zip(prefix, new))])[None]
        out = run(packed, batch)[0]
        for b in range(len(schedule.chunks)):
            outs[b].append(out[batch.q_starts[b]:batch.q_starts[b + 1]])
    return [torch.cat(o) for o in outs]


def mixer_gap(config, mixers: Iterable[tuple[Run, Reference]], hidden: int,
              schedule: Schedule) -> tuple[float, float]:
    """Each mixer served over `schedule` from a fresh pool (random inputs of width `hidden`), against
    its reference on each whole sequence alone: the max abs difference, and the max of it relative
    to the largest reference output (small-init weights give small outputs, where an absolute bound
    alone is loose)."""
    inputs = schedule.hidden_inputs(hidden, seed=1)
    worst, relative = 0.0, 0.0
    with torch.no_grad():
        for run, reference in mixers:
            served = serve(MixerPool(config), run, inputs, schedule)
            for b, x in enumerate(inputs):
                want = reference(x)
                gap = diff(served[b], want)
                worst, relative = max(worst, gap), max(relative, gap / want.abs().max().item())
    print(f"mixer max abs diff {worst:.2e} ({relative:.2e} of the largest output)")
    return worst, relative


def runner_logits_gap(model: torch.nn.Module, n_mixers: int, schedule: Schedule) -> float:
    """`ModelRunner` on a copy of `model` (kvchain's attention beside kvchain's `n_mixers` mixers)
    served over `schedule` on random tokens, against transformers' one uncached forward of each
    whole sequence: the max abs logit difference."""
    seqs = schedule.token_inputs(model.config.vocab_size, seed=2)
    pool = MixerPool(model.config)
    runner = ModelRunner(copy.deepcopy(model), pool.plan)
    assert runner.mixers == n_mixers

    def run(packed, batch):
        return runner.logits(batch, packed[0], positions(batch), torch.arange(packed.shape[1]))[None]

    with torch.no_grad():
        ours = serve(pool, run, seqs, schedule)
        worst = max(diff(ours[b], model(input_ids=ids[None], use_cache=False).logits[0])
                    for b, ids in enumerate(seqs))
    print(f"logits max abs diff {worst:.2e}")
    return worst


def checkpoint_gap(config, run: Run, reference: Reference, hidden: int, first: int,
                   second: int) -> tuple[float, float]:
    """A request's state after `first` tokens copied to a checkpoint slot; the request runs on and
    overwrites its own slot, which must leave the checkpoint as it was; a new row restored from the
    checkpoint serves the next `second` tokens, then one decode. The max abs difference from the
    reference on the whole sequence, and that reference's largest output (for a relative bound)."""
    pool = MixerPool(config)
    storage = pool.storage
    x = torch.randn(first + second + 1, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(x)
        row = storage.alloc_row()
        run(x[None, :first], pool.step([row], [0], [first], [True]))
        checkpoint = storage.alloc_state_slots(1)
        storage.copy_state(storage.table.state_slot[[row]], checkpoint)
        run(x[None, first:], pool.step([row], [first], [second + 1], [False]))
        restored = storage.alloc_row()
        batch = pool.step([restored], [first], [second], [False])
        storage.copy_state(checkpoint, storage.table.state_slot[[restored]])
        out = run(x[None, first:first + second], batch)[0]
        decode = run(x[None, first + second:], pool.step([restored], [first + second], [1], [False]))
    worst = max(diff(out, want[first:first + second]), diff(decode[0], want[-1:]))
    print(f"checkpoint max abs diff {worst:.2e}")
    return worst, want.abs().max().item()


def slot_states(batch: ForwardBatch, layer: int, names: Sequence[str]) -> list[torch.Tensor]:
    """Copies of `layer`'s state tensors `names` in the batch's slots, one row per request."""
    view = batch.pool_of(layer)
    return [view.state(layer, name)[batch.state_slots].clone() for name in names]


def assert_bucket_leaves_each_state_alone(config, run: Run, layer: int, names: Sequence[str], hidden: int,
                                          rel_tol: float) -> None:
    """Two prompt chunks of different lengths stepped in one padded bucket: the states `names` of
    `layer` left in their slots are those of each chunk run alone, within `rel_tol` of the largest
    value (states are small). Held on the states themselves, since an output term (Mamba's D skip)
    can dwarf a state error."""
    lengths = [3, 9]
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(n, hidden, generator=gen) for n in lengths]
    with torch.no_grad():
        pool = MixerPool(config)
        together = pool.step([pool.storage.alloc_row() for _ in lengths], [0, 0], lengths, [True, True])
        assert [g.length for g in state_groups(together)] == [9]  # one bucket, the short chunk padded
        run(torch.cat(inputs)[None], together)
        got = slot_states(together, layer, names)
        for b, x in enumerate(inputs):
            alone_pool = MixerPool(config)
            alone = alone_pool.step([alone_pool.storage.alloc_row()], [0], [lengths[b]], [True])
            run(x[None], alone)
            for ours, want in zip(got, slot_states(alone, layer, names), strict=True):
                assert diff(ours[b], want[0]) < rel_tol * want[0].abs().max().item()


def assert_needs_the_batch(model: torch.nn.Module) -> None:
    """A copy of `model` with kvchain's mixers installed, called without `kvchain_batch`: one
    InputError naming it, not a forward on no state."""
    ours = copy.deepcopy(model)
    install_state_mixers(ours)
    with torch.no_grad(), pytest.raises(InputError, match="kvchain_batch"):
        ours(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)


def delta_inputs(seed: int, per_channel: bool = False, n: int = 2, length: int = 37, heads: int = 3, dk: int = 8,
                 dv: int = 5) -> tuple[torch.Tensor, ...]:
    """Random inputs of the delta-rule scans (`deltanet.gated_delta_scan`): normalised q and k, v,
    a log decay per head (or per key channel: slow and fast channels), beta and a non-zero state.
    The default length crosses several blocks and ends mid-block."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(rand(n, length, heads, dk), dim=-1)
    k = torch.nn.functional.normalize(rand(n, length, heads, dk), dim=-1)
    v = rand(n, length, heads, dv)
    g = -rand(n, length, heads, dk).abs() * torch.linspace(0.01, 3.0, dk) if per_channel \
        else -rand(n, length, heads).abs()
    return q, k, v, g, rand(n, length, heads).sigmoid(), rand(n, heads, dk, dv)

