"""Decode's recent history between finetune quanta, and the plan headroom it implies.

`DecodeHistory` is fed once per quantum boundary (`MemoryManager.refill_reserve`) with decode's
used blocks. From it come two figures:
- the reserve refill's extra: the largest growth over one of the last `growth_window`
  intervals (what decode may add before the next boundary);
- the plan headroom: budget pages decode is expected to take back soon, which the next quantum
  must leave alone so that those reclaims are cap changes, not cache flushes. It is the largest
  of: `plan_headroom_intervals` times the largest growth over the last `headroom_window`
  intervals; the floor `plan_headroom_min_pages`; and, with `plan_peak_window` > 0, what decode
  would need at its peak over the last `plan_peak_window` boundaries (a prior,
  `plan_peak_prior_blocks`, counts as the first observation and ages out like any other) plus
  the low watermark. The peak term is what keeps CUDA-graphed quanta (whose private pool,
  sized by the largest shape captured, only a flush returns) from growing into memory the next
  burst of the same size will need.

The maxima over the windows change only in `observe` (once per quantum boundary), so they are
computed there and read as plain integers by `headroom_pages`, which the manager calls every
iteration (`FinetuneBudget.plan_bytes`): no pass over a window per iteration.
"""

from __future__ import annotations

from collections import deque

from gpu_runtime.memory.config import MemoryManagerConfig
from gpu_runtime.memory.layout import KVLayout


class DecodeHistory:
    """Decode's used blocks at recent quantum boundaries (plain integers)."""

    def __init__(self, config: MemoryManagerConfig, layout: KVLayout) -> None:
        self._config = config
        self._layout = layout
        self._used_at_last: int | None = None
        self._interval_growth: deque[int] = deque(maxlen=config.growth_window)
        self._headroom_growth: deque[int] = deque(maxlen=config.headroom_window)
        self._recent_used: deque[int] = deque(maxlen=max(config.plan_peak_window, 1))
        if config.plan_peak_window and config.plan_peak_prior_blocks:
            self._recent_used.append(config.plan_peak_prior_blocks)
        self._refill_growth = 0
        self._headroom_growth_max = 0
        self._peak_used = max(self._recent_used, default=0) if config.plan_peak_window else 0
        self.version = 0
        """Observations so far: what derived figures are cached against."""

    def observe(self, used_blocks: int) -> None:
        """One quantum boundary: decode holds `used_blocks` now."""
        self.version += 1
        if self._used_at_last is not None:
            growth = max(used_blocks - self._used_at_last, 0)
            self._refill_growth = _append_max(self._interval_growth, growth, self._refill_growth)
            self._headroom_growth_max = _append_max(
                self._headroom_growth, growth, self._headroom_growth_max
            )
        self._used_at_last = used_blocks
        if self._config.plan_peak_window:
            self._peak_used = _append_max(self._recent_used, used_blocks, self._peak_used)

    def refill_growth_blocks(self) -> int:
        """The largest growth over one of the last `growth_window` intervals."""
        return self._refill_growth

    def peak_used_blocks(self) -> int:
        """Decode's most used blocks over the last `plan_peak_window` boundaries (0: off)."""
        return self._peak_used

    def headroom_pages(self, kv_prefix_pages: int, *, with_peak: bool = True) -> int:
        """Pages decode may map beyond its `kv_prefix_pages` before long (not yet rounded to
        the map unit nor reduced by the free pages); `with_peak=False` leaves the peak term
        out (recent growth and the floor only)."""
        cfg = self._config
        layout = self._layout
        growth = self._headroom_growth_max * cfg.plan_headroom_intervals
        pages = max(layout.pages_for_blocks(growth), cfg.plan_headroom_min_pages)
        if cfg.plan_peak_window and with_peak:
            low_blocks = layout.blocks_in_pages(cfg.reserve_low_pages)
            at_peak = layout.pages_for_blocks(self.peak_used_blocks() + low_blocks)
            pages = max(pages, at_peak - kv_prefix_pages)
        return pages


def _append_max(window: deque[int], value: int, current_max: int) -> int:
    """Append `value` (>= 0) to the bounded `window` whose maximum is `current_max` (0 when
    empty); returns the new maximum. A full pass only when the value pushed out was the
    maximum and the new one is smaller."""
    if window.maxlen == 0:
        return 0
    evicted = window[0] if window and len(window) == window.maxlen else None
    window.append(value)
    if value >= current_max:
        return value
    if evicted is not None and evicted >= current_max:
        return max(window)
    return current_max
