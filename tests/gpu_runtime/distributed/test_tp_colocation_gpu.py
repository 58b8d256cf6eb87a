"""Two GPUs (NCCL): the co-location loop over a TP 2 engine group with green-context
partitions on every rank. Each rank builds its own split table (`follower_sharing`), decode
graphs are captured per split on every rank together (rank 0 on its split's decode stream,
each follower on its own), and the loop's plans alternate the split: the follower launches
every step on rank 0's split and runs rank 0's quanta, in order, on its split's finetune
stream. Tokens agree with the TP 1 loop's within fp32 rounding of a two-rank sum, the job's
losses within 1e-3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.engine.engine_group import ModelSource, start_engine_group
from gpu_runtime.model import build_random_model
from tests.gpu_runtime.distributed.test_tp_colocation import (
    MODEL,
    SEED,
    RecordingJobs,
    _co_run,
    tiny_job,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

CONFIG = EngineConfig(
    device="cuda",
    num_kv_blocks=64,
    block_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    static_decode_batches=True,
    cuda_graph_batch_sizes=(1, 2, 4),
)
DECODE_GROUPS = (4, 8)


def green_sharing(device: str) -> Any:
    """A rank's green-context partitions (the same table on every rank)."""
    from gpu_runtime.sharing import create_sharing

    return create_sharing(torch.device(device), decode_groups=DECODE_GROUPS, strict=True)


def _capture(engine: Engine, sharing: Any) -> None:
    for decode_sms in sharing.table.choices:
        engine.capture_cuda_graphs(
            partition=decode_sms, stream=sharing.partition(decode_sms)[0], sm_count=decode_sms
        )


def test_two_gpus_apply_rank_0_s_partitions_and_quanta(tmp_path: Path) -> None:
    from gpu_runtime.sharing.green import green_context_unavailable_reason

    reason = green_context_unavailable_reason(torch.device("cuda:0"))
    if reason is not None:
        pytest.skip(f"green contexts: {reason}")
    sharing = green_sharing("cuda:0")
    reference = build_random_model(MODEL, seed=SEED, device="cuda:0", dtype="float32")
    engine = Engine(reference, CONFIG)
    _capture(engine, sharing)
    want = _co_run(engine, tiny_job("job", {"seed": 1, "epochs": 2}, reference), sharing)
    del engine
    record = tmp_path / "follower.json"
    with start_engine_group(
        ModelSource(config=MODEL, seed=SEED, dtype="float32"),
        CONFIG,
        2,
        timeout_s=120,
        follower_sharing=green_sharing,
        follower_part=RecordingJobs(str(record)),
    ) as group:
        engine = group.engine
        _capture(engine, sharing)
        got = _co_run(
            engine, tiny_job("job", {"seed": 1, "epochs": 2}, engine.runner.model), sharing
        )
        assert not group.failed.is_set(), group.failure
    sharing.close()
    assert [p.exitcode for p in group.processes] == [0]
    assert len(set(got["stepped"])) == len(DECODE_GROUPS) + 1  # every split ran decode
    follower = json.loads(record.read_text())
    assert follower["orders"] == got["launched"]
    assert follower["partitions"][-len(got["stepped"]) :] == got["stepped"]
    assert all(error is None for _, _, error in follower["losses"])
    same = sum(
        a == b
        for w, g in zip(want["tokens"], got["tokens"], strict=True)
        for a, b in zip(w, g, strict=True)
    )
    assert same >= 0.9 * sum(len(w) for w in want["tokens"])
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-3, atol=1e-4
    )
