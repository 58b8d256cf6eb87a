"""Fallback sharing: two plain CUDA streams, no spatial split.

Decode runs on a high-priority stream and finetune on a low-priority one; both see every SM.
Stream priority only orders the *dispatch* of thread blocks waiting for an SM, it does not
preempt running blocks, so a long finetune kernel still delays decode. The scheduler must therefore
size each finetune quantum to the iteration's slack (predicted TPOT budget minus predicted decode
time alone) when this mechanism is in use.
"""

from __future__ import annotations

import torch

from gpu_runtime.sharing.base import GpuSharing
from gpu_runtime.sharing.partition import PartitionTable


class StreamSharing(GpuSharing):
    """Time sharing on two streams; the only valid split is the whole device."""

    mechanism = "streams"

    def __init__(self, device: torch.device, total_sms: int | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"StreamSharing needs a CUDA device, got {device}")
        if total_sms is None:
            total_sms = torch.cuda.get_device_properties(device).multi_processor_count
        super().__init__(PartitionTable(total_sms=total_sms, decode_sms_options=()), device)
        a, b = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        # In CUDA a numerically lower priority is more urgent (e.g. -5 beats 0).
        self._decode = torch.cuda.Stream(device=device, priority=min(a, b))
        self._finetune = torch.cuda.Stream(device=device, priority=max(a, b))
        self._closed = False

    def partition(self, decode_sms: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The two streams; ``decode_sms`` must be the device's SM count (no split exists)."""
        if self._closed:
            raise RuntimeError("StreamSharing is closed")
        self.table.get(decode_sms)
        return self._decode, self._finetune

    def close(self) -> None:
        # torch owns these streams; dropping the object is enough.
        self._closed = True
