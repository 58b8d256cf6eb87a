"""The finetune side of `bench/memory.py trace`: how big a quantum fits the budget it reads.

`finetune_footprint` measures, once, what a LoRA job keeps between quanta and its activation
bytes per token; `QuantumSizing` turns a budget into a token count (with a safety factor that
shrinks after an out-of-memory error, and the measured footprints of the CUDA-graph shapes
captured); `budgeted_policy` is the host loop's policy that launches such a quantum beside
decode whenever none runs; with `ReleaseHooks` (phase `unified_release`) it also launches a
larger shape pooled on its own when the release plan covers what that shape's capture held
(dropping the shared pool's shapes first, so the two pools are never held together).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
RECAPTURE_MARGIN = 1.1
"""A larger shape pooled on its own is captured again only when the release plan covers its
footprint by this factor (the memory side releases it below 1.0): no capture-release cycles
while decode hovers at the threshold."""


class QuantumSizing:
    """What the finetune side knows to size a quantum: its footprint and a safety factor that
    shrinks after an out-of-memory error (the finetune side's adaptation)."""

    def __init__(self, resident_bytes: int, bytes_per_token: float, max_examples: int) -> None:
        self.resident_bytes = resident_bytes
        self.bytes_per_token = bytes_per_token
        self.max_examples = max_examples
        self.safety = 0.9
        self.footprints: dict[int, int] = {}
        """Examples per micro-batch -> finetune memory held once that shape was captured
        (its graphs' pool, shared with the smaller shapes, plus the job's live state)."""
        self.shared_rows: int | None = None
        """With larger shapes pooled on their own (`unified_release`): the most examples of a
        shape in the shared pool (what fits beside decode's peak); None: one shared pool."""

    def record_capture(self, examples: int, held_bytes: int) -> None:
        """The finetune side holds `held_bytes` after capturing the `examples` shape."""
        self.footprints[examples] = max(self.footprints.get(examples, 0), held_bytes)

    def tokens(self, budget_bytes: int, max_seq_len: int, captured: Collection[int] = ()) -> int:
        """Tokens of the largest micro-batch of a power-of-two number of whole examples (at
        most `max_examples`) that fits: few distinct shapes keep the caching allocator's
        blocks reusable from one quantum to the next. 0 when not even one example fits.

        A shape in `captured` (its CUDA graphs are held) fits when the memory held after its
        capture (`footprints`) does: its replay allocates nothing. The estimate from the bytes
        per token (with the safety factor) is well above that (2 examples of 512 tokens: 8.0
        GiB estimated, 7.1 GiB held on the H200), so a budget planned down to what finetuning
        already holds would otherwise run a smaller shape in the same memory."""
        room = (budget_bytes - self.resident_bytes) * self.safety
        examples = min(int(room / (self.bytes_per_token * max_seq_len)), self.max_examples)
        examples = 0 if examples < 1 else 1 << (examples.bit_length() - 1)
        for shape in captured:
            held = self.footprints.get(shape)
            if held is not None and shape <= self.max_examples and held <= budget_bytes:
                examples = max(examples, shape)
        return examples * max_seq_len

    def measured_tokens(
        self,
        budget_bytes: int,
        max_seq_len: int,
        *,
        above: int = 0,
        at_most: int | None = None,
        refused: Collection[int] = (),
        captured: Collection[int] = (),
        margin: float = 1.0,
    ) -> int:
        """Tokens of the largest shape of more than `above` and at most `at_most` examples
        (and `max_examples`) whose measured footprint (`footprints`: what finetuning held
        once it was captured) fits `budget_bytes`, that footprint times `margin` for a shape
        not in `captured` (it would be captured again); 0 when none does. Measured shapes
        only: a shape is captured again (after a release) only where its capture fitted
        before. `refused`: shapes whose capture ran out of memory (they would run eagerly)."""
        limit = self.max_examples if at_most is None else min(at_most, self.max_examples)
        fits = [
            shape
            for shape, held in self.footprints.items()
            if above < shape <= limit
            and shape not in refused
            and held * (1.0 if shape in captured else margin) <= budget_bytes
        ]
        return max(fits, default=0) * max_seq_len


@dataclass(frozen=True)
class ReleaseHooks:
    """What `budgeted_policy` needs to launch a shape pooled on its own: the release plan
    (`EngineMemory.finetune_release_plan_bytes`), the promise of a quantum launched against
    it (`EngineMemory.promise_finetune_bytes`), the shapes whose capture was refused, and
    `prepare(examples)`, called before such a shape is captured again (drops the shared
    pool's shapes and flushes: `drop_shared_shapes`)."""

    plan: Callable[[], int]
    promise: Callable[[int], None]
    refused: Callable[[], Collection[int]]
    prepare: Callable[[int], object]


def warm_sizes(sizing: QuantumSizing, budget_bytes: int, max_seq_len: int) -> list[int]:
    """Examples per warm-up quantum, before a phase's clock starts: one example twice (the
    first on a new (thread, stream) runs eagerly, the second is captured), then every larger
    power of two that fits the budget (each captured once). Empty when not even one fits."""
    fits = sizing.tokens(budget_bytes, max_seq_len) // max_seq_len
    if fits < 1:
        return []
    sizes = [1, 1]
    while sizes[-1] * 2 <= fits:
        sizes.append(sizes[-1] * 2)
    return sizes


def budgeted_policy(
    sizing: QuantumSizing,
    decode_sms: int | None,
    captured: Callable[[], Collection[int]] | None = None,
    release: ReleaseHooks | None = None,
) -> Any:
    """A quantum beside decode whenever none runs, sized to the budget it reads (fewer
    examples per micro-batch when the budget is small); `decode_sms` is the stream sharing's
    only split (the whole device) on CUDA, None on CPU; `captured()`: the shapes (examples
    per micro-batch) whose CUDA graphs the job holds now (`captured_shapes`). With `release`
    (and `sizing.shared_rows` set by the warm-up): the shared pool's shapes run when the
    plan covers their measured footprint (captured again after a release) or the estimate,
    and a larger shape whose footprint fits the release plan runs instead (its quantum is
    promised that plan; not captured: `RECAPTURE_MARGIN`, after `release.prepare`): its own
    graph pool is what the memory side releases between quanta when decode grows."""
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
            tokens = sizing.tokens(budget, seq, shapes)
            shared = sizing.shared_rows
            if release is not None and shared is not None:
                refused = release.refused()
                base = sizing.measured_tokens(budget, seq, at_most=shared, refused=refused)
                tokens = max(min(tokens, shared * seq), base)
                plan = release.plan()
                larger = sizing.measured_tokens(
                    plan,
                    seq,
                    above=shared,
                    refused=refused,
                    captured=shapes,
                    margin=RECAPTURE_MARGIN,
                )
                if larger > tokens:
                    if larger // seq not in shapes:
                        release.prepare(larger // seq)
                    release.promise(plan)
                    tokens = larger
            if tokens < job.max_seq_len:
                return IterationPlan(
                    decode_sms=decode_sms, paused=True, note=f"budget {budget} B too small"
                )
            launch = FinetuneLaunch(job.job_id, tokens)
            return IterationPlan(decode_sms=decode_sms, launches=(launch,))

    return BudgetedQuanta()


def captured_shapes(trainer: Any) -> set[int]:
    """Examples per micro-batch of the shapes whose CUDA graphs `trainer` holds now (none
    without graphs, or once they are off for good)."""
    graphs = getattr(trainer, "graphs", None)
    if graphs is None or graphs.disabled is not None:
        return set()
    return {int(key.rows) for key in graphs.keys()}


def refused_shapes(trainer: Any) -> set[int]:
    """Examples per micro-batch of the shapes whose capture ran out of memory (eager since)."""
    graphs = getattr(trainer, "graphs", None)
    if graphs is None:
        return set()
    return {int(key.rows) for key in graphs.policy.refused}


def drop_shared_shapes(trainer: Any, memory: Any) -> int:
    """Before a larger shape is captured into its own pool: drop the shared pool's graphs and
    let the memory side flush (`MemoryManager.finetune_graphs_released`), so that the two
    pools are never held together. Returns the graphs dropped."""
    from gpu_runtime.finetune.graph_pools import SHARED

    graphs = getattr(trainer, "graphs", None)
    if graphs is None or graphs.disabled is not None:
        return 0
    dropped = len(graphs.release_group(SHARED))
    memory.manager.finetune_graphs_released(dropped)
    return dropped


def release_separate_shape(trainer: Any) -> int:
    """`MemoryManager.release_finetune_graphs` for `trainer`: drop its largest separately
    pooled shape's graphs (the count; 0 without graphs or such a shape)."""
    graphs = getattr(trainer, "graphs", None)
    if graphs is None or graphs.disabled is not None:
        return 0
    return len(graphs.release_largest_separate())


def finetune_footprint(trainer: Any, seq_len: int, device: Any) -> tuple[int, float]:
    """(bytes kept between quanta, activation bytes per token), measured with 1 and 4 examples
    on CUDA (the quantum's peak above what was allocated before it). With CUDA graphs the runs
    are eager (warm-up), captures and replays; a graph's peak is what its work needs in the
    graphs' private pool (`QuantumResult.peak_memory_bytes`), which stays reserved between
    quanta: sizing a quantum by it counts that pool in the budget."""
    import torch

    if device.type != "cuda":
        trainer.step_quantum(max_tokens=seq_len)  # warm (lazy imports) outside the phases
        return 0, 64.0 * 1024  # CPU: budgets are accounting only
    peaks: dict[int, int] = {}
    for examples in (1, 4, 1, 4):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = trainer.step_quantum(max_tokens=examples * seq_len)
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
    from bench.colocate import synthetic_examples
    from gpu_runtime.finetune.hparams import LoraSpec, resolve_hyperparameters
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
