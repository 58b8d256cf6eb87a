"""The co-location loop over a tensor-parallel engine group on CPU (gloo, 2 ranks, fp32 tiny
model, a counting clock): every rank applies rank 0's plan.

One spawned group runs it all. A policy alternating the SM split (a CPU stand-in for a
sharing: its split table, no streams) and launching quanta CONCURRENT and AFTER_DECODE: the
follower's launches carry rank 0's split per step and it runs rank 0's quanta in order (its
own trainer of the job, built by the job factory, on its worker thread) with rank 0's losses;
decode tokens and the job's loss curve equal the TP 1 loop's, and the plans are TP 1's. Then,
with rank 0's quanta on a worker thread too, a job removed and one paused while their quanta
are in flight: the loop finishes well within the group's timeout.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpu_runtime.colocation import (
    CoLocationPolicy,
    FinetuneLaunch,
    HostLoop,
    IterationContext,
    IterationPlan,
    ThreadedExecutor,
)
from gpu_runtime.colocation.baselines import quantum_tokens
from gpu_runtime.colocation.executor import SequentialExecutor
from gpu_runtime.colocation.tp_follower_jobs import FollowerJobs, FollowerJobsFactory
from gpu_runtime.colocation.tp_loop import LoopMirror, MirroredExecutor, RunQuantum, mirror_loop
from gpu_runtime.colocation.types import LaunchMode
from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.training_examples import TokenizedExample
from gpu_runtime.distributed.control import DriverChannel
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.engine_group import ModelSource, start_engine_group
from gpu_runtime.engine.tp_follower import Follower
from gpu_runtime.engine.tp_messages import Launch
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.sharing.partition import PartitionTable
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401

MODEL = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=509)
SEED = 7
CONFIG = EngineConfig(
    num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96
)
TIMEOUT_S = 60.0
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)


class CpuSplits:
    """A sharing's split table without streams (decode and quanta on the current stream)."""

    spatial = True

    def __init__(self) -> None:
        self.table = PartitionTable.build(132, (4, 8))

    def partition(self, decode_sms: int) -> tuple[None, None]:
        self.table.get(decode_sms)
        return None, None


class Alternating(CoLocationPolicy):
    """Split i of the table at iteration i; a quantum of 2 examples whenever none runs,
    every third one after decode."""

    name = "alternating"

    def __init__(self) -> None:
        self.index = 0

    def plan(self, ctx: IterationContext) -> IterationPlan:
        self.index += 1
        decode_sms = ctx.decode_sms_options[self.index % len(ctx.decode_sms_options)]
        launches: tuple[FinetuneLaunch, ...] = ()
        if ctx.jobs and ctx.in_flight is None:
            mode = LaunchMode.AFTER_DECODE if self.index % 3 == 0 else LaunchMode.CONCURRENT
            job = ctx.jobs[0]
            launches = (FinetuneLaunch(job.job_id, quantum_tokens(job, 2), mode),)
        return IterationPlan(decode_sms=decode_sms, launches=launches)


def _examples(seed: int) -> list[TokenizedExample]:
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for length in (9, 12, 7, 14, 10, 8, 11, 13):
        ids = torch.randint(0, MODEL.vocab_size, (length,), generator=generator).tolist()
        examples.append(TokenizedExample(tuple(ids), tuple([-100] * 3 + ids[3:])))
    return examples


def tiny_job(job_id: str, spec: Any, serving: CausalLM) -> LoraTrainer:
    """The job factory of every rank: a LoRA job over `serving` from `spec` (seed, epochs)."""
    examples = _examples(spec["seed"])
    hparams = resolve_hyperparameters(
        n_train_examples=len(examples),
        n_epochs=spec["epochs"],
        batch_size=4,
        learning_rate_multiplier=50.0,
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=spec["seed"],
        warmup_ratio=0.0,
    )
    return LoraTrainer(serving, examples, hparams)


@dataclass(frozen=True)
class RecordingJobs:
    """The followers' part: `FollowerJobs`, and a record of what it applied (written at
    shutdown to `path`: each launch's partition, each quantum order, each quantum's loss)."""

    path: str

    def __call__(self, follower: Follower) -> Any:
        return _Recorder(FollowerJobsFactory(tiny_job)(follower), self.path)


class _Recorder:
    def __init__(self, jobs: FollowerJobs, path: str) -> None:
        self.jobs = jobs
        self.path = path
        self.partitions: list[Any] = []
        self.orders: list[list[Any]] = []

    def apply(self, message: Any) -> bool:
        if isinstance(message, Launch):
            self.partitions.append(message.partition)
        elif isinstance(message, RunQuantum):
            self.orders.append(_order(message))
        return self.jobs.apply(message)

    def close(self) -> None:
        self.jobs.close()
        losses = [(r.job_id, r.loss, r.error) for r in self.jobs.reports]
        record = {"partitions": self.partitions, "orders": self.orders, "losses": losses}
        Path(self.path).write_text(json.dumps(record))


def _order(o: RunQuantum) -> list[Any]:
    return [o.job_id, o.max_tokens, o.mode.value, o.decode_sms, o.max_layers]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]


def _counting_clock() -> Any:
    ticks = itertools.count()
    return lambda: next(ticks) * 1e-3


def _co_run(engine: Engine, trainer: LoraTrainer, sharing: Any = None) -> dict[str, Any]:
    """The loop with `Alternating` over a job and four requests, to the end, on `sharing`'s
    splits (None: `CpuSplits`)."""
    outputs: dict[str, list[int]] = {}

    def keep(batch: list[Any]) -> None:
        for out in batch:
            outputs[out.request_id] = out.output_token_ids

    loop = HostLoop(
        engine,
        Alternating(),
        tpot_slo_ms=1e6,
        sharing=CpuSplits() if sharing is None else sharing,
        output_sink=keep,
        clock=_counting_clock(),
    )
    spec = {"seed": 1, "epochs": 2}
    loop.add_job("job", trainer, spec=spec if engine.runner.model.parallel.size > 1 else None)
    ids = [loop.add_request(p, PARAMS) for p in _prompts()]
    records = loop.run_until_idle(max_iterations=200)
    loop.close()
    state = loop.job_state("job")
    assert state.finished and state.failed is None
    launched = [
        [f.job_id, f.max_tokens, f.mode.value, r.decode_sms, f.max_layers]
        for r in records
        for f in r.finetune_launched
    ]
    return {
        "tokens": [outputs[i] for i in ids],
        "losses": [q.loss for r in records for q in r.quanta],
        "plans": [(r.decode_sms, len(r.finetune_launched)) for r in records],
        "launched": launched,
        "stepped": [r.decode_sms for r in records if r.decode_batch or r.prefill_tokens],
        "executor": loop.executor,
    }


class HeldExecutor(ThreadedExecutor):
    """The worker-thread executor, holding each concurrent quantum until someone waits for it
    (so a quantum is in flight, on rank 0 and on the follower, when the test acts)."""

    def __init__(self) -> None:
        super().__init__(time.perf_counter)
        self._held: Any = None

    def _start(self, task: Any) -> None:
        self._held = task

    def wait(self, timeout_s: float | None = None) -> bool:
        held, self._held = self._held, None
        if held is not None:
            super()._start(held)
        return super().wait(timeout_s)


def _remove_and_pause_in_flight(engine: Engine) -> float:
    """Two jobs, rank 0's quanta on a worker thread: remove one and pause the other while a
    quantum of each is in flight; seconds until the loop is idle."""
    started = time.monotonic()
    loop = HostLoop(
        engine, Alternating(), tpot_slo_ms=1e6, sharing=CpuSplits(), executor=HeldExecutor()
    )
    for job_id, seed in (("gone", 2), ("held", 3)):
        spec = {"seed": seed, "epochs": 3}
        loop.add_job(job_id, tiny_job(job_id, spec, engine.runner.model), spec=spec)
    for prompt in _prompts():
        loop.add_request(prompt, PARAMS)
    for job_id, act in (("gone", loop.remove_job), ("held", loop.pause_job)):
        loop.run_iteration()
        in_flight = loop.executor.in_flight
        assert in_flight is not None and in_flight.job_id == job_id
        act(job_id)
    loop.run_until_idle(max_iterations=200)
    loop.close()
    assert loop.job_ids == ["held"] and loop.job_state("held").paused
    assert loop.job_state("held").quanta == 1
    return time.monotonic() - started


def test_two_ranks_apply_rank_0_s_plan_with_the_one_gpu_tokens_and_losses(
    tmp_path: Path,
) -> None:
    reference = build_random_model(MODEL, seed=SEED)
    want = _co_run(Engine(reference, CONFIG), tiny_job("job", {"seed": 1, "epochs": 2}, reference))
    assert len(set(want["stepped"])) == 3 and len(want["losses"]) >= 4
    modes = {mode for _, _, mode, _, _ in want["launched"]}
    assert modes == {LaunchMode.CONCURRENT.value, LaunchMode.AFTER_DECODE.value}
    record = tmp_path / "follower.json"
    with start_engine_group(
        ModelSource(config=MODEL, seed=SEED),
        CONFIG,
        2,
        cpu_threads=1,
        timeout_s=TIMEOUT_S,
        follower_part=RecordingJobs(str(record)),
    ) as group:
        engine = group.engine
        got = _co_run(engine, tiny_job("job", {"seed": 1, "epochs": 2}, engine.runner.model))
        assert isinstance(got.pop("executor"), MirroredExecutor)
        elapsed = _remove_and_pause_in_flight(engine)
        assert elapsed < TIMEOUT_S / 2, f"the loop took {elapsed:.1f} s"
        assert not group.failed.is_set(), group.failure
    want.pop("executor")
    assert got["tokens"] == want["tokens"]
    assert got["plans"] == want["plans"] and got["launched"] == want["launched"]
    torch.testing.assert_close(
        torch.tensor(got["losses"], dtype=torch.float64),
        torch.tensor(want["losses"], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    follower = json.loads(record.read_text())
    co_run = len(got["launched"])
    assert follower["orders"][:co_run] == got["launched"]  # same quanta, same order
    assert follower["partitions"][: len(got["stepped"])] == got["stepped"]
    losses = [loss for job, loss, _ in follower["losses"][:co_run]]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(got["losses"], dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    assert all(error is None for _, _, error in follower["losses"])
    assert {job for job, _, _ in follower["losses"][co_run:]} == {"gone", "held"}
    assert [p.exitcode for p in group.processes] == [0]


def test_a_memory_pool_and_a_job_without_spec_are_refused_at_tp() -> None:
    parallel = SimpleNamespace(size=2)
    engine = SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(parallel=parallel)))
    executor = SequentialExecutor(time.perf_counter)
    with pytest.raises(NotImplementedError, match="memory pool under tensor parallelism"):
        mirror_loop(engine, executor, memory=object())
    with pytest.raises(ValueError, match="needs the job's spec"):
        LoopMirror(DriverChannel.__new__(DriverChannel)).check_spec("j", None)
    parallel.size = 1
    assert mirror_loop(engine, executor, memory=object()) == (executor, None)
