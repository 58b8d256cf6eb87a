"""Inputs and outputs of the memory manager: its configuration, decode's demand, the grant."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryManagerConfig:
    """Watermarks, step size and hysteresis of the `MemoryManager` (units: pool pages)."""

    reserve_low_pages: int = 64
    """Decode's mapped free pages are refilled up to this (plus waiting requests' needs)."""
    reserve_high_pages: int = 512
    """Above this many mapped free pages for `shrink_after_iterations`, decode gives pages back."""
    max_step_pages: int = 64
    """Most pages one `maintain` call maps, unmaps, lends or reclaims (small steps)."""
    shrink_after_iterations: int = 50
    """Consecutive iterations above the high watermark before KV pages go back."""
    grow_hold_iterations: int = 50
    """Iterations after the last reclaim before finetuning may grow again."""
    min_decode_pages: int = 1
    """Pages decode always keeps mapped (page 0 holds the padding block CUDA graphs read)."""
    max_waiting_pages: int = 1024
    """Cap on the pages the reserve grows by for queued requests."""
    growth_window: int = 4
    """Intervals between finetune quanta over which decode's block growth is remembered: the
    reserve refilled between quanta covers the largest (see `MemoryManager.refill_reserve`)."""
    plan_headroom_intervals: int = 4
    """Quanta are sized to the budget less the pages decode would take back if it grew this
    many more intervals at the largest recent rate (`FinetuneBudget.reclaim_headroom_pages`):
    finetune memory then stays below the budget a reclaim leaves, so that reclaim is a cap
    change, not a cache flush (which waits for the device and drops the trainers' CUDA graphs).
    0: quanta are sized to the whole budget."""
    headroom_window: int = 64
    """Intervals between quanta over which the largest decode growth is remembered for the plan
    headroom: longer than `growth_window`, so that a quiet spell between bursts does not let
    finetuning fill the budget again right before the next burst's reclaims."""
    plan_headroom_min_pages: int = 0
    """The plan headroom is at least this (when `plan_headroom_intervals` > 0), decode's free
    pages included: what the first refill of a burst takes before any growth was seen (e.g.
    the low watermark plus `max_waiting_pages`)."""
    plan_peak_window: int = 0
    """> 0: the plan headroom also covers decode's peak over this many quantum boundaries
    (plus the low watermark): quanta are planned to fit beside the last burst's peak, so a
    burst of the same size reclaims by cap changes (`gpu_runtime.memory.headroom`). 0: off."""
    plan_peak_prior_blocks: int = 0
    """With `plan_peak_window`: a peak known before any boundary (e.g. the host's history),
    counted as the first observation; it ages out like the others."""
    reclaim_from_finetune: bool = True
    """False turns the pool into a static split: pages lent to finetuning never come back to
    decode, which preempts instead (the baseline the benchmark compares with)."""

    def __post_init__(self) -> None:
        for name in (
            "reserve_low_pages",
            "reserve_high_pages",
            "shrink_after_iterations",
            "grow_hold_iterations",
            "max_waiting_pages",
            "plan_headroom_intervals",
            "plan_headroom_min_pages",
            "plan_peak_window",
            "plan_peak_prior_blocks",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.growth_window < 1:
            raise ValueError(f"growth_window must be >= 1, got {self.growth_window}")
        if self.headroom_window < 1:
            raise ValueError(f"headroom_window must be >= 1, got {self.headroom_window}")
        if self.max_step_pages <= 0:
            raise ValueError(f"max_step_pages must be positive, got {self.max_step_pages}")
        if self.min_decode_pages < 1:
            raise ValueError(f"min_decode_pages must be >= 1, got {self.min_decode_pages}")
        if self.reserve_high_pages <= self.reserve_low_pages:
            raise ValueError(
                f"reserve_high_pages ({self.reserve_high_pages}) must exceed "
                f"reserve_low_pages ({self.reserve_low_pages})"
            )


@dataclass(frozen=True)
class DecodeDemand:
    """Decode's block usage as its block manager and scheduler see it now."""

    used_blocks: int
    """Blocks held by running requests."""
    next_step_blocks: int = 0
    """Blocks the next step will allocate (tokens crossing a block edge, admitted prefills)."""
    waiting_blocks: int = 0
    """Blocks the queued (not yet admitted) requests would need: grows the reserve ahead."""
    top_used_block: int | None = None
    """One past the highest block id in use (0 when none), if known; blocks below it can't be
    unmapped. Costly to compute, so `maintain` also takes it as a callable, asked only when
    decode is about to give pages back."""

    def __post_init__(self) -> None:
        for name in ("used_blocks", "next_step_blocks", "waiting_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.top_used_block is not None and self.top_used_block < self.used_blocks:
            raise ValueError(
                f"top_used_block ({self.top_used_block}) < used_blocks ({self.used_blocks})"
            )


@dataclass(frozen=True)
class DecodeGrant:
    """What the decode block manager applies before allocating for the next step."""

    usable_blocks: int
    """Block ids `[0, usable_blocks)` are backed by memory; allocate only below this."""
    short_blocks: int
    """Blocks the next step wants beyond `usable_blocks`: preempt requests to free them."""
