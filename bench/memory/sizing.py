"""The finetune side of `python -m bench.memory trace`: how big a quantum fits the budget it reads.

`finetune_footprint` measures, once per mode (with and without activation recomputation), what
a LoRA job keeps between quanta and its activation bytes per token; `QuantumSizing`
(`gpu_runtime.finetune.quantum_fit.QuantumFit`) turns a budget into a quantum shape: examples
per micro-batch and whether it recomputes (the largest without that fits, else the largest
with; a safety factor that shrinks after an out-of-memory error, and the measured footprints of
the CUDA-graph shapes captured); `budgeted_policy` is the host loop's policy that launches such
a quantum beside decode whenever none runs; with `ReleaseHooks` (phase `unified_release`) it
also launches a shape the choice order prefers (more examples, or no recomputation), pooled on
its own, when the release plan covers what that shape's capture held (dropping the shared
pool's shapes first, so the two pools are never held together).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from bench.common.examples import synthetic_examples
from gpu_runtime.finetune.quantum_fit import QuantumFit, QuantumShape, best
from gpu_runtime.finetune.shape_release import RECAPTURE_MARGIN

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class QuantumSizing(QuantumFit):
    """`QuantumFit` (estimates, measured footprints, the choice order: the largest shape
    without recomputation that fits, else with it) plus what the bench's phases track."""

    shared: set[QuantumShape] | None = None
    """With shapes pooled on their own (`unified_release`): the shapes in the shared pool
    (what fits beside decode's peak); None: one shared pool."""
    launched: Counter[str] = field(default_factory=Counter)
    """Shape label -> quanta the policy launched (`QuantumShape.label`: "2", "1r")."""


@dataclass(frozen=True)
class ReleaseHooks:
    """What `budgeted_policy` needs to launch a shape pooled on its own: the release plan
    (`EngineMemory.finetune_release_plan_bytes`), the promise of a quantum launched against
    it (`EngineMemory.promise_finetune_bytes`), the shapes whose capture was refused, and
    `prepare(shape)`, called before such a shape is captured again (drops the shared pool's
    shapes and flushes: `gpu_runtime.finetune.shape_release.drop_shared_shapes`)."""

    plan: Callable[[], int]
    promise: Callable[[int], None]
    refused: Callable[[], Collection[QuantumShape]]
    prepare: Callable[[QuantumShape], object]


def budgeted_policy(
    sizing: QuantumSizing,
    decode_sms: int | None,
    captured: Callable[[], Collection[QuantumShape]] | None = None,
    release: ReleaseHooks | None = None,
    on_launch: Callable[[QuantumShape], object] | None = None,
) -> Any:
    """A quantum beside decode whenever none runs, sized to the budget it reads (the choice
    order: fewer examples, then recomputation, when the budget is small); `decode_sms` is the
    stream sharing's only split (the whole device) on CUDA, None on CPU; `captured()`: the
    shapes whose CUDA graphs the job holds now (`shape_release.captured_shapes`);
    `on_launch(shape)` before each launch (the phase sets the trainer's mode and tells the
    memory manager). With `release` (and `sizing.shared` set by the warm-up): the shared
    pool's shapes run when the plan covers their measured footprint (captured again after a
    release) or the estimate, and a shape the choice order puts first whose footprint fits
    the release plan runs instead (its quantum is promised that plan; not captured:
    `RECAPTURE_MARGIN`, after `release.prepare`): its own graph pool is what the memory side
    releases between quanta when decode grows."""
    from gpu_runtime.colocation import CoLocationPolicy, FinetuneLaunch, IterationPlan

    class BudgetedQuanta(CoLocationPolicy):
        name = "budgeted"

        def plan(self, ctx: Any) -> Any:
            if not ctx.jobs or ctx.in_flight is not None:
                return IterationPlan(decode_sms=decode_sms)
            job = ctx.jobs[0]
            budget = ctx.finetune_budget_bytes or 0
            shapes = captured() if captured is not None else ()
            seq = job.max_seq_len
            choice = sizing.choose(budget, seq, shapes)
            shared = sizing.shared
            if release is not None and shared is not None:
                refused = release.refused()
                choice = best(
                    [
                        sizing.choose(budget, seq, shapes, among=shared),
                        sizing.choose_measured(budget, shared, refused=refused),
                    ]
                )
                plan = release.plan()
                larger = sizing.choose_measured(
                    plan,
                    set(sizing.shapes()) - shared,
                    refused=refused,
                    captured=shapes,
                    margin=RECAPTURE_MARGIN,
                )
                if larger is not None and best([larger, choice]) == larger:
                    if larger not in shapes:
                        release.prepare(larger)
                    release.promise(plan)
                    choice = larger
            if choice is None:
                return IterationPlan(
                    decode_sms=decode_sms, paused=True, note=f"budget {budget} B too small"
                )
            sizing.launched[choice.label] += 1
            if on_launch is not None:
                on_launch(choice)
            launch = FinetuneLaunch(job.job_id, choice.examples * seq)
            return IterationPlan(decode_sms=decode_sms, launches=(launch,))

    return BudgetedQuanta()


CPU_BYTES_PER_TOKEN = {False: 64.0 * 1024, True: 16.0 * 1024}
"""CPU runs' activation bytes per token without / with recomputation (budgets there are
accounting only; the ratio is about the H200's at 2k-token examples)."""


def finetune_footprint(
    trainer: Any, seq_len: int, device: Any, recompute: bool = False
) -> tuple[int, float]:
    """(bytes kept between quanta, activation bytes per token) of quanta with or without
    activation recomputation, measured with 1 and 4 examples on CUDA (the quantum's peak above
    what was allocated before it). With CUDA graphs the runs are eager (warm-up), captures and
    replays; a graph's peak is what its work needs in the graphs' private pool
    (`QuantumResult.peak_memory_bytes`), which stays reserved between quanta: sizing a quantum
    by it counts that pool in the budget."""
    import torch

    if device.type != "cuda":  # warm (lazy imports) outside the phases
        trainer.step_quantum(max_tokens=seq_len, recompute=recompute)
        return 0, CPU_BYTES_PER_TOKEN[recompute]
    peaks: dict[int, int] = {}
    for examples in (1, 4, 1, 4):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = trainer.step_quantum(max_tokens=examples * seq_len, recompute=recompute)
        torch.cuda.synchronize()
        # The larger of the two runs of each size: the first quantum of a trainer allocates
        # more (optimizer state, workspaces), and a phase's first quantum must fit too.
        reported = result.peak_memory_bytes or 0
        peak = max(torch.cuda.max_memory_allocated(), reported) - before
        peaks[int(result.examples)] = max(peaks.get(int(result.examples), 0), peak)
    resident = torch.cuda.memory_allocated() - trainer_start_allocated(trainer)
    small, big = min(peaks), max(peaks)
    if big == small:
        raise RuntimeError(f"footprint quanta all ran {big} examples")
    per_token = (peaks[big] - peaks[small]) / ((big - small) * seq_len)
    return max(resident, 0) + int(peaks[small] - per_token * small * seq_len), per_token * 1.1


def trainer_start_allocated(trainer: Any) -> int:
    return int(getattr(trainer, "_bench_allocated_at_start", 0))


def lora_trainer(model: Any, args: Any, *, examples: int, epochs: int, batch_size: int) -> Any:
    """The bench's LoRA job (rank 16, alpha 32, q/k/v/o, no dropout) on `examples` synthetic
    `--ft-seq-len`-token examples; CUDA-graphed quanta on CUDA unless `--ft-eager`."""
    from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
    from gpu_runtime.finetune.trainer import LoraTrainer

    hparams = resolve_hyperparameters(
        n_train_examples=examples,
        n_epochs=epochs,
        batch_size=batch_size,
        lora=LoraSpec(rank=16, alpha=32, dropout=0.0),
        seed=args.seed,
        warmup_ratio=0.0,
        max_seq_len=args.ft_seq_len,
    )
    data = synthetic_examples(examples, args.ft_seq_len, model.config.vocab_size, args.seed + 1)
    return LoraTrainer(model, data, hparams, cuda_graphs=False if args.ft_eager else None)
