"""LFM2/LFM3's gated short convolution on the pool: the module's own projections and conv weights,
with the conv's last `K - 1` inputs read from and written to the request's state slot.

The layer projects each token to B, C and x, convolves B*x depthwise and causally over the last K
inputs (no activation), gates the result by C and projects it out; its only state is the conv
window. Having no recurrence beyond the window, the whole packed batch (prefill chunks and decodes
alike) runs in one pass: every request's saved window is put before the packed inputs, and each
token's K taps are rows gathered from that one tensor (indices built once on the host), so no
request is stepped on its own."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError
from .batch import ForwardBatch
from .conv_state import all_requests, conv_store, packed_input, read_state, transformers_classes, write_state


def shortconv_module_types() -> tuple[type, ...]:
    """The mixer classes `shortconv_forward` serves (none when transformers lacks them): LFM3's
    short conv and LFM2's, which is the same layer."""
    return (transformers_classes("transformers.models.lfm3.modeling_lfm3", "Lfm3ShortConv")
            + transformers_classes("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"))


def tap_rows(batch: ForwardBatch, kernel: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices into `[saved windows of all B requests (B * (K-1) rows, request-major); packed new
    inputs (T rows)]`: `taps` `[T, K]`, the K inputs each new token's conv reads (oldest first), and
    `tails` `[B, K-1]`, the last K-1 inputs of each request after its new tokens (its next window)."""
    new_lens = batch.new_lens.astype(np.int64)
    starts = np.asarray(batch.q_starts, dtype=np.int64)
    n_req, keep = batch.batch_size, kernel - 1
    if len(starts) != n_req + 1 or int(starts[0]) != 0 or (np.diff(starts) != new_lens).any() or (new_lens < 1).any():
        raise InputError(f"q_starts {starts.tolist()} do not pack the new tokens {new_lens.tolist()}")

    def rows(req: np.ndarray, ext: np.ndarray) -> np.ndarray:
        # `ext` indexes the request's window followed by its new inputs
        return np.where(ext < keep, req * keep + ext, n_req * keep + starts[req] + ext - keep)

    req_of = np.repeat(np.arange(n_req, dtype=np.int64), new_lens)
    local = np.arange(int(starts[-1]), dtype=np.int64) - starts[req_of]
    taps = rows(req_of[:, None], local[:, None] + np.arange(kernel))
    tails = rows(np.arange(n_req, dtype=np.int64)[:, None], new_lens[:, None] + np.arange(keep))
    return taps, tails


def shortconv_forward(module: torch.nn.Module, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """`module` (an `Lfm3ShortConv` / `Lfm2ShortConv`) over the packed batch: `[1, T, hidden]` ->
    `[1, T, hidden]`."""
    x = packed_input(hidden_states, batch)
    dtype = x.dtype
    b, c, xs = module.in_proj(x).chunk(3, dim=-1)
    weight = module.conv.weight.squeeze(1)  # [hidden, K]
    kernel = weight.shape[-1]
    everyone = all_requests(batch)
    pool = conv_store(batch, module.layer_idx)
    past = read_state(pool, everyone, weight.dtype)  # [B, hidden, K-1]
    if past.shape[-1] != kernel - 1:
        raise InputError(f"conv state keeps {past.shape[-1]} inputs, the kernel of width {kernel} needs {kernel - 1}")
    rows = torch.cat([past.transpose(1, 2).reshape(-1, weight.shape[0]), (b * xs).to(weight.dtype)])
    taps, tails = (torch.as_tensor(t, device=x.device) for t in tap_rows(batch, kernel))
    conv = rows[taps[:, 0]] * weight[:, 0]
    for k in range(1, kernel):
        conv = conv + rows[taps[:, k]] * weight[:, k]
    if module.conv.bias is not None:
        conv = conv + module.conv.bias
    write_state(pool, everyone, rows[tails].transpose(1, 2))
    return module.out_proj(c * conv.to(dtype)).unsqueeze(0)
