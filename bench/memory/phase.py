"""One phase of `python -m bench.memory trace`: a fresh pool, decode engine and LoRA job driven
through the host loop over the trace; returns the phase's result row.

`run_phase("decode_only" | "decode_only_split" | "unified" | "static_split" |
"unified_no_peak" | "unified_release", ...)` builds
everything on a new pool of `plan["pool_gib"][name]` GiB
(closed again even when the phase fails), warms the job's quanta up (CUDA-graph warm-up and
captures on the worker thread and finetune stream the loop uses), replays the trace's arrivals
against the loop clock for `--duration` s, then lets the running requests finish for at most
`--drain` s. `decode_only` has no job and decodes on the whole device: the reference for decode
iteration time; `decode_only_split` has no job either but decodes on the split the co-located
phases use (what the split alone costs decode). `unified` and `static_split` decode on the
`--decode-sms` split (green contexts; the finetune stream gets the other SMs), or on a
high-priority stream with `--sharing streams`. `unified_release` is `unified` whose shapes
larger than what fits beside decode's peak get graph pools of their own, planned against the
release plan (growth headroom only) and released between quanta when decode grows.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from bench.memory.iterations import IterationLog
from bench.memory.phase_row import phase_row
from bench.memory.sizing import QuantumSizing, ReleaseHooks, budgeted_policy, lora_trainer
from bench.memory.warmup import warm_quanta
from gpu_runtime.finetune.quantum_fit import QuantumShape
from gpu_runtime.finetune.shape_release import (
    captured_shapes,
    drop_shared_shapes,
    refused_shapes,
    release_separate_shape,
)

GIB = 1 << 30
PAGE = 2 << 20


def run_phase(
    name: str,
    args: Any,
    model: Any,
    trace: list[Any],
    prompts: list[list[int]],
    plan: dict,
    sharing: Any = None,
) -> tuple[dict[str, Any], list[list[Any]]]:
    """One phase on a fresh pool: its result row and its iterations (`ITERATION_COLUMNS`).
    The pool is closed (and the device's cap lifted) even when the phase fails. `sharing`:
    the run's `GpuSharing` (None on CPU)."""
    import torch

    from gpu_runtime.memory import create_page_pool

    cuda = args.device.startswith("cuda")
    pool = create_page_pool(
        device=args.device,
        pool_bytes=int(plan["pool_gib"].get(name, args.pool_gib) * GIB),
        page_bytes=PAGE if cuda else plan["cpu_page_bytes"],
        pinned_tail_pages=1,
        torch_headroom_bytes=int(args.torch_headroom_gib * GIB),
    )
    try:
        phase = _Phase(name, args, model, prompts, plan, pool, sharing)
        row = phase.drive(trace)
        return row, phase.log.rows
    finally:
        pool.close()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


class _Phase:
    """Engine, memory, loop and job of one phase, and what the drive observed."""

    def __init__(
        self,
        name: str,
        args: Any,
        model: Any,
        prompts: list[list[int]],
        plan: dict,
        pool: Any,
        sharing: Any,
    ) -> None:
        self.name = name
        self.args = args
        self.prompts = prompts
        self.static = name == "static_split"
        self.release = name == "unified_release"
        self.with_job = not name.startswith("decode_only")
        self.sharing = sharing
        self.decode_sms: int | None = None
        if sharing is not None:  # decode alone gets the whole device, unless on the split
            total = int(sharing.table.total_sms)
            on_split = self.with_job or name == "decode_only_split"
            self.decode_sms = min(args.decode_sms, total) if on_split else total
        self.memory = self._memory(model, plan, pool)
        self.engine = self._engine(model)
        self.sizing = QuantumSizing(
            plan["resident_bytes"],
            plan["bytes_per_token"],
            args.max_examples,
            recompute_bytes_per_token=plan.get("recompute_bytes_per_token"),
            only_recompute=plan.get("recompute") == "always",
        )
        self.loop, self.job = self._loop(model, pool)
        self.warmup = warm_quanta(self) if self.job is not None else {}
        self.graphs_at_start = self._graph_counts()
        self.recompute_at_start = self._recomputed()
        print(f"[{name}] pool {pool.num_pages} pages, engine ready {self.warmup}", flush=True)
        self.rejected = 0
        self.ooms = 0
        self.oom_details: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.kv_peak_blocks = 0
        self.series: list[tuple[float, float, float, float]] = []
        # (t, budget lent, what quanta were told to plan for, finetune allocator reserved)
        self.lent_samples: list[tuple[float, int, int, int]] = []
        self.records: list[Any] = []
        self.log = IterationLog(self.memory, self.engine, args.device.startswith("cuda"))

    def _memory(self, model: Any, plan: dict, pool: Any) -> Any:
        from gpu_runtime.memory import EngineMemory, MemoryManagerConfig

        policy = MemoryManagerConfig(
            reserve_low_pages=plan["reserve_low_pages"],
            reserve_high_pages=plan["reserve_high_pages"],
            max_step_pages=plan["step_pages"],
            shrink_after_iterations=10**9 if self.static else plan["hysteresis"],
            grow_hold_iterations=plan["hysteresis"],
            min_decode_pages=plan["static_decode_pages"] if self.static else 1,
            plan_headroom_intervals=plan["plan_headroom_intervals"],
            plan_headroom_min_pages=plan["plan_headroom_min_pages"],
            # `unified_no_peak`: quanta planned by recent growth only (may capture graphs the
            # next burst must flush); `unified`: also beside decode's recent peak.
            plan_peak_window=0 if self.name == "unified_no_peak" else plan["plan_peak_window"],
            plan_peak_prior_blocks=plan.get("plan_peak_prior_blocks", 0),
            reclaim_from_finetune=not self.static,
        )
        return EngineMemory.prepare(
            pool,
            model.config,
            block_size=16,
            kv_dtype="bfloat16" if self.args.device.startswith("cuda") else "float32",
            max_model_len=self.args.max_model_len,
            config=policy,
        )

    def _engine(self, model: Any) -> Any:
        """The decode engine over the pool, graphs captured and warmed on decode's stream."""
        import torch

        from gpu_runtime.engine import Engine, EngineConfig, SamplingParams

        args = self.args
        memory = self.memory
        engine = Engine(
            model,
            EngineConfig(
                num_kv_blocks=memory.binding.initial_blocks,
                kv_block_capacity=memory.binding.capacity_blocks,
                block_size=16,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_batched_tokens,
                mixed_cuda_graphs=args.mixed_graphs,
                max_model_len=args.max_model_len,
                device=args.device,
                cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            ),
            kv_storage_factory=memory.binding.storage_factory,
        )
        memory.attach(engine)
        stream: AbstractContextManager[Any] = nullcontext()
        cuda = args.device.startswith("cuda")
        if self.sharing is not None and self.decode_sms is not None:
            # Decode on its split's stream (green context), quanta on the other SMs; on one
            # stream the decode step would queue behind the whole quantum.
            decode_stream = self.sharing.partition(self.decode_sms)[0]
            engine.capture_cuda_graphs(partition=self.decode_sms, stream=decode_stream)
            stream = torch.cuda.stream(decode_stream)
        # Warm prefill and decode on decode's stream so their cached activations count as
        # decode's, not finetune's (the caching allocator keeps blocks per stream).
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
        with stream:
            engine.generate([self.prompts[0][: args.max_batched_tokens]] * 2, warm)
            engine.generate([p[:256] for p in self.prompts[:16]], warm)
        if cuda:
            torch.cuda.synchronize()
        memory.decode_ready()
        return engine

    def _loop(self, model: Any, pool: Any) -> tuple[Any, Any]:
        from gpu_runtime.colocation import HostLoop

        def captured() -> set[QuantumShape]:
            job = getattr(self, "job", None)
            return set() if job is None else captured_shapes(job.trainer)

        def on_launch(shape: QuantumShape) -> None:  # the mode of the quantum launched next
            job = getattr(self, "job", None)
            if job is not None:
                job.trainer.recompute = shape.recompute
            self.memory.manager.finetune.quantum_mode(
                examples=shape.examples, recompute=shape.recompute
            )

        release = None
        if self.release:

            def job_trainer() -> Any:
                job = getattr(self, "job", None)
                return None if job is None else job.trainer

            release = ReleaseHooks(
                self.memory.finetune_release_plan_bytes,
                self.memory.promise_finetune_bytes,
                lambda: refused_shapes(job_trainer()),
                lambda shape: drop_shared_shapes(job_trainer(), self.memory),
            )
        loop = HostLoop(
            self.engine,
            budgeted_policy(self.sizing, self.decode_sms, captured, release, on_launch),
            tpot_slo_ms=1e9,
            sharing=self.sharing,
            memory=self.memory,
        )
        executor = loop.executor
        self.memory.finetune_busy = lambda: executor.in_flight is not None
        self.memory.wait_for_finetune = lambda: executor.wait()
        if not self.with_job:
            return loop, None
        # The adapters live in finetune's own pool (CUDA: a MemPool), so they count as
        # finetune memory and decode's eager growth does not.
        with self.memory.finetune_allocations():
            trainer = lora_trainer(model, self.args, examples=512, epochs=50, batch_size=8)
        self.memory.manager.finetune.set_demand(pool.num_pages * pool.page_bytes)
        # A reclaim that must flush drops the trainer's CUDA graphs first (their private pool
        # is not returned by a cache flush).
        pool.before_flush = trainer.release_cuda_graphs
        if self.release:  # between quanta, decode's growth drops the largest separate shape
            self.memory.manager.finetune.graph_release = lambda: release_separate_shape(trainer)
        return loop, loop.add_job("ft", trainer)

    def _graph_counts(self) -> dict[str, int]:
        graphs = None if self.job is None else self.job.trainer.graphs
        return {} if graphs is None else dict(graphs.counts)

    def _recomputed(self) -> int:
        return 0 if self.job is None else int(self.job.trainer.recompute_micro_batches)

    def recompute_quanta(self) -> int:
        """Micro-batches that recomputed activations since the warm-up."""
        return self._recomputed() - self.recompute_at_start

    def graph_state(self) -> dict[str, Any]:
        graphs = None if self.job is None else self.job.trainer.graphs
        if graphs is None:
            return {"graphs": False}
        end = dict(graphs.counts)
        timed = {k: v - self.graphs_at_start.get(k, 0) for k, v in end.items()}
        return {
            "graphs": True,
            "timed_counts": {k: v for k, v in timed.items() if v},
            "disabled": graphs.disabled,
            "captured_at_end": len(graphs.keys()),
        }

    # ---- the drive --------------------------------------------------------------------------
    def drive(self, trace: list[Any]) -> dict[str, Any]:
        from gpu_runtime.engine import SamplingParams

        args, loop, engine = self.args, self.loop, self.engine
        start = loop.clock()
        i = 0
        drain_until = args.duration + args.drain
        next_sample = 0.0
        try:
            while True:
                now = loop.clock() - start
                if now >= drain_until or (
                    now >= args.duration and not engine.has_unfinished_requests()
                ):
                    break
                while i < len(trace) and trace[i].arrival_s <= min(now, args.duration):
                    r = trace[i]
                    params = SamplingParams(
                        max_tokens=r.output_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                        detokenize=False,
                    )
                    arrival = start + r.arrival_s
                    try:
                        loop.add_request(self.prompts[i], params, f"r{r.index}", arrival=arrival)
                    except ValueError:
                        self.rejected += 1
                    i += 1
                record = loop.run_iteration()
                self.records.append(record)
                self._account(record, start)
                _, lent, _, reserved = self.lent_samples[-1]
                self.log.record(record, start, lent, reserved)
                if now >= next_sample:
                    next_sample = now + 0.25
                    self._sample(now)
                if not (record.decode_batch or record.prefill_tokens):
                    # Nothing to decode: wait for the quantum (or the next arrival), don't spin.
                    until = trace[i].arrival_s if i < len(trace) else drain_until
                    pause = min(max(until - (loop.clock() - start), 0.0), 0.005)
                    if loop.executor.in_flight is not None:
                        loop.wait_for_finetune(timeout_s=pause)
                    else:
                        time.sleep(min(pause, 0.001))
        finally:
            end = loop.clock()
            loop.close()
        return phase_row(self, arrived=i, window=max(end - start, 1e-9))

    def _account(self, record: Any, start: float) -> None:
        memory = self.memory
        for report in record.quanta:
            if report.error is None:
                continue
            if "out of memory" in report.error.lower():
                # Count it, make the next quanta smaller, and let the job go on.
                self.ooms += 1
                if len(self.oom_details) < 5:
                    self.oom_details.append(
                        {
                            "t_s": round(self.loop.clock() - start, 3),
                            "budget_gib": round(memory.finetune_budget_bytes() / GIB, 3),
                            "quantum_ms": round(report.duration_ms, 1),
                            "error": report.error[:600],
                        }
                    )
                memory.manager.finetune.record_oom()
                self.sizing.safety *= 0.8
                self.job.failed = None
            elif len(self.errors) < 5:
                self.errors.append(report.error)
        used = self.engine.block_manager.num_used_blocks
        self.kv_peak_blocks = max(self.kv_peak_blocks, used)
        split = memory.manager.split()
        self.lent_samples.append(
            (
                record.timestamp - start,
                memory.lent_bytes(),
                memory.manager.finetune.plan_bytes(),
                split.finetune_reserved_bytes,
            )
        )

    def _sample(self, now: float) -> None:
        split = self.memory.manager.split()
        kv = self.engine.block_manager.num_used_blocks * self.memory.manager.layout.block_bytes
        self.series.append(
            (
                round(now, 3),
                round(split.finetune_budget_bytes / GIB, 3),
                round(split.finetune_allocated_bytes / GIB, 3),
                round(kv / GIB, 3),
            )
        )
