"""The host agent at tensor-parallel degree 2 on CPU (two gloo ranks over the tiny model): it
serves the T = 1 agent's tokens, trains a placed job to the T = 1 losses, saves an unsharded
adapter that a T = 1 host serves alike, refuses what it cannot do (the memory pool, a degree
the model cannot be sharded at, an engine group other than 0), restarts its group for another
base model and stops its followers when it stops."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.agent.cli import parse_args
from gpu_runtime.agent.config import AgentConfigError
from gpu_runtime.agent.serving import EngineSpec
from gpu_runtime.agent.tp_serving import FollowerJobBuilder
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.contract.tensor_parallel import TensorParallelError
from gpu_runtime.engine import EngineConfig, SamplingParams
from tests.gpu_runtime.agent.conftest import Host, Reports, job_spec, make_runtime

SCORED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = "Q: hello"


def _engine_config() -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=256, device="cpu",
    )  # fmt: skip


def make_tp_runtime(
    model_dir: Path, storage: LocalStorage, work_dir: Path, send: Any, size: int
) -> Host:
    """`conftest.make_runtime`'s host with its engine an engine group of `size` ranks."""
    from gpu_runtime.agent.runtime import HostRuntime
    from gpu_runtime.colocation import NaivePolicy
    from gpu_runtime.server import EngineLoop, MetricsCollector

    spec = EngineSpec(
        _engine_config(),
        lora_slots=2,
        lora_max_rank=8,
        tensor_parallel_size=size,
        jobs=FollowerJobBuilder(storage, work_dir),
    )
    runtime = HostRuntime(
        host="h2",
        base_model="tiny",
        serving=spec.build(model_dir),
        engine_spec=spec,
        policy=lambda predictor: NaivePolicy(quantum_examples=2),
        tpot_slo_ms=1e6,
        storage=storage,
        work_dir=work_dir,
        send=send,
        total_bytes=2**30,
        base_model_path=str(model_dir),
        metrics_interval_s=0.5,
        request_metrics=MetricsCollector(),
    )
    return Host(runtime, EngineLoop(runtime))


def _place(host: Host, job_id: str, **command: Any) -> None:
    host.command({"command": "apply_placement", "command_id": f"c-{job_id}", "placement_id": 1,
                  "job": job_spec(job_id), **command})  # fmt: skip


def _train(host: Host, reports: Reports, job_id: str) -> tuple[list[float], dict[str, Any]]:
    _place(host, job_id)
    done = reports.wait_for("job_succeeded", timeout=60)
    assert done["job_id"] == job_id
    losses = [m["train_loss"] for m in reports.seen if m["kind"] == "job_progress"]
    return losses, done


def test_a_tp2_agent_serves_and_trains_like_tp1(
    tiny_model_dir: Path,
    storage: LocalStorage,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    one_reports, two_reports = Reports(), Reports()
    one = make_runtime(tiny_model_dir, storage, tmp_path / "one", one_reports)
    one.loop.start()
    two = make_tp_runtime(tiny_model_dir, storage, tmp_path / "two", two_reports, 2)
    group = two.runtime.engine_group
    two.loop.start()
    try:
        assert two.runtime.status().tensor_parallel_size == 2
        assert one.runtime.status().tensor_parallel_size == 1
        base_one, base_one_lp = one.generate(None, PROMPT, SCORED)
        base_two, base_two_lp = two.generate(None, PROMPT, SCORED)
        assert base_two.output_token_ids == base_one.output_token_ids
        assert base_two_lp == pytest.approx(base_one_lp, rel=1e-4, abs=1e-4)

        # an engine group this agent does not drive: logged and dropped, never a job_failed
        with caplog.at_level(logging.ERROR, logger="gpu_runtime.agent.runtime"):
            _place(two, "ftjob-g1", engine_group=1)
            two.command({"command": "load_base_model", "command_id": "lb-g1", "engine_group": 1,
                         "base_model": "other", "model_dir": str(tiny_model_dir)})  # fmt: skip
        dropped = [r.getMessage() for r in caplog.records if "engine group 1" in r.getMessage()]
        assert len(dropped) == 2 and all("engine group 0 only" in m for m in dropped)
        assert two.runtime.status().base_model == "tiny"
        assert not {"job_started", "job_failed"} & set(two_reports.kinds())
        assert "ftjob-g1" not in two.runtime.jobs.runs

        losses_one, _ = _train(one, one_reports, "ftjob-tp1")
        losses_two, done_two = _train(two, two_reports, "ftjob-tp2")
        assert "job_failed" not in two_reports.kinds()
        assert len(losses_two) == len(losses_one) == 6
        assert losses_two == pytest.approx(losses_one, rel=1e-5)

        # a pause at T = 2 stops at the last checkpoint's step (none between quanta)
        two.command({"command": "apply_placement", "command_id": "c-p", "placement_id": 2,
                     "job": job_spec("ftjob-p", checkpoint_every_steps=4)})  # fmt: skip
        progress = two_reports.wait_for("job_progress", timeout=60)
        while progress["job_id"] != "ftjob-p":
            progress = two_reports.wait_for("job_progress", timeout=60)
        two.command({"command": "pause", "command_id": "p", "job_id": "ftjob-p",
                     "placement_id": 2})  # fmt: skip
        stopped = two_reports.wait_for("job_stopped", timeout=60)
        checkpoints = [m["step"] for m in two_reports.seen
                       if m["kind"] == "checkpoint" and m["job_id"] == "ftjob-p"]  # fmt: skip
        assert stopped["reason"] == "paused"
        assert stopped["step"] == (checkpoints[-1] if checkpoints else 0)
        assert two.runtime.status().placements == []

        # the T = 2 adapter is whole: a T = 1 host serves it with the T = 2 host's tokens
        name = "ft:tiny:t1::ftjob-tp2"
        assert two.runtime.status().adapters == [name]
        tuned_two, tuned_two_lp = two.generate(name, PROMPT, SCORED)
        one.command({"command": "load_adapter", "command_id": "la", "name": name,
                     "storage_key": done_two["adapter_key"]})  # fmt: skip
        tuned_one, tuned_one_lp = one.generate(name, PROMPT, SCORED)
        assert tuned_one.output_token_ids == tuned_two.output_token_ids
        assert tuned_one_lp == pytest.approx(tuned_two_lp, rel=1e-4, abs=1e-4)
        assert abs(tuned_one_lp[0] - base_one_lp[0]) > 1e-4

        # another base model restarts the group (the old followers exit)
        two.command({"command": "load_base_model", "command_id": "lb", "base_model": "tiny-b",
                     "model_dir": str(tiny_model_dir)})  # fmt: skip
        assert two.runtime.status().base_model == "tiny-b"
        assert not any(process.is_alive() for process in group.processes)
        group = two.runtime.engine_group
        again, _ = two.generate(None, PROMPT, SCORED)
        assert again.output_token_ids == base_one.output_token_ids
    finally:
        one.stop()
        two.stop()
    assert not any(process.is_alive() for process in group.processes)  # stopped with the agent


def test_refusals_memory_pool_and_degree(tiny_model_dir: Path, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "storage")
    jobs = FollowerJobBuilder(storage, tmp_path / "work")
    with pytest.raises(ValueError, match="memory pool runs at tensor_parallel_size 1"):
        EngineSpec(_engine_config(), memory_pool=True, pool_bytes=2**26,
                   tensor_parallel_size=2, jobs=jobs)  # fmt: skip
    auto = EngineSpec(_engine_config(), tensor_parallel_size=2, jobs=jobs)
    assert not auto.uses_pool
    with pytest.raises(ValueError, match="needs jobs"):
        EngineSpec(_engine_config(), tensor_parallel_size=2)
    # the tiny model has 4 attention heads: 3 ranks cannot hold them (nothing is spawned)
    with pytest.raises(TensorParallelError, match="num_attention_heads 4"):
        EngineSpec(_engine_config(), tensor_parallel_size=3, jobs=jobs).build(tiny_model_dir)
    base = ["--host", "h", "--broker", "memory://", "--work-dir", str(tmp_path / "w")]
    with pytest.raises(SystemExit):
        parse_args([*base, "--tensor-parallel-size", "2", "--memory-pool", "on",
                    "--memory-pool-gb", "1"])  # fmt: skip
    assert parse_args([*base, "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    with pytest.raises(AgentConfigError, match="--memory-pool on needs --tensor-parallel-size 1"):
        replace(parse_args(base), memory_pool=True, memory_pool_bytes=2**26,
                tensor_parallel_size=2)  # fmt: skip
