"""kvchain's gated-DeltaNet forward (`engine/deltanet.py`) against each transformers gated-DeltaNet
class it serves, on the tiny models of `engine/tiny.py` (fp32, their own weights): three requests
packed in one batch (prompts in two chunks of different lengths, one shorter than the conv window,
then batched decodes), their conv and recurrent state in a real pool planned from the model's
config whose state slots start as NaN bytes, must give the module's own forward on each whole
sequence alone. The families differ in how they split their input projections, in their gate and
norm, and OLMo Hybrid lets beta reach 2 (negative eigenvalues)."""

from __future__ import annotations

import functools

import pytest
import torch

from kvchain.engine.deltanet import deltanet_forward, deltanet_module_types
from kvchain.engine.mixers import install_state_mixers
from kvchain.engine.tiny import make_model
from support.mixer_pool import CONV_SCHEDULE, mixer_gap

#: tiny family -> the transformers class of its recurrent mixer
FAMILIES = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5": "Qwen3_5GatedDeltaNet",
    "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "lara_mini": "LaraMiniGatedDeltaNet",
}
TOL = 1e-4
SCHEDULE = CONV_SCHEDULE


def _mixers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    served = deltanet_module_types()
    return {m.layer_idx: m for m in model.modules() if served and isinstance(m, served)}


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    name = FAMILIES[request.param]
    if name not in {cls.__name__ for cls in deltanet_module_types()}:
        pytest.skip(f"this transformers has no {name}")
    return request.param


def test_every_deltanet_layer_of_the_family_is_installed(family):
    model = make_model(family)
    mixers = _mixers(model)
    assert mixers and {type(m).__name__ for m in mixers.values()} == {FAMILIES[family]}
    assert install_state_mixers(model) == len(mixers)


def test_mixer_matches_the_module_on_each_sequence(family):
    model = make_model(family)
    config = model.config
    runs = [(functools.partial(deltanet_forward, m), lambda x, m=m: m(x[None])[0])
            for m in _mixers(model).values()]
    worst, relative = mixer_gap(config, runs, config.hidden_size, SCHEDULE)
    assert worst < TOL and relative < TOL, (worst, relative)


def test_olmo_hybrid_beta_reaches_past_one():
    """OLMo Hybrid's negative eigenvalues: beta = 2 sigmoid(b), so the test above covers steps past 1."""
    from kvchain.engine.deltanet import _project

    model = make_model("olmo_hybrid")
    module = next(iter(_mixers(model).values()))
    assert module.allow_neg_eigval
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        beta = _project(module, x).beta
    assert beta.max() > 1.0 and beta.max() <= 2.0

