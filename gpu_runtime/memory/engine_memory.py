"""`EngineMemory`: the unified pool wired to one decode `Engine` and the host loop.

It implements the host loop's `FinetuneMemory` contract (`gpu_runtime.colocation.loop`):
`before_decode()` on the critical path before the decode step, `after_decode()` off it,
`finetune_budget_bytes()` read before every quantum, `lent_bytes()`, and `quantum_done(...)` after
every quantum. The decode side's demand is read from the engine's scheduler (running requests'
next chunk or token; waiting prompts' first chunk), mirroring `ContinuousBatchingScheduler`.

Build order on a host: load weights; `pool = create_page_pool(device=..., pinned_tail_pages=...)`;
`memory = EngineMemory.prepare(pool, model_config, engine_config_kwargs)` gives the engine config
and storage factory; build the `Engine` with them; `memory.attach(engine)`; warm the engine up
(CUDA graphs); `memory.decode_ready()` so torch's decode allocations are not charged to
finetuning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from gpu_runtime.memory.kv_binding import KVPoolBinding
from gpu_runtime.memory.layout import (
    FinetuneBudgetExceeded,
    KVLayout,
    MemoryPoolError,
    kv_block_bytes,
)
from gpu_runtime.memory.manager import DecodeGrant, MemoryManager, MemoryManagerConfig
from gpu_runtime.memory.work import MemoryWork, WorkMeter

if TYPE_CHECKING:
    from gpu_runtime.memory.pool import PagePool

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def engine_kv_layout(
    model_config: Any, *, block_size: int, dtype: str, page_bytes: int
) -> KVLayout:
    """The KV layout of the decode engine's block-major storage for a `ModelConfig`."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"KV dtype {dtype!r} not in {sorted(_DTYPE_BYTES)}")
    block = kv_block_bytes(
        block_tokens=block_size,
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype_bytes=_DTYPE_BYTES[dtype],
    )
    return KVLayout(page_bytes=page_bytes, block_bytes=block)


def scheduler_block_demand(engine: Any) -> tuple[int, int]:
    """(blocks the running requests need next step, blocks the waiting ones' first chunk need):
    the scheduler's `preview()` of the next step (`StepPreview.running_block_demand`,
    `StepPreview.waiting_block_demand`)."""
    preview = engine.scheduler.preview()
    return preview.running_block_demand, preview.waiting_block_demand


def scheduler_waiting_blocks(engine: Any) -> int:
    """The second figure of `scheduler_block_demand` alone (what `after_decode` needs); 0
    without a preview when nothing waits."""
    scheduler = engine.scheduler
    if not scheduler.waiting:
        return 0
    return int(scheduler.preview().waiting_block_demand)


class EngineMemory:
    """Pool + policy + binding for one engine; the host loop's memory adapter."""

    def __init__(
        self,
        manager: MemoryManager,
        binding: KVPoolBinding,
        finetune_busy: Callable[[], bool] | None = None,
        wait_for_finetune: Callable[[], object] | None = None,
    ) -> None:
        """`finetune_busy` tells whether a finetune quantum is still running on the device
        (e.g. `lambda: loop.executor.in_flight is not None`; None means never) and
        `wait_for_finetune` waits for it (e.g. `loop.executor.wait`). Set them after the host
        loop exists (they are plain attributes)."""
        self.manager = manager
        self.binding = binding
        self.finetune_busy = finetune_busy
        self.wait_for_finetune = wait_for_finetune
        self._engine: Any = None
        self._promised_bytes: int | None = None
        self.last_grant: DecodeGrant | None = None
        self.process_wide_peaks = False
        """True when `quantum_done` peaks count the whole process (set by `attach` on CUDA)."""
        self._meter = WorkMeter(manager.counters)
        self.last_before = MemoryWork()
        """What the last `before_decode()` did (time, maps, reclaims, flushes, waits)."""
        self.last_after = MemoryWork()
        """What the last `after_decode()` did."""

    @classmethod
    def prepare(
        cls,
        pool: PagePool,
        model_config: Any,
        *,
        block_size: int,
        kv_dtype: str,
        max_model_len: int,
        config: MemoryManagerConfig | None = None,
    ) -> EngineMemory:
        """Manager and binding for an engine of this model; decode always keeps enough pages
        for one request of `max_model_len` tokens (the engine rejects longer ones)."""
        layout = engine_kv_layout(
            model_config, block_size=block_size, dtype=kv_dtype, page_bytes=pool.page_bytes
        )
        config = config or MemoryManagerConfig()
        one_request = layout.pages_for_blocks(-(-max_model_len // block_size))
        if one_request > config.min_decode_pages:
            config = dataclasses.replace(config, min_decode_pages=one_request)
        manager = MemoryManager(pool, layout, config)
        return cls(manager, KVPoolBinding(manager))

    def engine_config_fields(self) -> dict[str, int]:
        """`num_kv_blocks` and `kv_block_capacity` for the engine's `EngineConfig`."""
        return {
            "num_kv_blocks": self.binding.initial_blocks,
            "kv_block_capacity": self.binding.capacity_blocks,
        }

    def attach(self, engine: Any) -> None:
        """Bind the engine built with `engine_config_fields()` and `binding.storage_factory`."""
        if engine.runner.kv_cache.storage.data_ptr() != self.manager.pool.kv_storage().data_ptr():
            raise MemoryPoolError("the engine's KV storage is not the pool's range")
        self.binding.attach(engine.block_manager)
        self.manager.before_decode_unmap = engine.runner.wait_for_launched
        self._engine = engine
        self.process_wide_peaks = bool(engine.config.is_cuda)

    def finetune_allocations(self) -> AbstractContextManager[None]:
        """Context for the finetune side's long-lived allocations (a trainer's adapters and
        optimizer state): on CUDA they go to finetune's own `torch.cuda.MemPool`, so that
        they count as finetune memory and decode's own growth does not."""
        return self.manager.pool.backend.finetune_allocations()

    def decode_ready(self) -> None:
        """Decode's own torch memory is allocated (warm-up, graphs): charge finetuning only
        for what comes after."""
        self.manager.pool.reset_baseline()
        logger.info("decode ready: finetune accounting starts from here")

    # ---- FinetuneMemory (gpu_runtime.colocation.loop) ---------------------------------
    def before_decode(self) -> None:
        """With no quantum in flight, first refill the reserve (reclaiming if needed: the
        only reclaim that neither waits for nor starves a quantum); then make the step's blocks
        usable, waiting for a running quantum only if they cannot be had otherwise."""
        self._meter.start()
        running, waiting = scheduler_block_demand(self._bound())
        busy = self._busy()
        if not busy:
            self.binding.refill(waiting_blocks=waiting)
        self.last_grant = self.binding.before_step(
            next_step_blocks=running,
            waiting_blocks=waiting,
            finetune_busy=busy,
            wait_for_finetune=self.wait_for_finetune,
            promised_bytes=self._promised_bytes if busy else None,
        )
        self.last_before = self._meter.stop()

    def after_decode(self) -> None:
        self._meter.start()
        # Read what finetune holds once per iteration: on CUDA this also lets the torch cap
        # follow decode's own growth (cached; a snapshot only after a segment came or went).
        self.manager.pool.backend.finetune_reserved_bytes()
        waiting = scheduler_waiting_blocks(self._bound())
        busy = self._busy()
        self.binding.maintain(
            waiting_blocks=waiting,
            finetune_busy=busy,
            promised_bytes=self._promised_bytes if busy else None,
        )
        self.last_after = self._meter.stop()

    def finetune_budget_bytes(self) -> int:
        """What the next quantum should fit in: the budget less the pages decode is expected
        to reclaim before the next quantum boundary (`FinetuneBudget.plan_bytes`), so
        that reclaim is a cap change instead of a cache flush. `lent_bytes()` is the budget.

        Read with no quantum in flight (when the loop plans a launch), the value is remembered
        as what the next quantum was promised: while it runs, decode may take the budget above
        that promise and above what the finetune allocator holds without waiting for it."""
        plan = self.manager.finetune.plan_bytes()
        if not self._busy():
            self._promised_bytes = plan
        return plan

    def finetune_release_plan_bytes(self) -> int:
        """What a quantum may plan for when its memory beyond `finetune_budget_bytes()` is a
        separately pooled graph shape that `FinetuneBudget.graph_release` can drop
        between quanta (`FinetuneBudget.release_plan_bytes`). A pure read: a finetune
        side that launches such a quantum calls `promise_finetune_bytes` with it."""
        return self.manager.finetune.release_plan_bytes()

    def promise_finetune_bytes(self, nbytes: int) -> None:
        """Raise what the quantum about to launch was promised to `nbytes` (with no quantum in
        flight; ignored while one runs): while it runs, decode takes no budget below that
        promise without waiting for it (e.g. a shape being captured into its own pool)."""
        if not self._busy():
            self._promised_bytes = max(self._promised_bytes or 0, nbytes)

    def finetune_graphs_released(self, dropped: int) -> None:
        """The finetune side dropped `dropped` CUDA graphs between quanta on its own (e.g. the
        shared pool's before a shape is captured into a pool of its own): their pool is
        flushed (`FinetuneBudget.graphs_released`). With no quantum in flight."""
        self.manager.finetune.graphs_released(dropped)

    def lent_bytes(self) -> int:
        return self.manager.pool.finetune_budget_bytes

    def quantum_done(self, *, peak_bytes: int, resident_bytes: int) -> None:
        """Account a quantum. With `process_wide_peaks` (the `LoraTrainer` reports
        `torch.cuda.max_memory_allocated`, weights included) the decode baseline is taken off
        first. A peak over budget is counted and logged, not raised: on CUDA the torch cap is
        the enforcement, and the host loop must keep running."""
        if self.process_wide_peaks:
            baseline = self.manager.pool.backend.finetune_baseline_bytes()
            peak_bytes = max(peak_bytes - baseline, 0)
        resident_bytes = min(resident_bytes, peak_bytes)
        try:
            self.manager.finetune.quantum_done(peak_bytes=peak_bytes, resident_bytes=resident_bytes)
        except FinetuneBudgetExceeded as exc:
            logger.warning("finetune quantum over budget: %s", exc)

    def finetune_quantum_mode(self, *, examples: int, recompute: bool) -> None:
        """The quantum about to launch recomputes or not (`FinetuneBudget.quantum_mode`:
        counted, switches logged)."""
        self.manager.finetune.quantum_mode(examples=examples, recompute=recompute)

    def _busy(self) -> bool:
        return bool(self.finetune_busy()) if self.finetune_busy is not None else False

    def _bound(self) -> Any:
        if self._engine is None:
            raise MemoryPoolError("attach the engine first")
        return self._engine
