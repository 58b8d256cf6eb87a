"""A host whose KV cache and finetune jobs share the unified memory pool (a GPU host's default,
with its SM sharing; the CPU accounting pool on request): it serves and trains exactly like a
host without one, reports the pool's free memory, and the finetune budget goes back when no job
is left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.agent.host_factory import HOST_MEMORY_CONFIG
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import SamplingParams
from gpu_runtime.memory import engine_kv_layout
from tests.gpu_runtime.agent.conftest import Host, Reports, job_spec, make_runtime

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _train(host: Host, reports: Reports) -> tuple[dict[str, Any], list[int]]:
    """Train one job to success, serving a request while it trains; stops the host."""
    host.loop.start()
    try:
        host.command({"command": "apply_placement", "command_id": "c1", "placement_id": 1,
                      "job": job_spec()})  # fmt: skip
        reports.wait_for("job_started")
        out, _ = host.generate("tiny", "Q: hello", GREEDY)
        return reports.wait_for("job_succeeded"), list(out.output_token_ids)
    finally:
        host.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pool_host_trains_and_serves_like_a_plain_host(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, device: str
) -> None:
    plain_reports, pool_reports = Reports(), Reports()
    plain = make_runtime(tiny_model_dir, storage, tmp_path / "plain", plain_reports,
                         device=device, pool=False)  # fmt: skip
    assert plain.runtime.host_memory is None
    plain_done, plain_tokens = _train(plain, plain_reports)

    pool_bytes = None  # CUDA: the free device memory less what decode's own allocations need
    if device == "cpu":
        model = plain.runtime.engine.runner.model
        layout = engine_kv_layout(model.config, block_size=16, dtype="float32", page_bytes=1)
        pool_bytes = 96 * layout.block_bytes
    pooled = make_runtime(tiny_model_dir, storage, tmp_path / "pool", pool_reports,
                          device=device, pool=True, pool_bytes=pool_bytes)  # fmt: skip
    memory = pooled.runtime.host_memory
    assert memory is not None and pooled.runtime.loop.memory is memory.memory
    # graph pools per shape, released between quanta (memory/test_host_release.py)
    assert pooled.runtime.loop.jobs.release_graph_shapes
    assert memory.manager.finetune.graph_release is not None
    assert memory.manager.config.plan_peak_window == HOST_MEMORY_CONFIG.plan_peak_window > 0
    if device == "cuda":  # SM splits (or prioritised streams), graphs captured per split
        sharing = pooled.runtime.loop.sharing
        assert sharing is not None and len(sharing.table.choices) >= 1
    assert pooled.runtime.engine.config.kv_block_capacity == memory.memory.binding.capacity_blocks
    pool_done, pool_tokens = _train(pooled, pool_reports)

    assert pool_tokens == plain_tokens
    tolerance = 1e-5 if device == "cpu" else 1e-3
    assert abs(pool_done["train_loss"] - plain_done["train_loss"]) < tolerance
    assert pool_done["trained_tokens"] == plain_done["trained_tokens"]
    pooled.runtime.refresh_status()  # the loop thread has stopped: safe here
    split = memory.split()
    assert split.finetune_budget_bytes == 0  # no job left: the budget went back to the pool
    # free for a new job: the pool less decode's pages and what torch still holds for
    # finetuning (its caching allocator keeps freed blocks reserved; 0 on the CPU pool)
    free = split.pool_bytes - split.decode_bytes - split.finetune_reserved_bytes
    assert pooled.runtime.status().free_bytes == free
