"""Reading a published HF config's fields.

Published configs vary (nulls for absent values, legacy layer-type names, aliases), so every read
goes through `Fields`, which turns a missing or malformed value into one-line `InputError` naming
the field and the family, never a KeyError or TypeError."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ..errors import InputError
from ..units import dtype_name

T = TypeVar("T")

_MISSING: Any = object()

#: Dtypes a config's `torch_dtype` may name for the model's activations (and so its KV by default).
MODEL_DTYPES = ("bfloat16", "float16", "float32")

#: More layers than any real model has; a larger count means a corrupt config.
MAX_LAYERS = 100_000


class Fields:
    """The text model's fields of one config, read on behalf of one family.

    `outer` is the whole config when the text model is nested in `text_config`; it is consulted
    only for the dtype, which multimodal checkpoints record at the top level."""

    def __init__(self, values: Mapping[str, Any], family: str, outer: Mapping[str, Any] | None = None):
        self.values = values
        self.family = family
        self.outer = outer if outer is not None else values

    # ------------------------------------------------------------ errors

    def error(self, field: str, problem: str) -> InputError:
        return InputError(f"{self.family} config: {field!r} {problem}")

    # ------------------------------------------------------------ scalars

    def present(self, name: str) -> bool:
        """True when the field is there and not null (configs write null for "not used")."""
        return self.values.get(name) is not None

    def integer(self, name: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        """An integer field; a missing or null one takes `default`, or raises when there is none."""
        value = self.values.get(name)
        if value is None:
            if default is _MISSING:
                raise self.error(name, "is missing")
            return default
        return self.as_integer(name, value, minimum)

    def num_layers(self, name: str = "num_hidden_layers") -> int:
        """The layer count; bounded so that a corrupt value fails here instead of allocating a
        list per layer (the deepest published models have a few hundred layers)."""
        value = self.integer(name)
        if value > MAX_LAYERS:
            raise self.error(name, f"= {value} is implausibly large (more than {MAX_LAYERS} layers)")
        return value

    def window(self, name: str = "sliding_window") -> int | None:
        """A window size, or None when it is off: configs write null or 0 (transformers writes
        `sliding_window: 0` for Qwen-MoE models whose window is disabled)."""
        value = self.values.get(name)
        if value is None or (value == 0 and not isinstance(value, bool)):
            return None
        return self.as_integer(name, value)

    def optional_integer(self, name: str, *, minimum: int = 1) -> int | None:
        value = self.values.get(name)
        return None if value is None else self.as_integer(name, value, minimum)

    def first_integer(self, names: Sequence[str], default: Any = _MISSING, *, minimum: int = 1) -> int:
        """The first present field among aliases (e.g. `conv_kernel` or `mamba_d_conv`)."""
        for name in names:
            if self.present(name):
                return self.integer(name, minimum=minimum)
        if default is _MISSING:
            alternatives = " or ".join(repr(n) for n in names[1:])
            raise self.error(
                names[0], f"is missing (nor is {alternatives} given)" if alternatives else "is missing"
            )
        return default

    def flag(self, name: str, default: bool) -> bool:
        value = self.values.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def string(self, name: str) -> str | None:
        value = self.values.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(name, f"must be a string, got {value!r}")
        return value

    def as_integer(self, name: str, value: Any, minimum: int = 1) -> int:
        """Check one value read from a nested field (a list entry) as an integer >= minimum."""
        integral_float = isinstance(value, float) and value.is_integer()
        if isinstance(value, bool) or not (isinstance(value, int) or integral_float):
            raise self.error(name, f"must be an integer, got {value!r}")
        value = int(value)
        if value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(name, f"must be {what}, got {value}")
        return value

    # ------------------------------------------------------------ lists

    def sequence(self, name: str) -> list[Any] | None:
        value = self.values.get(name)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise self.error(name, f"must be a list, got {type(value).__name__}")
        return list(value)

    def integers(self, name: str, *, minimum: int = 0) -> list[int] | None:
        items = self.sequence(name)
        if items is None:
            return None
        return [self.as_integer(f"{name}[{i}]", item, minimum) for i, item in enumerate(items)]

    def layer_kinds(
        self, names: Sequence[str], kinds: Mapping[str, T], num_layers: int | None
    ) -> list[T] | None:
        """Per-layer kinds from the first present list field among `names` (e.g. `layer_types`),
        mapped through `kinds`; None when no such list is given. An unknown entry or a length other
        than `num_layers` (when given) raises."""
        for name in names:
            items = self.sequence(name)
            if items is None:
                continue
            if not items:
                raise self.error(name, "is an empty list")
            out: list[T] = []
            for i, item in enumerate(items):
                if not isinstance(item, str) or item not in kinds:
                    raise self.error(name, f"entry {i} is {item!r}; expected one of {sorted(kinds)}")
                out.append(kinds[item])
            if num_layers is not None and len(out) != num_layers:
                raise self.error(name, f"lists {len(out)} layers but num_hidden_layers is {num_layers}")
            return out
        return None

    # ------------------------------------------------------------ derived values

    def head_dim(
        self, num_heads: int, *, names: Sequence[str] = ("head_dim",), default: int | None = None
    ) -> int:
        """`head_dim` when given; else the family's default, else hidden_size // num_attention_heads."""
        for name in names:
            if self.present(name):
                return self.integer(name)
        if default is not None:
            return default
        hidden = self.integer("hidden_size")
        if hidden % num_heads:
            raise self.error(
                "head_dim",
                f"is missing and hidden_size {hidden} does not divide by num_attention_heads {num_heads}",
            )
        return hidden // num_heads

    def model_dtype(self) -> str:
        """The model's dtype (`torch_dtype`, or `dtype` in newer configs) when it is one KV can hold
        as is; bfloat16 otherwise (e.g. when absent, or a quantized checkpoint's storage type)."""
        for source in (self.values, self.outer):
            for key in ("torch_dtype", "dtype"):
                value = source.get(key)
                if isinstance(value, str):
                    try:
                        name = dtype_name(value)
                    except InputError:
                        continue
                    if name in MODEL_DTYPES:
                        return name
        return "bfloat16"

    def serving_dtype(self) -> str:
        """The dtype engines run the model in under `dtype="auto"`: the config's 16-bit dtype, and
        bfloat16 for a float32 config (engines do not serve in float32 unless told to)."""
        name = self.model_dtype()
        return "bfloat16" if name == "float32" else name

    # ------------------------------------------------------------ tensor parallelism

    def split_heads(self, field: str, heads: int, tp: int) -> int:
        """Attention KV heads held per rank: split evenly, or replicated one per rank when there are
        fewer heads than ranks and they divide the rank count."""
        if heads % tp == 0:
            return heads // tp
        if heads < tp and tp % heads == 0:
            return 1
        raise self.error(
            field,
            f"= {heads} cannot be split over tp_size {tp} "
            "(needs heads divisible by tp, or tp divisible by heads)",
        )

    def split_exact(self, field: str, value: int, tp: int) -> int:
        """A recurrent-state dimension that each rank holds an equal share of."""
        if value % tp:
            raise self.error(field, f"= {value} does not divide by tp_size {tp}")
        return value // tp
