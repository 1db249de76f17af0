"""A rank's shard of a checkpoint's weights, split as tensor-parallel engines split them.

Every layer is split by heads or by inner rows, so a rank computes its own heads end to end and
writes only their keys, values and state into its own pool; the one layer that mixes the heads
back (an attention's or a mixer's output projection, an MLP's down projection, the experts'
down projections) keeps this rank's columns and sums its partial output over the ranks with an
all-reduce. What stays whole on every rank: embeddings, norms over the hidden size, routers, the
shared expert's gate, Zamba2's shared MLP (gate and up fused, with its adapters), the head. The
kinds of layer split (the recurrent mixers' splits in `tp_mixers.py`, the pieces they are cut with
in `tp_parts.py`):

- attention (q/k/v/o projections): by query and key-value heads (values as wide as the module's
  `v_proj` gives them: MiMo-V2-Flash's are narrower than its keys); a gated query (`q_proj` twice as
  wide, each head's query followed by its gate), a per-head output gate and attention sinks split
  with their heads; a q/k norm over every head's channels at once (OLMo's) keeps this rank's
  weights and sums its mean square over the ranks; a shared block run at several layers (Zamba's,
  Zamba2's) splits at each, and Zamba2's per-use LoRA adapters keep their up-projection's rows;
- multi-head latent attention (DeepSeek-V2/V3 and its kin): by query heads (with Bailing's and
  HY-V4's output gates and HY-V4's sinks), the latent whole on every rank (its pool holds all of it, as
  `models/deepseek.py` plans);
- dense MLPs: gate/up (or up alone) by rows, down by columns;
- MoE experts (fused 3-D weights, GPT-OSS's, Qwen3-Next's and Llama 4's layouts): every expert's
  inner rows, the summed output reduced;
- Mamba2 mixers (Nemotron-H, Bamba, Granite 4.0-H, Mamba2, Falcon-H1, Zamba2): by groups of heads, with their
  z, x, B, C and dt projections, conv channels, per-head decay, skip and norm weights (Falcon-H1's
  mup multipliers with their rows, its gated norm's group count this rank's);
- Mamba1 mixers (Mamba, Falcon-Mamba, Jamba): by inner channels, with their x and z projections,
  conv channels, dt projection, decay and skip; `x_proj` reads every channel, so its dt, B and C
  are summed over the ranks before their norms and `dt_proj`;
- gated DeltaNet mixers (Qwen3-Next, Qwen3.5, Lara Mini, OLMo Hybrid): by key heads, with their value
  heads, conv channels, gates and decay, however the mixer lays out its input projections;
- Kimi Delta Attention: by heads, with their conv channels, forget gate, beta and output gate;
- short convolutions (LFM): by hidden channels, with their B, C and x projections;
- MiniMax's lightning attention: by heads, with their decay slopes and output gate; its norm over
  every head's channels sums its mean square over the ranks;
- RecurrentGemma's RG-LRU: by heads (its gates are block-diagonal), with their x and y branches,
  conv channels and recurrence parameter;
- Zamba's per-head Mamba: by heads, each with its own `x_proj` and `dt_proj`.

Each rank's state shapes are then those `model_from_config(..., tp_size=N)` plans for it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..decl import KVLayerDecl, Unit
from ..engine.conv_state import transformers_classes
from ..engine.latent import latent_module
from ..engine.mixers import layer_in_name, served_mixer_types
from ..errors import InputError
from . import tp_mixers
from .tp_parts import (
    SplitRMSNorm,
    blocks,
    columns,
    parameter,
    reduced,
    rows,
    spans_heads,
    split,
)


def _value_dim(module: torch.nn.Module) -> int:
    """An attention's value width per head: `head_dim`, or MiMo-V2-Flash's narrower `v_head_dim`."""
    return module.v_proj.out_features // (module.k_proj.out_features // int(module.head_dim))


def _attention(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    head_dim, v_dim = int(module.head_dim), _value_dim(module)
    kv_heads = module.k_proj.out_features // head_dim
    out = _attention_out(module)
    heads = getattr(module, out).in_features // v_dim
    per_head = module.q_proj.out_features // heads  # head_dim, or twice it for a gated query
    h, kvh = split(heads, n, "attention heads"), split(kv_heads, n, "key-value heads")
    module.q_proj = rows(blocks(rank, h, per_head), module.q_proj)
    module.k_proj = rows(blocks(rank, kvh, head_dim), module.k_proj)
    module.v_proj = rows(blocks(rank, kvh, v_dim), module.v_proj)
    setattr(module, out, columns(blocks(rank, h, v_dim), getattr(module, out), rank, group))
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        module.sinks = parameter(module.sinks[rank * h:(rank + 1) * h])
    if isinstance(getattr(module, "g_proj", None), torch.nn.Linear):  # LFM's per-head output gate
        module.g_proj = rows(blocks(rank, h, 1), module.g_proj)
    for name, index in (("q_norm", blocks(rank, h, head_dim)), ("k_norm", blocks(rank, kvh, head_dim))):
        norm = getattr(module, name, None)
        if spans_heads(norm, head_dim):
            setattr(module, name, SplitRMSNorm(norm, index, group))
    for name, index in (("q", blocks(rank, h, per_head)), ("k", blocks(rank, kvh, head_dim)),
                        ("v", blocks(rank, kvh, v_dim))):
        _adapters(getattr(module, f"linear_{name}_adapter_list", ()), index)


def _adapters(adapters: Iterable[torch.nn.Module], index: torch.Tensor) -> None:
    """Zamba2's per-use LoRA adapters, each added to its projection's output: the down-projection
    reads the whole input and stays whole, the up-projection keeps the projection's rows `index`
    (the uses that run no adapter hold an identity)."""
    for adapter in adapters:
        if isinstance(adapter, torch.nn.Sequential):
            adapter[1] = rows(index, adapter[1])


def _attention_out(module: torch.nn.Module) -> str | None:
    """The name of an attention module's output projection: `o_proj`, or `out_proj` (LFM2's)."""
    return next((name for name in ("o_proj", "out_proj") if isinstance(getattr(module, name, None), torch.nn.Linear)),
                None)


def _latent(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """MLA by query heads: each rank's queries, its heads' rows of the latent's up-projection
    (`kv_b_proj`: each head's key and value parts) and its columns of the output. The latent's own
    projection and norm stay whole: every rank keeps (and writes into its pool) the whole latent."""
    h = split(int(module.num_heads), n, "attention heads")
    q_name = "q_proj" if getattr(module, "q_proj", None) is not None else "q_b_proj"
    setattr(module, q_name, rows(blocks(rank, h, int(module.qk_head_dim)), getattr(module, q_name)))
    kv_width = int(module.qk_nope_head_dim) + int(module.v_head_dim)
    module.kv_b_proj = rows(blocks(rank, h, kv_width), module.kv_b_proj)
    module.o_proj = columns(blocks(rank, h, int(module.v_head_dim)), module.o_proj, rank, group)
    if isinstance(getattr(module, "g_proj", None), torch.nn.Linear):  # Bailing's per-head output gate
        module.g_proj = rows(blocks(rank, h, 1), module.g_proj)
    if isinstance(getattr(module, "gate_proj", None), torch.nn.Linear):  # HY-V4's per-channel output gate
        module.gate_proj = rows(blocks(rank, h, int(module.v_head_dim)), module.gate_proj)
    if isinstance(getattr(module, "sinks", None), torch.Tensor):  # HY-V4's, one per head
        module.sinks = parameter(module.sinks[rank * h:(rank + 1) * h])
    module.num_heads = h


#: a dense MLP's (gate, up, down) projection names: HF's usual ones and LFM's
_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _mlp_names(module: torch.nn.Module) -> tuple[str | None, str, str] | None:
    for gate, up, down in _MLP_NAMES:
        if all(isinstance(getattr(module, a, None), torch.nn.Linear) for a in (up, down)):
            return (gate if isinstance(getattr(module, gate, None), torch.nn.Linear) else None), up, down
    return None


def _mlp(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    gate, up, down = _mlp_names(module)
    index = blocks(rank, split(getattr(module, up).out_features, n, "MLP intermediate rows"), 1)
    for name in (gate, up) if gate else (up,):
        setattr(module, name, rows(index, getattr(module, name)))
    setattr(module, down, columns(index, getattr(module, down), rank, group))


def _experts(module: torch.nn.Module, rank: int, n: int, group: Any) -> None:
    """Fused experts: GPT-OSS stores `[E, hidden, 2I]` with gate and up interleaved and biases;
    Qwen3-Next stores `[E, 2I, hidden]` with the gates first, then the ups (LongCat-Flash's rows
    past its routed experts belong to identity experts, which use none)."""
    with torch.no_grad():
        if hasattr(module, "gate_up_proj_bias"):  # gpt-oss
            inner = split(module.gate_up_proj.shape[-1] // 2, n, "expert intermediate rows")
            pairs = blocks(rank, inner, 2)
            module.gate_up_proj = parameter(module.gate_up_proj[:, :, pairs])
            module.gate_up_proj_bias = parameter(module.gate_up_proj_bias[:, pairs])
            kept = blocks(rank, inner, 1)
            module.down_proj = parameter(module.down_proj[:, kept])
            if rank:
                module.down_proj_bias = parameter(torch.zeros_like(module.down_proj_bias))
            module.intermediate_size = inner
        elif hasattr(module, "expert_dim"):  # Llama 4: `[E, hidden, 2I]`, the gates first, then the ups
            full = module.gate_up_proj.shape[-1] // 2
            inner = split(full, n, "expert intermediate rows")
            kept = torch.cat([blocks(rank, inner, 1), blocks(rank, inner, 1, full)])
            module.gate_up_proj = parameter(module.gate_up_proj[:, :, kept])
            module.down_proj = parameter(module.down_proj[:, blocks(rank, inner, 1)])
            module.expert_dim = module.intermediate_size = inner
        else:
            full = module.gate_up_proj.shape[1] // 2
            inner = split(full, n, "expert intermediate rows")
            kept = torch.cat([blocks(rank, inner, 1), blocks(rank, inner, 1, full)])
            module.gate_up_proj = parameter(module.gate_up_proj[:, kept])
            module.down_proj = parameter(module.down_proj[:, :, blocks(rank, inner, 1)])
            module.intermediate_dim = inner
    if rank and isinstance(getattr(module, "identity_expert", None), torch.nn.Identity):
        # LongCat-Flash's zero-compute experts pass their tokens through: the sum over the ranks
        # must add that once, from rank 0
        module.identity_expert = _Zeros()
    reduced(module, group)


class _Zeros(torch.nn.Module):
    """An identity expert's share on a rank other than the first: nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


#: the recurrent mixers whose weights this module splits, by class: another family's mixer with the
#: same weight names may lay them out otherwise (split projections, multipliers, per-channel decay),
#: so it stays unsplit and `check_split` refuses it when the pool holds its state
_SPLIT_MIXERS = {
    "deltanet": (("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
                 ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
                 ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
                 ("transformers.models.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet"),
                 ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet")),
    "mamba2": (("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
               ("transformers.models.bamba.modeling_bamba", "BambaMixer"),
               ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
               ("transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer"),
               ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
               ("transformers.models.zamba2.modeling_zamba2", "Zamba2MambaMixer")),
    "mamba1": (("transformers.models.mamba.modeling_mamba", "MambaMixer"),
               ("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer"),
               ("transformers.models.jamba.modeling_jamba", "JambaMambaMixer")),
    "kda": (("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention"),
            ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention")),
    "lightning": (("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention"),),
    "rglru": (("transformers.models.recurrent_gemma.modeling_recurrent_gemma", "RecurrentGemmaRecurrentBlock"),),
    "zamba": (("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer"),),
}


def _split_mixer(module: torch.nn.Module) -> str | None:
    """The kind of a recurrent mixer this module splits, or None for one it does not."""
    return next((kind for kind, classes in _SPLIT_MIXERS.items() for where, name in classes
                 if isinstance(module, transformers_classes(where, name))), None)


def _kind(module: torch.nn.Module) -> str | None:
    """Which split `module` takes, read from the weights it holds (a recurrent mixer: from its class)."""
    served = served_mixer_types()
    if served and isinstance(module, served):
        if (kind := _split_mixer(module)) is not None:
            return kind
        if isinstance(getattr(module, "in_proj", None), torch.nn.Linear) and isinstance(
                getattr(module, "conv", None), torch.nn.Conv1d):
            return "shortconv"
        return None
    if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj")) and _attention_out(module):
        return "attention"
    if latent_module(module):
        return "latent"
    if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
        return "experts"
    if _mlp_names(module) is not None:
        return "mlp"
    return None


_SHARD = {"attention": _attention, "latent": _latent, "deltanet": tp_mixers.deltanet, "mamba2": tp_mixers.mamba2, "shortconv": tp_mixers.shortconv,
          "experts": _experts, "mlp": _mlp, "mamba1": tp_mixers.mamba1, "kda": tp_mixers.kda, "lightning": tp_mixers.lightning,
          "rglru": tp_mixers.rglru, "zamba": tp_mixers.zamba}


def _experts_inner(module: torch.nn.Module) -> int:
    last = hasattr(module, "gate_up_proj_bias") or hasattr(module, "expert_dim")  # gpt-oss's, Llama 4's
    return (module.gate_up_proj.shape[-1] if last else module.gate_up_proj.shape[1]) // 2


#: what each kind of layer splits by: (its count, what it is called in a refusal)
_TOTALS = {
    "attention": lambda m: [(getattr(m, _attention_out(m)).in_features // _value_dim(m), "attention heads"),
                            (m.k_proj.out_features // int(m.head_dim), "key-value heads")],
    "latent": lambda m: [(int(m.num_heads), "attention heads")],
    "mlp": lambda m: [(getattr(m, _mlp_names(m)[1]).out_features, "MLP intermediate rows")],
    "shortconv": lambda m: [(m.out_proj.in_features, "short-conv channels")],
    "experts": lambda m: [(_experts_inner(m), "expert intermediate rows")],
    "mamba2": lambda m: [(m.num_heads, "Mamba heads"), (m.n_groups, "Mamba groups")],
    "deltanet": lambda m: [(m.num_k_heads, "linear key heads"), (m.num_v_heads, "linear value heads")],
    "mamba1": lambda m: [(m.intermediate_size, "Mamba inner channels")],
    "kda": lambda m: [(m.num_heads, "linear attention heads")],
    "lightning": lambda m: [(m.num_attention_heads, "lightning attention heads")],
    "rglru": lambda m: [(m.rg_lru.num_attention_heads, "RG-LRU heads")],
    "zamba": lambda m: [(m.n_mamba_heads, "Zamba Mamba heads")],
}


#: the kinds of layer that write KV or state into the pool
_POOL_KINDS = ("attention", "latent", "deltanet", "mamba2", "mamba1", "kda", "shortconv", "lightning", "rglru", "zamba")
#: of those, the kinds that write KV (the others write recurrent state)
_KV_KINDS = ("attention", "latent")


def _layer_of(name: str, module: torch.nn.Module) -> int | None:
    """The layer a module's KV or state is kept for: its own `layer_idx`, or for one that keeps none
    (RecurrentGemma's block before the engine numbers it, a shared attention block told its layer
    per call) the `layers.<i>` its name sits in."""
    lid = getattr(module, "layer_idx", None)
    return lid if isinstance(lid, int) and lid >= 0 else layer_in_name(name)


def check_split(model: torch.nn.Module, n: int, decls: Iterable[KVLayerDecl] = ()) -> int:
    """Refuse, in one line and before any rank starts, a layer whose heads or rows do not split
    over `n` ranks, or a layer the pool gives KV (`decls`' token parts) without a split attention
    of that layer, or state without a split mixer of that layer: its whole heads would meet the
    pool's shard of them. The number of layers that split."""
    layers = [(module, kind) for module in model.modules() if (kind := _kind(module)) is not None]
    for module, kind in layers:
        for total, what in _TOTALS[kind](module):
            split(total, n, what)
    kv_layers, state_layers = set(), set()
    for decl in decls:
        for part in decl.parts:
            (kv_layers if part.geometry.unit is Unit.TOKEN else state_layers).add(decl.layer_id)
    # every name of a module counts: a shared attention block reused under several `layers.<i>`
    # splits each layer it runs at
    split_kv, split_state = set(), set()
    for name, module in model.named_modules(remove_duplicate=False):
        kind = _kind(module)
        if kind in _POOL_KINDS and (lid := _layer_of(name, module)) is not None:
            (split_kv if kind in _KV_KINDS else split_state).add(lid)
    whole = sorted((kv_layers - split_kv) | (state_layers - split_state))
    if whole:
        raise InputError(f"--tp {n}: layers {whole} hold KV or state in a form not split over ranks here "
                         "(attention and shared attention blocks, latent attention, Nemotron-H, Bamba, Granite, "
                         "Mamba2, Falcon-H1 and Zamba2 Mamba2 mixers, Mamba, Falcon-Mamba and Jamba Mamba1, "
                         "Zamba's per-head Mamba, Qwen3-Next, Qwen3.5, Lara Mini and OLMo Hybrid gated DeltaNet, "
                         "Kimi Delta Attention, MiniMax lightning attention, RecurrentGemma RG-LRU and LFM "
                         "short-conv layers are)")
    return len(layers)


def shard_model(model: torch.nn.Module, rank: int, n: int, group: Any = None) -> int:
    """Keep rank `rank`'s shard of every layer of `model` that splits; the number of layers split.
    The row-parallel sums run over `group` (None: the whole process group)."""
    split_layers = 0
    for module in list(model.modules()):
        kind = _kind(module)
        if kind is not None:
            _SHARD[kind](module, rank, n, group)
            split_layers += 1
    return split_layers
