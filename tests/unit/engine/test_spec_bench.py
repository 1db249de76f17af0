"""`kvchain bench spec`: its arithmetic and its JSON schema."""

from __future__ import annotations

import json

import pytest

from kvchain.bench.spec import ServeFigures, spec_summary
from kvchain.cli import main
from kvchain.errors import InputError


def test_forwards_per_token_and_the_ratio():
    plain = ServeFigures(target_forwards=40, output_tokens=80)
    spec = ServeFigures(target_forwards=16, output_tokens=80, draft_forwards=60, proposed=48, accepted=36)
    out = spec_summary(plain, spec, identical=True, family="x")
    assert out["plain"]["forwards_per_token"] == 0.5
    assert out["speculative"]["forwards_per_token"] == 0.2
    assert out["ratio"] == pytest.approx(0.4)
    assert out["speculative"]["acceptance_rate"] == 0.75
    assert out["family"] == "x" and out["identical"] is True


def test_runs_of_different_lengths_are_not_compared():
    with pytest.raises(InputError, match="not comparable"):
        spec_summary(ServeFigures(4, 8), ServeFigures(2, 9), identical=False)


def test_bench_spec_json(capsys):
    capsys.readouterr()
    assert main(["bench", "spec", "--family", "gemma3", "--requests", "2", "--max-new-tokens", "6",
                 "--num-speculative-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"schema_version", "family", "requests", "k", "draft", "plain", "speculative", "ratio",
            "identical"} <= set(out)
    assert out["identical"] is True
    for run in ("plain", "speculative"):
        assert {"target_forwards", "output_tokens", "forwards_per_token"} <= set(out[run])
    assert out["plain"]["output_tokens"] == out["speculative"]["output_tokens"] == 12
    # the whole-target draft is always accepted: fewer target forwards per token
    assert out["speculative"]["acceptance_rate"] == 1.0 and out["ratio"] < 1
    assert out["ratio"] == pytest.approx(out["speculative"]["forwards_per_token"] / out["plain"]["forwards_per_token"])


def test_bench_spec_table_piped_is_laid_out_for_100_columns(capsys):
    """Piped (not a terminal), a command's tables get the 100 columns every table is laid out for,
    not rich's 80, which cut the row label to "speculati…"."""
    capsys.readouterr()
    assert main(["bench", "spec", "--family", "gemma3", "--requests", "2", "--max-new-tokens", "6",
                 "--num-speculative-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "…" not in text and "speculative │" in text
    assert max(len(line) for line in text.splitlines()) <= 100
