"""`kvchain make-checkpoint ... --draft` and `kvchain generate --draft-model-path ...`: a matching draft
written, speculative generation reporting its acceptance and tokens per target forward, and the
start-up refusals as one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from kvchain.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-cli")
    assert main(["make-checkpoint", "nemotron_h", str(root / "t"), "--draft", str(root / "d")]) == 0
    return root / "t", root / "d"


def test_generate_with_a_draft_reports_acceptance(pair, capsys):
    target, draft = pair
    capsys.readouterr()
    assert main(["generate", "--model-path", str(target), "--prompt", "hello kvchain", "--max-new-tokens", "9",
                 "--ignore-eos", "--json", "--draft-model-path", str(draft), "--num-speculative-tokens", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain = None
    assert main(["generate", "--model-path", str(target), "--prompt", "hello kvchain", "--max-new-tokens", "9",
                 "--ignore-eos", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    stats = out["stats"]
    assert stats["spec_rounds"] > 0 and stats["spec_proposed"] > 0
    assert stats["acceptance_rate"] == stats["spec_accepted"] / stats["spec_proposed"]
    assert stats["tokens_per_target_forward"] == stats["output_tokens"] / stats["forwards"]


def test_a_recurrent_draft_without_a_checkpoint_policy_is_refused_at_start(pair, capsys):
    target, draft = pair
    capsys.readouterr()
    rc = main(["generate", "--model-path", str(target), "--prompt", "x", "--no-prefix-cache",
               "--draft-model-path", str(draft), "--num-speculative-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--no-prefix-cache" in err


def test_draft_flags_go_together(pair, capsys):
    target, draft = pair
    capsys.readouterr()
    assert main(["generate", "--model-path", str(target), "--prompt", "x", "--draft-model-path", str(draft)]) == 2
    assert "go together" in capsys.readouterr().err
