"""The warm-up of a phase's LoRA job in `python -m bench.memory trace`, before the phase's clock.

`warm_quanta(phase)` lends the idle pool to finetuning, runs one quantum of each shape that fits
(`QuantumFit.warm_plan`: the shape the plan picks and the smaller ones of its mode, with or
without activation recomputation) through the loop's own executor and finetune stream (the
first on a (thread, stream) runs eagerly, the rest are captured), flushes the eager warm-up's
cached activations (the graphs' pools stay) and records what each captured shape left held
(`QuantumSizing.footprints`). In `unified_release` those shapes share one pool and each shape
the choice order puts before them (more examples, or no recomputation), up to the release
plan, is captured into its own after the shared shapes were dropped (the two are never held
together), so its footprint is its pool alone plus the job's live state; the phase starts
holding the last shape captured.
"""

from __future__ import annotations

from typing import Any

from gpu_runtime.finetune.quantum_fit import QuantumShape
from gpu_runtime.finetune.shape_release import captured_shapes

GIB = 1 << 30


def warm_quanta(phase: Any) -> dict[str, Any]:
    """Warm `phase`'s job up (a `phase._Phase` with its memory, loop and job built);
    returns the row's `finetune_warmup`. Shapes run smallest estimate first, so the graphs'
    shared pool grows once per new largest shape. `unified_release`: the shapes the plan
    fits share that pool; the ones the choice order prefers, up to the release plan, get
    their own (`separate_except`), captured after the shared shapes were dropped and their
    cache flushed (before the clock: not counted as a release)."""
    import torch

    from gpu_runtime.colocation.executor import QuantumTask
    from gpu_runtime.colocation.types import LaunchMode

    memory, loop, job, sizing = phase.memory, phase.loop, phase.job, phase.sizing
    seq = job.max_seq_len
    memory.after_decode()  # nothing decodes yet: idle pages go to finetuning
    stream = None
    if phase.sharing is not None and phase.decode_sms is not None:
        stream = phase.sharing.partition(phase.decode_sms)[1]
    budget = memory.finetune_budget_bytes()
    out: dict[str, Any] = {"budget_gib": round(budget / GIB, 2), "quanta": []}
    release_bytes = None
    if phase.release:
        release_bytes = max(budget, memory.finetune_release_plan_bytes())
        out["release_plan_gib"] = round(release_bytes / GIB, 2)
    shared, order = sizing.warm_plan(budget, seq, release_bytes)
    graphs = job.trainer.graphs
    if phase.release:
        from gpu_runtime.finetune.graph_pools import SHARED, PoolGroups, separate_except

        sizing.shared = shared
        out["shared_pool_shapes"] = sorted(s.label for s in shared)
        if graphs is not None:
            graphs.pool_groups = PoolGroups(
                separate_except({(s.examples, s.recompute) for s in shared})
            )
    held_after: dict[QuantumShape, int] = {}
    captured_in_warmup: set[QuantumShape] = set()
    for shape in order[:1] + order:  # the first runs twice: eagerly, then captured
        if phase.release and shape not in shared and graphs is not None:
            if graphs.release_group(SHARED):  # the larger shape's pool alone
                memory.manager.pool.flush_finetune_cache()
                out["shared_dropped_before"] = shape.label
        job.trainer.recompute = shape.recompute
        task = QuantumTask(
            "ft", job.trainer, shape.examples * seq, LaunchMode.CONCURRENT, phase.decode_sms, stream
        )
        before = phase._graph_counts()
        loop.executor.submit(task)
        if not loop.executor.wait(120.0):
            raise RuntimeError(f"warm-up quantum {shape} ran over 120 s")
        (report,) = loop.executor.poll()
        after = phase._graph_counts()
        modes = sorted(k for k in after if after[k] > before.get(k, 0))
        out["quanta"].append([shape.label, round(report.duration_ms, 1), ",".join(modes)])
        held_after[shape] = memory.manager.split().finetune_reserved_bytes
        if "capture" in modes:
            captured_in_warmup.add(shape)
        if report.error is not None:  # go on eagerly rather than lose the phase
            out["error"] = report.error[:400]
            job.trainer.disable_cuda_graphs(f"warm-up quantum failed: {report.error}")
            break
    if torch.cuda.is_available() and phase.args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager warm-up's activations; graphs keep theirs
    held = memory.manager.split().finetune_reserved_bytes
    out["finetune_reserved_gib"] = round(held / GIB, 2)
    captured = captured_shapes(job.trainer)
    if phase.release and graphs is not None and graphs.disabled is None:
        captured |= captured_in_warmup  # the shared shapes, dropped for the larger one
    for shape, footprint in shape_footprints(
        captured, held, held_after, shared if phase.release else None
    ).items():
        sizing.record_capture(shape, footprint)
    return out


def shape_footprints(
    captured: set[QuantumShape],
    held: int,
    held_after: dict[QuantumShape, int],
    shared: set[QuantumShape] | None,
) -> dict[QuantumShape, int]:
    """What each captured shape needs held to replay. One shared graph pool (`shared` None):
    what finetuning holds after the warm-up (`held`), for every shape. With shapes outside
    `shared` pooled on their own: a shared shape, what was held once the last shared shape was
    captured (`held_after`: finetune's reserved bytes after each shape's warm-up quantum, in
    warm-up order); a separate shape, what was held after its own capture (`unified_release`
    drops the shared shapes before it: its pool alone and the live state; anything still held
    beside it is included, so conservative). `captured` includes the shared shapes dropped
    that way: they are captured again by that footprint."""
    if shared is None:
        return {shape: held for shape in captured}
    shared_held = max((n for s, n in held_after.items() if s in shared), default=0)
    return {
        shape: shared_held if shape in shared else held_after.get(shape, held) for shape in captured
    }
