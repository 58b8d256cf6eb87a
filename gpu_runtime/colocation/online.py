"""A stage-1/2 decode latency model fitted from the loop's own iteration records.

Used where no trained predictor artifact exists (and by ``bench.colocate`` when it profiles
before the traces): for every decode split ``s`` (decode SM count) it fits, by ridge-regularised
least squares over the iterations observed **without** a finetune quantum beside decode,

    stage1_s(ms) = a_s + b_s * batch + c_s * context_kilotokens + d_s * prefill_kilotokens

(b, c, d >= 0: a slope fitted negative is dropped),

and, from iterations **with** a quantum beside decode, an interference ratio per
(split, whether the quantum had its own SMs): the median of observed / stage1_s. A split with
too few samples of its own falls back to the ``prior`` model; without one, to a pooled fit over
every split's samples (the four features above, each also divided by the decode SM share), and
before even that has ``min_samples``, to the nearest fitted split scaled by SM share. Targets
are whole-iteration times (``IterationRecord.iteration_ms``), i.e. the token-to-token latency
requests see, host work included.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np

from gpu_runtime.colocation.latency_model import DecodeLatencyModel
from gpu_runtime.colocation.types import IterationRecord, LaunchMode
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum

_SHARE_KEY_DIGITS = 4


def _key(share: float) -> float:
    return round(share, _SHARE_KEY_DIGITS)


def _features(iteration: DecodeIteration) -> list[float]:
    return [
        1.0,
        float(iteration.batch_size),
        iteration.context_tokens_total / 1e3,
        iteration.prefill_chunk_tokens / 1e3,
    ]


@dataclass
class _Fit:
    coef: tuple[float, float, float, float]
    samples: int

    def __call__(self, iteration: DecodeIteration) -> float:
        a, b, c, d = self.coef  # plain floats: this runs dozens of times per decode iteration
        return (
            a
            + b * iteration.batch_size
            + c * iteration.context_tokens_total / 1e3
            + d * iteration.prefill_chunk_tokens / 1e3
        )


class OnlineLatencyModel:
    """Stage-1/2 model per decode split, refitted as observations arrive (see module doc)."""

    quantum_size_independent = True
    """Stage 2 is stage 1 times a ratio per (split, disjoint), whatever the quantum's size
    (policies may ask once per split)."""

    def __init__(
        self,
        prior: DecodeLatencyModel | None = None,
        *,
        window: int = 2000,
        min_samples: int = 8,
        ridge: float = 1e-3,
        refit_every: int = 16,
    ) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self.ridge = ridge
        self.refit_every = refit_every
        self._solo: dict[float, deque[tuple[list[float], float]]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._ratios: dict[tuple[float, bool], deque[float]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._pending: list[tuple[DecodeIteration, FinetuneQuantum | None, float]] = []
        self._fits: dict[float, _Fit] = {}
        self._ratio_cache: dict[tuple[float, bool], tuple[int, float]] = {}
        self._ratio_counts: dict[tuple[float, bool], int] = defaultdict(int)
        self._since_fit: dict[float, int] = defaultdict(int)
        self._pooled: np.ndarray | None = None
        self._pooled_at = 0
        self._solo_total = 0

    # ---- observations -----------------------------------------------------------------------
    def observe(
        self, iteration: DecodeIteration, quantum: FinetuneQuantum | None, observed_ms: float
    ) -> None:
        """Add one observed iteration (quantum None: nothing ran beside decode)."""
        if observed_ms <= 0:
            return
        key = _key(iteration.decode_sm_share)
        if quantum is None or quantum.tokens == 0:
            self._solo[key].append((_features(iteration), observed_ms))
            self._since_fit[key] += 1
            self._solo_total += 1
            if key not in self._fits or self._since_fit[key] >= self.refit_every:
                self._refit(key)
            # The pooled fit serves thin splits; refitted less often as samples accumulate.
            if self._solo_total - self._pooled_at >= max(self.refit_every, self._pooled_at // 4):
                self._refit_pooled()
            return
        self._pending.append((iteration, quantum, observed_ms))
        self._drain_pending()

    def observe_record(self, record: IterationRecord, seq_len: int = 512, rank: int = 16) -> None:
        """Add a loop record (ignored when decode was idle)."""
        observation = record_observation(record, seq_len, rank)
        if observation is not None:
            self.observe(*observation)

    def _drain_pending(self) -> None:
        keep = []
        for iteration, quantum, observed in self._pending:
            key = _key(iteration.decode_sm_share)
            if key in self._fits or (self.prior is None and self._pooled is not None):
                assert quantum is not None
                solo = self._stage1(iteration)
                ratio_key = (key, _disjoint(iteration, quantum))
                self._ratios[ratio_key].append(observed / solo)
                self._ratio_counts[ratio_key] += 1
            else:
                keep.append((iteration, quantum, observed))
        self._pending = keep[-1000:]

    def _solve(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Ridge least squares with every coefficient but the intercept (column 0) kept >= 0:
        latency never falls as the batch, the context or the prefill grows, and a negative
        slope fitted on one load range extrapolates wildly to another. A coefficient that
        comes out negative is fixed at 0 and the rest refitted."""
        scale = np.maximum(np.abs(x).max(axis=0), 1e-9)
        xs = x / scale
        free = np.ones(xs.shape[1], dtype=bool)
        coef = np.zeros(xs.shape[1])
        for _ in range(xs.shape[1]):
            sub = xs[:, free]
            gram = sub.T @ sub + self.ridge * len(y) * np.eye(sub.shape[1])
            coef = np.zeros(xs.shape[1])
            coef[free] = np.linalg.solve(gram, sub.T @ y)
            negative = [i for i in range(1, xs.shape[1]) if free[i] and coef[i] < 0]
            if not negative:
                break
            free[min(negative, key=lambda i: coef[i])] = False
        coef[~free] = 0.0
        return np.asarray(coef / scale)

    def _refit(self, key: float) -> None:
        samples = self._solo[key]
        self._since_fit[key] = 0
        if len(samples) < self.min_samples:
            return
        x = np.array([f for f, _ in samples], dtype=np.float64)
        y = np.array([ms for _, ms in samples], dtype=np.float64)
        a, b, c, d = (float(v) for v in self._solve(x, y))
        self._fits[key] = _Fit((a, b, c, d), len(y))
        self._drain_pending()

    def _refit_pooled(self) -> None:
        """One fit over every split: features and features / share (see the module doc)."""
        rows = [(f, share, ms) for share, samples in self._solo.items() for f, ms in samples]
        if len(rows) < self.min_samples:
            return
        x = np.array([[*f, *(v / s for v in f)] for f, s, _ in rows], dtype=np.float64)
        y = np.array([ms for _, _, ms in rows], dtype=np.float64)
        self._pooled = self._solve(x, y)
        self._pooled_at = self._solo_total
        self._drain_pending()

    def _pooled_ms(self, iteration: DecodeIteration) -> float:
        assert self._pooled is not None
        f = _features(iteration)
        share = max(iteration.decode_sm_share, 1e-3)
        return float(np.dot(self._pooled, [*f, *(v / share for v in f)]))

    def describe(self) -> dict[str, dict[str, object]]:
        """Per fitted share: the stage-1 coefficients (ms: intercept, per sequence, per 1k
        context tokens, per 1k prefill tokens) and the samples they came from."""
        return {
            str(share): {"coef_ms": [round(c, 4) for c in fit.coef], "samples": fit.samples}
            for share, fit in sorted(self._fits.items())
        }

    def samples(self) -> dict[float, int]:
        """Solo (stage-1) samples per decode SM share."""
        return {share: len(s) for share, s in sorted(self._solo.items())}

    def ratio_samples(self) -> dict[str, int]:
        """Interference samples per (share, disjoint)."""
        return {f"{s}/{'own' if d else 'shared'}": n for (s, d), n in self._ratio_counts.items()}

    @property
    def pooled(self) -> bool:
        """Whether the pooled all-split fit exists (the fallback for thin splits)."""
        return self._pooled is not None

    # ---- prediction -------------------------------------------------------------------------
    @property
    def fitted_shares(self) -> list[float]:
        return sorted(self._fits)

    def _stage1(self, iteration: DecodeIteration) -> float:
        key = _key(iteration.decode_sm_share)
        fit = self._fits.get(key)
        if fit is not None:
            return max(fit(iteration), 0.1)
        if self.prior is not None:
            return self.prior.predict_ms(iteration, None)
        if self._pooled is not None:
            return max(self._pooled_ms(iteration), 0.1)
        if not self._fits:
            raise LookupError(
                f"no split has {self.min_samples} samples and there is no prior model "
                f"(samples per share: {self.samples()})"
            )
        nearest = min(self._fits, key=lambda s: abs(s - key))
        return max(self._fits[nearest](iteration), 0.1) * (nearest / key) ** 0.5

    def interference_ratio(self, share: float, disjoint: bool) -> float | None:
        """Median observed / stage-1 with a quantum beside decode (None: never observed).

        Recomputed after every ``refit_every`` new ratios (and on the first few), not per call.
        """
        key = (_key(share), disjoint)
        ratios = self._ratios.get(key)
        if not ratios:
            return None
        count = self._ratio_counts[key]
        cached = self._ratio_cache.get(key)
        stale = cached is None or (
            count != cached[0]
            and (count - cached[0] >= self.refit_every or count < self.min_samples)
        )
        if stale:
            value = float(np.median(np.fromiter(ratios, dtype=np.float64)))
            self._ratio_cache[key] = (count, value)
            return value
        assert cached is not None
        return cached[1]

    def predict_ms(self, iteration: DecodeIteration, quantum: FinetuneQuantum | None) -> float:
        solo = self._stage1(iteration)
        if quantum is None or quantum.tokens == 0:
            return solo
        ratio = self.interference_ratio(iteration.decode_sm_share, _disjoint(iteration, quantum))
        if ratio is not None:
            return solo * max(ratio, 1.0)
        if self.prior is not None:
            solo_prior = self.prior.predict_ms(iteration, None)
            return solo * self.prior.predict_ms(iteration, quantum) / solo_prior
        return solo * (1.1 if _disjoint(iteration, quantum) else 2.0)


def _disjoint(iteration: DecodeIteration, quantum: FinetuneQuantum) -> bool:
    return quantum.sm_share + iteration.decode_sm_share <= 1.0 + 1e-9


def record_observation(
    record: IterationRecord, seq_len: int, rank: int
) -> tuple[DecodeIteration, FinetuneQuantum | None, float] | None:
    """(the iteration, the quantum beside decode, decode's observed ms) of a loop record; None
    when decode was idle. A quantum run after decode is part of the iteration's time but not of
    decode's latency, so it is taken out."""
    if not (record.decode_batch or record.prefill_tokens):
        return None
    total = record.total_sms
    share = 1.0 if not total or record.decode_sms is None else record.decode_sms / total
    iteration = DecodeIteration(
        record.decode_batch,
        record.context_tokens_total,
        record.context_tokens_max,
        record.prefill_tokens,
        share,
    )
    quantum = None
    if record.beside_tokens:
        tokens, launch_sms = record.beside_tokens, record.beside_decode_sms
        quantum = beside_quantum(tokens, launch_sms, total, seq_len, rank)
    after = sum(q.duration_ms for q in record.quanta if q.mode is LaunchMode.AFTER_DECODE)
    return iteration, quantum, record.iteration_ms - after


def beside_quantum(
    tokens: int, launch_decode_sms: int | None, total_sms: int | None, seq_len: int, rank: int
) -> FinetuneQuantum:
    """The stage-2 row of a quantum launched with split ``launch_decode_sms``."""
    if not total_sms or launch_decode_sms is None or launch_decode_sms >= total_sms:
        share = 1.0
    else:
        share = (total_sms - launch_decode_sms) / total_sms
    return FinetuneQuantum(
        tokens=tokens, seq_len=max(seq_len, 1), lora_rank=rank, backward=True, sm_share=share
    )
