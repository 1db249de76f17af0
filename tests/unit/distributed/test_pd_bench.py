"""`kvchain bench pd`: its arithmetic and its JSON."""

from __future__ import annotations

import json

import pytest

from kvchain.bench.pd import SCHEMA, summarize
from kvchain.cli_common import dump_json


def test_bandwidths_are_of_the_medians_and_the_ratio_is_the_median_of_per_repeat_ratios():
    out = summarize("gloo", 10**9, [(1.0, 0.5), (2.0, 1.0), (4.0, 1.0)], requests=2, tokens=64, segments=3,
                    pages={"full": 8})
    assert out["batch_gb_per_s"] == 0.5 and out["large_gb_per_s"] == 1.0
    assert out["ratio"] == 0.5  # per repeat: 0.5, 0.5, 0.25
    assert out["samples"][2] == {"batch_s": 4.0, "large_s": 1.0}


def test_the_json_carries_every_field_of_the_schema():
    out = json.loads(dump_json(summarize("nixl", 4096, [(0.002, 0.001)], requests=1, tokens=16, segments=5,
                                         pages={"full": 1, "state": 1})))
    assert set(SCHEMA) <= set(out) and out["engine"] == "nixl" and out["repeats"] == 1
    assert out["ratio"] == pytest.approx(0.5) and out["bytes"] == 4096 and out["segments"] == 5
