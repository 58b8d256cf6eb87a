"""A trained latency predictor, corrected online by what the loop itself observes.

The ONNX predictor (``gpu_runtime.predictor``) is trained offline on the GPU's profile: it knows
how latency moves with batch, context, prefill chunk, SM share and the quantum beside decode,
but not this host's constant offsets (the loop's own host work per iteration, a different H200,
an engine changed since the profile). :class:`CorrectedLatencyModel` multiplies its prediction
by ``sum(observed) / sum(predicted)`` over recent iterations of the same kind (decode SM share,
whether a quantum ran beside decode, the size class of the step's prefill chunk tokens: none,
<= 64, <= 128, <= 256, more), falling back to the ratio over every share of that kind, then to
the same two with any chunk size (a class not yet seen), then to 1. Chunk steps get a ratio per
size class because the engine replays them from graphs per token bucket: their cost moves with
the padded bucket in steps a model trained on other chunk sizes can miss in either direction,
and one ratio over all sizes would under-predict the big ones. A ratio of sums, not a median:
a request's TPOT is a mean over its iterations, so occasional slow ones (a stall, a launch) must
raise the prediction as much as they raise that mean; one iteration counts at most
``ratio_bounds[1]`` times its prediction. Targets are whole iteration times
(``IterationRecord.iteration_ms``), as for ``OnlineLatencyModel``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from gpu_runtime.colocation.online import record_observation
from gpu_runtime.colocation.predictor import DecodeLatencyModel, Pair, predict_many
from gpu_runtime.colocation.types import IterationRecord
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum

Kind = tuple[bool, int]
"""(a quantum beside decode, the step's chunk class: 0 none, 1 <= 64 tokens, 2 <= 128, 3 <= 256,
4 more); class -1 stands for any chunk (the coarse fallback)."""

CHUNK_CLASS_TOKENS = (64, 128, 256)
"""Upper token bounds of chunk classes 1, 2, 3 (class 4 above the last)."""


def chunk_class(tokens: int) -> int:
    if tokens <= 0:
        return 0
    for index, bound in enumerate(CHUNK_CLASS_TOKENS, start=1):
        if tokens <= bound:
            return index
    return len(CHUNK_CLASS_TOKENS) + 1


def _coarse(kind: Kind) -> Kind:
    beside, size = kind
    return (beside, -1 if size > 0 else 0)


def _ratio_of_sums(pairs: deque[tuple[float, float]]) -> float:
    return sum(o for _, o in pairs) / sum(p for p, _ in pairs)


def _kind(iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> Kind:
    beside = quantum is not None and quantum.tokens > 0
    return beside, chunk_class(iteration.prefill_chunk_tokens)


class CorrectedLatencyModel:
    """``base.predict_ms`` times a learnt ratio per kind of iteration (see the module doc)."""

    def __init__(
        self,
        base: DecodeLatencyModel,
        *,
        window: int = 64,
        min_samples: int = 4,
        ratio_bounds: tuple[float, float] = (0.1, 8.0),
    ) -> None:
        """``window``: iterations kept per key; ``min_samples``: iterations a key needs before
        it is used; ``ratio_bounds``: the range one iteration's observed/predicted is clipped
        to (one stalled iteration must not throw the ratio far; the lower bound leaves room for
        an engine whose chunk steps got 4x cheaper than its predictor's profile, as on the H200
        when chunk attention became one kernel per layer)."""
        if window < 1 or min_samples < 1 or not 0 < ratio_bounds[0] < 1 < ratio_bounds[1]:
            raise ValueError(
                f"window={window}, min_samples={min_samples} must be >= 1 and ratio_bounds="
                f"{ratio_bounds} must bracket 1 above 0"
            )
        self.base = base
        self.window = window
        self.min_samples = min_samples
        self.ratio_bounds = ratio_bounds
        self._pairs: dict[tuple[float, Kind], deque[tuple[float, float]]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._pooled: dict[Kind, deque[tuple[float, float]]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._share_ratios: dict[tuple[float, Kind], float] = {}
        self._kind_ratios: dict[Kind, float] = {}

    def ratio(self, share: float, kind: Kind) -> float:
        """The correction applied to iterations of ``kind`` on ``share`` of the SMs."""
        share = round(share, 4)
        for key in (kind, _coarse(kind)):
            cached = self._share_ratios.get((share, key))
            if cached is None:
                cached = self._kind_ratios.get(key)
            if cached is not None:
                return cached
        return 1.0

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        base = self.base.predict_ms(iteration, quantum)
        return base * self.ratio(iteration.decode_sm_share, _kind(iteration, quantum))

    def predict_many(self, pairs: Sequence[Pair]) -> list[float]:
        """``predict_ms`` of every pair, the base model asked once (``predict_many``)."""
        bases = predict_many(self.base, pairs)
        return [
            b * self.ratio(it.decode_sm_share, _kind(it, q))
            for b, (it, q) in zip(bases, pairs, strict=True)
        ]

    def observe(
        self, iteration: DecodeIteration, quantum: FinetuneQuantum | None, observed_ms: float
    ) -> None:
        """Add one observed iteration (its prediction by ``base`` is recomputed here)."""
        if observed_ms <= 0:
            return
        predicted = self.base.predict_ms(iteration, quantum)
        if not predicted > 0:
            return
        low, high = self.ratio_bounds
        clipped = min(max(observed_ms, low * predicted), high * predicted)
        fine = _kind(iteration, quantum)
        share = round(iteration.decode_sm_share, 4)
        for kind in {fine, _coarse(fine)}:
            per_share, pooled = self._pairs[share, kind], self._pooled[kind]
            per_share.append((predicted, clipped))
            pooled.append((predicted, clipped))
            if len(per_share) >= self.min_samples:
                self._share_ratios[share, kind] = _ratio_of_sums(per_share)
            if len(pooled) >= self.min_samples:
                self._kind_ratios[kind] = _ratio_of_sums(pooled)

    def observe_record(self, record: IterationRecord, seq_len: int = 512, rank: int = 16) -> None:
        """Add a loop record (ignored when decode was idle)."""
        observation = record_observation(record, seq_len, rank)
        if observation is not None:
            self.observe(*observation)

    def describe(self) -> dict[str, Any]:
        """The learnt ratios (for results and logs)."""

        def name(kind: Kind) -> str:
            beside, size = kind
            step = {0: "decode", -1: "prefill"}.get(size)
            if step is None:
                bounds = (*CHUNK_CLASS_TOKENS, None)
                top = bounds[size - 1]
                step = f"prefill<={top}" if top is not None else f"prefill>{bounds[-2]}"
            return f"{'beside' if beside else 'alone'}/{step}"

        return {
            "per_share": {
                f"{share}/{name(kind)}": round(m, 4)
                for (share, kind), m in sorted(self._share_ratios.items())
            },
            "pooled": {name(kind): round(m, 4) for kind, m in self._kind_ratios.items()},
        }
