"""The host loop chooses activation recomputation per launch from the memory budget
(`JobState.choose_mode`): the mode the policy sizes a quantum by is the mode the trainer runs
and the memory manager counts."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.colocation import HostLoop, NaivePolicy
from gpu_runtime.colocation.job_state import RECOMPUTE_LAYERS_ESTIMATE, JobState
from gpu_runtime.colocation.types import (
    IterationContext,
    IterationPlan,
    LaunchMode,
    QuantumReport,
)
from gpu_runtime.finetune.shape_release import RECAPTURE_MARGIN
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.tiny_host import GREEDY, SEQ, tiny_host, tiny_trainer


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


def _state(model: CausalLM, layers: int | None = 32) -> JobState:
    state = JobState("ft", tiny_trainer(model), SEQ, SEQ, 4, layers=layers)
    state.choose_recompute = True
    return state


def test_choose_mode_prefers_no_recomputation_and_recomputes_only_when_that_alone_fits(
    model: CausalLM,
) -> None:
    state = _state(model)
    state.choose_mode(10**9)  # nothing measured yet: without, uncapped (the first quantum)
    assert (state.recompute, state.bytes_per_token) == (False, None)
    state.measured_bytes_per_token[False] = 1000.0
    estimate = 1000.0 * RECOMPUTE_LAYERS_ESTIMATE / 32
    state.choose_mode(None)  # no pool figure: without
    assert not state.recompute and state.bytes_per_token == 1000.0
    state.choose_mode(SEQ * 1000)  # one example without fits
    assert not state.recompute and state.bytes_per_token == 1000.0
    state.choose_mode(SEQ * 1000 - 1)  # only with: the policy sizes by the estimate
    assert state.recompute and state.bytes_per_token == estimate
    state.choose_mode(int(SEQ * estimate) - 1)  # neither: without (the policy pauses)
    assert not state.recompute and state.bytes_per_token == 1000.0
    state.measured_bytes_per_token[True] = 50.0  # a measured figure replaces the estimate
    state.choose_mode(int(SEQ * estimate) - 1)
    assert state.recompute and state.bytes_per_token == 50.0
    unknown = _state(model, layers=None)  # no layer count, nothing measured with: no estimate
    unknown.measured_bytes_per_token[False] = 1000.0
    unknown.choose_mode(SEQ * 100)
    assert not unknown.recompute and unknown.bytes_per_token == 1000.0
    fixed = _state(model)
    fixed.choose_recompute = False
    fixed.bytes_per_token = 7.0
    fixed.measured_bytes_per_token[False] = 1000.0
    fixed.choose_mode(1)
    assert not fixed.recompute and fixed.bytes_per_token == 7.0


def test_record_quantum_files_bytes_per_token_under_the_mode_that_ran(model: CausalLM) -> None:
    state = _state(model)

    def report(tokens: int, peak: int | None) -> QuantumReport:
        return QuantumReport(
            "ft", tokens, 1.0, LaunchMode.CONCURRENT, None, finetune_peak_bytes=peak
        )

    state.record_quantum(report(SEQ, SEQ * 800))
    assert state.measured_bytes_per_token == {False: 800.0}
    state.trainer.optimizer_tail.recompute_micro_batches += 1  # this one recomputed
    state.record_quantum(report(SEQ, SEQ * 60))
    assert state.measured_bytes_per_token == {False: 800.0, True: 60.0}
    state.record_quantum(report(SEQ, None))  # no peak (CPU): nothing learnt
    state.record_quantum(report(SEQ, SEQ * 900))
    assert state.measured_bytes_per_token == {False: 900.0, True: 60.0}


class BudgetSeen(NaivePolicy):
    """The naive policy, keeping the budget each launch was planned with."""

    def __init__(self) -> None:
        super().__init__(quantum_examples=1)
        self.budgets: list[int | None] = []

    def plan(self, ctx: IterationContext) -> IterationPlan:
        plan = super().plan(ctx)
        if plan.launches:
            self.budgets.append(ctx.finetune_budget_bytes)
        return plan


def _loop(model: CausalLM) -> tuple[HostLoop, object]:
    host, engine = tiny_host(model)
    loop = HostLoop(
        engine, BudgetSeen(), tpot_slo_ms=1e9, memory=host.memory, choose_recompute=True
    )
    host.bind_loop(loop)
    host.set_finetune_jobs(1)
    return loop, host


def test_loop_runs_and_counts_the_mode_the_budget_allows(model: CausalLM) -> None:
    loop, host = _loop(model)
    trainer = tiny_trainer(model, epochs=20)
    state = loop.add_job("ft", trainer)
    assert state.choose_recompute  # a pool, and hparams that do not force recomputation
    counters = host.memory.manager.counters  # type: ignore[attr-defined]
    # One example without recomputation never fits; with it, whenever one byte per token does.
    state.measured_bytes_per_token.update({False: 1e15, True: 1.0})
    modes: list[bool] = []
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 480, (n,), generator=gen).tolist() for n in (5, 30, 12, 40)]
    for p in prompts:
        loop.add_request(p, GREEDY)
    for _ in range(40):
        if loop.run_iteration().finetune_launched:
            modes.append(trainer.recompute)
    budgets = loop.policy.budgets  # type: ignore[attr-defined]
    recomputed = modes
    assert sum(recomputed) >= 3 and not all(recomputed)
    # With it exactly when one example fits that way (the pool lends nothing at first).
    assert all(m == (b >= SEQ) for b, m in zip(budgets, modes, strict=True))
    assert trainer.recompute_micro_batches == sum(recomputed)
    assert counters.finetune_recompute_launches == sum(recomputed)
    # Now one example without recomputation fits whenever one with it does: no more recomputing.
    state.measured_bytes_per_token[False] = 1.0
    switches = counters.finetune_mode_switches
    launched = 0
    for _ in range(30):
        launched += bool(loop.run_iteration().finetune_launched)
    assert launched >= 3 and not trainer.recompute
    assert trainer.recompute_micro_batches == sum(recomputed)
    assert counters.finetune_recompute_launches == sum(recomputed)
    assert counters.finetune_mode_switches == switches + 1
    loop.close()


def test_hparams_that_force_recomputation_are_left_alone(model: CausalLM) -> None:
    loop, _ = _loop(model)
    trainer = tiny_trainer(model, checkpointing=True)
    state = loop.add_job("ft", trainer)
    assert not state.choose_recompute
    state.measured_bytes_per_token.update({False: 1.0})  # would choose without
    for _ in range(10):
        loop.run_iteration()
    assert trainer.recompute and trainer.recompute_micro_batches >= 1
    loop.close()


def test_choose_mode_runs_without_recomputation_against_the_release_plan(
    model: CausalLM,
) -> None:
    """With graph shapes released one at a time (`release_shapes`): one example without
    recomputation that fits only the release plan runs in a pool of its own, planned for that
    plan (by `RECAPTURE_MARGIN` until such a shape is held), before any recomputing shape."""
    state = _state(model)
    state.release_shapes = True
    state.measured_bytes_per_token.update({False: 1000.0, True: 50.0})
    one = SEQ * 1000
    state.choose_mode(one, release_bytes=10 * one)  # fits the plan: the shared pool
    assert (state.recompute, state.separate, state.planned_bytes) == (False, False, one)
    margin = int(one * RECAPTURE_MARGIN) + 1
    state.choose_mode(one - 1, release_bytes=margin)
    assert (state.recompute, state.separate, state.planned_bytes) == (False, True, margin)
    assert state.bytes_per_token == 1000.0
    state.choose_mode(one - 1, release_bytes=one)  # not held: the margin is missing
    assert (state.recompute, state.separate, state.planned_bytes) == (True, False, one - 1)
    assert state.bytes_per_token == 50.0
    state.choose_mode(one - 1)  # no release plan (a quantum in flight): as before
    assert state.recompute and not state.separate
    fixed = _state(model)
    fixed.choose_recompute = False
    fixed.choose_mode(5, release_bytes=10**9)
    assert not fixed.separate and fixed.planned_bytes == 5


def test_release_graph_shapes_needs_a_release_plan_and_chosen_modes(model: CausalLM) -> None:
    loop, host = _loop(model)
    with pytest.raises(ValueError, match="release_graph_shapes"):
        HostLoop(loop.engine, BudgetSeen(), tpot_slo_ms=1e9, release_graph_shapes=True)
    with pytest.raises(ValueError, match="release_graph_shapes"):
        HostLoop(
            loop.engine,
            BudgetSeen(),
            tpot_slo_ms=1e9,
            memory=host.memory,  # type: ignore[attr-defined]
            release_graph_shapes=True,
        )
    # Without graphs (a CPU trainer) the job's shapes stay as they were.
    released = HostLoop(
        loop.engine,
        BudgetSeen(),
        tpot_slo_ms=1e9,
        memory=host.memory,  # type: ignore[attr-defined]
        choose_recompute=True,
        release_graph_shapes=True,
    )
    assert not released.add_job("ft", tiny_trainer(model)).release_shapes
    loop.close()
