"""HostLoop end to end on CPU: real tiny-model decode and real tiny LoRA quanta."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpu_runtime.colocation import (
    CoLocationPolicy,
    DecodeOnlyPolicy,
    FinetuneLaunch,
    HostLoop,
    IterationContext,
    IterationPlan,
    IterationRecord,
    JobError,
    MetricsAggregator,
    NaivePolicy,
    PlanError,
)
from gpu_runtime.colocation.executor import QuantumTask, SequentialExecutor
from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import build_random_model
from gpu_runtime.model.tiny import tiny_config

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 40)), [3, 4]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine() -> Engine:
    model = build_random_model(tiny_config("llama"), seed=3, dtype="float32")
    config = EngineConfig(
        num_kv_blocks=32,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    return Engine(model, config)


def _trainer(engine: Engine, examples: Any, epochs: int = 1) -> LoraTrainer:
    hparams = resolve_hyperparameters(
        n_train_examples=len(examples),
        n_epochs=epochs,
        batch_size=4,
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=0,
        warmup_ratio=0.0,
    )
    return LoraTrainer(engine.runner.model, examples, hparams)


def _decode_alone() -> list[list[int]]:
    engine = _engine()
    return [out.output_token_ids for out in engine.generate(PROMPTS, PARAMS)]


def test_naive_loop_runs_decode_and_quanta_end_to_end(train_examples: Any) -> None:
    engine = _engine()
    trainer = _trainer(engine, train_examples)
    metrics = MetricsAggregator(tpot_slo_ms=1e6)
    outputs: dict[str, list[int]] = {}

    def keep(batch: list[Any]) -> None:
        for out in batch:
            outputs[out.request_id] = out.output_token_ids

    loop = HostLoop(
        engine,
        NaivePolicy(quantum_examples=2),
        tpot_slo_ms=1e6,
        metrics_sink=metrics.add,
        output_sink=keep,
    )
    ids = [loop.add_request(p, PARAMS) for p in PROMPTS]
    loop.add_job("job-a", trainer)
    records = loop.run_until_idle(max_iterations=200)
    loop.close()

    # Decode is unchanged by the LoRA quanta that ran beside it.
    assert [outputs[i] for i in ids] == _decode_alone()
    # Every example was trained once; the job finished after its 2 optimizer steps.
    state = loop.job_state("job-a")
    assert state.finished and state.step == 2 and state.failed is None
    assert state.tokens_trained == sum(e.num_tokens for e in train_examples)
    assert sum(r.finetune_tokens for r in records) == state.tokens_trained
    # One TPOT sample per token after each request's first; every request finished.
    assert sum(len(r.tpot_samples_ms) for r in records) == len(PROMPTS) * (PARAMS.max_tokens - 1)
    finished = [f for r in records for f in r.finished]
    assert sorted(f.request_id for f in finished) == sorted(ids)
    assert all(f.output_tokens == PARAMS.max_tokens and f.tpot_ms and f.ttft_ms for f in finished)
    interval = metrics.flush(loop.clock())
    assert interval.finished_requests == len(PROMPTS)
    assert interval.slo_attainment == 1.0
    assert interval.finetune_tokens == state.tokens_trained
    assert interval.tpot_ms_p50 is not None and interval.tpot_ms_p99 is not None
    assert interval.goodput_tokens_per_s > 0


def test_decode_only_never_trains_and_jobs_can_be_paused(train_examples: Any) -> None:
    engine = _engine()
    loop = HostLoop(engine, NaivePolicy(quantum_examples=1), tpot_slo_ms=1e6)
    loop.add_job("job-a", _trainer(engine, train_examples))
    loop.pause_job("job-a")
    assert not loop.has_work()
    loop.add_request(PROMPTS[0], PARAMS)
    records = loop.run_until_idle(max_iterations=50)
    assert all(not r.quanta and not r.finetune_launched for r in records)
    loop.resume_job("job-a")
    record = loop.run_iteration()
    assert record.finetune_launched and record.finetune_tokens > 0
    trainer = loop.remove_job("job-a")
    assert isinstance(trainer, LoraTrainer) and loop.job_ids == []
    with pytest.raises(JobError):
        loop.pause_job("job-a")

    only = HostLoop(_engine(), DecodeOnlyPolicy(), tpot_slo_ms=1e6)
    only.add_job("job-b", _trainer(only.engine, train_examples))
    only.add_request(PROMPTS[1], PARAMS)
    for _ in range(10):
        assert only.run_iteration().finetune_tokens == 0
    assert only.job_state("job-b").tokens_trained == 0


class _BadPolicy(CoLocationPolicy):
    name = "bad"

    def plan(self, ctx: IterationContext) -> IterationPlan:
        return IterationPlan(launches=(FinetuneLaunch("nobody", 64),))


def test_loop_rejects_plans_that_break_the_contract() -> None:
    loop = HostLoop(_engine(), _BadPolicy(), tpot_slo_ms=10.0)
    loop.add_request(PROMPTS[0], PARAMS)
    with pytest.raises(PlanError, match="nobody"):
        loop.run_iteration()


def test_records_carry_plan_and_observation(train_examples: Any) -> None:
    seen: list[IterationRecord] = []
    engine = _engine()
    loop = HostLoop(
        engine, NaivePolicy(quantum_examples=1), tpot_slo_ms=50.0, metrics_sink=seen.append
    )
    loop.add_job("j", _trainer(engine, train_examples))
    loop.add_request(PROMPTS[2], PARAMS)
    record = loop.run_iteration()
    assert seen == [record]
    assert record.policy == "naive" and record.index == 0
    assert record.prefill_tokens == len(PROMPTS[2]) and record.decode_batch == 0
    assert record.decode_tokens == 1 and record.observed_ms > 0
    assert record.iteration_ms >= record.observed_ms
    assert 0 < record.plan_ms < record.iteration_ms - record.observed_ms + 1e-6  # host time
    assert record.finetune_launched[0].job_id == "j" and record.quanta[0].tokens > 0
    second = loop.run_iteration()
    assert second.decode_batch == 1 and len(second.tpot_samples_ms) == 1


def test_harli_on_the_loop_trains_under_a_loose_slo_and_pauses_under_an_impossible_one(
    train_examples: Any,
) -> None:
    from gpu_runtime.colocation import AnalyticLatencyModel, HarliPolicy, OnlineLatencyModel

    engine = _engine()
    model = OnlineLatencyModel(AnalyticLatencyModel(base_ms=1.0))
    loose = HostLoop(engine, HarliPolicy(model), tpot_slo_ms=1e4)
    loose.add_job("j", _trainer(engine, train_examples))
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for p in PROMPTS:
        loose.add_request(p, long)
    records = loose.run_until_idle(max_iterations=100)
    assert loose.job_state("j").finished
    assert all(r.predicted_ms is not None for r in records if r.decode_batch)
    assert model.fitted_shares == [1.0]  # fitted from the loop's own decode-alone iterations

    engine = _engine()
    strict = HostLoop(engine, HarliPolicy(AnalyticLatencyModel()), tpot_slo_ms=0.01)
    strict.add_job("j", _trainer(engine, train_examples))
    strict.add_request(PROMPTS[0], PARAMS)
    strict.run_iteration()  # prefill while decode is idle: a quantum may run
    busy = [strict.run_iteration() for _ in range(4)]
    assert all(r.paused and not r.finetune_launched for r in busy)


@pytest.mark.parametrize("during", [False, True])
def test_threaded_executor_overlaps_quanta_with_decode_and_accounts_every_token(
    train_examples: Any, during: bool
) -> None:
    """The GPU executor (a worker thread) on CPU: quanta run beside decode, none is lost; also
    when they are handed over from inside the decode step (``launch_during_decode``)."""
    from gpu_runtime.colocation import ThreadedExecutor

    engine = _engine()
    trainer = _trainer(engine, train_examples, epochs=2)
    loop = HostLoop(
        engine,
        NaivePolicy(quantum_examples=1),
        tpot_slo_ms=1e6,
        executor=ThreadedExecutor(time.perf_counter),
        launch_during_decode=during,
    )
    outputs: dict[str, list[int]] = {}
    loop.output_sink = lambda batch: outputs.update(
        {o.request_id: o.output_token_ids for o in batch}
    )
    ids = [loop.add_request(p, PARAMS) for p in PROMPTS]
    loop.add_job("j", trainer)
    records = loop.run_until_idle(max_iterations=2000)
    loop.close()
    state = loop.job_state("j")
    assert state.finished and state.failed is None
    assert state.tokens_trained == 2 * sum(e.num_tokens for e in train_examples)
    assert sum(r.finetune_tokens for r in records) + 0 <= state.tokens_trained
    assert [outputs[i] for i in ids] == _decode_alone()
    assert any(r.in_flight for r in records)
    assert loop.executor.in_flight is None


class _WhenSubmitted(SequentialExecutor):
    """Notes, per concurrent quantum, whether a decode step was queued and not yet read back."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(time.perf_counter)
        self.engine = engine
        self.during_step: list[bool] = []

    def _start(self, task: QuantumTask) -> None:
        last = self.engine.runner.readback.last_launched
        self.during_step.append(last is not None and not last.resolved)
        super()._start(task)


@pytest.mark.parametrize("during", [False, True])
def test_launch_during_decode_starts_quanta_while_the_step_is_queued(
    train_examples: Any, during: bool
) -> None:
    """`launch_during_decode`: the quantum is handed over once the step is queued (its host
    work then overlaps the step on a GPU), or after the call when it ran no step; off, before
    the step. Decode and training come out the same either way."""
    engine = _engine()
    trainer = _trainer(engine, train_examples)
    executor = _WhenSubmitted(engine)
    outputs: dict[str, list[int]] = {}
    loop = HostLoop(
        engine,
        NaivePolicy(quantum_examples=1),
        tpot_slo_ms=1e6,
        executor=executor,
        launch_during_decode=during,
        output_sink=lambda batch: outputs.update({o.request_id: o.output_token_ids for o in batch}),
    )
    ids = [loop.add_request(p, PARAMS) for p in PROMPTS]
    loop.add_job("j", trainer)
    records = loop.run_until_idle(max_iterations=500)
    loop.close()
    assert [outputs[i] for i in ids] == _decode_alone()
    state = loop.job_state("j")
    assert state.finished and state.failed is None
    assert state.tokens_trained == sum(e.num_tokens for e in train_examples)
    launched = [r for r in records if r.finetune_launched]
    assert len(executor.during_step) == len(launched) > 0
    stepped = [r.decode_tokens > 0 for r in launched]
    assert executor.during_step == (stepped if during else [False] * len(launched))
    assert any(executor.during_step) is during


class _Recording(DecodeOnlyPolicy):
    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def plan(self, ctx: IterationContext) -> IterationPlan:
        self.seen.append(ctx.worst_running_tpot_ms)
        return super().plan(ctx)


def test_context_reports_the_worst_running_request_tpot() -> None:
    policy = _Recording()
    loop = HostLoop(_engine(), policy, tpot_slo_ms=50.0)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [loop.add_request(p, long) for p in PROMPTS[:2]]
    records = [loop.run_iteration() for _ in range(20)]
    assert policy.seen[0] is None  # nobody has 16 tokens yet
    worst = policy.seen[-1]
    assert worst is not None
    # It is a mean of token gaps so far: within the range of the observed gaps.
    gaps = [g for r in records for g in r.tpot_samples_ms]
    assert min(gaps) <= worst <= max(gaps)
    for request_id in ids:  # aborted behind the loop's back: no longer counted
        loop.engine.abort_request(request_id)
    loop.run_iteration()
    assert policy.seen[-1] is None


class _Sliced(CoLocationPolicy):
    name = "sliced"

    def plan(self, ctx: IterationContext) -> IterationPlan:
        if not ctx.jobs or ctx.in_flight is not None:
            return IterationPlan()
        return IterationPlan(launches=(FinetuneLaunch(ctx.jobs[0].job_id, 64, max_layers=3),))


def test_layer_sliced_quanta_credit_tokens_when_the_micro_batch_completes(
    train_examples: Any,
) -> None:
    engine = _engine()
    trainer = _trainer(engine, train_examples)
    loop = HostLoop(engine, _Sliced(), tpot_slo_ms=1e6)
    loop.add_job("j", trainer)
    records = loop.run_until_idle(max_iterations=500)
    loop.close()
    reports = [q for r in records for q in r.quanta]
    assert all(q.error is None and 1 <= q.layer_passes <= 3 for q in reports)
    partial = [q for q in reports if not q.micro_batch_done]
    assert partial and all(q.tokens == 0 and q.loss is None for q in partial)
    state = loop.job_state("j")
    assert state.finished and state.tokens_trained == sum(e.num_tokens for e in train_examples)
    assert state.last_loss is not None


def test_harli_fills_the_slack_with_layer_slices_on_the_loop(train_examples: Any) -> None:
    """Whole quanta priced far over the slack, slices (measured costs) under it: harli runs the
    job in layer slices after decode, and the loop credits each micro-batch once it completes."""
    from gpu_runtime.colocation import AnalyticLatencyModel, HarliConfig, HarliPolicy

    engine = _engine()
    trainer = _trainer(engine, train_examples)
    config = HarliConfig(
        prior_quantum_overhead_ms=1e5,
        allow_shared=False,
        slice_call_ms=1.0,
        slice_forward_layer_ms=1.0,
        slice_backward_layer_ms=1.0,
    )
    # The analytic model says 1 ms; the CPU engine's real steps take several and the margin
    # grows to its cap (0.5): a 500 ms SLO keeps room for slices however loaded the machine
    # (at 50 ms a busy CI box left decode alone over the bound and harli paused throughout).
    loop = HostLoop(
        engine, HarliPolicy(AnalyticLatencyModel(base_ms=1.0), config), tpot_slo_ms=500.0
    )
    loop.add_job("j", trainer)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for p in PROMPTS:
        loop.add_request(p, long)
    records = [loop.run_iteration() for _ in range(30)]
    loop.close()
    launches = [launch for r in records for launch in r.finetune_launched]
    assert launches and all(launch.max_layers is not None for launch in launches)
    reports = [q for r in records for q in r.quanta]
    assert all(q.error is None and q.layer_passes >= 1 for q in reports)
    done = [q for q in reports if q.micro_batch_done]
    assert done and loop.job_state("j").tokens_trained == sum(q.tokens for q in done) > 0


def test_add_request_passes_the_adapter_name_to_the_engine() -> None:
    """An engine without adapters refuses a named adapter: the name reached it, and the loop
    starts no latency clock for the refused request."""
    loop = HostLoop(_engine(), DecodeOnlyPolicy(), tpot_slo_ms=100.0)
    with pytest.raises(ValueError, match="adapter"):
        loop.add_request(PROMPTS[0], PARAMS, "r-lora", lora_name="tenant-a")
    assert loop.add_request(PROMPTS[0], PARAMS, "r-base", lora_name=None) == "r-base"
    assert loop.running_requests() == []
    loop.close()


def test_job_views_name_the_launches_that_would_not_replay_a_graph() -> None:
    """`JobState.cold_launches` asks the trainer per (quantum size, split's finetune stream),
    and the loop asks again only once the job's data or graphs moved; a job without graphs
    reports none."""
    from collections import Counter
    from types import SimpleNamespace

    from gpu_runtime.colocation import AnalyticLatencyModel
    from gpu_runtime.colocation.harli import HarliPolicy
    from gpu_runtime.colocation.job_state import JobState

    captured = {(2 * 256, 111), (4 * 256, 222)}  # (max tokens, stream handle) with a graph

    class _Trainer:
        graphs = SimpleNamespace(disabled=None, counts=Counter[str](), keys=list)
        stream = SimpleNamespace(position=0)
        asked = 0

        def replays_next(self, max_tokens: int, streams: set[int]) -> dict[int, bool]:
            self.asked += 1
            return {stream: (max_tokens, stream) in captured for stream in streams}

    trainer = _Trainer()
    job = JobState("job", trainer, 256, 256, 16)  # type: ignore[arg-type]
    cold = job.cold_launches((1, 2, 4), ((48, 111), (132, 222)))
    assert cold == {(1, 48), (4, 48), (1, 132), (2, 132)}
    assert job.view(cold).cold_launches == cold
    plain = JobState("job", SimpleNamespace(graphs=None), 256, 256, 16)  # type: ignore[arg-type]
    assert plain.cold_launches((1, 2), ((48, 111),)) == frozenset()

    handles = {48: 111, 132: 222}
    sharing = SimpleNamespace(
        table=SimpleNamespace(choices=(48, 132)),
        partition=lambda d: (None, SimpleNamespace(cuda_stream=handles[d])),
    )
    harli = HarliPolicy(AnalyticLatencyModel())
    loop = HostLoop(_engine(), harli, tpot_slo_ms=1e6, sharing=sharing)
    trainer.asked = 0
    seen = loop.planner.cold_launches(job)
    assert (2, 48) not in seen and (4, 132) not in seen
    assert {(k, d) for k in harli.launch_sizes for d in (48, 132)} - seen == {(2, 48), (4, 132)}
    asked = trainer.asked
    assert loop.planner.cold_launches(job) == seen and trainer.asked == asked  # nothing moved
    trainer.stream.position = 2  # a quantum ran: asked again
    loop.planner.cold_launches(job)
    assert trainer.asked == 2 * asked
    no_split = HostLoop(_engine(), harli, tpot_slo_ms=1e6)
    assert no_split.planner.cold_launches(job) == set()
    # A policy that reads no graph readiness costs the loop nothing.
    only = HostLoop(_engine(), DecodeOnlyPolicy(), tpot_slo_ms=1e6, sharing=sharing)
    asked = trainer.asked
    assert only.planner.cold_launches(job) == set() and trainer.asked == asked


def test_a_job_paused_at_its_batch_end_runs_only_to_finish_the_batch(
    train_examples: Any,
) -> None:
    """A host's pause: the quanta of the batch in progress run (its gradients are not
    thrown away), then none, however often the loop plans; resume lifts it."""
    engine = _engine()
    loop = HostLoop(engine, NaivePolicy(quantum_examples=1), tpot_slo_ms=1e6)
    loop.add_job("job-a", _trainer(engine, train_examples, epochs=3))
    trainer = loop.job_state("job-a").trainer
    loop.run_iteration()  # the first of the batch's 4 one-example quanta
    assert trainer.has_pending_gradients and trainer.step == 0
    loop.pause_job("job-a", at_batch_end=True)
    assert loop.job_state("job-a").runnable
    records = loop.run_until_idle(max_iterations=50)
    assert sum(len(r.quanta) for r in records) == 3
    assert trainer.step == 1 and not trainer.has_pending_gradients
    assert not loop.job_state("job-a").runnable and not loop.has_work()
    loop.resume_job("job-a")
    assert loop.run_iteration().finetune_tokens > 0


def test_a_fan_out_times_each_sequence_from_the_request_arrival() -> None:
    import dataclasses

    from gpu_runtime.engine.fanout import child_id

    loop = HostLoop(_engine(), DecodeOnlyPolicy(), tpot_slo_ms=1e6)
    parent = loop.add_request(PROMPTS[2], dataclasses.replace(PARAMS, n=3))
    records = loop.run_until_idle(max_iterations=50)
    finished = {f.request_id: f for r in records for f in r.finished}
    assert sorted(finished) == [child_id(parent, i) for i in range(3)]
    assert all(f.output_tokens == PARAMS.max_tokens and f.ttft_ms for f in finished.values())
    aborted = loop.add_request(PROMPTS[2], dataclasses.replace(PARAMS, n=2))
    loop.run_iteration()
    loop.abort_request(aborted)
    assert loop.running_requests() == [] and not loop.has_work()
