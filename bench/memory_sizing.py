"""The finetune side of `bench/memory.py trace`: how big a quantum fits the budget it reads.

`finetune_footprint` measures, once, what a LoRA job keeps between quanta and its activation
bytes per token; `QuantumSizing` turns a budget into a token count (with a safety factor that
shrinks after an out-of-memory error, and the measured footprints of the CUDA-graph shapes
captured); `budgeted_policy` is the host loop's policy that launches such a quantum beside
decode whenever none runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


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
) -> Any:
    """A quantum beside decode whenever none runs, sized to the budget it reads (fewer
    examples per micro-batch when the budget is small); `decode_sms` is the stream sharing's
    only split (the whole device) on CUDA, None on CPU; `captured()`: the shapes (examples
    per micro-batch) whose CUDA graphs the job holds now (`captured_shapes`)."""
    from gpu_runtime.colocation import CoLocationPolicy, FinetuneLaunch, IterationPlan

    class BudgetedQuanta(CoLocationPolicy):
        name = "budgeted"

        def plan(self, ctx: Any) -> Any:
            if not ctx.jobs or ctx.in_flight is not None:
                return IterationPlan(decode_sms=decode_sms)
            job = ctx.jobs[0]
            budget = ctx.finetune_budget_bytes or 0
            shapes = captured() if captured is not None else ()
            tokens = sizing.tokens(budget, job.max_seq_len, shapes)
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
