"""What each layer stores: a `KVLayerDecl` made of parts, each a geometry and a lifetime.

Geometries say how many bytes one unit holds (a token for attention, a slot for recurrent state);
lifetimes say how long a unit lives (all tokens, the last `window` tokens, or one slot per request
with checkpoints). Planning groups parts by (lifetime, unit) into sub-pools (`plan.py`)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import DeclarationError
from .units import dtype_name, dtype_size, is_integer


class Unit(enum.Enum):
    """What one allocation unit of a sub-pool is."""

    TOKEN = "token"
    SLOT = "slot"


# ---------------------------------------------------------------- geometries


@dataclass(frozen=True)
class MHA:
    """Multi-head (or grouped-query) attention: K and V per KV head per token."""

    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        _positive(self, "kv_heads", "head_dim")
        if self.v_head_dim is not None:
            _positive(self, "v_head_dim")

    unit = Unit.TOKEN

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def unit_bytes(self) -> int:
        """Bytes one token of one layer holds: K and V for every KV head."""
        return self.kv_heads * (self.head_dim + self.v_dim) * dtype_size(self.dtype)

    def describe(self) -> str:
        v = "" if self.v_head_dim is None else f"/v{self.v_head_dim}"
        return f"MHA {self.kv_heads}x{self.head_dim}{v} {self.dtype}"


#: a sparse-attention indexer's key is stored as fp8 with one float32 scale per this many dims
INDEX_QUANT_BLOCK = 128


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: one compressed latent plus a shared rope key per token.

    `index_head_dim` > 0 adds the key of a sparse-attention indexer (DeepSeek-V3.2's DSA): one
    head per token, kept beside the latent because it lives exactly as long, stored as serving
    engines store it, fp8 with a float32 scale per `INDEX_QUANT_BLOCK` dims (132 bytes for 128)."""

    kv_lora_rank: int
    rope_dim: int
    dtype: str = "bfloat16"
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        _positive(self, "kv_lora_rank")
        _positive(self, "rope_dim", "index_head_dim", least=0)
        if self.index_head_dim % INDEX_QUANT_BLOCK:
            raise DeclarationError(f"MLA index_head_dim must be a multiple of {INDEX_QUANT_BLOCK} (or 0), "
                                   f"got {self.index_head_dim}")

    unit = Unit.TOKEN

    def index_bytes(self) -> int:
        """Bytes of the indexer key per token: fp8 values and their float32 scales."""
        return self.index_head_dim + 4 * (self.index_head_dim // INDEX_QUANT_BLOCK)

    def unit_bytes(self) -> int:
        return (self.kv_lora_rank + self.rope_dim) * dtype_size(self.dtype) + self.index_bytes()

    def describe(self) -> str:
        index = f" + indexer key {self.index_head_dim} fp8" if self.index_head_dim else ""
        return f"MLA {self.kv_lora_rank}+{self.rope_dim} {self.dtype}{index}"


@dataclass(frozen=True)
class StateTensor:
    """One named recurrent-state tensor held per request slot (e.g. `conv` or `ssm`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise DeclarationError(f"state tensor name must be an identifier, got {self.name!r}")
        shape = _sequence(self.shape)
        if not shape or not all(is_integer(s) and s > 0 for s in shape):
            raise DeclarationError(f"state tensor {self.name!r} needs a non-empty shape of positive integers, "
                                   f"got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True)
class State:
    """Recurrent state (Mamba, linear attention): named tensors held per request slot."""

    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        tensors = _sequence(self.tensors)
        if tensors is None or not all(isinstance(t, StateTensor) for t in tensors):
            raise DeclarationError(f"a State geometry's tensors must be StateTensors, got {self.tensors!r}")
        object.__setattr__(self, "tensors", tensors)
        if not self.tensors:
            raise DeclarationError("a State geometry needs at least one tensor")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise DeclarationError(f"state tensor names repeat: {names}")

    unit = Unit.SLOT

    def unit_bytes(self) -> int:
        """Bytes one slot of one layer holds: every tensor."""
        return sum(t.nbytes() for t in self.tensors)

    def describe(self) -> str:
        inner = ", ".join(f"{t.name}{list(t.shape)} {t.dtype}" for t in self.tensors)
        return f"State[{inner}]"


Geometry = MHA | MLA | State

# ---------------------------------------------------------------- lifetimes


@dataclass(frozen=True)
class FullLifetime:
    """Every token stays for the request's life. The sub-pool of this lifetime owns virtual ids."""

    rank = 2

    def describe(self) -> str:
        return "full"


@dataclass(frozen=True)
class WindowLifetime:
    """Only the last `window` tokens are read. `chunked`: attention within aligned chunks of
    `window` tokens (Llama 4), which retains at most `window` tokens as well."""

    window: int
    chunked: bool = False

    rank = 1

    def __post_init__(self) -> None:
        _positive(self, "window")
        if not isinstance(self.chunked, (bool, np.bool_)):
            raise DeclarationError(f"WindowLifetime chunked must be a bool, got {self.chunked!r}")
        object.__setattr__(self, "chunked", bool(self.chunked))

    def describe(self) -> str:
        return f"{'chunk' if self.chunked else 'window'} {self.window}"


@dataclass(frozen=True)
class StateLifetime:
    """One slot per request; `checkpoint_interval` tokens between cached checkpoints of the state
    (None: the prefix cache keeps the state at the sequence end only); `speculative_slots`: the
    scratch slots a speculative round takes per request (k + 1), priced with its own."""

    checkpoint_interval: int | None = None
    speculative_slots: int = 0

    rank = 0

    def __post_init__(self) -> None:
        if self.checkpoint_interval is not None:
            _positive(self, "checkpoint_interval")
        _positive(self, "speculative_slots", least=0)

    def describe(self) -> str:
        base = "state" if self.checkpoint_interval is None else f"state (checkpoint every {self.checkpoint_interval})"
        return f"{base} + {self.speculative_slots} speculative slots" if self.speculative_slots else base


Lifetime = FullLifetime | WindowLifetime | StateLifetime


# ---------------------------------------------------------------- parts and layers


@dataclass(frozen=True)
class KVPart:
    """One geometry stored under one lifetime."""

    geometry: Geometry
    lifetime: Lifetime

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, (MHA, MLA, State)):
            raise DeclarationError(f"a KVPart's geometry must be MHA, MLA or State, got {self.geometry!r}")
        if not isinstance(self.lifetime, (FullLifetime, WindowLifetime, StateLifetime)):
            raise DeclarationError("a KVPart's lifetime must be FullLifetime, WindowLifetime or StateLifetime, "
                                   f"got {self.lifetime!r}")
        state_geometry = isinstance(self.geometry, State)
        state_lifetime = isinstance(self.lifetime, StateLifetime)
        if state_geometry != state_lifetime:
            raise DeclarationError(
                f"{self.geometry.describe()} cannot live under a {self.lifetime.describe()} lifetime: "
                "recurrent state takes StateLifetime, attention takes FullLifetime or WindowLifetime"
            )

    @property
    def unit(self) -> Unit:
        return self.geometry.unit

    @property
    def is_attention(self) -> bool:
        return not isinstance(self.geometry, State)


@dataclass(frozen=True)
class KVLayerDecl:
    """What one local layer stores: one attention part, one state part, or one of each."""

    layer_id: int
    parts: tuple[KVPart, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _positive(self, "layer_id", least=0)
        parts = _sequence(self.parts)
        if parts is None or not all(isinstance(p, KVPart) for p in parts):
            raise DeclarationError(f"layer {self.layer_id}'s parts must be KVParts, got {self.parts!r}")
        object.__setattr__(self, "parts", parts)
        attention = [p for p in self.parts if p.is_attention]
        state = [p for p in self.parts if not p.is_attention]
        if len(attention) > 1 or len(state) > 1:
            raise DeclarationError(
                f"layer {self.layer_id} declares {len(attention)} attention and {len(state)} state parts; "
                "a layer holds at most one of each"
            )


def kv_layer_decls(layers: Iterable[Sequence[KVPart] | KVPart | None]) -> list[KVLayerDecl]:
    """Number a model's layers in order. Each entry is the layer's parts (a part, a sequence of
    parts, or None for a layer with no KV state, such as an MLP-only layer)."""
    entries = _sequence(layers)
    if entries is None:
        raise DeclarationError(f"layers must be a sequence of layer entries, got {layers!r}")
    decls: list[KVLayerDecl] = []
    for layer_id, parts in enumerate(entries):
        if parts is None:
            continue
        if isinstance(parts, KVPart):
            parts = (parts,)
        if isinstance(parts, (str, bytes)) or _sequence(parts) is None:
            raise DeclarationError(f"layer {layer_id}'s entry must be a KVPart, a sequence of KVParts or None, "
                                   f"got {parts!r}")
        decls.append(KVLayerDecl(layer_id, tuple(parts)))
    if not decls:
        raise DeclarationError("a model must declare at least one layer with KV state")
    return decls


def _positive(decl: object, *names: str, least: int = 1) -> None:
    """Each named field of `decl` an integer of at least `least` (1: a positive integer), stored back
    as a plain int so a numpy integer declares the same geometry as the int it holds."""
    for name in names:
        value = getattr(decl, name)
        if not is_integer(value) or value < least:
            what = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise DeclarationError(f"{type(decl).__name__} {name} must be {what}, got {value!r}")
        object.__setattr__(decl, name, int(value))


def _sequence(values: object) -> tuple | None:
    """`values` as a tuple, or None when it is not an iterable (a string is one of characters)."""
    try:
        return tuple(values)  # type: ignore[arg-type]
    except TypeError:
        return None
