"""Releasing a separately pooled CUDA-graph shape between quanta (`FinetuneBudget.release_graphs`):
when it happens (decode's growth leaves what finetune holds above the release plan, or a
refill needs what only a flush frees), what it is counted as, and that it never happens while
a quantum runs. The finetune side is the real pool-group bookkeeping of the trainer's graphs
(`PoolGroups`); on CPU a flush frees the whole cache above the live state."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_runtime.engine import SamplingParams
from gpu_runtime.finetune.graph_policy import GraphKey
from gpu_runtime.finetune.graph_pools import SHARED, PoolGroups, separate_above
from gpu_runtime.memory import DecodeDemand
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.memory.policy_helpers import PAGE, policy_manager
from tests.gpu_runtime.memory.test_engine_memory import _pooled_engine


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


class _Shapes:
    """The trainer's captured shapes: 1 and 2 examples in the shared pool, 4 in its own."""

    def __init__(self) -> None:
        self.groups = PoolGroups(separate_above(2))
        for rows in (1, 2, 4):
            self.groups.add(GraphKey(rows, 512, 512 * rows, 7))
        self.released: list[list[int]] = []

    def release(self) -> int:
        group = self.groups.largest_separate()
        if group is None:
            return 0
        keys = self.groups.keys_of(group)
        for key in keys:
            self.groups.remove(key)
        self.released.append(sorted(key.rows for key in keys))
        return len(keys)


def _lent(**config: Any) -> tuple[Any, Any, _Shapes]:
    manager, pool = policy_manager(num_pages=64, grow_hold_iterations=0, **config)
    manager.finetune.set_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    assert pool.finetune_pages == 60
    shapes = _Shapes()
    manager.finetune.graph_release = shapes.release
    return manager, pool, shapes


def test_decode_growth_releases_the_largest_separate_shape_at_the_next_boundary() -> None:
    manager, pool, shapes = _lent(plan_peak_window=8, plan_peak_prior_blocks=20)
    # The peak term keeps 20 pages out of the plan; the release plan counts growth only.
    assert manager.finetune.plan_bytes() == 40 * PAGE
    assert manager.finetune.release_plan_bytes() == 60 * PAGE
    # The 4-example shape was captured into its own pool in the quiet spell: 50 pages held.
    manager.finetune.quantum_done(peak_bytes=50 * PAGE, resident_bytes=2 * PAGE)
    assert manager.refill_reserve(DecodeDemand(used_blocks=0)) == 0
    assert shapes.released == [] and manager.counters.graph_releases == 0
    # Decode grows 2 blocks over one interval: 4 intervals of that are 8 pages of headroom.
    # The refill takes 4 unheld pages (a cap change); then 50 held > 56 - 8: release.
    assert manager.refill_reserve(DecodeDemand(used_blocks=2)) == 4
    assert shapes.released == [[4]]
    assert set(shapes.groups.groups()) == {SHARED}
    c = manager.counters
    assert c.graph_releases == 1 and len(c.flush_latency) == 1 and c.urgent_flushes == 0
    assert pool.backend.finetune_reserved_bytes() == 2 * PAGE  # CPU: the cache is gone
    assert manager.finetune.release_plan_bytes() == 48 * PAGE
    # The shared shape is held again (a replay's pool); nothing separate is left to release.
    manager.finetune.quantum_done(peak_bytes=20 * PAGE, resident_bytes=2 * PAGE)
    for used in (4, 6, 10):
        manager.refill_reserve(DecodeDemand(used_blocks=used))
    assert shapes.released == [[4]] and c.graph_releases == 1 and len(c.flush_latency) == 1
    assert c.deferred_flushes == 0
    pool.check()


def test_a_refill_that_only_a_flush_could_serve_releases_first() -> None:
    # No plan headroom: the release plan is the whole budget, so only the refill triggers.
    manager, pool, shapes = _lent(plan_headroom_intervals=0)
    manager.finetune.quantum_done(peak_bytes=58 * PAGE, resident_bytes=2 * PAGE)
    assert manager.finetune.release_plan_bytes() == 60 * PAGE
    got = manager.refill_reserve(DecodeDemand(used_blocks=4, waiting_blocks=8))
    # used 4 + low 4 + waiting 8 = 16 pages wanted, 4 mapped: 2 unheld pages by a cap change,
    # then the release and a flush, then the other 10 by a cap change.
    assert got == 12 and manager.usable_blocks == 16
    assert shapes.released == [[4]] and manager.counters.graph_releases == 1
    assert manager.counters.deferred_flushes == 1  # the first pass left what needed a flush
    pool.check()
    # Under a static split the hook is never asked.
    manager, pool, shapes = _lent(reclaim_from_finetune=False, min_decode_pages=4)
    manager.finetune.quantum_done(peak_bytes=58 * PAGE, resident_bytes=2 * PAGE)
    manager.refill_reserve(DecodeDemand(used_blocks=4, waiting_blocks=8))
    assert shapes.released == [] and manager.counters.graph_releases == 0


def test_nothing_is_released_while_a_quantum_runs() -> None:
    manager, pool, shapes = _lent(plan_peak_window=8, plan_peak_prior_blocks=20)
    manager.finetune.quantum_done(peak_bytes=58 * PAGE, resident_bytes=2 * PAGE)
    waited: list[int] = []
    growing = DecodeDemand(used_blocks=4, top_used_block=4, waiting_blocks=8, next_step_blocks=4)
    for _ in range(3):  # a quantum in flight: maintain defers, before_step waits for it
        manager.maintain(growing, finetune_busy=True, promised_bytes=58 * PAGE)
        grant = manager.before_step(
            growing,
            finetune_busy=True,
            wait_for_finetune=lambda: waited.append(1),
            promised_bytes=58 * PAGE,
        )
        assert grant.short_blocks == 0
    assert shapes.released == [] and manager.counters.graph_releases == 0
    assert waited  # the urgent need waited for the quantum (then flushed, without the hook)
    manager.refill_reserve(DecodeDemand(used_blocks=8, waiting_blocks=8))
    assert manager.counters.graph_releases == 0  # the urgent flush left nothing held above
    manager.finetune.quantum_done(peak_bytes=40 * PAGE, resident_bytes=2 * PAGE)
    manager.refill_reserve(DecodeDemand(used_blocks=12, waiting_blocks=8))
    assert shapes.released == [[4]] and manager.counters.graph_releases == 1


def test_the_engine_memory_releases_only_in_before_decode_between_quanta(model: CausalLM) -> None:
    engine, memory = _pooled_engine(model, pages=48)
    manager = memory.manager
    page = manager.pool.page_bytes
    busy = [True]
    memory.finetune_busy = lambda: busy[0]
    manager.finetune.set_demand(40 * page)
    busy[0] = False
    memory.after_decode()  # idle: the pool is lent
    shapes = _Shapes()
    manager.finetune.graph_release = shapes.release
    held = manager.pool.finetune_pages * page
    manager.finetune.quantum_done(peak_bytes=held, resident_bytes=page)
    # The quantum launched now is promised the release plan (a shape captured in its pool).
    plan = memory.finetune_release_plan_bytes()
    assert plan == manager.finetune.release_plan_bytes() == held  # no headroom configured
    memory.promise_finetune_bytes(plan)
    busy[0] = True
    memory.promise_finetune_bytes(10 * plan)  # ignored while a quantum runs
    assert memory._promised_bytes == plan
    params = SamplingParams(max_tokens=6, temperature=0.0, detokenize=False, ignore_eos=True)
    for prompt in ([5] * 30, [7] * 30, [9] * 20):
        engine.add_request(prompt, params)
    for _ in range(4):  # decode grows beside the running quantum: no release
        memory.before_decode()
        engine.step()
        memory.after_decode()
        assert memory.last_before.flushes == memory.last_after.flushes == 0
    assert shapes.released == [] and manager.counters.graph_releases == 0
    assert manager.counters.deferred_reclaims > 0  # decode wanted finetune's pages meanwhile
    busy[0] = False  # the quantum is done: the boundary releases, counted in that call
    memory.before_decode()
    assert shapes.released == [[4]] and manager.counters.graph_releases == 1
    assert memory.last_before.flushes == 1 and memory.last_before.flush_ms >= 0
    engine.step()
    memory.after_decode()
    assert memory.last_after.flushes == 0


def test_graphs_the_finetune_side_drops_itself_are_flushed_and_counted() -> None:
    manager, pool, shapes = _lent(plan_peak_window=8, plan_peak_prior_blocks=20)
    manager.finetune.quantum_done(peak_bytes=30 * PAGE, resident_bytes=2 * PAGE)
    dropped = shapes.groups.keys_of(SHARED)  # the shared shapes, before 4 is captured alone
    for key in dropped:
        shapes.groups.remove(key)
    manager.finetune.graphs_released(len(dropped))
    c = manager.counters
    assert c.graph_releases == 1 and len(c.flush_latency) == 1 and c.urgent_flushes == 0
    assert pool.backend.finetune_reserved_bytes() == 2 * PAGE
    assert pool.finetune_pages == 60  # no budget change: the pages stay lent
    manager.finetune.graphs_released(0)  # nothing dropped: no flush
    assert c.graph_releases == 1 and len(c.flush_latency) == 1
    pool.check()
