"""Kimi Delta Attention (Kimi Linear's linear-attention layers) on the pool: the module's own
projections, conv weights, forget gate, gated norm and output projection, with the conv window and
the recurrent state read from and written to the request's state slot.

KDA is the gated delta rule of `deltanet.py` with a decay per key channel instead of per head: each
token decays row c of a head's state S (`[head_dim, head_dim]`) by exp(g_c), then corrects what S
recalls for the token's key towards its value with step beta, and the output reads S with the
query. So the layer runs through `delta_rule_layer` (conv, l2-normalised q and k, the scans and the
pool's state) with one value head per q/k head; only its inputs and its output differ:

- q, k and v each have their own projection, conv'd side by side as one `conv1d` (no bias) in that
  channel order, the plan's `conv` state `[3 * heads * head_dim, kernel - 1]`;
- g `[T, heads, head_dim]` is the module's `forget_gate` (a low-rank projection, -exp(A_log) times
  a softplus of it plus dt_bias), beta = sigmoid(b_proj);
- the output goes through an RMS norm per head gated by sigmoid of a low-rank projection
  (`g_a_proj`, `g_b_proj`, `o_norm`; Bailing's one `g_proj`), then `o_proj`.

Bailing's hybrid (Ring-linear) runs the same layer with its own forget gate module and a
one-projection output gate."""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .conv_state import cast, packed_input, transformers_classes
from .deltanet import DeltaHeads, DeltaInputs, delta_rule_layer

#: (module, class) of each transformers KDA mixer `kda_forward` serves
MIXERS = (("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention"),
          # Bailing's (Ring-linear): the same rule, its output gate one projection (`g_proj`)
          ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention"))


def kda_module_types() -> tuple[type, ...]:
    """The mixer classes `kda_forward` serves (those this transformers has)."""
    return tuple(cls for module, name in MIXERS for cls in transformers_classes(module, name))


def _project(module: torch.nn.Module, x: torch.Tensor) -> DeltaInputs:
    """The layer's inputs from the packed hidden states `x` `[T, hidden]`. The forget gate is the
    module's own (float32, `[T, heads, head_dim]`): it reads a `[batch, seq, hidden]` input."""
    shape = (x.shape[0], module.num_heads, module.head_dim)
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    low_rank = getattr(module, "g_proj", None) is None
    gate = (module.g_b_proj(module.g_a_proj(x)) if low_rank else module.g_proj(x)).view(shape)
    g = module.forget_gate(x[None])[0].view(shape)
    return DeltaInputs(mixed, gate, module.b_proj(x).sigmoid(), g)


def kda_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (one of `kda_module_types()`) over the packed batch: `[1, T, hidden]` -> `[1, T, hidden]`."""
    x = packed_input(hidden_states, batch)
    inputs = _project(module, x)
    heads, dim = module.num_heads, module.head_dim
    y = delta_rule_layer(module, batch, inputs, DeltaHeads(heads, heads, dim, dim))  # [T, heads, dim]
    normed = module.o_norm(cast(y, x.dtype), inputs.gate)
    return module.o_proj(normed.reshape(1, x.shape[0], heads * dim))
