"""CUDA graphs of a training micro-batch's forward and backward, one per static shape and stream.

Launched eagerly, one micro-batch of an 8B model is thousands of kernels, each paid for in Python
and autograd bookkeeping on the host, whatever the number of tokens; the quantum runs on a worker
thread, so that host work also competes with the decode loop for the GIL. A captured graph
replays the same kernels with one launch, so a quantum's host time no longer grows with its
kernel count (``python -m bench.finetune`` compares the two). A micro-batch's key, its packed
static inputs and what a run reports live in :mod:`gpu_runtime.finetune.graph_buffers` (the
names are re-exported here).

**Keys.** A graph is captured per :class:`GraphKey`: micro-batch rows, sequence length padded to
a bucket (:func:`bucket_length`: at most 4 steps per power of two, so under 25 % padding), the
count of loss slots padded the same way (unused slots point at position 0 with the ignore target,
so they add nothing to the loss or the gradients), the stream the graph was captured on (a
graph's kernels run in the context it was captured in, a green-context SM partition, say, so a
caller that makes another partition's stream current gets its own graph), and whether the
micro-batch recomputes its activations (the forward-backward is called with that flag; its
checkpointed layers touch no RNG state, so they capture like the rest).

**Memory.** By default all graphs of a trainer share one private memory pool. With a grouping
(:attr:`MicroBatchGraphs.pool_groups`, e.g.
:func:`~gpu_runtime.finetune.graph_pools.separate_above`) each group of shapes has its own pool,
and :meth:`MicroBatchGraphs.release_largest_separate` drops the graphs of the largest separately
pooled shape so that its pool alone can go back to the device (between quanta; the shape is
captured again when it comes back). Inputs, the loss output and the
adapters' ``.grad`` tensors are allocated outside it before capture, so a replay of one graph
cannot overwrite anything another graph, or the caller, reads later. The captured backward adds
into the ``.grad`` tensors in place; the trainer zeroes them in place after an optimizer step and
never replaces them (a replay checks that and drops every graph if they were replaced).

**Randomness.** LoRA dropout inside a graph draws from the trainer's own CUDA generator: its state
is swapped into the process's default CUDA generator (``graphsafe_set_state``, a pointer swap)
only while capturing, so the graph registers that state. Each replay then advances the trainer's
philox offset by exactly what the eager micro-batch would have consumed and draws the same masks,
so checkpoints (which store that generator's state) resume exactly, and decode sampling in the
same process does not touch the trainer's state while a graph replays. A capture that fails
leaves the state it registered marked as capturing, so every later draw from it would raise;
the trainer then gets a new generator at the state saved before the capture
(:meth:`TrainerRng.renew_cuda_generator`) and its quanta go on eagerly. (During a capture, as
during a whole eager quantum, another thread's CUDA sampling would draw from the trainer's state.)

**Fallback.** The first micro-batch on a (thread, stream) runs eagerly (it warms up cuBLAS and
the autograd engine on that stream); which shapes are captured, and when, is
:class:`~gpu_runtime.finetune.graph_policy.CapturePolicy`'s call (the others run eagerly). If a
capture runs out of memory, that shape stays eager; if it fails otherwise, graphs are disabled
for the trainer, the reason is kept in :attr:`MicroBatchGraphs.disabled`, and every quantum runs
eagerly (each result says so). :meth:`MicroBatchGraphs.release` drops the graphs so that their
pool can go back to the device (``torch.cuda.empty_cache()`` alone cannot free it).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from gpu_runtime.finetune.batching import MicroBatch
from gpu_runtime.finetune.data import IGNORE_INDEX
from gpu_runtime.finetune.graph_buffers import (
    ForwardBackward,
    GraphRun,
    _Captured,
    graph_key,
    pack_inputs,
    unpack_inputs,
)
from gpu_runtime.finetune.graph_policy import CapturePolicy, GraphKey, bucket_length
from gpu_runtime.finetune.graph_pools import PoolGroups
from gpu_runtime.finetune.quantum import TrainerRng

__all__ = [
    "ForwardBackward",
    "GraphCaptureError",
    "GraphRun",
    "MicroBatchGraphs",
    "graph_key",
    "pack_inputs",
    "unpack_inputs",
]


class GraphCaptureError(RuntimeError):
    """A micro-batch could not be captured (the trainer then runs eagerly)."""


def _weak(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
    """A getter of ``fn`` that holds a bound method weakly."""
    if inspect.ismethod(fn):
        ref = weakref.WeakMethod(fn)

        def get() -> Callable[..., Any]:
            method = ref()
            if method is None:
                raise ReferenceError("the trainer these graphs belong to is gone")
            return method

        return get
    return lambda: fn


class MicroBatchGraphs:
    """Captured forward+backward per :class:`GraphKey` for one trainer (see the module doc)."""

    def __init__(
        self,
        forward_backward: ForwardBackward,
        params: Sequence[torch.nn.Parameter],
        rng: TrainerRng | None,
        device: torch.device,
        eager_rng: Callable[[], AbstractContextManager[None]],
        policy: CapturePolicy | None = None,
    ) -> None:
        """``forward_backward`` runs one micro-batch (eagerly or under capture); ``rng`` holds the
        trainer's generators (``rng.cuda_generator`` draws dropout) and ``eager_rng()`` swaps
        them in around an eager run; ``policy`` decides what to capture (default
        :class:`CapturePolicy`)."""
        # weak when bound to the trainer that owns these graphs: no reference cycle, so a
        # finished job's graphs and their pool go with its trainer, without waiting for the GC
        self._forward_backward = _weak(forward_backward)
        self.params = list(params)
        self.rng = rng
        self.device = device
        self._eager_rng = _weak(eager_rng)
        self.policy = policy or CapturePolicy()
        self.disabled: str | None = None
        """Why graphs are off for good (a failed capture), else None."""
        self.counts: Counter[str] = Counter()
        """Micro-batches run per mode ("replay", "capture", "eager"); "released": graphs dropped
        by :meth:`release_largest_separate` or :meth:`release_group`."""
        self._graphs: dict[GraphKey, _Captured] = {}
        self.pool_groups = PoolGroups()
        """Which pool each shape allocates in (default: one shared pool). Replace it only
        while no graph is captured."""
        self._pools: dict[Any, Any] = {}  # pool group -> the graphs' private pool handle
        self._warm: set[tuple[int, int]] = set()
        self._side: Any = None
        self._grads: list[torch.Tensor] | None = None

    def keys(self) -> list[GraphKey]:
        """Captured keys, least recently used first."""
        return self.policy.captured

    def release(self) -> None:
        """Drop every graph; their shared pool goes back to torch's cache once no graph holds
        it (``torch.cuda.empty_cache()`` then returns it to the device). Shapes are captured
        again as they come (per the policy)."""
        self._graphs.clear()
        self.policy.clear()
        self.pool_groups.clear()
        self._pools.clear()

    def release_largest_separate(self) -> list[GraphKey]:
        """Drop the graphs of the separately pooled group with the largest shape
        (:meth:`PoolGroups.largest_separate`) and that group's pool handle, so the pool goes
        back to torch's cache once no graph holds it (a cache flush then returns it to the
        device); the shared pool and its graphs stay. Returns the dropped keys (empty: nothing
        is pooled separately). Call between quanta only: a replay in flight uses the pool."""
        group = self.pool_groups.largest_separate()
        return [] if group is None else self.release_group(group)

    def release_group(self, group: Hashable) -> list[GraphKey]:
        """Drop the graphs of pool group ``group`` (e.g. :data:`~graph_pools.SHARED` before a
        larger shape is captured into its own pool) and its pool handle; returns the dropped
        keys, smallest first (empty: the group holds none). Between quanta only."""
        dropped = sorted(self.pool_groups.keys_of(group), key=lambda k: (k.rows, k.seq_len))
        for key in dropped:
            self._drop(key)
        self.counts["released"] += len(dropped)
        return dropped

    def _drop(self, key: GraphKey) -> None:
        """Drop one graph; its group's pool handle goes with the group's last graph."""
        self._graphs.pop(key, None)
        self.policy.removed(key)
        emptied = self.pool_groups.remove(key)
        if emptied is not None:
            self._pools.pop(emptied, None)

    def disable(self, reason: str) -> None:
        """Turn graphs off for good: drop every graph and run each later micro-batch eagerly,
        reporting ``reason`` as its fallback (keeps the first reason if already disabled)."""
        self.release()
        if self.disabled is None:
            self.disabled = reason[:400]

    def padded_length(self, n: int) -> int:
        """Sequence length a micro-batch whose longest example has ``n`` tokens is padded to."""
        return bucket_length(n)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run the block on a capturable stream: the caller's, or the trainer's own side stream
        when the caller left the default stream current (it waits for the caller's work first,
        and the caller's stream waits for it after)."""
        if self.device.type != "cuda":
            yield
            return
        current = torch.cuda.current_stream(self.device)
        if current != torch.cuda.default_stream(self.device):
            yield
            return
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(current)
        try:
            with torch.cuda.stream(self._side):
                yield
        finally:
            current.wait_stream(self._side)

    def would_replay(self, batch: MicroBatch, stream: int, recompute: bool = False) -> bool:
        """Whether ``batch`` (padded to its bucket) launched from this thread on the CUDA stream
        whose handle is ``stream`` would replay a captured graph, not run eagerly (the first
        micro-batch on a (thread, stream)) or be captured now: a pure look, nothing changes."""
        if self.disabled is not None:
            return False
        return graph_key(batch, stream, recompute) in self._graphs

    def run(self, batch: MicroBatch, denominator: int, recompute: bool = False) -> GraphRun:
        """Forward and backward of ``batch`` (host tensors, sequence padded to its bucket),
        gradients of ``loss_sum / denominator`` added to the adapters' ``.grad``; with
        ``recompute``, activations are recomputed in the backward (its own graph)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self._is_cuda else 0
        key = graph_key(batch, stream, recompute)
        if self.disabled is not None:
            return self._eager(batch, denominator, recompute, self.disabled)
        self._check_grads()
        warm = (threading.get_ident(), stream)
        decision = self.policy.decide(key, warm in self._warm)
        if decision.action == "eager":
            run = self._eager(batch, denominator, recompute, decision.reason or "")
            self._warm.add(warm)
            return run
        if decision.evict is not None:
            self._drop(decision.evict)
        mode = decision.action
        if mode == "capture":
            try:
                entry = self._capture(key)
            except torch.OutOfMemoryError:  # this shape only; the eager run may fit (or not)
                self.policy.out_of_memory(key)
                return self._eager(batch, denominator, recompute, "capture ran out of memory")
            except Exception as exc:  # any other capture failure: eager from now on
                self.disabled = f"capture failed: {type(exc).__name__}: {exc}"[:400]
                self.release()
                return self._eager(batch, denominator, recompute, self.disabled)
            self.policy.added(key)
        else:
            entry = self._graphs[key]
        packed = pack_inputs(batch, key.loss_slots)
        if self._is_cuda:
            packed = packed.pin_memory()  # a truly asynchronous copy
        entry.inputs.copy_(packed, non_blocking=True)
        entry.denominator.fill_(float(denominator))
        entry.graph.replay()
        self.counts[mode] += 1
        return GraphRun(entry.loss_sum, mode, None, entry.extra_bytes)

    @property
    def _is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _eager(self, batch: MicroBatch, denominator: int, recompute: bool, reason: str) -> GraphRun:
        on_device = batch.to(self.device)
        with self._eager_rng()():
            loss_sum = self._forward_backward()(
                on_device.input_ids,
                on_device.positions,
                on_device.loss_positions,
                on_device.loss_targets,
                denominator,
                recompute,
            )
        self.counts["eager"] += 1
        return GraphRun(loss_sum, "eager", reason, None)

    def _check_grads(self) -> None:
        """Captured graphs add into the ``.grad`` tensors they saw; drop them all if replaced."""
        if self._grads is None:
            return
        if any(p.grad is not g for p, g in zip(self.params, self._grads, strict=True)):
            self.release()
            self._grads = None

    def _capture(self, key: GraphKey) -> _Captured:
        """Capture ``key``'s micro-batch into its pool group's private pool (the static inputs,
        denominator and loss output outside it) and register the graph."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._grads = [p.grad for p in self.params if p.grad is not None]
        cells = key.rows * key.seq_len
        inputs = torch.zeros(2 * cells + 2 * key.loss_slots, dtype=torch.long, device=self.device)
        inputs[2 * cells + key.loss_slots :] = IGNORE_INDEX
        denominator = torch.ones((), dtype=torch.float32, device=self.device)
        loss_out = torch.zeros((), dtype=torch.float32, device=self.device)
        group = self.pool_groups.group_of(key)
        graph, extra = self._capture_graph(
            key, self._pools.get(group), inputs, denominator, loss_out
        )
        if group not in self._pools:
            self._pools[group] = graph.pool()
        self.pool_groups.add(key)
        entry = _Captured(graph, inputs, denominator, loss_out, extra)
        self._graphs[key] = entry
        return entry

    def _capture_graph(
        self,
        key: GraphKey,
        pool: Any,
        inputs: torch.Tensor,
        denominator: torch.Tensor,
        loss_out: torch.Tensor,
    ) -> tuple[Any, int]:
        """The CUDA-only part of a capture: ``(graph, bytes its work needs above what was
        allocated before it)``, the graph's work reading ``inputs`` and ``denominator`` and
        writing ``loss_out``, captured into ``pool`` (None: a new private pool)."""
        if not self._is_cuda:
            raise GraphCaptureError(f"CUDA graphs need a CUDA device, not {self.device}")
        ids, positions, loss_positions, loss_targets = unpack_inputs(inputs, key)
        graph = torch.cuda.CUDAGraph()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        default_generator = torch.cuda.default_generators[index]
        process_state = default_generator.graphsafe_get_state()
        before = torch.cuda.memory_allocated(self.device)
        generator = None if self.rng is None else self.rng.cuda_generator
        saved = None if generator is None else generator.get_state()
        if generator is not None:
            default_generator.graphsafe_set_state(generator)
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                loss_sum = self._forward_backward()(
                    ids, positions, loss_positions, loss_targets, denominator, key.recompute
                )
                loss_out.copy_(loss_sum.detach())
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
        except BaseException:
            if saved is not None and self.rng is not None:
                # the registered state may still be marked as capturing: replace it
                self.rng.renew_cuda_generator(saved)
            raise
        finally:
            default_generator.graphsafe_set_state(process_state)
        return graph, max(0, torch.cuda.max_memory_allocated(self.device) - before)
