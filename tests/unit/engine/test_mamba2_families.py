"""kvchain's one Mamba2 forward (`engine/mamba2.py`) against transformers' own mixers of every family
it serves, on the same weights in fp32: Bamba, Granite 4.0-H, pure Mamba2 and Falcon-H1 (its mup
multipliers, and its gated norm before the gate, after it, or absent). Three requests packed in one
batch (prompts in two chunks of different lengths, then batched decodes), their conv and SSM state
in a real pool whose slots start as NaN bytes, must give transformers' output of each whole
sequence in one forward, at the mixer and at the logits; a state checkpoint copied to another slot
continues the request from there. Nemotron-H's mixer is held the same way in `test_state_mixers.py`."""

from __future__ import annotations

import functools

import pytest
import torch

from kvchain.engine.mamba2 import mamba2_forward, mamba2_module_types
from kvchain.engine.mixers import install_state_mixers, served_mixer_types
from kvchain.engine.tiny import make_model
from support.mixer_pool import CONV_SCHEDULE, checkpoint_gap, mixer_gap, runner_logits_gap

TOL = 1e-4
SCHEDULE = CONV_SCHEDULE


#: case -> (tiny family, overrides). transformers' scan chunk is 4, so its chunked scan crosses chunk
#: boundaries inside a prompt (kvchain's scans whole blocks of at least `mamba2.MIN_BLOCK`)
CASES = {
    "bamba": ("bamba", {"mamba_chunk_size": 4}),
    # time steps clamped on both sides: the tiny weights give softplus(dt) from about 0.1 to 4
    "granitemoehybrid": ("granitemoehybrid", {"mamba_chunk_size": 4, "time_step_limit": (0.3, 1.5)}),
    "mamba2": ("mamba2", {"chunk_size": 4}),
    "falcon_h1": ("falcon_h1", {"mamba_chunk_size": 4}),
    "falcon_h1_norm_after_gate": ("falcon_h1", {"mamba_chunk_size": 4, "mamba_norm_before_gate": False}),
    "falcon_h1_no_norm": ("falcon_h1", {"mamba_chunk_size": 4, "mamba_rms_norm": False}),
}


def _mixers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {m.layer_idx: m for m in model.modules() if isinstance(m, mamba2_module_types())}


def _vary_vectors(model: torch.nn.Module, seed: int) -> None:
    """Move the mixers' vectors (dt bias, A_log, D, norm weight, conv bias) off their init values
    (ones, log 1..H, zeros), which would hide a dropped or misplaced one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in _mixers(model).values():
            for _name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
                if param.ndim == 1:
                    param.add_(0.3 * torch.randn(param.shape, generator=gen))


@pytest.fixture(params=sorted(CASES))
def case(request):
    family, overrides = CASES[request.param]
    model = make_model(family, seed=0, **overrides)
    _vary_vectors(model, seed=5)
    mixers = _mixers(model)
    assert mixers and all(p.dtype == torch.float32 for p in model.parameters())
    return model.config, model, mixers


def test_the_engine_serves_every_mamba2_hybrid():
    names = {cls.__name__ for cls in mamba2_module_types()}
    assert {"NemotronHMamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "Mamba2Mixer",
            "FalconH1Mixer"} <= names
    assert set(mamba2_module_types()) <= set(served_mixer_types())


def test_mixer_matches_transformers_on_each_sequence(case):
    config, _model, mixers = case
    # transformers' forward of the whole sequence, no cache
    runs = [(functools.partial(mamba2_forward, m), lambda x, m=m: m(x[None])[0]) for m in mixers.values()]
    _worst, relative = mixer_gap(config, runs, config.hidden_size, SCHEDULE)
    assert relative < TOL


def test_logits_match_one_whole_forward(case):
    """The whole model on the pool (kvchain's attention beside the mixers, the family's multipliers
    around them) against transformers' one uncached forward of each sequence."""
    _config, model, mixers = case
    assert runner_logits_gap(model, len(mixers), SCHEDULE) < TOL


def test_checkpoint_copy_continues_the_request(case):
    config, _model, mixers = case
    module = next(iter(mixers.values()))
    first, second = SCHEDULE.chunks[1]
    worst, scale = checkpoint_gap(config, functools.partial(mamba2_forward, module),
                                  lambda x: module(x[None])[0], config.hidden_size, first, second)
    assert worst < TOL * scale


def test_a_hybrid_model_gets_one_kvchain_mixer_per_mamba_layer():
    model = make_model("bamba")
    assert install_state_mixers(model) == len(_mixers(model)) == 2
