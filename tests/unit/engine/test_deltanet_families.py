"""kvchain's gated-DeltaNet forward (`engine/deltanet.py`) against each transformers gated-DeltaNet
class it serves, on the tiny models of `engine/tiny.py` (fp32, their own weights): three requests
packed in one batch (prompts in two chunks of different lengths, one shorter than the conv window,
then batched decodes), their conv and recurrent state in a real pool planned from the model's
config whose state slots start as NaN bytes, must give the module's own forward on each whole
sequence alone. The families differ in how they split their input projections, in their gate and
norm, and OLMo Hybrid lets beta reach 2 (negative eigenvalues)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.deltanet import deltanet_forward, deltanet_module_types
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.tiny import make_model
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

#: tiny family -> the transformers class of its recurrent mixer
FAMILIES = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5": "Qwen3_5GatedDeltaNet",
    "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "lara_mini": "LaraMiniGatedDeltaNet",
}
TOL = 1e-4
PAGE = 4
# per request: the two prompt chunks (one of a single token, shorter than the conv window), then decodes
CHUNKS = [(3, 6), (9, 2), (1, 5)]
DECODES = 4


def _mixers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    served = deltanet_module_types()
    return {m.layer_idx: m for m in model.modules() if served and isinstance(m, served)}


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    name = FAMILIES[request.param]
    if name not in {cls.__name__ for cls in deltanet_module_types()}:
        pytest.skip(f"this transformers has no {name}")
    return request.param


class _Pool:
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
            state_slots=torch.as_tensor(ids.state_slots, dtype=torch.long),
            state_fresh=torch.tensor(fresh),
        )


def _schedule() -> list[tuple[list[int], list[int], list[bool]]]:
    """(prefix lens, new lens, fresh) of each step serving all three requests."""
    steps = [([0, 0, 0], [c[0] for c in CHUNKS], [True] * 3),
             ([c[0] for c in CHUNKS], [c[1] for c in CHUNKS], [False] * 3)]
    prompt = [sum(c) for c in CHUNKS]
    return steps + [([p + i for p in prompt], [1, 1, 1], [False] * 3) for i in range(DECODES)]


def _serve(pool: _Pool, module: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """kvchain's forward of `module` over the schedule; each request's outputs, in order."""
    rows = [pool.storage.alloc_row() for _ in CHUNKS]
    outs: list[list[torch.Tensor]] = [[] for _ in CHUNKS]
    for prefix, new, fresh in _schedule():
        batch = pool.step(rows, prefix, new, fresh)
        packed = torch.cat([inputs[b][p:p + n] for b, (p, n) in enumerate(zip(prefix, new))])[None]
        out = deltanet_forward(module, packed, batch)[0]
        for b in range(len(CHUNKS)):
            outs[b].append(out[batch.q_starts[b]:batch.q_starts[b + 1]])
    return [torch.cat(o) for o in outs]


def test_every_deltanet_layer_of_the_family_is_installed(family):
    model = make_model(family)
    mixers = _mixers(model)
    assert mixers and {type(m).__name__ for m in mixers.values()} == {FAMILIES[family]}
    assert install_state_mixers(model) == len(mixers)


def test_mixer_matches_the_module_on_each_sequence(family):
    model = make_model(family)
    config = model.config
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(sum(c) + DECODES, config.hidden_size, generator=gen) for c in CHUNKS]
    worst, relative = 0.0, 0.0
    with torch.no_grad():
        for module in _mixers(model).values():
            ours = _serve(_Pool(config), module, inputs)
            for b, x in enumerate(inputs):
                ref = module(x[None])[0]
                assert torch.isfinite(ours[b]).all(), "a NaN slot byte reached the output"
                diff = (ours[b] - ref).abs().max().item()
                worst, relative = max(worst, diff), max(relative, diff / ref.abs().max().item())
    assert worst < TOL and relative < TOL, (worst, relative)


def test_olmo_hybrid_beta_reaches_past_one():
    """OLMo Hybrid's negative eigenvalues: beta = 2 sigmoid(b), so the test above covers steps past 1."""
    from kvchain.engine.deltanet import _project

    model = make_model("olmo_hybrid")
    module = next(iter(_mixers(model).values()))
    assert module.allow_neg_eigval
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        beta = _project(module, x).beta
    assert beta.max() > 1.0 and beta.max() <= 2.0

