"""bench/decode/attention.py: the choice of a split per batch from measured rows, and its
options (the timing itself needs a CUDA GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.decode.attention import best_split_per_batch, parse_args


def _row(batch: int, context: int, splits: int, us: float, block_n: int = 64) -> dict[str, Any]:
    return {
        "batch": batch,
        "context": context,
        "num_splits": splits,
        "block_n": block_n,
        "num_warps": 4,
        "num_stages": 2,
        "us_per_layer_p50": us,
    }


def test_best_split_is_least_time_summed_over_the_batchs_contexts() -> None:
    rows = [
        _row(8, 512, 1, 9.0),
        _row(8, 2048, 1, 30.0),  # fastest at 512 only: 39 in all
        _row(8, 512, 4, 10.0),
        _row(8, 2048, 4, 20.0),  # fastest summed: 30
        _row(8, 512, 8, 11.0),
        _row(8, 2048, 8, 19.5),  # fastest at 2048 only: 30.5
        _row(64, 512, 1, 40.0),
        _row(64, 2048, 1, 150.0),
        _row(64, 512, 2, 39.0),  # measured at one context only: cannot compete
    ]
    best = best_split_per_batch(rows)
    assert best[8]["num_splits"] == 4 and best[8]["us_summed"] == 30.0
    assert best[8]["us_per_context"] == {"512": 10.0, "2048": 20.0}
    assert best[64]["num_splits"] == 1 and best[64]["us_summed"] == 190.0


def test_tiles_compete_as_well_as_splits() -> None:
    rows = [_row(1, 512, 2, 8.0, block_n=32), _row(1, 512, 2, 7.0, block_n=128)]
    assert best_split_per_batch(rows)[1]["block_n"] == 128


@pytest.mark.parametrize(
    "argv",
    [["--batches", "8,x"], ["--splits", "0,2"], ["--contexts", ""], ["--reps", "2"]],
)
def test_bad_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_defaults_cover_the_engine_buckets() -> None:
    args = parse_args([])
    assert args.batches == [1, 8, 32, 64, 128, 256] and args.contexts == [512, 2048]
    assert 1 in args.splits and args.layers == 32
