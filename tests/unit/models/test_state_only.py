"""Models that keep only recurrent state (Mamba, Falcon-Mamba, Mamba2, an all-Mamba Bamba) plan a
chain of their state band and a token-id owner that mints the virtual ids with no KV bytes.

The expected bytes are computed here from the config fields the way serving engines size Mamba
state: a conv state of (kernel - 1) x conv channels in the model dtype, and an SSM state in float32
(the dtype kvchain gives every SSM state)."""

from __future__ import annotations

import json
import re

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
from kvchain.errors import BudgetError, InputError
from kvchain.models import model_from_config
from kvchain.plan import TOKEN_OWNER, Placement, PoolKind, TokenIds, plan_kv_storage
from kvchain.sizing import size_plan
from support.models import kvchain, plan_of

BF16, FP32 = 2, 4

# tiiuae/falcon-mamba-7b config.json, as copied verbatim (linking the published file) in
# sdpython/experimental-experiment, experimental_experiment/torch_models/llm_model_helper.py
# (`get_falcon_mamba_7b`). Its `expand` of 16 disagrees with intermediate_size 8192 = 2 x 4096;
# transformers and the engines size the mixer by intermediate_size.
FALCON_MAMBA_7B = {
    "architectures": ["FalconMambaForCausalLM"], "conv_kernel": 4, "expand": 16, "hidden_size": 4096,
    "intermediate_size": 8192, "model_type": "falcon_mamba", "num_hidden_layers": 64, "state_size": 16,
    "time_step_rank": 256, "torch_dtype": "bfloat16", "use_conv_bias": True, "vocab_size": 65024,
}

#: A Mamba2 model at a small scale (the transformers Mamba2Config field names).
MAMBA2 = {
    "model_type": "mamba2", "num_hidden_layers": 4, "hidden_size": 256, "expand": 2, "num_heads": 8,
    "head_dim": 64, "n_groups": 2, "state_size": 32, "conv_kernel": 4, "torch_dtype": "bfloat16",
}


def mamba1_slot_bytes(cfg: dict, tp: int = 1) -> int:
    inner = cfg["intermediate_size"] // tp
    conv = inner * (cfg["conv_kernel"] - 1) * BF16
    ssm = inner * cfg["state_size"] * FP32
    return cfg["num_hidden_layers"] * (conv + ssm)


def mamba2_slot_bytes(cfg: dict, tp: int = 1) -> int:
    groups = max(cfg["n_groups"] // tp, 1)  # one group replicated per rank when there are fewer
    heads = cfg["num_heads"] // tp
    conv = (heads * cfg["head_dim"] + 2 * groups * cfg["state_size"]) * (cfg["conv_kernel"] - 1) * BF16
    ssm = heads * cfg["head_dim"] * cfg["state_size"] * FP32
    return cfg["num_hidden_layers"] * (conv + ssm)



# ---------------------------------------------------------------- bytes


def test_falcon_mamba_7b_slot_bytes_equal_the_config_reading():
    plan = plan_of(FALCON_MAMBA_7B)
    state = plan.state
    # 64 layers x (conv 8192 x 3 x 2 bytes + ssm 8192 x 16 x 4 bytes)
    assert state.unit_bytes == mamba1_slot_bytes(FALCON_MAMBA_7B) == 64 * (49152 + 524288) == 36700160
    assert state.geometry.describe() == "State[conv[8192, 3] bfloat16, ssm[8192, 16] float32]"
    assert state.layer_ids == tuple(range(64))
    assert plan_of(FALCON_MAMBA_7B, tp_size=2).state.unit_bytes == mamba1_slot_bytes(FALCON_MAMBA_7B, 2)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mamba2_slot_bytes_equal_the_config_reading(tp):
    assert plan_of(MAMBA2, tp_size=tp).state.unit_bytes == mamba2_slot_bytes(MAMBA2, tp)


def test_mamba1_without_intermediate_size_reads_expand_times_hidden():
    cfg = {k: v for k, v in FALCON_MAMBA_7B.items() if k != "intermediate_size"}
    cfg["expand"] = 2
    assert plan_of(cfg).state.unit_bytes == mamba1_slot_bytes(FALCON_MAMBA_7B)


def test_mamba_configs_that_cannot_be_read_are_named():
    def message(cfg, **kwargs):
        with pytest.raises(InputError) as info:
            model_from_config(cfg, **kwargs)
        return str(info.value)

    assert "'state_size'" in message({k: v for k, v in FALCON_MAMBA_7B.items() if k != "state_size"})
    assert "'num_heads'" in message({**MAMBA2, "head_dim": 32})  # 8 x 32 != 2 x 256
    assert "'num_heads'" in message(MAMBA2, tp_size=16)  # 8 heads over 16 ranks
    assert "'conv_kernel'" in message({**MAMBA2, "conv_kernel": 1})


# ---------------------------------------------------------------- the chain


def test_a_state_only_chain_gets_a_token_id_owner_DECL_4():
    """DECL-4: a plan always has a full-attention owner; with only state declared, it is a token-id
    owner of no layers and no KV bytes, at the grow-down end, after the state band (DECL-6)."""
    plan = plan_of(FALCON_MAMBA_7B)
    assert [p.name for p in plan.sub_pools] == ["state", TOKEN_OWNER]
    owner = plan.owner
    assert owner.kind is PoolKind.FULL and owner.lifetime == FullLifetime()
    assert isinstance(owner.geometry, TokenIds) and owner.layer_ids == ()
    assert owner.unit_bytes == 0 and owner.envelope.payload_bytes == 0 and owner.page_bytes == 16
    assert owner.placement is Placement.DOWN_END and plan.state.placement is Placement.UP_END
    assert [plan.sub_pools[i].name for i in plan.tree_slots] == [TOKEN_OWNER, "state"]


def test_windows_without_a_full_attention_layer_get_the_token_id_owner_too_DECL_4():
    """DECL-4: the token-id owner stands in wherever no layer has full attention, windows included
    (their bands bind pages to its ids); `test_window_only.py` holds the refusal without it."""
    state = KVPart(State((StateTensor("ssm", (4, 4), "float32"),)), StateLifetime())
    window = KVPart(MHA(1, 8), WindowLifetime(16))
    assert plan_kv_storage(kv_layer_decls([window, [window, state]])).owner.name == TOKEN_OWNER
    assert plan_kv_storage(kv_layer_decls([state, state])).owner.name == TOKEN_OWNER


def test_sizing_a_state_only_chain_is_bounded_by_its_state_slots_DECL_10():
    """DECL-10/11: state slots are spent before tokens; a token costs nothing, so the concurrency
    is what the state slots serve, and an explicit slot count is kept."""
    plan = plan_of(FALCON_MAMBA_7B)
    sizing = size_plan(plan, 8 * 2**30, context_len=8192, max_running_requests=1024)
    assert sizing.limited_by == "state slots"
    per_slot = plan.state.page_bytes
    chain = sizing.arena_bytes - sizing.sink_bytes
    assert sizing.concurrency == sizing.state_slots
    # every slot the budget holds, less the gap the chain keeps between its two sub-pools
    assert sizing.state_slots == (chain - per_slot) // per_slot
    assert sizing.full_tokens >= sizing.concurrency * 8192
    explicit = size_plan(plan, 8 * 2**30, context_len=8192, max_running_requests=1024, state_slots=40)
    assert (explicit.state_slots, explicit.concurrency, explicit.limited_by) == (40, 40, "state slots")


def test_a_token_id_owner_boots_with_what_the_request_rows_use():
    """Its ids cost no KV, so its boot target is every row at the full context, not the leftover
    bytes, and a budget with slots to spare is bounded by the request rows."""
    plan = plan_of(FALCON_MAMBA_7B)
    sizing = size_plan(plan, 80 * 2**30, context_len=32768, max_running_requests=256)
    assert sizing.full_tokens == 256 * 32768
    assert (sizing.state_slots, sizing.concurrency, sizing.limited_by) == (256, 256, "max running requests")
    assert sizing.to_dict()["unused_bytes"] > 60 * 2**30


def test_a_state_only_storage_serves_requests_and_returns_every_page():
    """The chain's allocator runs a state-only plan: rows take virtual ids from the token-id owner
    and a slot from the state band's own id space (IDS-5), and give both back."""
    decls = model_from_config({**MAMBA2, "hidden_size": 64, "num_heads": 2, "head_dim": 64}).decls
    plan = plan_kv_storage(decls, page_size=4)
    probe = size_plan(plan, 2**30, context_len=64, max_running_requests=4, state_slots=4)
    sizing = size_plan(plan, probe.floor.one_request + 5 * plan.state.page_bytes, context_len=64,
                       max_running_requests=4, state_slots=4)
    storage = build_kv_storage(plan, sizing, "cpu")
    rows = [storage.alloc_row() for _ in range(3)]
    vtok = storage.alloc_extend(np.array(rows), np.array([10, 3, 7]))
    assert len(vtok) == 20 and len(set(vtok.tolist())) == 20
    slots = storage.table.state_slot[rows]
    assert len(set(slots.tolist())) == 3
    storage.free_rows(np.array(rows))
    storage.check_idle()
    counts = storage.allocator.band_counts()
    assert counts["state"]["live"] == counts[TOKEN_OWNER]["live"] == 0


def test_a_state_only_storage_too_large_for_its_id_arrays_is_refused_in_one_line():
    plan = plan_of(FALCON_MAMBA_7B)
    sizing = size_plan(plan, 8 * 2**30, context_len=8192, max_running_requests=64)
    with pytest.raises(BudgetError) as info:
        build_kv_storage(plan, sizing, "meta")
    assert "virtual pages" in str(info.value) and "\n" not in str(info.value)
    # the budget it names builds, and a page past it is refused: the figure is the budget's, not
    # the arena's (which leaves out the fixed allocations)
    limit = int(re.search(r"a budget of at most ([\d,]+)", str(info.value)).group(1).replace(",", ""))
    build_kv_storage(plan, size_plan(plan, limit, context_len=8192, max_running_requests=64), "meta")
    with pytest.raises(BudgetError):
        build_kv_storage(plan, size_plan(plan, limit + 2**20, context_len=8192, max_running_requests=64), "meta")


# ---------------------------------------------------------------- the command line



def test_kvchain_plan_prints_the_state_slots_and_the_token_owner(tmp_path):
    config = tmp_path / "falcon-mamba-7b.json"
    config.write_text(json.dumps(FALCON_MAMBA_7B))
    out = kvchain("plan", "--config", str(config), "--budget", "8GiB", "--context", "8192", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    chain = report["plan"]["chain"]
    assert [p["name"] for p in chain] == ["state", TOKEN_OWNER]
    assert chain[0]["unit_bytes"] == 36700160 and chain[1]["unit_bytes"] == 0
    sizing = report["sizing"]
    assert sizing["limited_by"] == "state slots" and sizing["concurrency"] == sizing["state_slots"] > 0

    text = kvchain("plan", "--config", str(config), "--budget", "8GiB", "--context", "8192")
    assert text.returncode == 0, text.stderr
    assert "token ids (no KV)" in text.stdout and "state slots" in text.stdout
    assert "token ids (no full-attention layer)" in text.stdout and "full-attention tokens" not in text.stdout

    sim = kvchain("simulate", "--config", str(config), "--budget", "8GiB", "--requests", "10")
    assert sim.returncode == 2 and "only recurrent state" in sim.stderr
    assert len(sim.stderr.strip().splitlines()) == 1
