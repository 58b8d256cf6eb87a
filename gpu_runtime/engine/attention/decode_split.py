"""How the paged decode kernel divides its work: splits per sequence and the tile.

Pure integer rules (no torch, no Triton), so they are tested on CPU. The rules by programs per
SM and the thresholds below are chosen in docs/decisions/0002-decode-attention-splits.md (the
sweep of `python -m bench.decode.attention`): from 1.25 (sequence, KV head) programs per SM on,
one split per sequence; below that, powers of two until about 3 programs per SM run, at most
`MAX_SPLITS`; split contexts use 32-token tiles, one split with fewer than 3 programs per SM
128-token tiles, else 64-token tiles with 3 stages.
"""

from __future__ import annotations

from typing import NamedTuple

MAX_SPLITS = 32
"""No more splits than this (batch 1's best, docs/decisions/0002-decode-attention-splits.md)."""
SINGLE_SPLIT_PROGRAMS_PER_SM = 1.25
"""From this many (sequence, KV head) programs per SM on, each sequence is one split."""
SPLIT_PROGRAMS_PER_SM = 3
"""Below that, split until about this many programs per SM run."""
LARGE_TILE_PROGRAMS_PER_SM = 3
"""One split with fewer programs per SM than this streams best with 128-token tiles."""


class DecodeTile(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int


def choose_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Splits per sequence (a power of two, 1..`MAX_SPLITS`) for a batch bucket; fixed per
    bucket because a CUDA graph fixes its grid, while contexts vary from step to step. A batch
    of 0 rows (a mixed step with no decode rows) gets 1: its launch has no programs."""
    if batch < 0 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(
            f"batch must be >= 0, num_kv_heads and num_sms >= 1, got {batch}, {num_kv_heads}, "
            f"{num_sms}"
        )
    programs = batch * num_kv_heads
    if programs == 0:
        return 1
    if programs >= SINGLE_SPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    target = -(-SPLIT_PROGRAMS_PER_SM * num_sms // programs)
    splits = 1
    while splits < target and splits < MAX_SPLITS:
        splits *= 2
    return splits


def choose_tile(programs: int, num_splits: int, num_sms: int = 132) -> DecodeTile:
    """The kernel's tile for `programs` = batch x KV heads and `num_splits` splits each."""
    if num_splits > 1:
        return DecodeTile(32, 4, 2)  # split contexts: short ranges, many programs
    if programs < LARGE_TILE_PROGRAMS_PER_SM * num_sms:
        return DecodeTile(128, 4, 2)  # few programs: more bytes in flight per program
    return DecodeTile(64, 4, 3)
