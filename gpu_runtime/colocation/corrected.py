"""A trained latency predictor, corrected online by what the loop itself observes.

The ONNX predictor (``gpu_runtime.predictor``) is trained offline on the GPU's profile: it knows
how latency moves with batch, context, prefill chunk, SM share and the quantum beside decode,
but not this host's constant offsets (the loop's own host work per iteration, a different H200,
an engine changed since the profile). :class:`CorrectedLatencyModel` multiplies its prediction
by ``sum(observed) / sum(predicted)`` over recent iterations of the same kind (decode SM share,
where the quantum beside decode ran: none, on SMs of its own or shared with decode on the whole
device as launched (``BESIDE``), or on SMs decode moved onto after the launch (``OVERLAP``, a
placement the predictor's profile never timed); the size class of the step's prefill chunk
tokens: none, <= 64, <= 128, <= 256, more), falling back to the ratio over every share of that
kind, then to the same two with any chunk size (a class not yet seen), then to 1. Chunk steps
get a ratio per size class because the engine replays them from graphs per token bucket: their
cost moves with the padded bucket in steps a model trained on other chunk sizes can miss in
either direction, and one ratio over all sizes would under-predict the big ones. A ratio of
sums, not a median: a request's TPOT is a mean over its iterations, so occasional slow ones (a
stall, a launch) must raise the prediction as much as they raise that mean; one iteration counts
at most ``ratio_bounds[1]`` times its prediction. Targets are whole iteration times
(``IterationRecord.iteration_ms``), as for ``OnlineLatencyModel``.

Observations made before serving (a calibration phase, decode alone on a trace) are **seeds**
(``observe(..., seed=True)``): a key's ratio is taken over its seeds and served iterations
together until it has ``min_samples`` served ones, then over those alone, and a ratio of served
iterations alone, of any share, is preferred to one with seeds (``ratio``). A calibration phase
runs another load than the one served (the benchmark's is a high-load trace) and a ratio is
one number per kind whatever the batch, so seeds kept beside served iterations would outweigh
them for dozens of iterations (docs/decisions/0012-latency-model.md).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from gpu_runtime.colocation.latency_model import DecodeLatencyModel, Pair, predict_many
from gpu_runtime.colocation.online import record_observation
from gpu_runtime.colocation.types import IterationRecord
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum

Kind = tuple[int, int]
"""(where a quantum ran beside decode: ``ALONE``, ``BESIDE`` or ``OVERLAP``; the step's chunk
class: 0 none, 1 <= 64 tokens, 2 <= 128, 3 <= 256, 4 more); class -1 stands for any chunk (the
coarse fallback)."""

ALONE, BESIDE, OVERLAP = 0, 1, 2
"""Placements of the quantum beside a decode step: none; on SMs of its own (a split) or both on
the whole device as launched; on SMs decode shares with it after moving to a wider split."""

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


PLACEMENT_NAMES = ("alone", "beside", "overlap")


class _Samples:
    """(predicted, observed) pairs of one key: seeds and served iterations, the last ``window``
    of each, with their running sums (a ratio per observation, no pass over the window)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.seeds: deque[tuple[float, float]] = deque()
        self.served: deque[tuple[float, float]] = deque()
        self._sums = {True: [0.0, 0.0], False: [0.0, 0.0]}

    def add(self, pair: tuple[float, float], seed: bool) -> None:
        pairs, sums = (self.seeds if seed else self.served), self._sums[seed]
        pairs.append(pair)
        sums[0] += pair[0]
        sums[1] += pair[1]
        if len(pairs) > self.window:
            old = pairs.popleft()
            sums[0] -= old[0]
            sums[1] -= old[1]

    def ratio(self, min_samples: int) -> tuple[float, bool] | None:
        """(ratio, whether served iterations alone gave it): over the served iterations once
        there are ``min_samples`` of them, before that over seeds and served together; None
        below ``min_samples`` in all."""
        served, seeds = self._sums[False], self._sums[True]
        if len(self.served) >= min_samples:
            return served[1] / served[0], True
        if len(self.served) + len(self.seeds) >= min_samples:
            return (served[1] + seeds[1]) / (served[0] + seeds[0]), False
        return None


def placement(iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> int:
    """``ALONE``, ``BESIDE`` or ``OVERLAP`` (see ``Kind``)."""
    if quantum is None or quantum.tokens <= 0:
        return ALONE
    decode, finetune = iteration.decode_sm_share, quantum.sm_share
    if decode + finetune <= 1.0 + 1e-3 or min(decode, finetune) >= 1.0 - 1e-3:
        return BESIDE
    return OVERLAP


def _kind(iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> Kind:
    return placement(iteration, quantum), chunk_class(iteration.prefill_chunk_tokens)


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
        an engine whose chunk steps got several times cheaper than its predictor's profile,
        e.g. after a change of chunk attention)."""
        if window < 1 or min_samples < 1 or not 0 < ratio_bounds[0] < 1 < ratio_bounds[1]:
            raise ValueError(
                f"window={window}, min_samples={min_samples} must be >= 1 and ratio_bounds="
                f"{ratio_bounds} must bracket 1 above 0"
            )
        self.base = base
        self.window = window
        self.min_samples = min_samples
        self.ratio_bounds = ratio_bounds
        # Per key: (seeds, served iterations), each the last ``window``.
        self._pairs: dict[tuple[float, Kind], _Samples] = defaultdict(lambda: _Samples(window))
        self._pooled: dict[Kind, _Samples] = defaultdict(lambda: _Samples(window))
        self._bases: dict[Pair, float] = {}
        self._share_ratios: dict[tuple[float, Kind], tuple[float, bool]] = {}
        self._kind_ratios: dict[Kind, tuple[float, bool]] = {}

    def ratio(self, share: float, kind: Kind) -> float:
        """The correction applied to iterations of ``kind`` on ``share`` of the SMs: the first
        of (this share, every share) x (the kind, any chunk size) that has one, taken first
        among ratios of served iterations alone, then among those with seeds. Serving on
        another split says more about this host now than seeds on this one: a split harli
        never takes would otherwise keep a seeded ratio for ever, however wrong (see the module
        docstring)."""
        share = round(share, 4)
        fallback: float | None = None
        for key in (kind, _coarse(kind)):
            for cached in (self._share_ratios.get((share, key)), self._kind_ratios.get(key)):
                if cached is None:
                    continue
                if cached[1]:
                    return cached[0]
                if fallback is None:
                    fallback = cached[0]
        return 1.0 if fallback is None else fallback

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        base = self.base.predict_ms(iteration, quantum)
        self._remember(((iteration, quantum),), (base,))
        return base * self.ratio(iteration.decode_sm_share, _kind(iteration, quantum))

    def predict_many(self, pairs: Sequence[Pair]) -> list[float]:
        """``predict_ms`` of every pair, the base model asked once (``predict_many``)."""
        bases = predict_many(self.base, pairs)
        self._remember(pairs, bases)
        return [
            b * self.ratio(it.decode_sm_share, _kind(it, q))
            for b, (it, q) in zip(bases, pairs, strict=True)
        ]

    def _remember(self, pairs: Sequence[Pair], bases: Sequence[float]) -> None:
        """Keep the base predictions of the latest plans: the iteration the loop then runs is
        usually one of them, and ``observe`` needs its base prediction (one model call per
        iteration less on the token path)."""
        if len(self._bases) > 1024:
            self._bases.clear()
        self._bases.update(zip(pairs, bases, strict=True))

    def observe(
        self,
        iteration: DecodeIteration,
        quantum: FinetuneQuantum | None,
        observed_ms: float,
        *,
        seed: bool = False,
    ) -> None:
        """Add one observed iteration (its prediction by ``base`` is recomputed here); ``seed``:
        observed before serving (see the module docstring)."""
        if observed_ms <= 0:
            return
        predicted = self._bases.get((iteration, quantum))
        if predicted is None:
            predicted = self.base.predict_ms(iteration, quantum)
        if not predicted > 0:
            return
        low, high = self.ratio_bounds
        clipped = min(max(observed_ms, low * predicted), high * predicted)
        fine = _kind(iteration, quantum)
        share = round(iteration.decode_sm_share, 4)
        for kind in {fine, _coarse(fine)}:
            per_share, pooled = self._pairs[share, kind], self._pooled[kind]
            per_share.add((predicted, clipped), seed)
            pooled.add((predicted, clipped), seed)
            ratio = per_share.ratio(self.min_samples)
            if ratio is not None:
                self._share_ratios[share, kind] = ratio
            ratio = pooled.ratio(self.min_samples)
            if ratio is not None:
                self._kind_ratios[kind] = ratio

    def observe_record(
        self, record: IterationRecord, seq_len: int = 512, rank: int = 16, *, seed: bool = False
    ) -> None:
        """Add a loop record (ignored when decode was idle)."""
        observation = record_observation(record, seq_len, rank)
        if observation is not None:
            self.observe(*observation, seed=seed)

    def describe(self) -> dict[str, Any]:
        """The learnt ratios (for results and logs)."""

        def name(kind: Kind) -> str:
            beside, size = kind
            step = {0: "decode", -1: "prefill"}.get(size)
            if step is None:
                bounds = (*CHUNK_CLASS_TOKENS, None)
                top = bounds[size - 1]
                step = f"prefill<={top}" if top is not None else f"prefill>{bounds[-2]}"
            return f"{PLACEMENT_NAMES[beside]}/{step}"

        return {
            "per_share": {
                f"{share}/{name(kind)}": round(m, 4)
                for (share, kind), (m, _) in sorted(self._share_ratios.items())
            },
            "pooled": {name(kind): round(m, 4) for kind, (m, _) in self._kind_ratios.items()},
            "seeded": sorted(
                [
                    f"{share}/{name(kind)}"
                    for (share, kind), (_, s) in self._share_ratios.items()
                    if not s
                ]
                + [name(kind) for kind, (_, s) in self._kind_ratios.items() if not s]
            ),
        }
