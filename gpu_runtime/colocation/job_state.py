"""The loop's finetune-job state and the memory-pool contract it calls (no torch here).

With a memory pool, a job whose hparams do not force activation recomputation has it chosen
per launch (``JobState.choose_mode``): the next launch recomputes only when one example without
recomputation does not fit the budget and one with it does (``QuantumFit.choose``'s order), and
the bytes per token the policy sizes the quantum by are that mode's.

With graph pools released one shape at a time (``HostLoop(release_graph_shapes=True)``, the
host agent's loop), a job's CUDA-graph shapes are pooled per launch
(``LaunchPoolGroups``): the next launch runs without recomputation also when one example
without it fits only the release plan (``ReleasePlanMemory.finetune_release_plan_bytes``: the
budget less decode's recent growth, without its peak), planned against that plan and captured
into a pool of its own (the shared pool's graphs dropped first), which the memory manager
releases between quanta when decode grows (``shape_release.release_largest_separate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpu_runtime.colocation.snapshot import trainer_replays_graphs
from gpu_runtime.colocation.types import JobView, QuantumReport
from gpu_runtime.finetune.graph_pools import LaunchPoolGroups
from gpu_runtime.finetune.quantum_fit import QuantumFit, QuantumShape
from gpu_runtime.finetune.shape_release import (
    RECAPTURE_MARGIN,
    captured_shapes,
    drop_shared_shapes,
    separate_shapes,
)

if TYPE_CHECKING:
    from gpu_runtime.finetune.trainer import LoraTrainer


class FinetuneMemory(Protocol):
    """The unified pool as the loop uses it (see ``gpu_runtime.colocation.memory``)."""

    def before_decode(self) -> None:
        """Critical path, before the decode step: make the step's KV blocks usable."""

    def after_decode(self) -> None:
        """Off the critical path: refill / shrink / lend pages."""

    def finetune_budget_bytes(self) -> int:
        """Bytes the next quantum may peak at."""

    def lent_bytes(self) -> int:
        """Bytes currently lent to finetuning."""

    def quantum_done(self, *, peak_bytes: int, resident_bytes: int) -> None:
        """Account a finished quantum's peak and what it keeps between quanta."""

    def finetune_quantum_mode(self, *, examples: int, recompute: bool) -> None:
        """The quantum about to launch: examples per micro-batch, with or without recomputation
        (counted; switches logged)."""


class ReleasePlanMemory(FinetuneMemory, Protocol):
    """A pool whose finetune graph pools are released one shape at a time (``EngineMemory``;
    see ``gpu_runtime/memory/README.md``, graph memory releasable one shape at a time)."""

    def finetune_release_plan_bytes(self) -> int:
        """What a quantum whose graphs are pooled on their own may plan to peak at."""

    def promise_finetune_bytes(self, nbytes: int) -> None:
        """The quantum about to launch was planned for ``nbytes`` (no quantum in flight)."""

    def finetune_graphs_released(self, dropped: int) -> None:
        """The finetune side dropped ``dropped`` graphs between quanta: flush their pool."""


RECOMPUTE_LAYERS_ESTIMATE = 3.0
"""A recomputing micro-batch keeps each layer's input and recomputes one layer at a time: about
one layer's activations plus the inputs and the loss's, taken as 3 layers' worth of the bytes
per token without recomputation (above what a recomputing quantum holds:
docs/decisions/0017-recompute-and-graph-release.md) until a recomputing quantum is measured."""


class JobError(KeyError):
    """Unknown or duplicate job id."""


@dataclass
class JobState:
    """The loop's view of one finetune job (read it with ``HostLoop.job_state``)."""

    job_id: str
    trainer: LoraTrainer
    seq_len: int
    max_seq_len: int
    lora_rank: int
    paused: bool = False
    stop_at_batch_end: bool = False
    """Run only to finish the optimizer batch in progress, then no new quanta (a host's
    pause: it checkpoints at that boundary)."""
    failed: str | None = None
    tokens_trained: int = 0
    quanta: int = 0
    last_loss: float | None = None
    step: int = 0
    bytes_per_token: float | None = None
    solo_tokens_per_s: float | None = None
    layers: int | None = None
    choose_recompute: bool = False
    """Whether the loop picks each launch's recomputation from the budget (``choose_mode``)."""
    recompute: bool = False
    """The mode of the job's next launch (what ``choose_mode`` picked)."""
    measured_bytes_per_token: dict[bool, float] = field(default_factory=dict)
    """Activation bytes per token seen per mode (recompute -> bytes; peaks beyond what was
    allocated when a quantum started, over its tokens)."""
    release_shapes: bool = False
    """Whether the job's graph shapes are pooled per launch and released one at a time
    (``pool_shapes_per_launch``)."""
    separate: bool = False
    """Whether the next launch runs in a pool of its own, planned against the release plan."""
    planned_bytes: int | None = None
    """The budget the next launch is planned for (what ``choose_mode`` was given, or the
    release plan for a separate launch)."""
    reports: list[QuantumReport] = field(default_factory=list, repr=False)
    _recomputed: int = field(default=0, repr=False)
    _cold: tuple[Any, frozenset[tuple[int, int | None]]] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return bool(self.trainer.finished)

    @property
    def runnable(self) -> bool:
        if self.paused or self.failed or self.finished:
            return False
        return not self.stop_at_batch_end or bool(self.trainer.has_pending_gradients)

    @property
    def graphed(self) -> bool:
        """Whether the job's whole micro-batches replay CUDA graphs."""
        return trainer_replays_graphs(self.trainer)

    def choose_mode(self, budget_bytes: int | None, release_bytes: int | None = None) -> None:
        """Pick the next launch's mode for ``budget_bytes`` and set ``bytes_per_token`` (what
        the policy caps quantum tokens by) to that mode's figure. Without recomputation until
        a quantum without it has been measured or while one example without it fits; with it
        when only that fits (``QuantumFit.choose``, no safety factor: the same arithmetic as
        the policy's cap). Its bytes per token before a recomputing quantum was measured:
        ``RECOMPUTE_LAYERS_ESTIMATE / layers`` of those without (no estimate, so no
        recomputation, when the layer count is unknown).

        ``release_bytes`` (the release plan; jobs with ``release_shapes``): when one example
        without recomputation does not fit ``budget_bytes`` but fits the release plan (by
        ``RECAPTURE_MARGIN`` unless a shape without recomputation is held in a pool of its own
        already), the launch runs without recomputation in a pool of its own (``separate``),
        planned against that plan (``planned_bytes``), before any recomputing shape: the
        choice order of ``QuantumFit``, the larger budget being the release plan."""
        self.separate = False
        self.planned_bytes = budget_bytes
        if not self.choose_recompute:
            return
        plain = self.measured_bytes_per_token.get(False)
        self.recompute = False
        self.bytes_per_token = plain
        if budget_bytes is None or plain is None:
            return
        if release_bytes is not None and self._fits_alone(plain, budget_bytes, release_bytes):
            self.separate = True
            self.planned_bytes = release_bytes
            return
        recomputing = self.measured_bytes_per_token.get(True)
        if recomputing is None and self.layers:
            recomputing = plain * min(1.0, RECOMPUTE_LAYERS_ESTIMATE / self.layers)
        if recomputing is None:
            return
        fit = QuantumFit(0, plain, 1, recomputing, safety=1.0)
        shape = fit.choose(budget_bytes, self.max_seq_len)
        if shape is not None and shape.recompute:
            self.recompute = True
            self.bytes_per_token = recomputing

    def _fits_alone(self, plain: float, budget_bytes: int, release_bytes: int) -> bool:
        """One example without recomputation fits the release plan but not the budget."""
        one = plain * self.max_seq_len
        if one <= budget_bytes:  # beside decode's peak: the shared pool
            return False
        held = any(not shape.recompute for shape in separate_shapes(self.trainer))
        return one * (1.0 if held else RECAPTURE_MARGIN) <= release_bytes

    def pool_shapes_per_launch(self) -> bool:
        """Pool the trainer's CUDA-graph shapes per launch (``LaunchPoolGroups``); only before
        any is captured. Returns whether they are (sets ``release_shapes``)."""
        graphs = self.trainer.graphs
        if graphs is None or graphs.disabled is not None or graphs.keys():
            return False
        graphs.pool_groups = LaunchPoolGroups()
        self.release_shapes = True
        return True

    def prepare_launch(self, examples: int, memory: ReleasePlanMemory | None, idle: bool) -> None:
        """Before a launch of ``examples`` examples per micro-batch in the mode ``choose_mode``
        picked (jobs with ``release_shapes``): a shape captured by it goes to a pool of its own
        when the launch is ``separate``, else to the shared pool. A separate launch with no
        quantum in flight (``idle``) whose shape is not held yet first drops the shared
        pool's graphs and flushes (``drop_shared_shapes``: the two pools are never held
        together), and is promised the release plan it was planned for."""
        graphs = self.trainer.graphs
        groups = None if graphs is None else graphs.pool_groups
        if not self.release_shapes or not isinstance(groups, LaunchPoolGroups):
            return
        groups.separate_launch = self.separate
        if not self.separate or memory is None or not idle:
            return
        if QuantumShape(max(1, examples), False) not in captured_shapes(self.trainer):
            drop_shared_shapes(self.trainer, memory)
        if self.planned_bytes is not None:
            memory.promise_finetune_bytes(self.planned_bytes)

    def record_quantum(self, report: QuantumReport) -> None:
        """Learn bytes per token from a finished quantum, by the mode its micro-batch ran in
        (the trainer's count of recomputing micro-batches moved: one quantum of a trainer
        runs at a time)."""
        done = int(getattr(self.trainer, "recompute_micro_batches", 0))
        recomputed = done > self._recomputed
        self._recomputed = done
        if report.finetune_peak_bytes is None or not report.tokens:
            return
        self.bytes_per_token = report.finetune_peak_bytes / report.tokens
        self.measured_bytes_per_token[recomputed] = self.bytes_per_token

    def view(self, cold_launches: frozenset[tuple[int, int | None]] = frozenset()) -> JobView:
        return JobView(
            self.job_id,
            self.seq_len,
            self.max_seq_len,
            self.lora_rank,
            self.bytes_per_token,
            self.solo_tokens_per_s,
            None if self.graphed else self.layers,
            cold_launches,
        )

    def cold_launches(
        self, examples: tuple[int, ...], streams: tuple[tuple[int | None, int], ...]
    ) -> frozenset[tuple[int, int | None]]:
        """(examples, decode SMs) whose next micro-batch would not replay a graph on that
        split's finetune stream (``streams``: (decode SMs, the stream's CUDA handle) pairs),
        asked of the trainer (``LoraTrainer.replays_next``) again only once its data position or
        graphs have moved (after a quantum); empty when the job runs no graphs."""
        graphs = self.trainer.graphs
        if graphs is None or not self.graphed or not streams:
            return frozenset()
        state = (
            self.trainer.stream.position,
            sum(graphs.counts.values()),
            len(graphs.keys()),
            examples,
            streams,
        )
        if self._cold is not None and self._cold[0] == state:
            return self._cold[1]
        handles = {handle for _, handle in streams}
        cold = set()
        for k in examples:
            replays = self.trainer.replays_next(k * self.max_seq_len, handles)
            if replays is not None:
                cold |= {(k, d) for d, handle in streams if not replays[handle]}
        self._cold = (state, frozenset(cold))
        return self._cold[1]
