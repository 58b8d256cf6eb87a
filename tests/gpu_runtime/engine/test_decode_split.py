"""The paged decode kernel's work division (`decode_split`): the rules the H200 sweep chose."""

from __future__ import annotations

import pytest

from gpu_runtime.engine.attention.decode_split import (
    MAX_SPLITS,
    DecodeTile,
    choose_num_splits,
    choose_tile,
)


@pytest.mark.parametrize(
    ("batch", "splits"),
    [(1, 32), (2, 32), (4, 16), (8, 8), (16, 4), (24, 1), (32, 1), (64, 1), (256, 1)],
)
def test_llama_heads_on_the_h200(batch: int, splits: int) -> None:
    # 8 KV heads, 132 SMs: split until ~3 programs per SM, one split from 1.25 per SM
    assert choose_num_splits(batch, 8, 132) == splits


def test_fewer_kv_heads_split_more_and_splits_stay_powers_of_two() -> None:
    assert choose_num_splits(8, 4, 132) == 16  # Qwen2.5-7B: 4 KV heads, 32 programs
    for batch in range(1, 300):
        for kv_heads in (1, 2, 4, 8):
            splits = choose_num_splits(batch, kv_heads, 132)
            assert 1 <= splits <= MAX_SPLITS and splits & (splits - 1) == 0
    assert choose_num_splits(1, 1, 132) == MAX_SPLITS


def test_tiles() -> None:
    assert choose_tile(64, 8) == DecodeTile(32, 4, 2)  # split contexts
    assert choose_tile(256, 1) == DecodeTile(128, 4, 2)  # batch 32: ~2 programs per SM
    assert choose_tile(512, 1) == DecodeTile(64, 4, 3)  # batch 64 and up
    assert choose_tile(256, 1, num_sms=64) == DecodeTile(64, 4, 3)  # 4 per SM on 64 SMs


def test_no_rows_is_one_split_and_bad_arguments_are_refused() -> None:
    assert choose_num_splits(0, 8, 132) == 1  # a mixed step without decode rows
    with pytest.raises(ValueError, match="got -1, 8, 132"):
        choose_num_splits(-1, 8, 132)
    with pytest.raises(ValueError, match="got 8, 0, 132"):
        choose_num_splits(8, 0, 132)
