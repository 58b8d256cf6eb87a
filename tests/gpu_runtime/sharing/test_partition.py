"""Partition table, validation and mechanism selection (pure Python, no GPU)."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.sharing import (
    GreenContextError,
    PartitionError,
    PartitionTable,
    SmPartitioner,
    StreamSharing,
    choose_mechanism,
)
from gpu_runtime.sharing.green import green_context_unavailable_reason, sm_granularity


def test_h200_table_has_every_multiple_of_eight_leaving_finetune_sms() -> None:
    table = PartitionTable.build(132)
    assert table.decode_sms_options == tuple(range(8, 113, 8))
    assert table.choices[-1] == 132
    part = table.get(48)
    assert (part.decode_sms, part.finetune_sms, part.spatial) == (48, 84, True)
    assert part.decode_share == pytest.approx(48 / 132)


def test_whole_device_is_time_shared_not_split() -> None:
    part = PartitionTable.build(132, (6, 9)).get(132)
    assert (part.decode_sms, part.finetune_sms, part.spatial) == (132, 0, False)
    assert part.decode_share == 1.0


def test_selected_groups_only() -> None:
    table = PartitionTable.build(132, (9, 6, 6))
    assert table.decode_sms_options == (48, 72)
    with pytest.raises(PartitionError, match="no partition with 56 decode SMs"):
        table.get(56)


def test_at_least_rounds_up_to_created_split() -> None:
    table = PartitionTable.build(132, (6, 9))
    assert table.at_least(1).decode_sms == 48
    assert table.at_least(49).decode_sms == 72
    assert table.at_least(73).decode_sms == 132
    with pytest.raises(PartitionError, match="exceed"):
        table.at_least(133)
    with pytest.raises(PartitionError, match="positive"):
        table.at_least(0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ((12,), "not a positive multiple of granularity 8"),
        ((128,), "leaves 4 SMs for finetune"),
        ((120,), "leaves 12 SMs for finetune on a 132-SM device; at least 16"),
        ((16, 8), "strictly ascending"),
        ((0,), "not a positive multiple"),
    ],
)
def test_invalid_tables_are_rejected_with_values(options: tuple[int, ...], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        PartitionTable(total_sms=132, decode_sms_options=options)


def test_granularity_by_architecture() -> None:
    assert [sm_granularity(m) for m in (7, 8, 9, 10)] == [2, 4, 8, 8]
    assert (
        PartitionTable.build(108, granularity=4, min_finetune_sms=4).decode_sms_options[-1] == 104
    )


def test_mechanism_choice() -> None:
    assert choose_mechanism("green_context", None).mechanism == "green_context"
    fallback = choose_mechanism("green_context", "cuda-bindings is not installed")
    assert (fallback.mechanism, fallback.fallback_reason) == (
        "streams",
        "cuda-bindings is not installed",
    )
    assert choose_mechanism("streams", None) == choose_mechanism("streams", "anything")
    with pytest.raises(GreenContextError, match="unavailable: no driver"):
        choose_mechanism("green_context", "no driver", strict=True)
    with pytest.raises(ValueError, match="unknown sharing mechanism 'mps'"):
        choose_mechanism("mps", None)


def test_cpu_device_has_no_green_contexts() -> None:
    reason = green_context_unavailable_reason(torch.device("cpu"))
    assert reason == "cpu is not a CUDA device"
    with pytest.raises(GreenContextError, match="not a CUDA device"):
        SmPartitioner(torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StreamSharing(torch.device("cpu"))
