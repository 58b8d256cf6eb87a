"""Per-iteration rows of one phase of `python -m bench.memory trace`, written beside the result file
as `<result>.iterations.json` (`{"columns": ITERATION_COLUMNS, "phases": {name: rows}}`).

One row per host-loop iteration (`ITERATION_COLUMNS`): when it started (ms since the phase's
clock started), the decode batch and prefill tokens of its step, the whole iteration's and the
step's wall time with the step's launch (host, until the model's work is queued) and wait (for
the device at the step's one sync) parts, the quantum beside it (its token cap; 0: none), the
quantum launched in it and the quanta that finished in it; what the pool did before the step
(`before_*`, `EngineMemory.before_decode`: urgent maps and reclaims, on the critical path) and
after it (`after_*`: refills, KV shrinks, lending), each a `MemoryWork` (host ms, maps and their
ms, pages mapped/unmapped, reclaims, cache flushes, waits for a quantum with their ms, budget
changes, preemptions); decode's used KV blocks, the finetune budget lent and what finetune's
pools held; and torch's allocator on CUDA (None on CPU): segments and reserved GiB after the
iteration, and in the iteration the device allocations and frees (a cudaFree waits for the
whole device), allocation retries (a cache flush each), `synchronize_and_free_events` calls
and pinned host blocks created (a cudaHostAlloc synchronises the device too).
"""

from __future__ import annotations

from typing import Any

from gpu_runtime.memory import MemoryWork

GIB = 1 << 30
WORK_FIELDS = MemoryWork.names()
ALLOCATOR_EVENTS = ("device_allocs", "device_frees", "alloc_retries", "sync_all_streams")
ITERATION_COLUMNS = (
    "t_ms",
    "decode_batch",
    "prefill_tokens",
    "iteration_ms",
    "step_ms",
    "launch_ms",
    "wait_ms",
    "quantum_beside_tokens",
    "quantum_launched_tokens",
    "quanta_done",
    *(f"before_{name}" for name in WORK_FIELDS),
    *(f"after_{name}" for name in WORK_FIELDS),
    "kv_used_blocks",
    "lent_gib",
    "finetune_reserved_gib",
    "segments",
    "reserved_gib",
    *ALLOCATOR_EVENTS,
    "host_allocs",
)
SLOWEST_KEYS = (
    "step_ms",
    "launch_ms",
    "wait_ms",
    "before_ms",
    "after_ms",
    "device_allocs",
    "device_frees",
    "sync_all_streams",
    "host_allocs",
)


def _round(value: float | int | None, digits: int = 3) -> float | int | None:
    return round(value, digits) if isinstance(value, float) else value


class IterationLog:
    """The rows of one phase: `record` after every `HostLoop.run_iteration()`."""

    def __init__(self, memory: Any, engine: Any, cuda: bool) -> None:
        self._memory = memory
        self._engine = engine
        backend = memory.manager.pool.backend
        self._allocator = getattr(backend, "allocator_stats", None) if cuda else None
        self._host = _host_allocs_reader() if cuda else None
        self._previous = self._events()
        self.rows: list[list[Any]] = []

    def _events(self) -> tuple[dict[str, int], int]:
        stats = self._allocator() if self._allocator is not None else {}
        return stats, self._host() if self._host is not None else 0

    def record(self, record: Any, start: float, lent_bytes: int, reserved_bytes: int) -> None:
        """One iteration: its `IterationRecord`, the phase's clock start, and the finetune
        budget lent and finetune's reserved bytes read after it."""
        stepped = bool(record.decode_batch or record.prefill_tokens)
        times = self._engine.last_step_times if stepped else None
        stats, host = self._events()
        previous, previous_host = self._previous
        self._previous = (stats, host)
        allocator: list[Any] = [None] * (2 + len(ALLOCATOR_EVENTS) + 1)
        if stats:
            allocator = [
                stats["segments"],
                round(stats["reserved_bytes"] / GIB, 3),
                *(stats[k] - previous.get(k, stats[k]) for k in ALLOCATOR_EVENTS),
                host - previous_host if self._host is not None else None,
            ]
        memory = self._memory
        self.rows.append(
            [
                round((record.timestamp - start) * 1e3, 2),
                record.decode_batch,
                record.prefill_tokens,
                round(record.iteration_ms, 3),
                round(record.observed_ms, 3),
                None if times is None else round(times.launch * 1e3, 3),
                None if times is None else round(times.wait * 1e3, 3),
                record.beside_tokens if record.in_flight else 0,
                sum(launch.max_tokens for launch in record.finetune_launched),
                len(record.quanta),
                *(_round(v) for v in memory.last_before.values()),
                *(_round(v) for v in memory.last_after.values()),
                self._engine.block_manager.num_used_blocks,
                round(lent_bytes / GIB, 3),
                round(reserved_bytes / GIB, 3),
                *allocator,
            ]
        )

    def slowest(self, count: int) -> list[dict[str, Any]]:
        """The `count` slowest iterations that stepped decode, slowest first, with what ran in
        them (the row's `slowest_iterations`)."""
        index = {name: i for i, name in enumerate(ITERATION_COLUMNS)}
        stepped = [r for r in self.rows if r[index["decode_batch"]] or r[index["prefill_tokens"]]]
        stepped.sort(key=lambda r: -r[index["iteration_ms"]])
        out = []
        for row in stepped[:count]:

            def cell(name: str, row: list[Any] = row) -> Any:
                return row[index[name]]

            out.append(
                {
                    "t_s": round(cell("t_ms") / 1e3, 3),
                    "iteration_ms": round(cell("iteration_ms"), 2),
                    "batch": cell("decode_batch"),
                    "prefill_tokens": cell("prefill_tokens"),
                    "quantum_beside_tokens": cell("quantum_beside_tokens"),
                    "reclaims": cell("before_reclaims") + cell("after_reclaims"),
                    "flushes": cell("before_flushes") + cell("after_flushes"),
                    **{name: cell(name) for name in SLOWEST_KEYS},
                }
            )
        return out


def _host_allocs_reader() -> Any:
    """A reader of the pinned host allocator's blocks created so far (its `num_host_alloc`,
    from the nested stats: no flattening per iteration); None without host allocator stats.
    A read that fails later returns the last value (the phase goes on)."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats_as_nested_dict", None)
    if stats is None:
        return None
    last = [0]

    def read() -> int:
        try:
            last[0] = int(stats().get("num_host_alloc", last[0]))
        except Exception:  # a host allocator without stats now: keep the last count
            pass
        return last[0]

    try:
        stats()
    except Exception:  # a torch whose host allocator has no stats
        return None
    return read
