"""The latency-model interface the co-location policies query, and a known analytic model.

Policies ask ``predict_ms(iteration, quantum)`` for one decode iteration's latency: ``quantum``
None is stage 1 (decode alone on ``iteration.decode_sm_share`` of the SMs), otherwise stage 2
(that finetune quantum running beside it). Inputs are the predictor schema's dataclasses
(``gpu_runtime.predictor.schema``), so the trained ONNX predictor plugs in through
:class:`StagedPredictorAdapter`; ``gpu_runtime.colocation.online`` fits one from observations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpu_runtime.colocation.types import DecodeSnapshot
from gpu_runtime.predictor.schema import NO_FINETUNE_ROW, DecodeIteration, FinetuneQuantum


class DecodeLatencyModel(Protocol):
    """Stage-1/2 decode iteration latency in ms."""

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        """Predicted decode iteration latency (ms); ``quantum`` None = decode alone."""
        ...


Pair = tuple[DecodeIteration, "FinetuneQuantum | None"]


def predict_many(model: DecodeLatencyModel, pairs: Sequence[Pair]) -> list[float]:
    """``model.predict_ms`` of every pair, in one call where the model has a batch path
    (``predict_many``, or the ONNX runtime's raw ``predict(rows)``: one session run for all)."""
    if not pairs:
        return []
    many = getattr(model, "predict_many", None)
    if many is not None:
        return list(many(pairs))
    rows_api = getattr(model, "predict", None)
    if rows_api is not None and hasattr(model, "max_batch"):
        import numpy as np

        rows = np.array(
            [
                [*it.row(), *(NO_FINETUNE_ROW if q is None or q.tokens == 0 else q.row())]
                for it, q in pairs
            ],
            dtype=np.float32,
        )
        _, colocated = rows_api(rows)
        return [float(v) for v in colocated]
    return [model.predict_ms(it, q) for it, q in pairs]


def decode_iteration(snapshot: DecodeSnapshot, decode_sm_share: float) -> DecodeIteration:
    """The predictor's stage-1 row for a snapshot (which must not be idle)."""
    return DecodeIteration(
        batch_size=snapshot.batch_size,
        context_tokens_total=snapshot.context_tokens_total,
        context_tokens_max=snapshot.context_tokens_max,
        prefill_chunk_tokens=snapshot.prefill_tokens,
        decode_sm_share=decode_sm_share,
    )


@dataclass(frozen=True)
class AnalyticLatencyModel:
    """A closed-form model (tests, and a prior before anything is fitted).

    Stage 1: ``base_ms + per_seq_ms * batch + per_ctx_token_us * context / 1000 +
    per_prefill_token_us * prefill / 1000``, divided by ``share ** share_exponent`` (fewer SMs,
    slower). Stage 2 multiplies that by ``1 + spatial_interference`` when the quantum has SMs of
    its own (``ft_sm_share + decode_sm_share <= 1``) and by ``1 + shared_interference`` when it
    shares decode's SMs.
    """

    base_ms: float = 5.0
    per_seq_ms: float = 0.02
    per_ctx_token_us: float = 0.05
    per_prefill_token_us: float = 20.0
    share_exponent: float = 0.6
    spatial_interference: float = 0.08
    shared_interference: float = 0.8

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        solo = (
            self.base_ms
            + self.per_seq_ms * iteration.batch_size
            + self.per_ctx_token_us * iteration.context_tokens_total / 1e3
            + self.per_prefill_token_us * iteration.prefill_chunk_tokens / 1e3
        ) / iteration.decode_sm_share**self.share_exponent
        if quantum is None or quantum.tokens == 0:
            return solo
        disjoint = quantum.sm_share + iteration.decode_sm_share <= 1.0 + 1e-9
        factor = self.spatial_interference if disjoint else self.shared_interference
        return solo * (1.0 + factor)


class StagedPredictorAdapter:
    """Adapts a predictor exposing separate stage-1/stage-2 calls to `DecodeLatencyModel`.

    ``stage1(iteration) -> ms`` and ``stage2(iteration, quantum) -> ms`` are e.g. the bound
    methods of the ONNX runtime wrapper in ``gpu_runtime.predictor``; a stage-2 call whose
    quantum has no tokens is answered by stage 1.
    """

    def __init__(
        self,
        stage1: Callable[[DecodeIteration], float],
        stage2: Callable[[DecodeIteration, FinetuneQuantum], float],
    ) -> None:
        self._stage1 = stage1
        self._stage2 = stage2

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        if quantum is None or quantum.tokens == 0:
            return float(self._stage1(iteration))
        return float(self._stage2(iteration, quantum))
