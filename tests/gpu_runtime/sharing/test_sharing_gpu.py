"""Green-context partitions and the stream fallback on a real GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.sharing import PartitionError, SmPartitioner, StreamSharing, create_sharing

pytestmark = pytest.mark.gpu


def test_partitions_compute_the_same_result_as_the_default_stream() -> None:
    device = torch.device("cuda", 0)
    with SmPartitioner(device, decode_groups=(6, 9)) as sharing:
        assert sharing.granted[48][0] == 48
        assert sum(sharing.granted[48]) == sharing.table.total_sms
        x = torch.randn(64, 1024, device=device)
        w = torch.randn(1024, 2048, device=device)
        reference = x @ w
        for k in sharing.table.choices:
            for stream in sharing.partition(k):
                with torch.cuda.stream(stream):
                    out = x @ w
                stream.synchronize()
                torch.testing.assert_close(out, reference)
        with pytest.raises(PartitionError):
            sharing.partition(56)


def test_stream_fallback_only_offers_the_whole_device() -> None:
    device = torch.device("cuda", 0)
    sharing = StreamSharing(device)
    total = sharing.table.total_sms
    decode, finetune = sharing.partition(total)
    assert decode.priority < finetune.priority
    with pytest.raises(PartitionError):
        sharing.partition(48)


def test_create_sharing_prefers_green_contexts() -> None:
    sharing = create_sharing(torch.device("cuda", 0), decode_groups=(6,))
    try:
        assert sharing.mechanism == "green_context"
    finally:
        sharing.close()
