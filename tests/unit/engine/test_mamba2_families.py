"""kvchain's one Mamba2 forward (`engine/mamba2.py`) against transformers' own mixers of every family
it serves, on the same weights in fp32: Bamba, Granite 4.0-H, pure Mamba2 and Falcon-H1 (its mup
multipliers, and its gated norm before the gate, after it, or absent). Three requests packed in one
batch (prompts in two chunks of different lengths, then batched decodes), their conv and SSM state
in a real pool whose slots start as NaN bytes, must give transformers' output of each whole
sequence in one forward, at the mixer and at the logits; a state checkpoint copied to another slot
continues the request from there. Nemotron-H's mixer is held the same way in `test_state_mixers.py`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.mamba2 import mamba2_forward, mamba2_module_types
from kvchain.engine.mixers import install_state_mixers, served_mixer_types
from kvchain.engine.runner import ModelRunner
from kvchain.engine.tiny import make_model
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

TOL = 1e-4
PAGE = 4
# per request: the two prompt chunks (one of a single token, shorter than the conv window), then decodes
CHUNKS = [(3, 6), (9, 2), (1, 5)]
DECODES = 4

#: case -> (tiny family, overrides). transformers' scan chunk is 4, so its chunked scan crosses chunk
#: boundaries inside a prompt (kvchain's scans whole blocks of at least `mamba2.MIN_BLOCK`)
CASES = {
    "bamba": ("bamba", {"mamba_chunk_size": 4}),
    # time steps clamped on both sides: the tiny weights give softplus(dt) from about 0.1 to 4
    "granitemoehybrid": ("granitemoehybrid", {"mamba_chunk_size": 4, "time_step_limit": (0.3, 1.5)}),
    "mamba2": ("mamba2", {"chunk_size": 4}),
    "falcon_h1": ("falcon_h1", {"mamba_chunk_size": 4}),
    "falcon_h1_norm_after_gate": ("falcon_h1", {"mamba_chunk_size": 4, "mamba_norm_before_gate": False}),
    "falcon_h1_no_norm": ("falcon_h1", {"mamba_chunk_size": 4, "mamba_rms_norm": False}),
}


def _mixers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {m.layer_idx: m for m in model.modules() if isinstance(m, mamba2_module_types())}


def _vary_vectors(model: torch.nn.Module, seed: int) -> None:
    """Move the mixers' vectors (dt bias, A_log, D, norm weight, conv bias) off their init values
    (ones, log 1..H, zeros), which would hide a dropped or misplaced one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in _mixers(model).values():
            for _name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
                if param.ndim == 1:
                    param.add_(0.3 * torch.randn(param.shape, generator=gen))


@pytest.fixture(params=sorted(CASES))
def case(request):
    family, overrides = CASES[request.param]
    model = make_model(family, seed=0, **overrides)
    _vary_vectors(model, seed=5)
    mixers = _mixers(model)
    assert mixers and all(p.dtype == torch.float32 for p in model.parameters())
    return model.config, model, mixers


class Server:
    """A real pool planned from the model's config, its state slots filled with NaN bytes, and the
    steps that pack requests into `ForwardBatch`es. Each layer names one sub-pool, as `ModelRunner`
    builds it: a Falcon-H1 layer (attention and state) names its attention sub-pool."""

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


def test_the_engine_serves_every_mamba2_hybrid():
    names = {cls.__name__ for cls in mamba2_module_types()}
    assert {"NemotronHMamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "Mamba2Mixer",
            "FalconH1Mixer"} <= names
    assert set(mamba2_module_types()) <= set(served_mixer_types())


def test_mixer_matches_transformers_on_each_sequence(case):
    config, _model, mixers = case
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(_total(b), config.hidden_size, generator=gen) for b in range(len(CHUNKS))]
    worst, relative = 0.0, 0.0
    with torch.no_grad():
        for module in mixers.values():
            ours = _serve(Server(config), lambda h, batch, m=module: mamba2_forward(m, h, batch), inputs)
            for b, x in enumerate(inputs):
                ref = module(x[None])[0]  # transformers' forward of the whole sequence, no cache
                diff = _diff(ours[b], ref)
                worst, relative = max(worst, diff), max(relative, diff / ref.abs().max().item())
    print(f"mixer max abs diff {worst:.2e} ({relative:.2e} of the largest output)")
    assert relative < TOL


def test_logits_match_one_whole_forward(case):
    """The whole model on the pool (kvchain's attention beside the mixers, the family's multipliers
    around them) against transformers' one uncached forward of each sequence."""
    config, model, mixers = case
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (_total(b),), generator=gen) for b in range(len(CHUNKS))]
    server = Server(config)
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
        mamba2_forward(module, x[None, :first], server.step([row], [0], [first], [True]))
        checkpoint = storage.alloc_state_slots(1)
        storage.copy_state(storage.table.state_slot[[row]], checkpoint)
        # the original request runs on and overwrites its own slot; the checkpoint must not move
        mamba2_forward(module, x[None, first:], server.step([row], [first], [second + 1], [False]))
        restored = storage.alloc_row()
        batch = server.step([restored], [first], [second], [False])
        storage.copy_state(checkpoint, storage.table.state_slot[[restored]])
        out = mamba2_forward(module, x[None, first:first + second], batch)[0]
        decode = mamba2_forward(module, x[None, first + second:],
                                server.step([restored], [first + second], [1], [False]))
    worst = max(_diff(out, ref[first:first + second]), _diff(decode[0], ref[-1:]))
    assert worst < TOL * ref.abs().max().item()


def test_a_hybrid_model_gets_one_kvchain_mixer_per_mamba_layer():
    model = make_model("bamba")
    assert install_state_mixers(model) == len(_mixers(model)) == 2
