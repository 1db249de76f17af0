"""The engine computes and keeps its KV in the checkpoint's own dtype (`dtype="auto"`, as serving
engines' `--dtype auto`) or the one asked for: a bfloat16 release serves in bfloat16, its pool
holding half the bytes per token a float32 engine holds, its logits transformers' in bfloat16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvchain.cli import main
from kvchain.engine.checkpoint import load_checkpoint, load_dtype
from kvchain.engine.serve import Engine, EngineConfig
from kvchain.errors import InputError
from support.engine import checkpoint_dir, workload

CONFIG = dict(budget_bytes=4 * 2**20, page_size=4, max_running=4, max_batched_tokens=48, context_len=128,
              ignore_eos=True, keep_logits=True)


@pytest.fixture(scope="module")
def bf16_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a bfloat16 release names itself: `torch_dtype` in its config."""
    out = tmp_path_factory.mktemp("bf16") / "llama"
    shutil.copytree(checkpoint_dir("llama"), out)
    config = json.loads((out / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def _bytes_per_token(engine: Engine) -> int:
    return sum(p.page_bytes for p in engine.storage.plan.sub_pools) // engine.storage.plan.page_size


def test_auto_serves_a_bfloat16_release_in_bfloat16(bf16_release: Path) -> None:
    requests = workload(4)
    with Engine(str(bf16_release), EngineConfig(**CONFIG)) as narrow:
        assert narrow.checkpoint.dtype == torch.bfloat16
        assert {p.dtype for p in narrow.checkpoint.model.parameters()} == {torch.bfloat16}
        result = narrow.generate(requests)
        narrow_bytes = _bytes_per_token(narrow)
    with Engine(str(bf16_release), EngineConfig(**CONFIG, dtype="float32")) as wide:
        assert wide.checkpoint.dtype == torch.float32
        assert _bytes_per_token(wide) == 2 * narrow_bytes
    reference = load_checkpoint(bf16_release, dtype="auto").model
    for i, request in enumerate(requests):
        ids = torch.tensor([list(request.prompt_token_ids)])
        with torch.no_grad():
            want = reference(ids).logits[0, -1].float()
        # one forward in bfloat16, summed in another order: a few units of its last place at logits of ~8
        assert float((result.logits[(i, 0)].float() - want).abs().max()) <= 0.25


@pytest.mark.parametrize(("asked", "config", "want"), [
    ("auto", {"dtype": "float32"}, torch.float32),
    ("auto", {"torch_dtype": "float16"}, torch.float16),
    ("auto", {"text_config": {"dtype": "bfloat16"}}, torch.bfloat16),
    ("auto", {}, torch.float32),
    ("bfloat16", {"dtype": "float32"}, torch.bfloat16),
    (torch.float16, {}, torch.float16),
])
def test_the_load_dtype_is_the_one_asked_for_or_the_checkpoint_s(asked, config, want) -> None:
    assert load_dtype(asked, config) == want


def test_a_dtype_that_is_not_a_load_dtype_is_refused() -> None:
    with pytest.raises(InputError, match=r"dtype must be auto or one of float32, bfloat16, float16, not 'int8'"):
        EngineConfig(dtype="int8")
    with pytest.raises(InputError, match=r"a checkpoint loads in float32, bfloat16, float16, not torch.int8"):
        load_dtype(torch.int8, {})


def test_a_dtype_asked_of_a_checkpoint_loaded_otherwise_is_refused() -> None:
    loaded = load_checkpoint(checkpoint_dir("llama"))
    with pytest.raises(InputError, match=r"dtype bfloat16 applies to a checkpoint the engine loads; this one is "
                                         r"loaded in float32"):
        Engine(loaded, EngineConfig(**CONFIG, dtype="bfloat16"))


def test_generate_takes_a_dtype(bf16_release: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model-path", str(checkpoint_dir("llama")), "--prompt", "hi", "--max-new-tokens", "3",
            "--json"]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 3
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--dtype", "int8"])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --dtype: invalid choice: 'int8'" in err[0]
