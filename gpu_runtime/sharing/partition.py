"""The SM partition table: which decode/finetune splits exist on a device (pure Python, no CUDA).

A split gives decode ``decode_sms`` streaming multiprocessors and finetune the rest. On Hopper the
driver hands out SM groups in multiples of 8 (``cuDevSmResourceSplitByCount`` rounds the request
up to its granularity), so the decode side is ``k * 8`` SMs for a chosen set of ``k``. The whole
device (``decode_sms == total_sms``) is always a valid choice: it means no spatial split, decode on
a full-device stream and finetune (if any) time-shared beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

SM_GRANULARITY_HOPPER = 8
"""SM groups on compute capability 9.x come in multiples of this many SMs."""

MIN_FINETUNE_SMS_HOPPER = 16
"""Smallest remainder kept for finetune: a bf16 cuBLAS GEMM on a smaller side (12 SMs) fails
with CUBLAS_STATUS_EXECUTION_FAILED although the split is created
(docs/decisions/0018-green-contexts-vs-streams.md)."""


class PartitionError(ValueError):
    """A requested SM split does not exist in the table or cannot exist on the device."""


@dataclass(frozen=True)
class Partition:
    """One decode/finetune split of the device's SMs.

    Attributes:
        decode_sms: SMs reserved for decode kernels (``k * granularity``, or ``total_sms``).
        finetune_sms: SMs left to finetune kernels; 0 only when ``spatial`` is False and the
            split is the whole device, in which case finetune shares all SMs in time.
        spatial: True when decode and finetune run on disjoint SM sets (green contexts).
    """

    decode_sms: int
    finetune_sms: int
    spatial: bool

    @property
    def decode_share(self) -> float:
        """Fraction of the device's SMs decode may use (0..1]."""
        return self.decode_sms / (self.decode_sms + self.finetune_sms)


@dataclass(frozen=True)
class PartitionTable:
    """The set of splits created up front, so the engine can change split every iteration.

    Attributes:
        total_sms: SMs on the device (132 on an H200 SXM).
        decode_sms_options: decode SM counts with a spatial split, ascending, each a multiple of
            ``granularity`` with at least ``min_finetune_sms`` left over.
        granularity: SM group granularity of the driver on this architecture.
        min_finetune_sms: smallest finetune side worth creating.
    """

    total_sms: int
    decode_sms_options: tuple[int, ...]
    granularity: int = SM_GRANULARITY_HOPPER
    min_finetune_sms: int = MIN_FINETUNE_SMS_HOPPER

    def __post_init__(self) -> None:
        if self.total_sms <= 0:
            raise PartitionError(f"total_sms must be positive, got {self.total_sms}")
        if self.granularity <= 0:
            raise PartitionError(f"granularity must be positive, got {self.granularity}")
        if self.min_finetune_sms <= 0:
            raise PartitionError(f"min_finetune_sms must be positive, got {self.min_finetune_sms}")
        if list(self.decode_sms_options) != sorted(set(self.decode_sms_options)):
            raise PartitionError(
                f"decode_sms_options must be strictly ascending, got {self.decode_sms_options}"
            )
        for sms in self.decode_sms_options:
            if sms <= 0 or sms % self.granularity:
                raise PartitionError(
                    f"decode_sms {sms} is not a positive multiple of granularity {self.granularity}"
                )
            if self.total_sms - sms < self.min_finetune_sms:
                raise PartitionError(
                    f"decode_sms {sms} leaves {self.total_sms - sms} SMs for finetune on a "
                    f"{self.total_sms}-SM device; at least {self.min_finetune_sms} are required"
                )

    @classmethod
    def build(
        cls,
        total_sms: int,
        decode_groups: tuple[int, ...] | None = None,
        granularity: int = SM_GRANULARITY_HOPPER,
        min_finetune_sms: int = MIN_FINETUNE_SMS_HOPPER,
    ) -> PartitionTable:
        """Table whose decode sides are ``k * granularity`` SMs for each ``k`` in decode_groups.

        ``decode_groups=None`` creates every ``k`` that leaves ``min_finetune_sms`` for finetune
        (k = 1..14 on a 132-SM H200).
        """
        if decode_groups is None:
            max_k = (total_sms - min_finetune_sms) // granularity
            decode_groups = tuple(range(1, max_k + 1))
        return cls(
            total_sms=total_sms,
            decode_sms_options=tuple(sorted({k * granularity for k in decode_groups})),
            granularity=granularity,
            min_finetune_sms=min_finetune_sms,
        )

    @property
    def choices(self) -> tuple[int, ...]:
        """Every decode SM count ``partition()`` accepts: the spatial options, then the device."""
        return (*self.decode_sms_options, self.total_sms)

    def get(self, decode_sms: int) -> Partition:
        """The split giving decode exactly ``decode_sms`` SMs; PartitionError if not created."""
        if decode_sms == self.total_sms:
            return Partition(decode_sms=self.total_sms, finetune_sms=0, spatial=False)
        if decode_sms not in self.decode_sms_options:
            raise PartitionError(
                f"no partition with {decode_sms} decode SMs; created: {list(self.choices)}"
            )
        return Partition(
            decode_sms=decode_sms, finetune_sms=self.total_sms - decode_sms, spatial=True
        )

    def at_least(self, decode_sms: int) -> Partition:
        """The smallest created split giving decode at least ``decode_sms`` SMs."""
        if decode_sms <= 0:
            raise PartitionError(f"decode_sms must be positive, got {decode_sms}")
        for option in self.choices:
            if option >= decode_sms:
                return self.get(option)
        raise PartitionError(f"{decode_sms} SMs exceed the device's {self.total_sms}")
