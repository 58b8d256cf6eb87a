"""Which quantum shapes a trainer holds CUDA graphs for, and dropping them between quanta so
that the memory side can take their graph pools back one shape at a time.

Used by both finetune sides that release graph pools per shape: the host agent's loop
(:class:`~gpu_runtime.colocation.loop.HostLoop` with ``release_graph_shapes``, whose shapes are
placed per launch by :class:`~gpu_runtime.finetune.graph_pools.LaunchPoolGroups`) and the
memory bench's ``unified_release`` phase (``python -m bench.memory``, shapes placed by its
warm-up plan). The memory side (``FinetuneBudget.graph_release``) calls
:func:`release_largest_separate` only between quanta, never while one runs; a finetune side
that is about to capture a shape into a pool of its own first drops the shared pool's graphs
(:func:`drop_shared_shapes`), so the two pools are never held together. Plain bookkeeping over
the trainers' ``graphs`` (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpu_runtime.finetune.graph_pools import SHARED
from gpu_runtime.finetune.quantum_fit import QuantumShape

RECAPTURE_MARGIN = 1.1
"""A shape pooled on its own is captured again only when the release plan covers its
footprint by this factor (the memory side releases it below 1.0): no capture-release cycles
while decode hovers at the threshold."""


def _live_graphs(trainer: Any) -> Any:
    """The trainer's graphs, or None without graphs or once they are off for good."""
    graphs = getattr(trainer, "graphs", None)
    if graphs is None or graphs.disabled is not None:
        return None
    return graphs


def captured_shapes(trainer: Any) -> set[QuantumShape]:
    """The shapes (examples per micro-batch, recomputation) whose CUDA graphs `trainer` holds
    now (none without graphs, or once they are off for good)."""
    graphs = _live_graphs(trainer)
    if graphs is None:
        return set()
    return {QuantumShape(int(key.rows), bool(key.recompute)) for key in graphs.keys()}


def separate_shapes(trainer: Any) -> set[QuantumShape]:
    """The captured shapes whose graphs are in a pool of their own (not the shared one)."""
    graphs = _live_graphs(trainer)
    if graphs is None:
        return set()
    return {
        QuantumShape(int(key.rows), bool(key.recompute))
        for group, keys in graphs.pool_groups.groups().items()
        if group != SHARED
        for key in keys
    }


def refused_shapes(trainer: Any) -> set[QuantumShape]:
    """The shapes whose capture ran out of memory (eager since)."""
    graphs = getattr(trainer, "graphs", None)
    if graphs is None:
        return set()
    return {QuantumShape(int(key.rows), bool(key.recompute)) for key in graphs.policy.refused}


def drop_shared_shapes(trainer: Any, memory: Any) -> int:
    """Before a shape is captured into its own pool: drop the shared pool's graphs and let the
    memory side flush (`memory.finetune_graphs_released`: `EngineMemory`'s, which is
    `manager.finetune.graphs_released`), so that the two pools are never held together.
    Between quanta only. Returns the graphs dropped."""
    graphs = _live_graphs(trainer)
    if graphs is None:
        return 0
    dropped = len(graphs.release_group(SHARED))
    memory.finetune_graphs_released(dropped)
    return dropped


def release_separate_shape(trainer: Any) -> int:
    """`FinetuneBudget.graph_release` for `trainer`: drop its largest separately
    pooled shape's graphs (the count; 0 without graphs or such a shape)."""
    graphs = _live_graphs(trainer)
    if graphs is None:
        return 0
    return len(graphs.release_largest_separate())


def release_largest_separate(trainers: Iterable[Any]) -> int:
    """`FinetuneBudget.graph_release` for several jobs: drop the separately pooled
    shape that holds the most (most examples, then the longest sequence, then without
    recomputation: `PoolGroups.largest_separate`'s order) among `trainers`, one shape per
    call. Returns the graphs dropped (0: no trainer pools a shape on its own)."""
    best: tuple[tuple[int, int, bool], Any] | None = None
    for trainer in trainers:
        graphs = _live_graphs(trainer)
        if graphs is None:
            continue
        group = graphs.pool_groups.largest_separate()
        if group is None:
            continue
        keys = graphs.pool_groups.keys_of(group)
        size = max((key.rows, key.seq_len, not key.recompute) for key in keys)
        if best is None or size > best[0]:
            best = (size, graphs)
    if best is None:
        return 0
    return len(best[1].release_largest_separate())
