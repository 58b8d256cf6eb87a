"""What the decode step prefetches into L2, and the byte ranges it asks for (no torch, no Triton).

A decode step at small batch leaves HBM idle during its small kernels (RoPE, the latency-bound
paged attention, the gaps between kernels), then reads each projection's weight in a GEMM too
short to reach copy bandwidth. Prefetching the next bytes into L2 while HBM is idle moves those
reads off the GEMM's (or the attention's) critical path. Targets, each issued at a fixed point
of the layer by `gpu_runtime.engine.l2_prefetch`:
- ``"o"``: the layer's o-projection weight, issued right after the q|k|v GEMM (it then loads
  during RoPE and attention);
- ``"kv"``: the batch's K/V blocks of the layer, issued before the layer's input RMSNorm (they
  then load during the norm and the q|k|v GEMM): each row's first blocks, at most
  `kv_max_bytes` per layer over the batch (`kv_blocks_per_row`).

The prefetch is a hint (Hopper's bulk L2 prefetch): it changes no value, only where bytes are
read from; a range the L2 cannot hold is simply read from HBM again.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFETCH_TARGETS = ("o", "kv")
BULK_ALIGN = 16
"""Bulk prefetches take 16-byte aligned addresses and sizes in multiples of 16 bytes."""


@dataclass(frozen=True)
class L2Prefetch:
    """The decode step's prefetch settings (`EngineConfig.decode_l2_prefetch` and friends)."""

    targets: frozenset[str] = frozenset()
    chunk_bytes: int = 16384
    """Bytes one bulk prefetch instruction asks for (one per thread)."""
    evict_last: bool = False
    """Prefetched lines carry L2's evict-last priority instead of the normal one."""
    kv_max_bytes: int = 24 << 20
    """K/V bytes per layer prefetched at most, shared evenly by the step's rows: more would not
    stay in L2 beside the weights streaming through it."""

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(PREFETCH_TARGETS)
        if unknown:
            raise ValueError(
                f"unknown L2 prefetch targets {sorted(unknown)}; known: {list(PREFETCH_TARGETS)}"
            )
        if self.chunk_bytes <= 0 or self.chunk_bytes % BULK_ALIGN:
            raise ValueError(
                f"chunk_bytes={self.chunk_bytes} must be a positive multiple of {BULK_ALIGN}"
            )
        if self.kv_max_bytes < 0:
            raise ValueError(f"kv_max_bytes={self.kv_max_bytes} must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.targets)


def range_chunks(nbytes: int, chunk_bytes: int) -> int:
    """Bulk prefetches needed for `nbytes` (the last one may be shorter)."""
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    return -(-nbytes // chunk_bytes)


def check_range(address: int, nbytes: int) -> None:
    """Bulk prefetch's alignment rules, checked before a launch (a misaligned bulk prefetch is
    an illegal instruction on the device, which would poison the CUDA context)."""
    if address % BULK_ALIGN or nbytes % BULK_ALIGN:
        raise ValueError(
            f"L2 prefetch range at {address:#x} of {nbytes} bytes is not {BULK_ALIGN}-byte aligned"
        )


def kv_blocks_per_row(rows: int, block_bytes: int, kv_max_bytes: int) -> int:
    """Blocks each of a step's `rows` prefetches (its first ones), so the batch asks for at most
    `kv_max_bytes` per layer; 0: the step prefetches no K/V."""
    if rows <= 0 or block_bytes <= 0:
        raise ValueError(f"rows={rows} and block_bytes={block_bytes} must be positive")
    return kv_max_bytes // (rows * block_bytes)
