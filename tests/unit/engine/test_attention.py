"""Paged attention (`engine/attention.py`) against `transformers` itself.

Tiny random Llama, Gemma 3 and gpt-oss models serve several requests packed in one forward through a
real pool (prefill in chunks, a mixed prefill/decode step, decode steps), and their logits must match
each prompt run alone through HF's eager attention. Kernel-level checks cover what the tiny models
cannot make visible: the exact window edge, Gemma 2's softcap and gpt-oss sinks against HF's own
eager functions, and garbage in pages the kernel must never let through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sliding_window_overlay
from transformers.modeling_utils import AttentionInterface
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from kvchain.build import build_kv_storage
from kvchain.engine.attention import ATTENDED, NAME, paged_attention, register
from kvchain.engine.batch import ForwardBatch
from kvchain.errors import InputError
from kvchain.models.registry import model_from_config
from kvchain.plan import PoolKind, plan_kv_storage
from kvchain.sizing import size_plan

TOL = 1e-4
WINDOW = 8
PAGE = 4
_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512)


def _llama() -> LlamaConfig:
    return LlamaConfig(intermediate_size=128, num_hidden_layers=2, **_COMMON)


def _gemma3() -> Gemma3TextConfig:
    return Gemma3TextConfig(intermediate_size=128, num_hidden_layers=4, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"] * 2, **_COMMON)


def _gpt_oss() -> GptOssConfig:
    return GptOssConfig(intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                        **_COMMON)


MODELS = {
    "llama": (_llama, LlamaForCausalLM),
    "gemma3": (_gemma3, Gemma3ForCausalLM),
    "gpt_oss": (_gpt_oss, GptOssForCausalLM),
}


def _model(name: str) -> torch.nn.Module:
    make_config, cls = MODELS[name]
    torch.manual_seed(0)
    model = cls(make_config()).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj"):  # sharper attention so masking mistakes show in the logits
                module.q_proj.weight.mul_(8.0)
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)
    return model


def _set_attention(model: torch.nn.Module, name: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            config._attn_implementation = name


class _Pool:
    """A real pool for `config`, driven as an engine would: one `ForwardBatch` per step."""

    def __init__(self, config) -> None:
        spec = model_from_config(config.to_dict(), kv_dtype="float32")
        self.plan = plan_kv_storage(spec.decls, page_size=PAGE)
        sizing = size_plan(self.plan, 64 * 2**20, context_len=256, max_running_requests=8, state_slots=8)
        self.storage = build_kv_storage(self.plan, sizing, "cpu")
        self.attention = [p for p in self.plan.sub_pools if p.kind in (PoolKind.FULL, PoolKind.WINDOW)]
        self.views = {p.name: self.storage.view(p.name) for p in self.attention}
        self.layer_pool = {layer: p.name for p in self.attention for layer in p.layer_ids}
        self.rows = np.zeros(0, dtype=np.int64)

    def sink(self, pool_name: str) -> int:
        pool = next(p for p in self.attention if p.name == pool_name)
        return int(self.storage.allocator.bands[pool.index].grid.sink_id)

    def batch(self, rows: np.ndarray, new_lens: np.ndarray) -> ForwardBatch:
        prefix = np.array([self.storage.seq_len(r) for r in rows], dtype=np.int64)
        seq = prefix + new_lens
        vtok = self.storage.alloc_extend(rows, seq)
        runner = self.storage.runner_ids(rows)
        step = self.storage.iteration_ids(vtok, rows)
        return ForwardBatch(
            q_starts=np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int64),
            prefix_lens=prefix,
            seq_lens=seq,
            page_size=PAGE,
            views=self.views,
            layer_pool=self.layer_pool,
            page_tables={n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in runner.page_tables.items()},
            write_locs={n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in step.locs.items()},
        )


def _run_step(model, pool: _Pool, rows: np.ndarray, tokens: list[np.ndarray]) -> tuple[ForwardBatch, torch.Tensor]:
    """One packed forward of `tokens[b]` for `rows[b]`: the logits of each request's last new token."""
    new_lens = np.array([len(t) for t in tokens], dtype=np.int64)
    batch = pool.batch(rows, new_lens)
    ids = torch.from_numpy(np.concatenate(tokens)).long()[None]
    pos = torch.from_numpy(np.concatenate([np.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)]))
    keep = torch.from_numpy(batch.q_starts[1:] - 1)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos.long()[None], logits_to_keep=keep, use_cache=False,
                    kvchain_batch=batch)
    return batch, out.logits[0]


# per step, {request: new tokens}: two prompts prefilled in two chunks, then a step mixing their first
# decodes with a third request's whole prompt, then decode steps for all three
PROMPTS = (13, 21, 6)
DECODES = 4
SCHEDULE = [
    {0: 9, 1: 5},
    {0: 4, 1: 16},
    {0: 1, 1: 1, 2: 6},  # two decodes and a whole prompt in one forward
] + [{0: 1, 1: 1, 2: 1}] * DECODES


def _serve(model, config, sequences, *, poison_sinks: bool = False) -> tuple[list[dict[int, torch.Tensor]], _Pool]:
    """Run SCHEDULE; `poison_sinks` fills every attention sub-pool's sink page with NaN bytes before
    each step (retired window columns and padded columns read it)."""
    register()
    _set_attention(model, NAME)
    pool = _Pool(config)
    rows = pool.rows = np.array([pool.storage.alloc_row() for _ in sequences], dtype=np.int64)
    done = [0] * len(sequences)
    results = []
    for step in SCHEDULE:
        reqs = sorted(step)
        if poison_sinks:
            for p in pool.attention:
                pool.views[p.name].pages[pool.sink(p.name)] = 0xFF
        tokens = [sequences[r][done[r]:done[r] + step[r]] for r in reqs]
        _batch, logits = _run_step(model, pool, rows[reqs], tokens)
        for r in reqs:
            done[r] += step[r]
        results.append({r: logits[i] for i, r in enumerate(reqs)})
        pool.storage.advance(rows[reqs])
    _set_attention(model, "eager")
    return results, pool


def _sequences(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, size=n + DECODES + 1) for n in PROMPTS]


def _reference(model, sequences) -> list[torch.Tensor]:
    """Each sequence alone through HF eager attention: logits at every position."""
    _set_attention(model, "eager")
    with torch.no_grad():
        return [model(input_ids=torch.from_numpy(s).long()[None], use_cache=False).logits[0] for s in sequences]


def _check(results, reference) -> float:
    done = [0] * len(reference)
    worst = 0.0
    for step, logits in zip(SCHEDULE, results):
        for r, got in logits.items():
            done[r] += step[r]
            worst = max(worst, float((got - reference[r][done[r] - 1]).abs().max()))
    assert worst < TOL, worst
    return worst


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_chunks_and_decodes_match_transformers(name):
    model = _model(name)
    sequences = _sequences()
    reference = _reference(model, sequences)
    results, _pool = _serve(model, model.config, sequences)
    _check(results, reference)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_retired_window_pages_and_garbage_sink_change_nothing(name):
    """Prompts longer than the window: `advance` retires pages wholly before it, their page-table
    entries then read the sink, which holds NaN bytes; the logits still match HF."""
    model = _model(name)
    sequences = _sequences(seed=2)
    reference = _reference(model, sequences)
    results, pool = _serve(model, model.config, sequences, poison_sinks=True)
    _check(results, reference)
    window = next(p for p in pool.attention if p.kind is PoolKind.WINDOW)
    table = pool.storage.runner_ids(pool.rows).page_tables[window.name]
    seq = np.array([pool.storage.seq_len(r) for r in pool.rows])
    retired = (seq - WINDOW) // PAGE  # columns wholly before the window
    assert retired.max() >= 4
    for b, n in enumerate(retired):
        assert (table[b, :n] == pool.sink(window.name)).all()


class _Attn(torch.nn.Module):
    """The attributes HF's eager functions and ours read from an attention module."""

    def __init__(self, layer_idx: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim
        self.num_key_value_groups = heads // kv_heads
        self.sinks = torch.nn.Parameter(torch.randn(heads) * 2.0)
        self.eval()


def _hf_mask(n: int, window: int | None) -> torch.Tensor:
    """HF's own mask functions, made additive: `[1, 1, n, n]`."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    allowed = causal_mask_function(0, 0, q, k)
    if window is not None:
        allowed = allowed & sliding_window_overlay(window)(0, 0, q, k)
    return torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def _kernel_case(pool_kind: PoolKind, n: int, seed: int = 0):
    """A Gemma 3 pool, one request of `n` tokens in one chunk, random q/k/v for one layer of `pool_kind`."""
    pool = _Pool(_gemma3())
    sub = next(p for p in pool.attention if p.kind is pool_kind)
    pool.rows = np.array([pool.storage.alloc_row()])
    batch = pool.batch(pool.rows, np.array([n]))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=g) * 2.0
    k = torch.randn(1, 2, n, 16, generator=g) * 2.0
    v = torch.randn(1, 2, n, 16, generator=g)
    return pool, sub, batch, _Attn(sub.layer_ids[0], 4, 2, 16), q, k, v


def test_softcap_matches_gemma2_eager():
    n = 11
    _pool, _sub, batch, module, q, k, v = _kernel_case(PoolKind.FULL, n)
    got, _ = paged_attention(module, q, k, v, None, scaling=0.25, softcap=1.5, kvchain_batch=batch)
    want, _ = gemma2_eager(module, q, k, v, _hf_mask(n, None), scaling=0.25, softcap=1.5)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("window", [None, 3, WINDOW])
def test_sinks_and_window_match_gpt_oss_eager(window):
    n = 14
    kind = PoolKind.FULL if window is None else PoolKind.WINDOW
    _pool, _sub, batch, module, q, k, v = _kernel_case(kind, n)
    got, _ = paged_attention(module, q, k, v, None, scaling=0.25, sliding_window=window, s_aux=module.sinks,
                             kvchain_batch=batch)
    want, _ = gpt_oss_eager(module, q, k, v, _hf_mask(n, window), scaling=0.25)
    assert got.shape == (1, n, 4, 16)
    assert (got - want.detach()).abs().max() < 1e-5


def test_window_edge_is_hf_convention():
    """A query at position i sees key j exactly when i - j < window: changing the pool's key at i - window
    changes nothing, at i - window + 1 it changes the output."""
    pool, sub, _batch, module, q, k, v = _kernel_case(PoolKind.WINDOW, 12)
    decode = pool.batch(pool.rows, np.array([1]))  # position 12
    qd, kd, vd = q[:, :, :1], k[:, :, :1], v[:, :, :1]
    view = pool.views[sub.name]
    layer = module.layer_idx
    table = decode.page_tables[sub.name][0]

    def run() -> torch.Tensor:
        return paged_attention(module, qd, kd, vd, None, sliding_window=WINDOW, kvchain_batch=_again(decode))[0]

    # the first call writes position 12 itself; positions 0..11 hold whatever the pool held
    view.k(layer)[table[:3]] = torch.randn(3, PAGE, 2, 16)
    view.v(layer)[table[:3]] = torch.randn(3, PAGE, 2, 16)
    base = run()
    i = 12
    outside, inside = i - WINDOW, i - WINDOW + 1
    # huge but finite values: a slot the request owns holds a real token, never a NaN (ALLOC-20)
    view.v(layer)[table[outside // PAGE], outside % PAGE] = 1e30
    view.k(layer)[table[outside // PAGE], outside % PAGE] = 1e30
    assert torch.equal(run(), base)
    view.v(layer)[table[inside // PAGE], inside % PAGE] += 1.0
    assert not torch.allclose(run(), base)


def _again(batch: ForwardBatch) -> ForwardBatch:
    """`batch` for another forward of the same step (a forward attends each layer once)."""
    batch.__dict__.pop(ATTENDED, None)
    return batch


def test_decode_batch_pads_with_garbage_safely():
    """Decodes of different lengths share one computation, keys padded to the longest; every page of
    the sub-pool the requests do not own (those the padded columns read among them) holds NaN; each
    result equals that request decoded alone. A stale NaN in the unwritten slots of a request's own
    fresh page does reach its output: whole pages are read, and only hand-out zeroing (ALLOC-20)
    keeps those slots clean."""
    pool = _Pool(_gemma3())
    sub = next(p for p in pool.attention if p.kind is PoolKind.FULL)
    module = _Attn(sub.layer_ids[0], 4, 2, 16)
    rows = np.array([pool.storage.alloc_row() for _ in range(3)])
    g = torch.Generator().manual_seed(3)
    lens = np.array([3, 16, 9])
    prefill = pool.batch(rows, lens)
    n = int(lens.sum())
    paged_attention(module, torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g),
                    torch.randn(1, 2, n, 16, generator=g), None, kvchain_batch=prefill)
    decode = pool.batch(rows, np.ones(3, dtype=np.int64))
    table = decode.page_tables[sub.name]
    owned = torch.zeros(pool.views[sub.name].n_pages, dtype=torch.bool)
    for b, n_pages in enumerate((decode.seq_lens + PAGE - 1) // PAGE):
        owned[table[b, :n_pages]] = True
    view = pool.views[sub.name]
    view.pages[~owned] = 0xFF
    q, k, v = (torch.randn(1, h, 3, 16, generator=g) for h in (4, 2, 2))
    together = paged_attention(module, q, k, v, None, kvchain_batch=decode)[0]
    assert torch.isfinite(together).all()
    fresh = table[1, decode.prefix_lens[1] // PAGE]  # request 1's decode starts this page
    stale = view.v(module.layer_idx)[fresh].clone()
    view.v(module.layer_idx)[fresh, 1:] = float("nan")  # past the token the decode writes
    poisoned = paged_attention(module, q, k, v, None, kvchain_batch=_again(decode))[0]
    assert torch.isnan(poisoned[0, 1]).all() and torch.equal(poisoned[0, [0, 2]], together[0, [0, 2]])
    view.v(module.layer_idx)[fresh] = stale
    for b in range(3):
        alone = ForwardBatch(
            q_starts=np.array([0, 1]), prefix_lens=decode.prefix_lens[b:b + 1], seq_lens=decode.seq_lens[b:b + 1],
            page_size=PAGE, views=pool.views, layer_pool=pool.layer_pool,
            page_tables={name: t[b:b + 1] for name, t in decode.page_tables.items()},
            write_locs={name: t[b:b + 1] for name, t in decode.write_locs.items()},
        )
        one = paged_attention(module, q[:, :, b:b + 1], k[:, :, b:b + 1], v[:, :, b:b + 1], None,
                              kvchain_batch=alone)[0]
        assert (one[0, 0] - together[0, b]).abs().max() < 1e-6


def test_register_is_idempotent_and_mask_is_none():
    register()
    register()
    assert AttentionInterface._global_mapping[NAME] is paged_attention
    assert AttentionMaskInterface._global_mapping[NAME]() is None


def test_needs_a_batch():
    module = _Attn(0, 4, 2, 16)
    with pytest.raises(InputError):
        paged_attention(module, torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16), None)
