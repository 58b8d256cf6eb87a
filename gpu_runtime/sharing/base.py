"""The interface the engine loop uses to share one GPU between decode and finetune."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self

import torch

from gpu_runtime.sharing.partition import Partition, PartitionTable


class GpuSharing(ABC):
    """Hands the engine loop a (decode stream, finetune stream) pair for the chosen split.

    Contract:
      * ``partition(decode_sms)`` is O(1) and launches nothing: every stream was created up
        front, so the split may change every decode iteration.
      * Work on the two returned streams may overlap; ordering between them (e.g. the finetune
        quantum reading weights that decode also reads) is the caller's, through events.
      * A CUDA graph runs on the SMs of the context its stream belonged to at **capture** time,
        whatever stream replays it: capture decode graphs once per (batch bucket, decode_sms)
        on ``partition(decode_sms)[0]``.
      * ``close()`` releases the streams and contexts; the object is unusable afterwards.
    """

    mechanism: str
    """``"green_context"`` (spatial SM split) or ``"streams"`` (time sharing only)."""

    def __init__(self, table: PartitionTable, device: torch.device) -> None:
        self.table = table
        self.device = device

    @property
    def spatial(self) -> bool:
        """True when decode and finetune can be given disjoint SM sets."""
        return self.mechanism == "green_context"

    def info(self, decode_sms: int) -> Partition:
        """The split ``partition(decode_sms)`` returns streams for (PartitionError if none)."""
        return self.table.get(decode_sms)

    @abstractmethod
    def partition(self, decode_sms: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(decode_stream, finetune_stream) for the split giving decode ``decode_sms`` SMs."""

    @abstractmethod
    def close(self) -> None:
        """Destroy what was created; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
