"""The decode step's L2 prefetch settings and byte ranges, without a GPU."""

from __future__ import annotations

import pytest

from gpu_runtime.engine import EngineConfig
from gpu_runtime.engine.config import EngineConfigError
from gpu_runtime.engine.prefetch_plan import (
    L2Prefetch,
    check_range,
    kv_blocks_per_row,
    range_chunks,
)


def test_settings_name_known_targets_and_bulk_sizes() -> None:
    assert not L2Prefetch().enabled
    assert L2Prefetch(targets=frozenset({"o", "kv"})).enabled
    with pytest.raises(ValueError, match=r"unknown L2 prefetch targets \['qkv'\]"):
        L2Prefetch(targets=frozenset({"o", "qkv"}))
    for chunk in (0, -16, 100):
        with pytest.raises(ValueError, match="multiple of 16"):
            L2Prefetch(chunk_bytes=chunk)
    with pytest.raises(ValueError, match="kv_max_bytes"):
        L2Prefetch(kv_max_bytes=-1)


def test_engine_config_refuses_unknown_targets() -> None:
    config = EngineConfig(num_kv_blocks=8, decode_l2_prefetch=("o", "kv"))
    assert config.decode_l2_prefetch == ("o", "kv")
    with pytest.raises(EngineConfigError, match=r"decode_l2_prefetch=\('gate_up',\)"):
        EngineConfig(num_kv_blocks=8, decode_l2_prefetch=("gate_up",))


def test_ranges_split_into_chunks_and_keep_the_alignment_rule() -> None:
    # Llama-3-8B's o-projection: 4096 x 4096 bf16 in 16 KiB prefetches
    assert range_chunks(4096 * 4096 * 2, 16384) == 2048
    assert range_chunks(16400, 16384) == 2  # a short last chunk
    assert range_chunks(0, 16384) == 0
    with pytest.raises(ValueError):
        range_chunks(-1, 16384)
    check_range(0x7F0000000000, 33554432)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_range(0x7F0000000002, 32)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_range(0x7F0000000000, 24)


def test_kv_budget_is_shared_by_the_rows() -> None:
    block = 2 * 8 * 16 * 128 * 2  # K and V of one layer, Llama heads, 16-token blocks: 64 KiB
    budget = 24 << 20
    assert kv_blocks_per_row(8, block, budget) == 48  # b=8: every block up to 768 tokens
    assert kv_blocks_per_row(32, block, budget) == 12
    assert kv_blocks_per_row(512, block, budget) == 0  # nothing: the step prefetches no K/V
    with pytest.raises(ValueError):
        kv_blocks_per_row(0, block, budget)
