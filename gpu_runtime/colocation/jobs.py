"""The loop's finetune-job state and the memory-pool contract it calls (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpu_runtime.colocation.snapshot import trainer_replays_graphs
from gpu_runtime.colocation.types import JobView, QuantumReport

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
    failed: str | None = None
    tokens_trained: int = 0
    quanta: int = 0
    last_loss: float | None = None
    step: int = 0
    bytes_per_token: float | None = None
    solo_tokens_per_s: float | None = None
    layers: int | None = None
    reports: list[QuantumReport] = field(default_factory=list, repr=False)
    _cold: tuple[Any, frozenset[tuple[int, int | None]]] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return bool(self.trainer.finished)

    @property
    def runnable(self) -> bool:
        return not (self.paused or self.failed or self.finished)

    @property
    def graphed(self) -> bool:
        """Whether the job's whole micro-batches replay CUDA graphs."""
        return trainer_replays_graphs(self.trainer)

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
