"""The engine against transformers on every other family it serves (`support.engine.MORE_FAMILIES`),
as `test_engine_matches_transformers` holds the core six: tiny checkpoints written with
`save_pretrained`, loaded through the engine's loader, served batched from a tight pool with moves,
prefix hits, window retirement and state checkpoints, token for token against transformers.

And a model whose recurrent layers the engine cannot run is refused at load, never served: its
mixer would run without the pool's state, and every token after the first would be wrong."""

from __future__ import annotations

import pytest
import torch

from kvchain.engine.mixers import check_state_layers_served, served_mixer_types
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.errors import InputError
from support.engine import (
    INDEXED_FAMILIES,
    MORE_FAMILIES,
    check_family,
    checkpoint_dir,
    every_token_indexed_dir,
    tight_budget,
)


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_family_output_is_transformers_output(family):
    """CI slice: 12 requests per family."""
    check_family(family, 12)


@pytest.mark.sweep
@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_family_output_is_transformers_output_64(family):
    """64 requests per family. A sparse-attention indexer's top-k is discontinuous: at 64 requests a
    pick on a near-tie flips between the batched forward and transformers' one-request forward (with
    a top-k of 16, DeepSeek-V3.2 showed four isolated one-token logit jumps, 0.02 to 0.5, errors of
    1e-6 before and after; one changed a greedy token). So the indexed families run here with every
    token in reach (`every_token_indexed_dir`); their sparse picks are held at 12 requests above and
    by `test_indexer.py`."""
    check_family(family, 64, every_token_indexed_dir(family) if family in INDEXED_FAMILIES else None)


class _Unserved(torch.nn.Module):
    """A recurrent mixer the engine has no forward for."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


def test_an_unserved_recurrent_mixer_is_refused():
    model = torch.nn.ModuleList([_Unserved(0), _Unserved(2)])
    with pytest.raises(InputError, match=r"layers \[0, 2\] keep recurrent state in _Unserved"):
        check_state_layers_served(model, {0, 1, 2})
    check_state_layers_served(model, {1})  # a state layer of another model (a fused draft's) is not this one's


def test_a_served_mixer_passes():
    served = served_mixer_types()
    assert served, "this transformers has none of the mixers the engine serves"
    from kvchain.engine.tiny import make_model

    model = make_model("qwen3_next")
    state_layers = {m.layer_idx for m in model.modules() if isinstance(m, served)}
    assert state_layers
    check_state_layers_served(model, state_layers)


def test_the_engine_refuses_a_model_whose_mixer_it_cannot_run(monkeypatch):
    """Built from a real checkpoint whose mixers the engine serves, but told it serves none: the
    engine refuses at construction, before any request."""
    from kvchain.engine import mixers
    from kvchain.engine.checkpoint import load_checkpoint

    monkeypatch.setattr(mixers, "served_mixer_types", lambda: ())
    family = "nemotron_h"
    cfg = EngineConfig(budget_bytes=tight_budget(family, 4), page_size=4, max_running=8, context_len=128)
    with pytest.raises(InputError, match="NemotronHMamba2Mixer, a mixer kvchain's engine does not serve"):
        Engine(load_checkpoint(checkpoint_dir(family)), cfg)
