"""`kvchain bench moves`: the sweep covers the page sizes and thread counts it names, each cell's
figures are consistent with each other, the headline is the worst cell, and the JSON keeps its
schema. Nothing here asserts a speed."""

from __future__ import annotations

import json
import os

import pytest

from kvchain.bench import moves_table
from kvchain.bench.moves import SWEEP_LAYERS, default_threads, page_bytes_for, run_moves_bench
from kvchain.cli import main
from support.output import assert_fits, rendered

CELL_KEYS = {"page_bytes", "threads", "pages_moved", "bytes_moved", "moves_gb_per_s", "copy_gb_per_s", "ratio"}


@pytest.fixture(scope="module")
def result() -> dict:
    return run_moves_bench(layers=(1, 4), threads=(1, 2), budget=2**25, repeats=1)


def test_sweep_spans_32_kib_to_2_mib_at_one_thread_and_every_core() -> None:
    assert [page_bytes_for(n) for n in SWEEP_LAYERS] == [32 * 2**10, 128 * 2**10, 512 * 2**10, 2 * 2**20]
    cores = os.cpu_count() or 1
    assert default_threads() == ((1,) if cores == 1 else (1, cores))


def test_json_schema(result: dict) -> None:
    assert next(iter(result)) == "headline"
    assert set(result) == {"headline", "device", "repeats", "cells"}
    assert set(result["headline"]) == {"worst_ratio", "page_bytes", "threads"}
    assert [(c["page_bytes"], c["threads"]) for c in result["cells"]] == [
        (page_bytes_for(n), t) for n in (1, 4) for t in (1, 2)]
    for cell in result["cells"]:
        assert set(cell) == CELL_KEYS
    json.loads(json.dumps(result))


def test_cell_arithmetic(result: dict) -> None:
    for cell in result["cells"]:
        assert cell["pages_moved"] > 0
        assert cell["bytes_moved"] == cell["pages_moved"] * cell["page_bytes"]
        # one repeat: the ratio is the quotient of the two bandwidths printed
        assert cell["ratio"] == pytest.approx(cell["moves_gb_per_s"] / cell["copy_gb_per_s"], rel=0.05)


def test_headline_is_the_worst_cell(result: dict) -> None:
    worst = min(result["cells"], key=lambda c: c["ratio"])
    assert result["headline"] == {"worst_ratio": worst["ratio"], "page_bytes": worst["page_bytes"],
                                  "threads": worst["threads"]}


def test_cli_refuses_an_unknown_device(capsys) -> None:
    assert main(["bench", "moves", "--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err


def test_the_table_fits_100_columns_without_cutting_a_figure(result: dict) -> None:
    text = rendered(moves_table(result))
    assert_fits(text)
    for c in result["cells"]:
        assert str(c["ratio"]) in text and str(c["moves_gb_per_s"]) in text
