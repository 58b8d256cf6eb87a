"""`gc_paused_for_capture` (CPU): cyclic garbage is collected when the outermost block starts,
the automatic collector stays off until it ends, and its previous state comes back. Graph
captures run inside it because a collection in the middle of a capture destroys dropped
engines' CUDA graphs there, which invalidates the capture (H200 run D2 at b38f5a4)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from gpu_runtime.engine.cuda_graphs import gc_paused_for_capture


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
