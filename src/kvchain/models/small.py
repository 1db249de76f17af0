"""Hand-made hybrids: the small chains the stress harness, the overlap driver, traces, benches and
tests run on, built in one place so each says only how its chain differs (page bytes, dtypes, how
many windows) instead of spelling out layers."""

from __future__ import annotations

from collections.abc import Sequence

from ..decl import (
    FullLifetime,
    Geometry,
    KVLayerDecl,
    KVPart,
    State,
    StateLifetime,
    WindowLifetime,
    kv_layer_decls,
)
from ..errors import DeclarationError
from ..units import is_integer
from .fields import MAX_LAYERS


def small_hybrid(
    full: Geometry,
    windows: Sequence[int] = (),
    *,
    window_geometry: Geometry | Sequence[Geometry] | None = None,
    state: State | None = None,
    checkpoint_interval: int | None = None,
    chunked: bool = False,
    state_layers: bool = False,
    blocks: int = 1,
) -> list[KVLayerDecl]:
    """`blocks` repeats of one block: a full-attention layer (`full`), then one attention layer per
    window length in `windows` (chunked attention with `chunked`), each of `window_geometry` (one
    geometry for all, one per window, or None: `full`'s). The `state` part, if any, lives on the
    block's full-attention layer, or, with `state_layers`, on a state-only layer after every
    attention layer (the Mamba-hybrid interleave); `checkpoint_interval` is its lifetime's."""
    if not is_integer(blocks) or not 1 <= blocks <= MAX_LAYERS:
        raise DeclarationError(f"a hybrid needs a whole number of blocks of layers, 1 to {MAX_LAYERS:,}, "
                               f"got {blocks!r}")
    if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence):
        raise DeclarationError(f"windows is a sequence of window lengths, not {type(windows).__name__}")
    blocks = int(blocks)
    if window_geometry is None or not isinstance(window_geometry, Sequence):
        geometries = [window_geometry or full] * len(windows)
    else:
        geometries = list(window_geometry)
        if len(geometries) != len(windows):
            raise DeclarationError(f"{len(geometries)} window geometries for {len(windows)} windows")
    state_part = None if state is None else KVPart(state, StateLifetime(checkpoint_interval))
    block: list = []
    if state_part is not None and not state_layers:
        block.append([KVPart(full, FullLifetime()), state_part])
    else:
        block.append(KVPart(full, FullLifetime()))
    if state_part is not None and state_layers:
        block.append(state_part)
    for window, geometry in zip(windows, geometries):
        block.append(KVPart(geometry, WindowLifetime(window, chunked=chunked)))
        if state_part is not None and state_layers:
            block.append(state_part)
    return kv_layer_decls(block * blocks)
