"""Pool groups of the trainer's CUDA graphs (plain bookkeeping, no GPU): which shapes share a
pool, when a group's pool can go, and which group is released first."""

from __future__ import annotations

import pytest

from gpu_runtime.finetune.graph_policy import GraphKey
from gpu_runtime.finetune.graph_pools import SHARED, PoolGroups, separate_above


def _key(rows: int, seq_len: int = 512, stream: int = 7) -> GraphKey:
    return GraphKey(rows, seq_len, seq_len * rows, stream)


def test_default_grouping_puts_every_shape_in_one_pool() -> None:
    groups = PoolGroups()
    assert {groups.add(_key(n)) for n in (1, 2, 4)} == {SHARED}
    assert groups.largest_separate() is None  # nothing can be released on its own
    assert groups.remove(_key(4)) is None and groups.remove(_key(1)) is None
    assert groups.remove(_key(2)) == SHARED  # the last graph: the pool can go
    assert groups.groups() == {}


def test_separate_above_gives_each_larger_shape_its_own_pool() -> None:
    group_of = separate_above(2)
    assert group_of(_key(1)) == group_of(_key(2)) == SHARED
    assert group_of(_key(4)) == ("rows", 4) != group_of(_key(8))
    # the same rows on another stream or length share that shape's pool
    assert group_of(_key(4, 256, stream=9)) == group_of(_key(4))
    with pytest.raises(ValueError):
        separate_above(-1)


def test_largest_separate_group_is_released_first_and_shared_never() -> None:
    groups = PoolGroups(separate_above(2))
    for key in (_key(1), _key(2), _key(4), _key(4, 256), _key(8, 128)):
        groups.add(key)
    assert groups.largest_separate() == ("rows", 8)
    assert groups.remove(_key(8, 128)) == ("rows", 8)  # its only graph: the pool goes
    assert groups.largest_separate() == ("rows", 4)
    assert groups.keys_of(("rows", 4)) == {_key(4), _key(4, 256)}
    assert groups.remove(_key(4)) is None  # one graph of that pool is left
    assert groups.remove(_key(4)) is None  # not captured (any more): nothing changes
    assert groups.remove(_key(4, 256)) == ("rows", 4)
    assert groups.largest_separate() is None
    assert groups.groups() == {SHARED: {_key(1), _key(2)}}
    groups.clear()
    assert groups.groups() == {} and groups.largest_separate() is None


def test_ties_between_separate_groups_go_to_the_longer_sequence() -> None:
    groups = PoolGroups(lambda key: ("len", key.seq_len))  # a grouping by length, no shared
    groups.add(_key(4, 256))
    groups.add(_key(4, 512))
    groups.add(_key(2, 1024))
    assert groups.largest_separate() == ("len", 512)  # 4 rows beat 2, then the length


def test_release_largest_separate_drops_that_shapes_graphs_and_keeps_the_shared_ones() -> None:
    """The bookkeeping of `MicroBatchGraphs.release_largest_separate` on CPU: captures are
    impossible here, so the captured state is entered as `_capture` leaves it (the GPU test
    `test_separately_pooled_shape_is_released_alone_and_trains_like_one_pool` captures)."""
    import contextlib

    import torch

    from gpu_runtime.finetune.graphs import MicroBatchGraphs

    graphs = MicroBatchGraphs(
        lambda *args: torch.zeros(()), [], None, torch.device("cpu"), contextlib.nullcontext
    )
    assert graphs.release_largest_separate() == []  # nothing captured
    graphs.pool_groups = PoolGroups(separate_above(2))
    keys = [_key(1), _key(2), _key(4), _key(4, 256), _key(8)]
    for key in keys:
        graphs._graphs[key] = object()  # type: ignore[assignment]
        graphs._pools.setdefault(graphs.pool_groups.add(key), object())
        graphs.policy.added(key)
    assert graphs.release_largest_separate() == [_key(8)]
    assert graphs.release_largest_separate() == [_key(4, 256), _key(4)]  # both 4-row graphs
    assert graphs.release_largest_separate() == []  # the shared pool is never released
    assert set(graphs.keys()) == {_key(1), _key(2)} == set(graphs._graphs)
    assert list(graphs._pools) == [SHARED] and graphs.counts["released"] == 3
    # The shared shapes go when a larger shape is to run in its own pool instead.
    assert graphs.release_group(SHARED) == [_key(1), _key(2)]
    assert graphs.keys() == [] and graphs._pools == {} and graphs.counts["released"] == 5
    assert graphs.release_group(SHARED) == []
    graphs.pool_groups.add(_key(1))
    graphs.policy.added(_key(1))
    graphs.release()
    assert graphs.keys() == [] and graphs._pools == {} and graphs.pool_groups.groups() == {}
