"""HostLoop over an engine with async scheduling: the next iteration is planned inside the
current step (`gpu_runtime.colocation.ahead`). Real tiny-model decode and LoRA quanta on CPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpu_runtime.colocation import (
    AnalyticLatencyModel,
    CoLocationPolicy,
    FinetuneLaunch,
    HarliConfig,
    HarliPolicy,
    HostLoop,
    IterationContext,
    IterationPlan,
    IterationRecord,
    LaunchMode,
    NaivePolicy,
    OnlineLatencyModel,
)
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from tests.gpu_runtime.colocation.test_loop import PROMPTS, _engine, _trainer

LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _async_engine(async_scheduling: bool = True) -> Engine:
    """The loop tests' engine with the bucketed decode path, which async scheduling needs."""
    base = _engine()
    config = dataclasses.replace(
        base.config,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
        async_scheduling=async_scheduling,
    )
    return Engine(base.runner.model, config)


def _decode_alone(params: SamplingParams) -> list[list[int]]:
    """The same requests on a synchronous engine with the same decode path, alone."""
    engine = _async_engine(async_scheduling=False)
    return [out.output_token_ids for out in engine.generate(PROMPTS, params)]


class _Watched(CoLocationPolicy):
    """Wraps a policy; notes for every plan whether the engine was inside a step then."""

    def __init__(self, inner: CoLocationPolicy, engine: Engine) -> None:
        self.inner = inner
        self.name = inner.name
        self.inside: list[bool] = []
        self.observed: list[int] = []
        self._in_step = False
        step = engine.step

        def watched_step(*args: Any, **kwargs: Any) -> Any:
            self._in_step = True
            try:
                return step(*args, **kwargs)
            finally:
                self._in_step = False

        engine.step = watched_step  # type: ignore[method-assign]
        self.launch_sizes = inner.launch_sizes

    def plan(self, ctx: IterationContext) -> IterationPlan:
        self.inside.append(self._in_step)
        return self.inner.plan(ctx)

    def observe(self, record: IterationRecord) -> None:
        self.observed.append(record.index)
        self.inner.observe(record)


def _loop(
    engine: Engine, policy: CoLocationPolicy, examples: Any, params: SamplingParams
) -> tuple[HostLoop, list[str], dict[str, list[int]]]:
    """A loop with the prompts queued and job "j" added; outputs by request id."""
    outputs: dict[str, list[int]] = {}
    loop = HostLoop(
        engine,
        policy,
        tpot_slo_ms=1e6,
        output_sink=lambda batch: outputs.update({o.request_id: o.output_token_ids for o in batch}),
    )
    ids = [loop.add_request(p, params) for p in PROMPTS]
    loop.add_job("j", _trainer(engine, examples))
    return loop, ids, outputs


def _run(engine: Engine, policy: CoLocationPolicy, examples: Any, params: SamplingParams) -> Any:
    loop, ids, outputs = _loop(engine, policy, examples, params)
    records = loop.run_until_idle(max_iterations=500)
    loop.close()
    return loop, records, [outputs[i] for i in ids]


def test_an_async_engine_plans_each_decode_step_ahead_and_decodes_as_the_synchronous_loop(
    train_examples: Any,
) -> None:
    engine = _async_engine()
    policy = _Watched(NaivePolicy(quantum_examples=1), engine)
    loop, records, tokens = _run(engine, policy, train_examples, SHORT)

    assert tokens == _decode_alone(SHORT)  # the same greedy tokens as decode alone, synchronously
    # Plans made inside a step: the decode-only steps the engine launched ahead.
    assert sum(policy.inside) >= 4 and not all(policy.inside)
    assert len(policy.inside) == len(records)  # one plan per iteration, none lost
    assert policy.observed == [r.index for r in records]  # each record observed, in order
    state = loop.job_state("j")
    assert state.finished and state.failed is None
    assert state.tokens_trained == sum(e.num_tokens for e in train_examples)
    assert sum(r.finetune_tokens for r in records) == state.tokens_trained
    assert sum(len(r.tpot_samples_ms) for r in records) == len(PROMPTS) * (SHORT.max_tokens - 1)
    assert sorted(f.request_id for r in records for f in r.finished) == sorted(
        f"req-{i}" for i in range(len(PROMPTS))
    )


def test_harli_observes_the_plan_each_record_ran_although_the_next_was_made_first(
    train_examples: Any,
) -> None:
    """Planning ahead calls `plan` for iteration k + 1 before `observe` of iteration k: harli
    reads what it needs of a plan from the record's memo, not from its latest plan."""
    engine = _async_engine()
    # No slices (quanta after decode, which run synchronously): whole quanta beside decode.
    config = HarliConfig(allow_slice=False)
    harli = HarliPolicy(OnlineLatencyModel(AnalyticLatencyModel(base_ms=1.0)), config)
    policy = _Watched(harli, engine)
    loop, records, tokens = _run(engine, policy, train_examples, LONG)

    assert any(policy.inside)
    assert loop.job_state("j").finished
    memos = [r.plan_memo for r in records]
    assert all(m is not None for m in memos)
    launched_ahead = 0
    for record, memo, inside in zip(records, memos, policy.inside, strict=True):
        concurrent = [
            launch for launch in record.finetune_launched if launch.mode is LaunchMode.CONCURRENT
        ]
        busy = bool(record.decode_batch or record.prefill_tokens)
        assert (memo.launch_planned is not None) == bool(concurrent and busy)
        assert memo.backing_off == (record.note == "backing off")
        launched_ahead += bool(concurrent and inside)
    assert launched_ahead > 0


class _AfterDecodeEveryOther(CoLocationPolicy):
    """A quantum after the decode step every other plan: a plan the loop cannot run ahead."""

    name = "after_decode_every_other"

    def __init__(self) -> None:
        self.plans = 0

    def plan(self, ctx: IterationContext) -> IterationPlan:
        self.plans += 1
        if self.plans % 2 or not ctx.jobs:
            return IterationPlan()
        launch = FinetuneLaunch(ctx.jobs[0].job_id, 64, LaunchMode.AFTER_DECODE)
        return IterationPlan(launches=(launch,))


def test_a_plan_with_a_quantum_after_decode_declines_the_step_ahead(train_examples: Any) -> None:
    engine = _async_engine()
    policy = _Watched(_AfterDecodeEveryOther(), engine)
    loop, records, tokens = _run(engine, policy, train_examples, LONG)

    assert tokens == _decode_alone(LONG)
    after = [r for r in records if r.finetune_launched]
    assert after and all(q.mode is LaunchMode.AFTER_DECODE for r in after for q in r.quanta)
    # Each such plan was made ahead, then ran synchronously: its quantum followed its own step.
    assert all(len(r.quanta) == 1 for r in after if r.decode_tokens)
    assert loop.job_state("j").tokens_trained == sum(r.finetune_tokens for r in records)


@pytest.mark.parametrize("change", ["pause", "remove"])
def test_a_plan_kept_from_ahead_is_made_again_when_its_job_stops_between_calls(
    train_examples: Any, change: str
) -> None:
    """A declined plan is kept for the next call; pausing or removing its job in between makes
    the loop plan that iteration again instead of launching the job."""
    engine = _async_engine()
    loop, ids, outputs = _loop(engine, _AfterDecodeEveryOther(), train_examples, LONG)
    for _ in range(40):
        loop.run_iteration()
        kept = loop.ahead.pending
        if kept is not None and kept.plan.launches and not kept.launched:
            break
    else:
        pytest.fail("no plan with a quantum after decode was kept from ahead")
    if change == "pause":
        loop.pause_job("j")
    else:
        loop.remove_job("j")
    record = loop.run_iteration()
    assert not record.finetune_launched and not record.quanta
    if change == "pause":
        loop.resume_job("j")
    records = loop.run_until_idle(max_iterations=500)
    loop.close()
    assert [outputs[i] for i in ids] == _decode_alone(LONG)
    trained = any(r.quanta for r in records)
    assert trained == (change == "pause")


class _FailsOnce(NaivePolicy):
    def __init__(self, at: int) -> None:
        super().__init__(quantum_examples=1)
        self.at = at
        self.calls = 0

    def plan(self, ctx: IterationContext) -> IterationPlan:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("plan failed")
        return super().plan(ctx)


def test_a_plan_that_fails_ahead_is_raised_after_the_step_and_the_loop_goes_on(
    train_examples: Any,
) -> None:
    engine = _async_engine()
    policy = _Watched(_FailsOnce(at=6), engine)
    loop, ids, outputs = _loop(engine, policy, train_examples, LONG)
    with pytest.raises(RuntimeError, match="plan failed"):
        for _ in range(50):
            loop.run_iteration()
    assert policy.inside[5]  # it failed ahead, inside a step
    loop.run_until_idle(max_iterations=500)  # the step it failed in was applied: no token lost
    loop.close()
    assert [outputs[i] for i in ids] == _decode_alone(LONG)


def test_an_engine_step_ahead_runs_where_the_caller_says_or_not_at_all() -> None:
    """`Engine.step(ahead=...)`: asked only when a step can be launched ahead; declining
    makes the next call synchronous; the tokens are those of the synchronous engine."""
    engine = _async_engine()
    asked: list[int] = []
    launched: list[int] = []

    class Ahead:
        def plan(self) -> tuple[Any, Any] | None:
            asked.append(len(asked))
            return None if len(asked) % 3 == 0 else ("split", None)

        def launched(self) -> None:
            launched.append(len(asked))

    partitions: list[Any] = []
    launch = engine.runner.launch

    def seen_launch(plan: Any, partition: Any = None) -> Any:
        partitions.append(partition)
        return launch(plan, partition)

    engine.runner.launch = seen_launch  # type: ignore[method-assign,assignment]
    ids = [engine.add_request(p, LONG) for p in PROMPTS]
    final: dict[str, list[int]] = {}
    ahead = Ahead()
    while engine.has_unfinished_requests():
        for out in engine.step(None, None, ahead):
            if out.finished:
                final[out.request_id] = out.output_token_ids
    assert [final[i] for i in ids] == _decode_alone(LONG)
    assert asked and launched == [n + 1 for n in range(len(asked)) if (n + 1) % 3]
    assert partitions.count("split") == len(launched)
    assert isinstance(engine.config, EngineConfig)
