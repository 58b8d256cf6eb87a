"""`gc_paused_for_capture` (CPU): cyclic garbage is collected when the outermost block starts,
the automatic collector stays off until it ends, and its previous state comes back. Graph
captures run inside it because a collection in the middle of a capture destroys dropped
engines' CUDA graphs there, which invalidates the capture
(docs/decisions/0009-gc-and-graph-capture.md)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.cuda_graphs import (
    free_dropped_captures,
    freeze_long_lived,
    gc_paused_for_capture,
    thaw_engine_freeze,
)
from gpu_runtime.engine.model_runner import ModelRunner
from gpu_runtime.model import CausalLM


class _Node:
    """An object in a reference cycle: freed by the cyclic collector only."""

    def __init__(self) -> None:
        self.me = self


def _garbage() -> weakref.ref[_Node]:
    """A dropped reference cycle; the weak reference dies when the collector frees it."""
    return weakref.ref(_Node())


@pytest.fixture(autouse=True)
def _collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_collects_first_then_keeps_the_collector_off() -> None:
    before = _garbage()
    assert before() is not None
    with gc_paused_for_capture():
        assert before() is None  # collected on entry, before any capture
        assert not gc.isenabled()
        during = _garbage()
        for _ in range(20_000):  # far past the automatic thresholds
            _Node()
        assert during() is not None  # no automatic collection inside
    assert gc.isenabled()
    gc.collect()
    assert during() is None


def test_nested_blocks_collect_once_and_reenable_at_the_outermost_end() -> None:
    with gc_paused_for_capture():
        made_inside = _garbage()
        with gc_paused_for_capture():
            assert made_inside() is not None  # the inner block does not collect again
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block's end leaves it off
    assert gc.isenabled()


def test_previous_state_comes_back_on_an_exception_and_when_already_off() -> None:
    with pytest.raises(RuntimeError), gc_paused_for_capture():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    with gc_paused_for_capture():
        assert not gc.isenabled()
    assert not gc.isenabled()  # stays as the caller had it
    left = _garbage()
    with gc_paused_for_capture():  # a new outermost block collects again, also with it off
        assert left() is None


# ---- the long-lived heap frozen after captures (full-collection stalls inside steps) --------


@pytest.fixture
def _thawed() -> Iterator[None]:
    thaw_engine_freeze()
    yield
    thaw_engine_freeze()
    gc.unfreeze()


def test_engine_config_freezes_after_capture_by_default() -> None:
    assert EngineConfig(num_kv_blocks=8).gc_freeze_after_capture


def test_full_collections_after_the_freeze_skip_what_was_alive(_thawed: None) -> None:
    """The co-location stalls (257 / 336 ms chunk steps, 333 ms outside a step) had the cost of
    a full collection over the process's whole heap; frozen objects are not walked by one."""
    long_lived = [[i] for i in range(20_000)]  # stands for model, engine, modules
    gc.collect()  # everything is in the oldest generation now
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(long_lived[0]) in oldest  # without the freeze: walked by every full collection
    frozen = freeze_long_lived()
    assert frozen >= len(long_lived)
    assert gc.get_freeze_count() >= frozen - 10  # a few frozen temporaries freed since
    later = [[i] for i in range(100)]
    gc.collect()
    walked = {id(o) for o in gc.get_objects(generation=2)}
    assert id(long_lived[0]) not in walked and id(long_lived[-1]) not in walked
    assert id(later[0]) in walked  # objects made after the freeze are still collected
    assert len(walked) < frozen // 4


def _frozen_dropped_engine() -> weakref.ref[_Node]:
    """An engine alive when the heap was frozen and dropped afterwards: a plain collection
    leaves it alive. Returns a weak reference to it."""
    engine = _Node()
    freeze_long_lived()
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is not None
    return dropped


def test_a_frozen_dropped_cycle_is_freed_at_the_next_capture(_thawed: None) -> None:
    dropped = _frozen_dropped_engine()  # an engine a test let go
    with gc_paused_for_capture():
        assert dropped() is None  # the next capture unfreezes and collects first
    assert gc.get_freeze_count() == 0


def test_free_dropped_captures_frees_a_frozen_dropped_engine(_thawed: None) -> None:
    """What closing a green-context partitioner runs first: an engine dropped after the freeze
    (a test's or a deployment's, whose graphs live in the contexts) is freed by it, where a
    plain collection leaves it to be freed after the contexts are gone (a process abort)."""
    dropped = _frozen_dropped_engine()
    free_dropped_captures(torch.device("cpu"))
    assert dropped() is None and gc.get_freeze_count() == 0
    free_dropped_captures()  # nothing frozen, no CUDA: a plain collection


def test_a_frozen_dropped_engine_is_freed_when_the_next_runner_is_built(
    _thawed: None, tiny_llama: CausalLM
) -> None:
    dropped = _frozen_dropped_engine()
    ModelRunner(tiny_llama, EngineConfig(num_kv_blocks=8, max_num_seqs=2, max_model_len=64))
    assert dropped() is None
    assert gc.get_freeze_count() == 0


def test_thaw_leaves_a_freeze_the_engine_did_not_make_alone(_thawed: None) -> None:
    gc.freeze()
    count = gc.get_freeze_count()
    assert count > 0
    assert not thaw_engine_freeze()
    # Still frozen (an unfreeze empties the permanent generation); a frozen object freed by
    # its reference count meanwhile may take the count down by a few.
    assert count - 100 <= gc.get_freeze_count() <= count
