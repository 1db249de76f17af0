"""`kvchain bench host`: a cell's figures follow from its rounds (medians of seconds, medians of the
per-round quotients), the headline is the worst ratio, the JSON keeps its schema, and a run really
backs up and loads back its prefixes. Nothing here asserts a speed."""

from __future__ import annotations

import json

import pytest

from kvchain.bench.host import headline, host_table, run_host_bench, summarize
from kvchain.cli import main
from support.output import assert_fits, rendered

CELL_KEYS = {"page_bytes", "layers", "pinned", "backup_bytes", "backup_gb_per_s", "backup_copy_gb_per_s",
             "backup_ratio", "load_bytes", "load_gb_per_s", "load_copy_gb_per_s", "load_ratio"}


def test_a_cell_is_medians_of_its_rounds():
    # (backup bytes, backup s, its copy s, load bytes, load s, its copy s)
    rounds = [(10**9, 2.0, 1.0, 5 * 10**8, 1.0, 0.25), (10**9, 4.0, 1.0, 5 * 10**8, 2.0, 1.0),
              (10**9, 1.0, 1.0, 5 * 10**8, 4.0, 0.5)]
    cell = summarize(4096, 2, rounds, pinned=False)
    assert cell["backup_gb_per_s"] == 0.5 and cell["backup_copy_gb_per_s"] == 1.0
    assert cell["backup_ratio"] == 0.5  # quotients 0.5, 0.25, 1.0
    assert cell["load_gb_per_s"] == 0.25 and cell["load_copy_gb_per_s"] == 1.0
    assert cell["load_ratio"] == 0.25  # quotients 0.25, 0.5, 0.125
    assert set(cell) == CELL_KEYS
    other = dict(cell, page_bytes=8192, backup_ratio=0.75, load_ratio=0.1)
    assert headline([cell, other]) == {"worst_ratio": 0.1, "direction": "load", "page_bytes": 8192}


@pytest.fixture(scope="module")
def result() -> dict:
    return run_host_bench(layers=(1,), repeats=2, batch_pages=8)


def test_json_schema_and_real_copies(result: dict):
    assert next(iter(result)) == "headline"
    assert set(result) == {"headline", "device", "repeats", "batch_pages", "cells"}
    assert set(result["headline"]) == {"worst_ratio", "direction", "page_bytes"}
    (cell,) = result["cells"]
    assert set(cell) == CELL_KEYS and cell["layers"] == 1
    # a backup copies every full page, every window row and the state; a load what a match reads
    assert cell["backup_bytes"] > cell["load_bytes"] > 8 * cell["page_bytes"]
    assert all(cell[k] > 0 for k in CELL_KEYS - {"pinned", "layers"})
    assert result["headline"]["worst_ratio"] == min(cell["backup_ratio"], cell["load_ratio"])
    json.loads(json.dumps(result))


def test_cli_refuses_an_unknown_device(capsys):
    assert main(["bench", "host", "--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err


def test_the_table_fits_100_columns_without_cutting_a_figure(result: dict):
    text = rendered(host_table(result))
    assert_fits(text)
    for c in result["cells"]:
        assert str(c["backup_ratio"]) in text and str(c["load_ratio"]) in text
