"""kvchain's short conv (`engine/shortconv.py`) against transformers' LFM3 and LFM2 modules on the
same weights, in fp32: three requests packed in one batch (prompts in two chunks, one of them a
single token, shorter than the conv window; then batched decodes), their conv state in a real pool
whose slots start as NaN bytes, must give the module's output for each sequence run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.shortconv import shortconv_forward, shortconv_module_types
from kvchain.engine.tiny import make_model, tiny_config
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

lfm3 = pytest.importorskip("transformers.models.lfm3.modeling_lfm3")
lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")

PAGE = 4
CHUNKS = [(3, 6), (9, 2), (1, 5)]  # per request: two prompt chunks, then DECODES single tokens
DECODES = 4


def _module(kind: str) -> torch.nn.Module:
    config = tiny_config("lfm3")
    torch.manual_seed(0)
    if kind == "lfm3":
        module = lfm3.Lfm3ShortConv(config, 0)
    else:
        cfg2 = lfm2.Lfm2Config(hidden_size=config.hidden_size, conv_L_cache=config.conv_L_cache,
                               num_hidden_layers=1, layer_types=["conv"])
        module = lfm2.Lfm2ShortConv(cfg2, 0)
    return module.float().eval()


def _storage():
    config = tiny_config("lfm3")
    plan = plan_kv_storage(model_from_config(config.to_dict(), kv_dtype="float32").decls, page_size=PAGE)
    sizing = size_plan(plan, 64 * 2**20, context_len=256, max_running_requests=8, state_slots=8)
    storage = build_kv_storage(plan, sizing, "cpu")
    views = {sp.name: storage.view(sp.name) for sp in plan.sub_pools}
    for sp in plan.sub_pools:
        if sp.kind is PoolKind.STATE:
            views[sp.name].pages.fill_(0xFF)  # every float read of these bytes is NaN
    return storage, views, {layer: sp.name for sp in plan.sub_pools for layer in sp.layer_ids}


@pytest.mark.parametrize("kind", ["lfm3", "lfm2"])
def test_shortconv_matches_hf_on_each_sequence(kind):
    module = _module(kind)
    assert isinstance(module, shortconv_module_types())
    storage, views, layer_pool = _storage()
    hidden = module.in_proj.in_features
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(sum(c) + DECODES, hidden, generator=gen) for c in CHUNKS]
    rows = np.array([storage.alloc_row() for _ in CHUNKS], dtype=np.int64)
    prompt = [sum(c) for c in CHUNKS]
    steps = [([0] * 3, [c[0] for c in CHUNKS], True), ([c[0] for c in CHUNKS], [c[1] for c in CHUNKS], False)]
    steps += [([p + i for p in prompt], [1, 1, 1], False) for i in range(DECODES)]
    outs: list[list[torch.Tensor]] = [[] for _ in CHUNKS]
    with torch.no_grad():
        for prefix, new, fresh in steps:
            prefix_a, new_a = np.array(prefix), np.array(new)
            vtok = storage.alloc_extend(rows, storage.table.seq_lens[rows] + new_a)
            ids = storage.iteration_ids(vtok, rows)
            batch = ForwardBatch(q_starts=np.concatenate([[0], np.cumsum(new_a)]), prefix_lens=prefix_a,
                                 seq_lens=prefix_a + new_a, page_size=PAGE, views=views, layer_pool=layer_pool,
                                 state_slots=torch.as_tensor(ids.state_slots, dtype=torch.long),
                                 state_fresh=torch.tensor([fresh] * 3))
            packed = torch.cat([inputs[b][p:p + n] for b, (p, n) in enumerate(zip(prefix, new))])[None]
            out = shortconv_forward(module, packed, batch)[0]
            for b in range(len(CHUNKS)):
                outs[b].append(out[batch.q_starts[b]:batch.q_starts[b + 1]])
        worst = 0.0
        for b, x in enumerate(inputs):
            ours, ref = torch.cat(outs[b]), module(x[None])[0]
            assert torch.isfinite(ours).all()
            worst = max(worst, (ours - ref).abs().max().item() / ref.abs().max().item())
    print(f"short conv max diff {worst:.2e} of the largest output")
    assert worst < 1e-5


def test_install_finds_every_lfm3_conv_layer():
    model = make_model("lfm3")
    conv_layers = sum(t == "conv" for t in model.config.layer_types)
    assert install_state_mixers(model) == conv_layers == 2
