"""Models with no full-attention layer (every attention layer windowed: Ministral, Mistral-7B-v0.1;
local attention and RG-LRU state: RecurrentGemma) plan a chain of their window (and state) bands
and a token-id owner that mints the virtual ids the window bands bind their pages to (IDS-3).

The expected bytes are computed here from the config fields: K and V of `num_key_value_heads` x
`head_dim` per attention layer in bf16; for RecurrentGemma's recurrent blocks, the conv1d state of
lru_width x (conv1d_width - 1) in the model dtype and the RG-LRU state of lru_width in float32 (what
transformers' RecurrentGemmaRecurrentBlock allocates: "recurrent_states always computed in full
precision")."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from kvchain.build import build_kv_storage
from kvchain.decl import (
    MHA,
    FullLifetime,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from kvchain.errors import InputError, PlanError
from kvchain.models import model_from_config
from kvchain.plan import TOKEN_OWNER, TOKEN_OWNER_WINDOW_SHARE, Placement, PoolKind, TokenIds, plan_kv_storage
from kvchain.sizing import pages_for, size_plan, window_peak_pages
from support.models import kvchain, plan_of

BF16, FP32 = 2, 4

#: transformers' MinistralConfig defaults (5.x): every layer in `layer_types` slides over 4,096
#: tokens of a 131,072-token context; head_dim is unset (hidden_size / heads = 128).
MINISTRAL = {
    "model_type": "ministral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": None, "sliding_window": 4096, "max_position_embeddings": 131072,
    "layer_types": ["sliding_attention"] * 32,
}

#: mistralai/Mistral-7B-v0.1 config.json: `sliding_window` on every layer, no switch.
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}

#: A RecurrentGemma-2B-shaped config (transformers' RecurrentGemmaConfig field names): 26 layers of
#: the (recurrent, recurrent, attention) pattern, one K/V head of 256 over a 2,048-token window.
RECURRENT_GEMMA = {
    "model_type": "recurrent_gemma", "num_hidden_layers": 26, "hidden_size": 2560, "lru_width": 2560,
    "num_attention_heads": 10, "num_key_value_heads": 1, "head_dim": 256, "attention_window_size": 2048,
    "conv1d_width": 4, "block_types": ["recurrent", "recurrent", "attention"], "torch_dtype": "bfloat16",
}


def attention_token_bytes(cfg: dict, layers: int, tp: int = 1) -> int:
    kv_heads = max(cfg["num_key_value_heads"] // tp, 1)  # fewer K/V heads than ranks: one per rank
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return layers * 2 * kv_heads * head_dim * BF16


def rg_lru_slot_bytes(cfg: dict, layers: int, tp: int = 1) -> int:
    width = cfg["lru_width"] // tp
    return layers * (width * (cfg["conv1d_width"] - 1) * BF16 + width * FP32)


def recurrent_gemma_layers(cfg: dict) -> tuple[int, int]:
    """(attention layers, recurrent layers): the block pattern repeats over the layers."""
    blocks = [cfg["block_types"][i % len(cfg["block_types"])] for i in range(cfg["num_hidden_layers"])]
    return blocks.count("attention"), blocks.count("recurrent")


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("cfg", [MINISTRAL, MISTRAL_7B_V01], ids=["ministral", "mistral-7b-v0.1"])
def test_all_window_models_plan_their_window_bytes(cfg, tp):
    plan = plan_of(cfg, tp_size=tp)
    assert [p.name for p in plan.sub_pools] == ["window4096", TOKEN_OWNER]
    window = plan.by_name("window4096")
    assert window.unit_bytes == attention_token_bytes(cfg, 32, tp)
    assert window.layer_ids == tuple(range(32)) and plan.state is None
    if tp == 1:
        assert window.unit_bytes == 32 * 2 * 8 * 128 * 2 == 131072


@pytest.mark.parametrize("tp", [1, 2])
def test_recurrent_gemma_plans_its_window_and_rg_lru_state_bytes(tp):
    plan = plan_of(RECURRENT_GEMMA, tp_size=tp)
    attention, recurrent = recurrent_gemma_layers(RECURRENT_GEMMA)
    assert (attention, recurrent) == (8, 18)
    assert [p.name for p in plan.sub_pools] == ["state", "window2048", TOKEN_OWNER]
    assert plan.by_name("window2048").unit_bytes == attention_token_bytes(RECURRENT_GEMMA, attention, tp)
    assert plan.state.unit_bytes == rg_lru_slot_bytes(RECURRENT_GEMMA, recurrent, tp)
    assert plan.by_name("window2048").layer_ids == tuple(range(2, 26, 3))
    if tp == 1:
        assert plan.state.geometry.describe() == "State[conv[2560, 3] bfloat16, rg_lru[2560] float32]"
        assert plan.state.unit_bytes == 18 * (2560 * 3 * 2 + 2560 * 4) == 460800


def test_recurrent_gemma_defaults_and_bad_blocks():
    """Without lru_width the channels are hidden_size, as transformers sets them; the default
    pattern is (recurrent, recurrent, attention) over a 2,048-token window and a width-4 conv."""
    bare = {k: v for k, v in RECURRENT_GEMMA.items()
            if k not in ("lru_width", "block_types", "attention_window_size", "conv1d_width")}
    assert plan_of(bare).state.unit_bytes == plan_of(RECURRENT_GEMMA).state.unit_bytes
    assert plan_of(bare).windows[0].window == 2048
    with pytest.raises(InputError, match="'block_types'"):
        model_from_config({**RECURRENT_GEMMA, "block_types": ["recurrent", "mlp"]})
    with pytest.raises(InputError, match="'lru_width'"):
        model_from_config(RECURRENT_GEMMA, tp_size=3)
    only_recurrent = plan_of({**RECURRENT_GEMMA, "block_types": ["recurrent"]})
    assert [p.name for p in only_recurrent.sub_pools] == ["state", TOKEN_OWNER]


# ---------------------------------------------------------------- the chain (DECL-4, IDS-3)


WINDOW = KVPart(MHA(1, 8), WindowLifetime(16))
STATE = KVPart(State((StateTensor("ssm", (4, 4), "float32"),)), StateLifetime())


def test_a_window_only_chain_gets_a_token_id_owner_DECL_4():
    """DECL-4: with no full-attention layer the plan still ends in a full-lifetime owner: the
    token-id owner (no layers, no KV bytes) at the grow-down end, windows before it (DECL-6)."""
    plan = plan_kv_storage(kv_layer_decls([WINDOW, [WINDOW, STATE]]), page_size=4)
    assert [p.name for p in plan.sub_pools] == ["state", "window16", TOKEN_OWNER]
    owner = plan.owner
    assert owner.kind is PoolKind.FULL and owner.lifetime == FullLifetime() and owner.layer_ids == ()
    assert isinstance(owner.geometry, TokenIds) and owner.unit_bytes == 0
    assert owner.placement is Placement.DOWN_END
    assert [plan.sub_pools[i].name for i in plan.tree_slots] == [TOKEN_OWNER, "window16", "state"]
    # a window page of 4 tokens x 2 layers x K,V of 8 bf16 is 256 bytes; the owner's page its share
    assert plan.by_name("window16").page_bytes == 256
    assert owner.page_bytes == max(16, -(-256 // TOKEN_OWNER_WINDOW_SHARE // 16) * 16) == 16
    big = plan_of(MINISTRAL)
    assert big.owner.page_bytes == big.windows[0].page_bytes // TOKEN_OWNER_WINDOW_SHARE == 32768


def test_a_plan_without_an_owner_is_refused_DECL_4(monkeypatch):
    """DECL-4: with the token-id owner not added, a window-only plan lacks a full-attention owner
    and `plan_kv_storage` refuses it."""
    decls = kv_layer_decls([WINDOW, [WINDOW, STATE]])
    monkeypatch.setattr(sys.modules[plan_kv_storage.__module__], "_add_token_owner", lambda groups: None)
    with pytest.raises(PlanError, match="full-attention owner"):
        plan_kv_storage(decls)


def test_a_chain_with_full_attention_gets_no_token_owner():
    plan = plan_kv_storage(kv_layer_decls([WINDOW, KVPart(MHA(1, 8), FullLifetime())]))
    assert TOKEN_OWNER not in [p.name for p in plan.sub_pools] and plan.owner.name == "full"


def test_a_window_only_storage_binds_window_pages_to_the_owner_ids_and_returns_every_page_IDS_3():
    """IDS-3 with a zero-byte owner: the window band binds its pages to the token-id owner's
    virtual pages; advancing retires the rows' pages behind the window (they read the sink,
    IDS-4), and freeing the rows returns every page of both bands."""
    plan = plan_kv_storage(kv_layer_decls([WINDOW, WINDOW]), page_size=4)
    probe = size_plan(plan, 2**30, context_len=64, max_running_requests=4)
    sizing = size_plan(plan, probe.floor.one_request + 2**16, context_len=64, max_running_requests=4)
    storage = build_kv_storage(plan, sizing, "cpu")
    rows = [storage.alloc_row() for _ in range(3)]
    vtok = storage.alloc_extend(np.array(rows), np.array([40, 9, 25]))
    assert len(vtok) == 74 and len(set(vtok.tolist())) == 74
    window, owner = storage.allocator.bands[plan.by_name("window16").index], storage.allocator.owner
    assert storage.advance(np.array(rows)) > 0
    tables = storage.runner_ids(np.array(rows)).page_tables
    retired = storage.table.window_lo[rows, 0].tolist()
    assert retired[0] > 0 and retired[2] > 0  # 40 and 25 tokens hold pages wholly behind the window
    bound = []
    for i, row in enumerate(rows):
        pages = storage.table.pages_of(row)
        physical = tables["window16"][i][: len(pages)]
        assert (physical[: retired[i]] == window.grid.sink_id).all()
        assert (physical[retired[i]:] != window.grid.sink_id).all()
        assert physical[retired[i]:].tolist() == storage.physical_pages("window16", pages[retired[i]:]).tolist()
        assert (tables[TOKEN_OWNER][i][: len(pages)] != owner.grid.sink_id).all()
        bound += physical[retired[i]:].tolist()
    assert len(bound) == len(set(bound)) == storage.allocator.band_counts()["window16"]["live"]
    for _ in range(20):
        storage.alloc_decode(np.array(rows))
        storage.advance(np.array(rows))
    storage.free_rows(np.array(rows))
    storage.check_idle()
    counts = storage.allocator.band_counts()
    assert counts["window16"]["live"] == counts[TOKEN_OWNER]["live"] == 0


# ---------------------------------------------------------------- sizing


def test_sizing_a_window_only_chain_is_bounded_by_its_window_rows_DECL_10():
    """DECL-10: a token costs the owner no KV, but its window rows do: the concurrency is the
    requests at the full context whose window rows (and owner id pages) fit, not the free ids."""
    plan = plan_of(MINISTRAL)
    window, owner = plan.windows[0], plan.owner
    context = 32768
    sizing = size_plan(plan, 80 * 2**30, context_len=context, max_running_requests=256)
    per_request = (window_peak_pages(4096, 64) * window.page_bytes + pages_for(context, 64) * owner.page_bytes)
    chain = sizing.arena_bytes - sizing.sink_bytes
    assert sizing.limited_by == "tokens"
    assert sizing.concurrency * per_request <= chain < (sizing.concurrency + 1) * per_request
    assert 100 < sizing.concurrency < 256  # 80 GiB of 520 MiB window rows each
    assert sizing.full_tokens >= sizing.concurrency * context


def test_a_window_only_owner_boots_with_every_row_at_full_context_when_windows_are_to_spare():
    plan = plan_of(MINISTRAL)
    sizing = size_plan(plan, 80 * 2**30, context_len=32768, max_running_requests=16)
    assert sizing.full_tokens == 16 * 32768
    assert (sizing.concurrency, sizing.limited_by) == (16, "max running requests")


def test_recurrent_gemma_sizing_serves_as_many_requests_as_its_slots_and_windows_allow():
    plan = plan_of(RECURRENT_GEMMA)
    sizing = size_plan(plan, 8 * 2**30, context_len=8192, max_running_requests=1024)
    served = sizing.full_tokens // 8192
    assert sizing.concurrency == min(served, sizing.state_slots) > 0
    window = plan.windows[0]
    assert sizing.target(window.name).pages <= served * window_peak_pages(2048, 64) + window_peak_pages(2048, 64)


# ---------------------------------------------------------------- the command line


def test_kvchain_plan_prints_the_window_band_and_the_token_owner(tmp_path):
    config = tmp_path / "ministral.json"
    config.write_text(json.dumps(MINISTRAL))
    out = kvchain("plan", "--config", str(config), "--budget", "8GiB", "--context", "32768", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    chain = report["plan"]["chain"]
    assert [p["name"] for p in chain] == ["window4096", TOKEN_OWNER]
    assert chain[0]["unit_bytes"] == 131072 and chain[1]["unit_bytes"] == 0
    sizing = report["sizing"]
    assert sizing["limited_by"] == "tokens" and 0 < sizing["concurrency"] < 20  # 8 GiB / 520 MiB


def test_kvchain_simulate_serves_a_window_only_model(tmp_path):
    """Every default pool serves a window-only model: the uniform-page layouts keep the token-id
    owner's own pages (it has no layers to group)."""
    config = tmp_path / "mistral.json"
    config.write_text(json.dumps({**MISTRAL_7B_V01, "num_hidden_layers": 2}))
    out = kvchain("simulate", "--config", str(config), "--budget", "256MiB", "--requests", "4", "--jobs", "1",
                  "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    assert [r["pool"] for r in results] == ["kvchain", "vllm-hybrid", "sglang-static", "ideal"]
    assert all(r["finished"] == 4 and r["aborted"] == r["rejected"] == 0 for r in results)


def test_recurrent_gemma_checkpoints_weigh_its_state_against_its_window_bytes():
    """The token-id owner holds no KV, so the default checkpoint interval weighs a state slot
    against the window's bytes per token: 460,800 / 8,192 is 56 tokens, a tenth of that rounds up
    to one page; a slot of 1,440 window tokens' weight takes half a chat turn (250 tokens, 4 pages)."""
    from kvchain.cache.checkpoints import default_checkpoint_interval

    assert default_checkpoint_interval(plan_of(RECURRENT_GEMMA)) == 64
    wide = plan_of({**RECURRENT_GEMMA, "lru_width": 2560 * 256})
    tokens = min(250, wide.state.page_bytes // attention_token_bytes(RECURRENT_GEMMA, 8) // 10)
    assert tokens == 250 and default_checkpoint_interval(wide) == 4 * 64
