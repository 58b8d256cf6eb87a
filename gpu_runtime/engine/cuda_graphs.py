"""CUDA graphs of the decode step, one per (batch bucket, partition key).

The partition key lets a co-location scheduler capture the same bucket once per SM partition
(e.g. per green context): capture with that partition's stream current, replay on it.

Captures run under `gc_paused_for_capture`: Python's cyclic garbage collector must not run while
a stream is capturing. A dropped engine is cyclic garbage (its runner holds its graphs, whose
forward is the runner's bound method); collected in the middle of another engine's capture, its
`CUDAGraph`s are destroyed there (`cudaGraphExecDestroy`, refused while a stream captures in
global mode: "operation not permitted when stream is capturing (function reset)") and the
capture is invalidated (`cudaErrorStreamCaptureInvalidated` at `capture_end`, after the next
library call in the capture fails, e.g. cuBLASLt `gemm_and_bias`). `torch.cuda.graph` no longer
runs `gc.collect()` before capturing (`torch.compiler.config.force_cudagraph_gc`, off by default).

After its captures the runner moves every object then alive into the collector's permanent
generation (`freeze_long_lived`, `EngineConfig.gc_freeze_after_capture`): modules, model and
engine are never garbage, yet each automatic full (generation-2) collection walked all of them,
a one-off stall of a few hundred ms inside whichever step allocated at that moment (the 257 and
336 ms chunk steps of the Qwen co-location runs, 333 ms outside `step()` in a Llama run). What
was frozen by the engine is unfrozen (`thaw_engine_freeze`) before the next capture and when a
new runner is built, so a dropped engine still gets collected then, and by
`free_dropped_captures`, which closing a green-context partitioner calls first.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

GraphKey = tuple[int, Hashable]

_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False
_engine_froze = False
"""True while objects sit in the permanent generation because of `freeze_long_lived`."""


def freeze_long_lived() -> int:
    """Collect, then move every object alive into the permanent generation (`gc.freeze`),
    so later full collections only walk what was allocated since. Returns the frozen count."""
    global _engine_froze
    with _gc_lock:
        gc.collect()
        gc.freeze()
        _engine_froze = True
        return gc.get_freeze_count()


def thaw_engine_freeze() -> bool:
    """Undo `freeze_long_lived` (`gc.unfreeze`) if the engine froze the heap: frozen cyclic
    garbage (a dropped engine) becomes collectable again. Leaves a caller's own freeze alone
    when the engine never froze. Returns True when it unfroze."""
    global _engine_froze
    with _gc_lock:
        if not _engine_froze:
            return False
        gc.unfreeze()
        _engine_froze = False
        return True


def free_dropped_captures(device: torch.device | None = None) -> None:
    """Free every dropped engine's graphs and memory now: undo the engine's freeze, collect,
    then (on CUDA) wait for the device and return the allocator's cached blocks. Call it
    before destroying what graphs were captured in (a green context, `SmPartitioner.close`):
    a `CUDAGraph` freed after its context is gone aborts the process, and a plain
    `gc.collect()` leaves a frozen dropped engine alive."""
    thaw_engine_freeze()
    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@contextmanager
def gc_paused_for_capture() -> Iterator[None]:
    """Collect cyclic garbage now, then keep the automatic collector off until the outermost
    such block ends (nested blocks neither collect again nor re-enable it); the collector's
    previous state comes back on exit, also on an exception. Wrap a whole series of captures in
    one block: a full collection costs milliseconds to tens of milliseconds."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        outermost = _gc_pauses == 0
        _gc_pauses += 1
        if outermost:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
    try:
        if outermost:
            thaw_engine_freeze()  # a dropped engine frozen by an earlier capture goes now
            gc.collect()
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


@dataclass
class CapturedGraph:
    """A captured decode step and its static output tensor."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor


class DecodeGraphs:
    """Captures and replays `forward(batch_size) -> Tensor` over fixed-shape buffers.

    `forward` must read its inputs from static buffers (sliced to batch_size) and allocate
    nothing that outlives the call except its output. All graphs share one memory pool.
    """

    def __init__(
        self, forward: Callable[[int], torch.Tensor], share_pool_with: DecodeGraphs | None = None
    ) -> None:
        """`share_pool_with`: another set whose memory pool these graphs use too (graphs that
        never run at the same time, e.g. the base and the LoRA decode step)."""
        self._forward = forward
        self._graphs: dict[GraphKey, CapturedGraph] = {}
        self._pool: Any = None
        self._pool_owner = share_pool_with

    def keys(self) -> list[GraphKey]:
        """Captured (batch_size, partition) keys."""
        return list(self._graphs)

    def has(self, batch_size: int, partition: Hashable = None) -> bool:
        """True when that bucket is captured for that partition."""
        return (batch_size, partition) in self._graphs

    @torch.no_grad()
    def capture(
        self,
        batch_size: int,
        partition: Hashable = None,
        stream: torch.cuda.Stream | None = None,
        warmup_iters: int = 2,
    ) -> None:
        """Warm up (compiles kernels) and capture `forward(batch_size)` on `stream` (with the
        garbage collector paused, see `gc_paused_for_capture`)."""
        with gc_paused_for_capture():
            self._capture(batch_size, partition, stream, warmup_iters)

    def _capture(
        self,
        batch_size: int,
        partition: Hashable,
        stream: torch.cuda.Stream | None,
        warmup_iters: int,
    ) -> None:
        stream = stream or torch.cuda.Stream()
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(warmup_iters):
                self._forward(batch_size)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None and self._pool_owner is not None:
            self._pool = self._pool_owner._pool
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            output = self._forward(batch_size)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(batch_size, partition)] = CapturedGraph(graph, output)

    def replay(self, batch_size: int, partition: Hashable = None) -> torch.Tensor:
        """Replay on the current stream; returns the static output (valid until next replay)."""
        captured = self._graphs[(batch_size, partition)]
        captured.graph.replay()
        return captured.output
