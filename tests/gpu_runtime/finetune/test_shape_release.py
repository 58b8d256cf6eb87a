"""Graph pools placed per launch (`LaunchPoolGroups`) and the shape releases of
`gpu_runtime/finetune/shape_release.py`, on the real graph bookkeeping of CPU trainers (the
capture itself through `tests/gpu_runtime/finetune/cpu_graphs.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_runtime.finetune.graph_policy import GraphKey, bucket_length
from gpu_runtime.finetune.graph_pools import SHARED, LaunchPoolGroups
from gpu_runtime.finetune.quantum_fit import QuantumShape
from gpu_runtime.finetune.shape_release import (
    captured_shapes,
    drop_shared_shapes,
    release_largest_separate,
    separate_shapes,
)
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.memory import DecodeDemand
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.finetune.cpu_graphs import with_cpu_graphs
from tests.gpu_runtime.memory.policy_helpers import PAGE, policy_manager
from tests.gpu_runtime.tiny_host import SEQ, tiny_trainer


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return build_random_model(tiny_config("llama"), seed=11)


def _key(rows: int, recompute: bool = False, seq_len: int = 64) -> GraphKey:
    return GraphKey(rows, seq_len, seq_len * rows, 0, recompute)


def test_a_shape_goes_where_its_first_capture_launch_put_it_until_it_is_dropped() -> None:
    groups = LaunchPoolGroups()
    assert groups.group_of(_key(1)) == SHARED  # nothing placed, a shared launch
    groups.separate_launch = True
    assert groups.group_of(_key(1)) == ("shape", 1, False)
    assert groups.add(_key(1)) == ("shape", 1, False)
    groups.separate_launch = False
    assert groups.add(_key(1, recompute=True)) == SHARED
    # Placed while captured: the next launch's kind does not move it (its pool is known).
    assert groups.group_of(_key(1)) == ("shape", 1, False)
    assert groups.add(_key(1, seq_len=128)) == ("shape", 1, False)  # another length, same shape
    assert groups.largest_separate() == ("shape", 1, False)
    assert groups.remove(_key(1)) is None  # the 128-token graph still holds that pool
    assert groups.group_of(_key(1)) == ("shape", 1, False)
    assert groups.remove(_key(1, seq_len=128)) == ("shape", 1, False)
    # All of that shape's graphs are gone: its next capture is placed by its launch again.
    assert groups.group_of(_key(1)) == SHARED
    groups.separate_launch = True
    assert groups.group_of(_key(1, recompute=True)) == SHARED  # still captured in the shared
    groups.clear()
    assert groups.group_of(_key(1, recompute=True)) == ("shape", 1, True)


def test_captured_shapes_are_the_rows_and_modes_of_the_held_graph_keys() -> None:
    keys = [
        SimpleNamespace(rows=2, seq_len=512, recompute=False),
        SimpleNamespace(rows=1, seq_len=512, recompute=True),
    ]
    graphs = SimpleNamespace(disabled=None, keys=lambda: keys)
    held = {QuantumShape(2), QuantumShape(1, recompute=True)}
    assert captured_shapes(SimpleNamespace(graphs=graphs)) == held
    assert captured_shapes(SimpleNamespace(graphs=None)) == set()
    off = SimpleNamespace(disabled="capture failed", keys=lambda: keys)
    assert captured_shapes(SimpleNamespace(graphs=off)) == set()


def _graphed(model: CausalLM, per_token: int = 100) -> LoraTrainer:
    trainer = with_cpu_graphs(tiny_trainer(model), lambda key: per_token * key.rows * SEQ)
    assert trainer.graphs is not None
    trainer.graphs.pool_groups = LaunchPoolGroups()
    return trainer


def _run(trainer: LoraTrainer, examples: int, separate: bool, recompute: bool = False) -> str:
    graphs = trainer.graphs
    assert graphs is not None and isinstance(graphs.pool_groups, LaunchPoolGroups)
    graphs.pool_groups.separate_launch = separate
    # graphed micro-batches count tokens padded to the sequence bucket
    tokens = examples * bucket_length(SEQ)
    result = trainer.step_quantum(max_tokens=tokens, recompute=recompute)
    return str(result.graph)


def test_cpu_replays_train_like_eager_quanta(model: CausalLM) -> None:
    """The CPU stand-in for a capture replays what an eager quantum computes: the same
    losses after each optimizer step, so tests of the loop's graph pools train as it would."""
    eager, graphed = tiny_trainer(model), _graphed(model)
    modes = [_run(graphed, 1, separate=False) for _ in range(8)]
    for _ in range(8):
        eager.step_quantum(max_tokens=SEQ)
    assert modes == ["eager", "capture"] + ["replay"] * 6
    # equal up to float summation order (graphs pad each example to its 64-token bucket)
    losses = [r.loss for r in eager.history]
    assert len(losses) == 4 and [r.loss for r in graphed.history] == pytest.approx(losses, rel=1e-4)
    assert len({round(loss, 3) for loss in losses}) == 4  # the adapters did move


def test_the_largest_separate_shape_among_jobs_is_released_first(model: CausalLM) -> None:
    small, large = _graphed(model), _graphed(model)
    for trainer, separate_rows in ((small, 1), (large, 2)):
        _run(trainer, 1, separate=False, recompute=True)  # warm-up (eager), then captured
        _run(trainer, 1, separate=False, recompute=True)
        _run(trainer, separate_rows, separate=True)
    assert separate_shapes(small) == {QuantumShape(1)}
    assert separate_shapes(large) == {QuantumShape(2)}
    assert captured_shapes(large) == {QuantumShape(2), QuantumShape(1, recompute=True)}
    assert release_largest_separate([small, large]) == 1
    assert separate_shapes(large) == set() and separate_shapes(small) == {QuantumShape(1)}
    assert captured_shapes(large) == {QuantumShape(1, recompute=True)}  # the shared pool stays
    assert release_largest_separate([small, large]) == 1
    assert release_largest_separate([small, large, SimpleNamespace(graphs=None)]) == 0
    assert large.graphs is not None and large.graphs.counts["released"] == 1
    # The released shape is captured again into a pool of its own by its next launch.
    assert _run(large, 2, separate=True) == "capture"
    assert separate_shapes(large) == {QuantumShape(2)}


def test_shared_shapes_are_dropped_and_flushed_before_a_shape_is_captured_alone(
    model: CausalLM,
) -> None:
    manager, pool = policy_manager(num_pages=64, grow_hold_iterations=0)
    manager.finetune.set_demand(60 * PAGE)
    manager.maintain(DecodeDemand(used_blocks=0, top_used_block=0))
    trainer = _graphed(model)
    for _ in range(2):
        _run(trainer, 1, separate=False, recompute=True)
    manager.finetune.quantum_done(peak_bytes=20 * PAGE, resident_bytes=2 * PAGE)
    # The memory side as the finetune side sees it (`EngineMemory` over this manager).
    memory = SimpleNamespace(finetune_graphs_released=manager.finetune.graphs_released)
    assert drop_shared_shapes(trainer, memory) == 1
    assert captured_shapes(trainer) == set()
    assert manager.counters.graph_releases == 1
    assert pool.backend.finetune_reserved_bytes() == 2 * PAGE  # flushed down to the live state
    assert drop_shared_shapes(trainer, memory) == 0  # nothing shared: no flush
    assert manager.counters.graph_releases == 1
    assert drop_shared_shapes(SimpleNamespace(graphs=None), memory) == 0
    pool.check()
