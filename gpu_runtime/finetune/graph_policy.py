"""Which training micro-batches get a CUDA graph: shape buckets, keys, and the capture policy.

Plain bookkeeping (no torch), so the rules are tested exactly on any machine; the graphs
themselves live in :mod:`gpu_runtime.finetune.graphs`.

Once a stream is warm (one eager micro-batch ran on it), a shape is captured when it has been
seen ``capture_after`` times (default 1: at once). Capturing costs about one or two eager
micro-batches of host time, but every eager micro-batch of a new
shape also grows torch's ordinary cache beside the graphs' pool by that shape's activations (GBs),
so by default only the warm-up runs eagerly; ``capture_after=2`` keeps shapes seen once eager. At
most ``max_graphs`` shapes stay captured, and a captured shape is dropped for a new one only when
it has gone unused for ``stale_after`` micro-batches; otherwise the new shape runs eagerly. So a
workload with more frequent shapes than slots never thrashes (capture, evict, capture again).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MIN_BUCKET = 64
STEPS_PER_OCTAVE = 4


def bucket_length(
    n: int, minimum: int = MIN_BUCKET, steps_per_octave: int = STEPS_PER_OCTAVE
) -> int:
    """The smallest bucket ``>= n``: ``minimum``, then ``steps_per_octave`` evenly spaced steps
    per power of two (64, 80, 96, 112, 128, 160, ..., 256, 320, ..., 2048, 2560, ...)."""
    if n < 1 or minimum < 1 or steps_per_octave < 1:
        raise ValueError(f"n={n}, minimum={minimum}, steps_per_octave={steps_per_octave} >= 1")
    if n <= minimum:
        return minimum
    octave = 1 << ((n - 1).bit_length() - 1)  # largest power of two below n
    step = max(1, octave // steps_per_octave)
    return -(-n // step) * step


@dataclass(frozen=True)
class GraphKey:
    """What one captured graph is valid for."""

    rows: int
    """Examples in the micro-batch."""
    seq_len: int
    """Padded sequence length (a :func:`bucket_length` value)."""
    loss_slots: int
    """Loss positions, padded (a :func:`bucket_length` value, at most ``rows * seq_len``)."""
    stream: int
    """Raw handle of the CUDA stream the graph was captured on and replays on."""
    recompute: bool = False
    """Whether the micro-batch recomputes its activations in the backward (another graph:
    other kernels, a smaller pool)."""


def loss_slots(rows: int, seq_len: int, loss_positions: int) -> int:
    """Padded loss-position count of a micro-batch (room for every position at most)."""
    return min(bucket_length(max(1, loss_positions)), rows * seq_len)


@dataclass(frozen=True)
class Decision:
    """What to do with one micro-batch."""

    action: str
    """"replay", "capture" or "eager"."""
    reason: str | None = None
    """Why it runs eagerly."""
    evict: GraphKey | None = None
    """A stale graph to drop before capturing."""


class CapturePolicy:
    """Decides per micro-batch (see the module docstring); the caller reports what happened."""

    def __init__(
        self, max_graphs: int = 32, capture_after: int = 1, stale_after: int | None = None
    ) -> None:
        if max_graphs < 1 or capture_after < 1:
            raise ValueError(f"max_graphs={max_graphs}, capture_after={capture_after} >= 1")
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self.stale_after = 4 * max_graphs if stale_after is None else stale_after
        self.seen: Counter[GraphKey] = Counter()
        self.refused: set[GraphKey] = set()
        """Shapes whose capture ran out of memory: they stay eager."""
        self._last_used: dict[GraphKey, int] = {}  # captured keys -> clock of last use
        self._clock = 0

    @property
    def captured(self) -> list[GraphKey]:
        """Captured keys, least recently used first."""
        return sorted(self._last_used, key=self._last_used.__getitem__)

    def decide(self, key: GraphKey, stream_warm: bool) -> Decision:
        """``stream_warm``: an eager micro-batch already ran on this (thread, stream)."""
        self._clock += 1
        self.seen[key] += 1
        if key in self._last_used:
            self._last_used[key] = self._clock
            return Decision("replay")
        if not stream_warm:
            return Decision("eager", "first micro-batch on this stream (warm-up)")
        if key in self.refused:
            return Decision("eager", "this shape's capture ran out of memory")
        seen = self.seen[key]
        if seen < self.capture_after:
            return Decision("eager", f"shape seen {seen}x, captured from {self.capture_after}x")
        evict = None
        if len(self._last_used) >= self.max_graphs:
            oldest = self.captured[0]
            if self._clock - self._last_used[oldest] < self.stale_after:
                return Decision("eager", f"all {self.max_graphs} graph slots in recent use")
            evict = oldest
        return Decision("capture", evict=evict)

    def added(self, key: GraphKey) -> None:
        """``key`` was captured (after a "capture" decision)."""
        self._last_used[key] = self._clock

    def removed(self, key: GraphKey) -> None:
        self._last_used.pop(key, None)

    def out_of_memory(self, key: GraphKey) -> None:
        """Capturing ``key`` ran out of memory: never try that shape again."""
        self.refused.add(key)

    def clear(self) -> None:
        """Every graph was dropped."""
        self._last_used.clear()
