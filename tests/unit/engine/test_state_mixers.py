"""kvchain's recurrent mixers (`engine/deltanet.py`, `engine/mamba2.py`) against transformers' own
modules on the same weights, in fp32: three requests packed in one batch (prompts in two chunks of
different lengths, then batched decodes), their conv and SSM state in a real pool whose slots start
as garbage, must give HF's outputs for each sequence run alone, at the mixer and at the logits; a
state checkpoint copied to another slot continues the request from there."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvchain.build import build_kv_storage
from kvchain.engine.batch import ForwardBatch
from kvchain.engine.conv_state import state_groups
from kvchain.engine.deltanet import deltanet_forward, gated_delta_chunked, gated_delta_scan
from kvchain.engine.mamba2 import mamba2_forward, ssd_scan
from kvchain.engine.mixers import install_state_mixers
from kvchain.errors import InputError
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

TOL = 1e-4
PAGE = 4
# per request: the two prompt chunks (one of a single token, shorter than the conv window), then decodes
CHUNKS = [(3, 6), (9, 2), (1, 5)]
DECODES = 4


def _qwen3_next() -> object:
    return qwen3_next.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        layer_types=["linear_attention"] * 4, dtype="float32",
    )


def _nemotron_h() -> object:
    # chunk_size 4: HF's chunked scan crosses block boundaries within a prompt chunk (ours takes blocks of
    # at least `mamba2.MIN_BLOCK`; its block crossings are held in test_blocked_scans_match_the_token_by_token_recurrence)
    return nemotron_h.NemotronHConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        hybrid_override_pattern="M-M-", mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
        max_position_embeddings=512, chunk_size=4, dtype="float32",
    )


MODELS = {
    "qwen3_next": (_qwen3_next, qwen3_next.Qwen3NextForCausalLM, "linear_attn", deltanet_forward),
    "nemotron_h": (_nemotron_h, nemotron_h.NemotronHForCausalLM, "mixer", mamba2_forward),
}


@pytest.fixture(params=sorted(MODELS))
def case(request):
    make_config, model_cls, attr, forward = MODELS[request.param]
    config = make_config()
    assert config.dtype in (torch.float32, "float32")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    mixers = {i: getattr(layer, attr) for i, layer in enumerate(model.model.layers)
              if hasattr(layer, attr) and hasattr(getattr(layer, attr), "conv1d")}
    return config, model, mixers, forward


def _with_attention_layer(cfg: dict) -> dict:
    """The config as the pool plans it: one full-attention layer appended past the model's (the
    parser refuses a model whose layers all keep state, since an attention layer owns the ids)."""
    cfg = dict(cfg)
    for key, attention in (("layer_types", "full_attention"), ("layers_block_type", "attention")):
        if cfg.get(key):
            cfg[key] = [*cfg[key], attention]
    if cfg.get("hybrid_override_pattern"):
        cfg["hybrid_override_pattern"] += "*"
    if "num_hidden_layers" in cfg:
        cfg["num_hidden_layers"] += 1
    return cfg


class Server:
    """A real pool from the model's config, its state slots filled with NaN bytes, and the steps that
    pack requests into `ForwardBatch`es. The mixers' layers hold only state, so the chain gets one
    extra full-attention layer (id past the model's) to own the virtual page ids."""

    def __init__(self, config) -> None:
        spec = model_from_config(_with_attention_layer(config.to_dict()), kv_dtype="float32")
        decls = list(spec.decls)
        self.plan = plan_kv_storage(decls, page_size=PAGE)
        sizing = size_plan(self.plan, 64 * 2**20, context_len=256, max_running_requests=8, state_slots=8)
        self.storage = build_kv_storage(self.plan, sizing, "cpu")
        self.views = {sp.name: self.storage.view(sp.name) for sp in self.plan.sub_pools}
        self.layer_pool = {layer: sp.name for sp in self.plan.sub_pools for layer in sp.layer_ids}
        for sp in self.plan.sub_pools:
            if sp.kind is PoolKind.STATE:
                self.views[sp.name].pages.fill_(0xFF)  # every float read of these bytes is NaN
                for layer in sp.layer_ids:
                    assert self.views[sp.name].state(layer, "conv").dtype == torch.float32

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
            state_slots=torch.as_tensor(ids.state_slots, dtype=torch.long),
            state_fresh=torch.tensor(fresh),
        )


def _schedule() -> list[tuple[list[int], list[int], list[bool]]]:
    """(prefix lens, new lens, fresh) of each step serving all three requests."""
    steps = [([0, 0, 0], [c[0] for c in CHUNKS], [True] * 3),
             ([c[0] for c in CHUNKS], [c[1] for c in CHUNKS], [False] * 3)]
    prompt = [sum(c) for c in CHUNKS]
    steps += [([p + i for p in prompt], [1, 1, 1], [False] * 3) for i in range(DECODES)]
    return steps


def _diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference; NaN (a garbage slot read) fails here, since max() would drop it."""
    assert ours.shape == ref.shape and torch.isfinite(ours).all() and torch.isfinite(ref).all()
    return (ours - ref).abs().max().item()


def _total(b: int) -> int:
    return sum(CHUNKS[b]) + DECODES


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


def test_mixer_matches_hf_on_each_sequence(case):
    config, _model, mixers, forward = case
    server = Server(config)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(_total(b), config.hidden_size, generator=gen) for b in range(len(CHUNKS))]
    worst, relative = 0.0, 0.0
    with torch.no_grad():
        for module in mixers.values():
            ours = _serve(server, lambda h, batch, m=module: forward(m, h, batch), inputs)
            for b, x in enumerate(inputs):
                ref = module(x[None])[0]
                diff = _diff(ours[b], ref)
                worst, relative = max(worst, diff), max(relative, diff / ref.abs().max().item())
            server = Server(config)
    print(f"mixer max abs diff {worst:.2e} ({relative:.2e} of the largest output)")
    # small-init weights give small outputs, so the absolute bound alone would be loose
    assert worst < TOL and relative < TOL


def _hf_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """HF alone on one sequence: a prefill of the prompt, then one decode step at a time with its cache.
    The masks are given (none: one unpadded sequence) since HF cannot build them from a cache that
    holds only recurrent layers."""
    masks = {"full_attention": None, "linear_attention": None}
    out = model(input_ids=ids[None, :prompt], position_ids=torch.arange(prompt)[None], attention_mask=masks,
                use_cache=True)
    logits, cache = [out.logits[0]], out.cache
    for t in range(prompt, len(ids)):
        out = model(input_ids=ids[None, t:t + 1], position_ids=torch.tensor([[t]]), attention_mask=masks,
                    cache=cache, use_cache=True)
        logits.append(out.logits[0])
        cache = out.cache
    return torch.cat(logits)


def test_logits_match_hf_on_each_sequence(case):
    config, model, mixers, _forward = case
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (_total(b),), generator=gen) for b in range(len(CHUNKS))]
    ours_model = copy.deepcopy(model)
    assert install_state_mixers(ours_model) == len(mixers)
    server = Server(config)

    def run(packed, batch):
        positions = torch.cat([torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)])
        return ours_model(input_ids=packed, position_ids=positions[None], use_cache=False, kvchain_batch=batch).logits

    with torch.no_grad():
        ours = _serve(server, run, seqs)
        worst = 0.0
        for b, ids in enumerate(seqs):
            ref = _hf_logits(model, ids, sum(CHUNKS[b]))
            worst = max(worst, _diff(ours[b], ref))
    print(f"logits max abs diff {worst:.2e}")
    assert worst < TOL


def test_checkpoint_copy_continues_the_request(case):
    config, _model, mixers, forward = case
    module = next(iter(mixers.values()))
    server = Server(config)
    storage = server.storage
    first, second = CHUNKS[1]
    x = torch.randn(first + second + 1, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = module(x[None])[0]
        row = storage.alloc_row()
        forward(module, x[None, :first], server.step([row], [0], [first], [True]))
        checkpoint = storage.alloc_state_slots(1)
        storage.copy_state(storage.table.state_slot[[row]], checkpoint)
        # the original request runs on and overwrites its own slot; the checkpoint must not move
        forward(module, x[None, first:], server.step([row], [first], [second + 1], [False]))
        restored = storage.alloc_row()
        batch = server.step([restored], [first], [second], [False])
        storage.copy_state(checkpoint, storage.table.state_slot[[restored]])
        out = forward(module, x[None, first:first + second], batch)[0]
        decode = forward(module, x[None, first + second:], server.step([restored], [first + second], [1], [False]))
    worst = max(_diff(out, ref[first:first + second]), _diff(decode[0], ref[-1:]))
    print(f"checkpoint max abs diff {worst:.2e}")
    assert worst < TOL


def test_missing_batch_is_an_input_error(case):
    _config, model, _mixers, _forward = case
    ours_model = copy.deepcopy(model)
    install_state_mixers(ours_model)
    with torch.no_grad(), pytest.raises(InputError, match="kvchain_batch"):
        ours_model(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)


def test_blocked_scans_match_the_token_by_token_recurrence():
    """The block forms of both recurrences against stepping one token at a time, over a length that
    crosses several blocks and ends mid-block, from a non-zero state."""
    gen = torch.Generator().manual_seed(4)
    n, length, heads, dk, dv = 2, 37, 3, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(rand(n, length, heads, dk), dim=-1)
    k = torch.nn.functional.normalize(rand(n, length, heads, dk), dim=-1)
    v, g, beta = rand(n, length, heads, dv), -rand(n, length, heads).abs(), rand(n, length, heads).sigmoid()
    state = rand(n, heads, dk, dv)
    want, want_state = gated_delta_scan(q, k, v, g, beta, state)
    got, got_state = gated_delta_chunked(q, k, v, g, beta, state, block=8)
    assert max(_diff(got, want), _diff(got_state, want_state)) < 1e-5

    x, dt, b, c = rand(n, length, heads, dv), rand(n, length, heads).exp(), rand(n, length, heads, dk), \
        rand(n, length, heads, dk)
    a, h0 = -rand(heads).abs(), rand(n, heads, dv, dk)
    want, want_state = ssd_scan(x, dt, a, b, c, h0, block=1)
    got, got_state = ssd_scan(x, dt, a, b, c, h0, block=8)
    assert max(_diff(got, want), _diff(got_state, want_state)) < 1e-4


def _states(batch: ForwardBatch, layer: int) -> list[torch.Tensor]:
    view = batch.pool_of(layer)
    return [view.state(layer, name)[batch.state_slots].clone() for name in ("conv", "ssm")]


def test_a_padded_bucket_leaves_every_state_as_its_chunk_alone(case):
    """Two prompt chunks of different lengths stepped in one padded bucket: the conv and SSM states
    left in their slots are those of each chunk run alone. Held on the states themselves, since the
    D skip can dwarf a state error in the outputs."""
    config, _model, mixers, forward = case
    layer, module = next(iter(mixers.items()))
    lengths = [3, 9]
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(n, config.hidden_size, generator=gen) for n in lengths]
    with torch.no_grad():
        server = Server(config)
        rows = [server.storage.alloc_row() for _ in lengths]
        together = server.step(rows, [0, 0], lengths, [True, True])
        assert [g.length for g in state_groups(together)] == [9]  # one bucket, the short chunk padded
        forward(module, torch.cat(inputs)[None], together)
        got = _states(together, layer)
        for b, x in enumerate(inputs):
            alone_server = Server(config)
            alone = alone_server.step([alone_server.storage.alloc_row()], [0], [lengths[b]], [True])
            forward(module, x[None], alone)
            for ours, want in zip(got, _states(alone, layer), strict=True):
                assert _diff(ours[b], want[0]) < 1e-4 * want[0].abs().max().item()  # relative: states are small
