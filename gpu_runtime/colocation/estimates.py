"""What Harli estimates from observations: its safety margin, quantum durations, the batch ahead.

Kept apart from the policy so each piece can be tested and reused (the host agent reports the
margin; ``QuantumDurations`` also serves capacity estimates).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from gpu_runtime.colocation.types import DecodeSnapshot, JobView, LaunchMode

if TYPE_CHECKING:
    from gpu_runtime.colocation.harli_config import HarliConfig

PRIOR_SOLO_TOKENS_PER_S = 10_000.0
"""Rate assumed for a job before any of its quanta was timed (only ratios between choices
matter until then)."""


def lookahead(decode: DecodeSnapshot) -> DecodeSnapshot:
    """The batch once the waiting requests have joined (at the running requests' mean context;
    their prompts' prefill is already in ``prefill_tokens``)."""
    if not decode.waiting_requests:
        return decode
    mean = decode.context_tokens_total // decode.batch_size if decode.batch_size else 0
    extra = decode.waiting_requests
    return DecodeSnapshot(
        decode.batch_size + extra,
        decode.context_tokens_total + extra * mean,
        decode.context_tokens_max,
        decode.prefill_tokens,
        0,
    )


class PrefillMix:
    """How often busy iterations carry a prefill chunk, and how many tokens it has then
    (exponential moving averages with weight ``smoothing``).

    A step with a chunk costs a large fixed amount more than a pure decode step, so the mean
    iteration time is a mixture of the two kinds, not the time of one step carrying the mean
    chunk (which would be a mixed step every time).

    The share is bias-corrected (the average over the iterations seen so far, weighted as the
    EMA weights them): an EMA started at 0 reads ``1 - (1 - a)^n`` of the true share after
    ``n`` iterations, a third of it after 8 at ``a = 0.05``, so a policy's first iterations
    looked like pure decode."""

    def __init__(
        self, smoothing: float, horizon: int = 32, memory_smoothing: float | None = None
    ) -> None:
        """``horizon``: iterations the mix describes; the prompts already queued (one chunk
        step each at least) raise the chunk share over it at once, before the averages move.
        ``memory_smoothing``: weight of a slower average of the same share; the share used is
        the larger of the two, so a burst's chunk steps are remembered for ~1/weight busy
        iterations after it (the next burst comes while a quantum launched in the lull still
        holds its split); None: the fast average alone."""
        if not 0 < smoothing <= 1 or (
            memory_smoothing is not None and not 0 < memory_smoothing <= 1
        ):
            raise ValueError(
                f"smoothing ({smoothing}) and memory_smoothing ({memory_smoothing}) must be "
                "in (0, 1]"
            )
        self.smoothing = smoothing
        self.horizon = horizon
        self.share = 0.0
        """Recent fraction of busy iterations with a chunk (bias-corrected EMA)."""
        self.remembered = 0.0
        """The larger of ``share`` and the slow average's (``share`` without a memory)."""
        self.tokens = 0.0
        """Chunk tokens of those iterations."""
        self._weights = (smoothing,) if memory_smoothing is None else (smoothing, memory_smoothing)
        self._ema = [0.0] * len(self._weights)
        self._sum = [0.0] * len(self._weights)  # 1 - (1 - a)^n: what the weights sum to

    def observe(self, prefill_tokens: int) -> None:
        a = self.smoothing
        mixed = prefill_tokens > 0
        for i, w in enumerate(self._weights):
            self._ema[i] += w * (float(mixed) - self._ema[i])
            self._sum[i] += w * (1.0 - self._sum[i])
        shares = [e / s for e, s in zip(self._ema, self._sum, strict=True)]
        self.share, self.remembered = shares[0], max(shares)
        if mixed:
            self.tokens = (
                prefill_tokens
                if self.tokens == 0
                else self.tokens + a * (prefill_tokens - self.tokens)
            )

    def mix(self, decode: DecodeSnapshot) -> tuple[tuple[float, DecodeSnapshot], ...]:
        """(weight, snapshot) of the two kinds of iteration after ``decode`` (waiting requests
        joined); weights sum to 1, a kind with no weight is left out. The chunk share is the
        recent one, or what the queued prompts alone will take of the horizon if more."""
        return tuple((recent, snap) for recent, _, snap in self.kinds(decode) if recent > 0)

    def kinds(self, decode: DecodeSnapshot) -> tuple[tuple[float, float, DecodeSnapshot], ...]:
        """(recent weight, remembered weight, snapshot) of each kind of iteration after
        ``decode``: the weights of :meth:`mix`, and the same with the ``remembered`` share; a
        kind with neither weight is left out."""
        ahead = lookahead(decode)
        if ahead.batch_size == 0:  # only prompts in flight: every step carries a chunk
            chunk = max(1, ahead.prefill_tokens, round(self.tokens))
            return ((1.0, 1.0, replace(ahead, prefill_tokens=chunk)),)
        queued = min(1.0, (decode.waiting_requests + (decode.prefill_tokens > 0)) / self.horizon)
        recent, remembered = max(self.share, queued), max(self.remembered, queued)
        tokens = max(1, round(self.tokens) if self.tokens else decode.prefill_tokens)
        out = []
        if recent < 1.0 or remembered < 1.0:
            out.append((1.0 - recent, 1.0 - remembered, replace(ahead, prefill_tokens=0)))
        if recent > 0.0 or remembered > 0.0:
            out.append((recent, remembered, replace(ahead, prefill_tokens=tokens)))
        return tuple(out)


class MarginTracker:
    """The adaptive safety margin (fraction of the SLO)."""

    def __init__(self, config: HarliConfig) -> None:
        self.config = config
        self._errors: deque[tuple[int, float]] = deque()
        """(busy iteration, relative error) of the last ``error_window`` busy iterations."""
        self._recent: deque[tuple[float, float]] = deque(maxlen=config.error_smoothing)
        self._violation = 0.0
        self._breached = False
        self._observed = 0  # observations so far: the cached margin's version
        self._predictions = 0  # observations that carried a prediction
        self._cached: tuple[int, float] | None = None

    def observe(
        self,
        predicted_ms: float | None,
        observed_ms: float,
        tpot_slo_ms: float,
        requests_breached: bool | None = None,
    ) -> None:
        """One busy iteration. Errors are judged on the mean over the last ``error_smoothing``
        iterations: a request's TPOT is a mean over its tokens, so one slow iteration (a
        prefill chunk) matters less than a bias that persists. A breach episode starts when
        ``requests_breached`` (a request finished over the SLO, or one running is headed over
        it) turns true; without request figures, when that iteration mean goes above the SLO.

        An iteration planned without a prediction (``predicted_ms`` None: a plan backoff) adds
        no error but still ages the breach term and still reports breaches: the breach term
        decays per busy iteration, not per prediction, and errors leave the window after
        ``error_window`` busy iterations, predicted or not (the newest ``min_error_samples``
        stay): aged per prediction, a margin raised by a burst would outlast the pause it
        causes, and early errors would hold it up for a whole trace
        (docs/decisions/0014-harli-plan-rules.md)."""
        self._observed += 1
        self._violation *= self.config.violation_decay
        oldest = self._observed - self.config.error_window  # the newest few are kept however old
        while len(self._errors) > self.config.min_error_samples and self._errors[0][0] <= oldest:
            self._errors.popleft()
        if predicted_ms is not None and predicted_ms > 0:
            self._predictions += 1
            self._recent.append((predicted_ms, observed_ms))
            predicted = sum(p for p, _ in self._recent)
            observed = sum(o for _, o in self._recent)
            self._errors.append((self._observed, (observed - predicted) / predicted))
        breached = requests_breached
        if breached is None:
            if not self._recent:
                return
            breached = sum(o for _, o in self._recent) / len(self._recent) > tpot_slo_ms
        if breached and not self._breached:  # once per episode, not per iteration of it
            self._violation += self.config.violation_step
        self._breached = breached

    @property
    def margin(self) -> float:
        """Read every plan: computed once per observation (a sort of the error window)."""
        if self._cached is None or self._cached[0] != self._observed:
            self._cached = (self._observed, self._compute())
        return self._cached[1]

    def _compute(self) -> float:
        cfg = self.config
        if len(self._errors) < cfg.min_error_samples:
            base = cfg.initial_margin
        else:
            ordered = sorted(e for _, e in self._errors)
            index = min(len(ordered) - 1, int(cfg.error_quantile * len(ordered)))
            base = cfg.base_margin + max(ordered[index], 0.0)
            if cfg.initial_margin_predictions:  # few, overlapping errors: a weak quantile
                fading = 1.0 - self._predictions / cfg.initial_margin_predictions
                base = max(base, cfg.initial_margin * fading)
        return min(base + self._violation, cfg.max_margin)


class LaunchOverhead:
    """Extra milliseconds an iteration takes when a concurrent quantum is launched in it.

    Launching a quantum is host work on the loop's thread before the decode step (inputs
    copied, graphs replayed, the optimizer step queued) plus the quantum's first kernels
    meeting decode's: such iterations take longer than the same iteration with the quantum
    already in flight, which the latency model (fitted on iterations, not launches) does not
    see. Learnt as the median of ``observed - predicted`` over the last
    ``window`` launch iterations (``predicted`` without this overhead), never below 0: a median,
    because a launch that captures a new graph shape stalls once for a third of a second, and a
    mean would charge that to the next ``window`` launches
    (docs/decisions/0014-harli-plan-rules.md)."""

    def __init__(self, window: int = 32, prior_ms: float = 0.0) -> None:
        self._excess: deque[float] = deque(maxlen=window)
        self.prior_ms = prior_ms
        self._median: float | None = None

    def observe(self, predicted_ms: float, observed_ms: float) -> None:
        self._excess.append(observed_ms - predicted_ms)
        self._median = None

    @property
    def ms(self) -> float:
        """Asked for every choice of a plan: the median is kept until the next launch."""
        if not self._excess:
            return self.prior_ms
        if self._median is None:
            self._median = max(0.0, statistics.median(self._excess))
        return self._median


class QuantumDurations:
    """Expected quantum duration per choice (decode_sms, mode): ``overhead_ms + tokens / rate``.

    Fitted per choice from its last ``window`` quanta (least squares over token counts when
    at least two sizes were seen, else the prior overhead and the observed mean rate); a choice
    never observed scales the solo rate by the SMs it gets (half the device's throughput when it
    shares all SMs with decode).
    """

    def __init__(self, prior_overhead_ms: float = 0.0, window: int = 32) -> None:
        self.prior_overhead_ms = prior_overhead_ms
        self._obs: dict[tuple[int | None, LaunchMode], deque[tuple[int, float]]] = {}
        self._window = window
        self._fits: dict[tuple[int | None, LaunchMode], tuple[float, float] | None] = {}

    def observe(self, decode_sms: int | None, mode: LaunchMode, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
        key = (decode_sms, mode)
        self._obs.setdefault(key, deque(maxlen=self._window)).append((tokens, ms))
        self._fits.pop(key, None)

    def _fit(self, key: tuple[int | None, LaunchMode]) -> tuple[float, float] | None:
        """(overhead ms, ms per token) of a choice, None if never observed (cached until the
        choice's next observation)."""
        if key not in self._fits:
            self._fits[key] = self._refit(key)
        return self._fits[key]

    def _refit(self, key: tuple[int | None, LaunchMode]) -> tuple[float, float] | None:
        obs = self._obs.get(key)
        if not obs:
            return None
        tokens = [t for t, _ in obs]
        times = [ms for _, ms in obs]
        mean_t, mean_ms = sum(tokens) / len(tokens), sum(times) / len(times)
        var = sum((t - mean_t) ** 2 for t in tokens)
        if var > 0:
            slope = sum((t - mean_t) * (ms - mean_ms) for t, ms in obs) / var
            overhead = mean_ms - slope * mean_t
            if slope > 0 and overhead >= 0:
                return overhead, slope
        overhead = min(self.prior_overhead_ms, 0.9 * mean_ms)
        return overhead, (mean_ms - overhead) / mean_t

    def solo_rate(self, job: JobView) -> float:
        """Tokens/s alone on the device: observed slices, else the job's figure, else a prior."""
        fit = self._fit((None, LaunchMode.AFTER_DECODE))
        if fit is not None:
            return 1e3 / fit[1]
        return job.tokens_per_s_solo or PRIOR_SOLO_TOKENS_PER_S

    def duration_ms(
        self, job: JobView, decode_sms: int | None, mode: LaunchMode, share: float, tokens: int
    ) -> float:
        """Expected duration of a ``tokens``-token quantum (``share``: its fraction of SMs)."""
        fit = self._fit((decode_sms, mode))
        if fit is None:
            effective = 0.5 if mode is LaunchMode.CONCURRENT and share >= 1.0 else share
            rate = self.solo_rate(job) * max(effective, 1e-3)
            return self.prior_overhead_ms + tokens / rate * 1e3
        overhead, per_token = fit
        return overhead + per_token * tokens
