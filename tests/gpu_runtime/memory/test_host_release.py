"""Graph pools released one shape at a time under the host agent's loop, on CPU: the pool
`build_host_memory` wires, `HostLoop(choose_recompute=True, release_graph_shapes=True)` as
`gpu_runtime/agent/runtime.py` builds it, `HostMemory.bind_loop`'s release hook, and a real
LoRA trainer whose graphed quanta run through `tests/gpu_runtime/finetune/cpu_graphs.py` (a
capture cannot run on CPU; each shape's graph pool is what `POOL_PER_TOKEN` says, recorded by
the CPU pool's caching-allocator model when its quantum finishes).

The story: with decode idle, one example without recomputation fits only the release plan
(the plan keeps room for decode's remembered peak), so it runs in a graph pool of its own;
requests arrive, decode's growth leaves that pool above the release plan, and the next quantum
boundary releases it (not the shared pool) and the job recomputes in the shared pool; once the
growth is forgotten, the shared shapes are dropped and the shape without recomputation is
captured alone again. Quanta keep running throughout, never over their budget."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from gpu_runtime.colocation import HostLoop, IterationPlan, NaivePolicy
from gpu_runtime.colocation.baselines import memory_cap_tokens
from gpu_runtime.colocation.types import IterationContext
from gpu_runtime.finetune.graph_pools import SHARED, LaunchPoolGroups
from gpu_runtime.finetune.quantum_fit import QuantumShape
from gpu_runtime.finetune.shape_release import captured_shapes, separate_shapes
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.finetune.cpu_graphs import with_cpu_graphs
from tests.gpu_runtime.tiny_host import GREEDY, POLICY, SEQ, tiny_host, tiny_trainer

POOL_PER_TOKEN = {False: 3072, True: 512}
"""Graph pool bytes per example token without / with recomputation: one example is 18 / 3
pages of the 48-page pool (a page is one 2 KiB KV block of the tiny model)."""
RELEASE_POLICY = dataclasses.replace(
    POLICY,
    plan_peak_window=64,  # the plan keeps room for decode's peak over 64 quantum boundaries
    plan_peak_prior_blocks=30,  # a peak known from the start: 30 blocks
    headroom_window=8,  # growth is forgotten after 8 intervals (the release plan comes back)
)
ONE, ONE_RECOMPUTING = QuantumShape(1), QuantumShape(1, recompute=True)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


class WithinBudget(NaivePolicy):
    """One example per quantum when the budget it is planned for holds one (Harli's memory
    rule, `memory_cap_tokens`); else a pause."""

    def __init__(self) -> None:
        super().__init__(quantum_examples=1)

    def plan(self, ctx: IterationContext) -> IterationPlan:
        if ctx.jobs and ctx.in_flight is None:
            cap = memory_cap_tokens(ctx.jobs[0], ctx.finetune_budget_bytes)
            if cap is not None and cap < ctx.jobs[0].max_seq_len:
                return IterationPlan(decode_sms=None, paused=True, note="memory budget")
        return super().plan(ctx)


def test_a_reclaim_under_the_agents_loop_releases_one_shape_between_quanta(
    model: CausalLM, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpu_runtime.memory")
    host, engine = tiny_host(model, RELEASE_POLICY)
    loop = HostLoop(
        engine,
        WithinBudget(),
        tpot_slo_ms=1e9,
        memory=host.memory,
        choose_recompute=True,
        release_graph_shapes=True,
    )
    host.bind_loop(loop)
    manager, counters = host.manager, host.manager.counters
    released_while_busy: list[bool] = []
    hook = manager.finetune.graph_release
    assert hook is not None

    def observed_release() -> int:  # the hook bind_loop set, seen from outside
        released_while_busy.append(loop.executor.in_flight is not None)
        return hook()

    manager.finetune.graph_release = observed_release
    trainer = with_cpu_graphs(
        tiny_trainer(model, epochs=50), lambda key: POOL_PER_TOKEN[key.recompute] * key.rows * SEQ
    )
    state = loop.add_job("ft", trainer)
    assert state.release_shapes and trainer.graphs is not None
    assert isinstance(trainer.graphs.pool_groups, LaunchPoolGroups)
    # Nothing measures activation bytes on CPU: the job knows its graphs' figures.
    state.measured_bytes_per_token.update({k: float(v) for k, v in POOL_PER_TOKEN.items()})
    host.set_finetune_jobs(1)
    one = POOL_PER_TOKEN[False] * SEQ

    # Decode idle: the plan keeps the prior peak's room, the release plan does not.
    first = loop.run_iteration()
    assert first.paused and counters.finetune_grows == 1  # the pool lends at the boundary
    record = loop.run_iteration()
    assert record.finetune_launched and state.separate
    assert host.memory._promised_bytes == manager.finetune.release_plan_bytes()  # not the plan
    assert manager.finetune.plan_bytes() < one <= manager.finetune.release_plan_bytes()
    for _ in range(12):
        loop.run_iteration()
    assert separate_shapes(trainer) == {ONE} and captured_shapes(trainer) == {ONE}
    held = manager.pool.backend.finetune_reserved_bytes()
    assert held == one and counters.graph_releases == 0
    tokens = state.tokens_trained

    # Requests arrive: decode grows, and the next boundary releases the separate shape.
    gen = torch.Generator().manual_seed(3)
    for n in (12, 20):
        loop.add_request(torch.randint(1, 480, (n,), generator=gen).tolist(), GREEDY)
    for _ in range(3):
        loop.run_iteration()
    assert counters.graph_releases == 1 and trainer.graphs.counts["released"] == 1
    assert any("released 1 graphs of its largest separate shape" in m for m in caplog.messages)
    assert released_while_busy == [False]
    assert captured_shapes(trainer) == {ONE_RECOMPUTING}  # recapturing in the shared pool
    assert trainer.graphs.pool_groups.groups() == {SHARED: set(trainer.graphs.keys())}
    assert counters.finetune_mode_switches == 1 and counters.urgent_flushes == 0

    # Decode's growth is forgotten: the shared shapes are dropped, ONE is captured alone again.
    for _ in range(20):
        loop.run_iteration()
    assert counters.graph_releases == 2  # the shared pool dropped and flushed
    assert any("dropped 1 graphs between quanta" in m for m in caplog.messages)
    assert separate_shapes(trainer) == captured_shapes(trainer) == {ONE}
    assert counters.finetune_mode_switches == 2
    assert counters.finetune_recompute_launches >= 3

    # Quanta ran through all of it, each within the budget it was planned for.
    assert state.tokens_trained > tokens > 0 and state.failed is None
    assert counters.finetune_budget_violations == 0 and counters.finetune_ooms == 0
    assert not engine.has_unfinished_requests()
    host.pool.check()
    loop.close()
    host.close()
