"""Profiling a host's own decode splits before serving: the policy that collects the samples.

``CalibrationPolicy`` drives the `HostLoop` through two phases so that an
``OnlineLatencyModel`` gets enough samples on **every** split, however few iterations the time
allows (a split observed only a handful of times would otherwise stay unfitted):

1. **solo**: decode alone, on the split with the fewest busy solo samples so far (ties: the
   next one in order), until every split has ``solo_target`` of them or ``solo_s`` passed;
2. **beside**: whenever no quantum is in flight, a quantum of ``quantum_examples[i]`` examples
   (sizes alternate, so quantum durations can be fitted as overhead + tokens / rate) on the
   split with the fewest beside samples; decode stays on that split while the quantum runs.

Decode stays on a split for ``block`` iterations at a time, and the first ``settle`` iterations
after it moves to another split are marked ``settle`` in the plan's note and not counted (nor
meant to be fitted): decode-alone samples taken while the split changes every iteration are
several times slower than samples on a held split, and would skew the fit.

``done`` says when every split reached both targets; ``counts()`` reports what was gathered.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gpu_runtime.colocation.policy import CoLocationPolicy
from gpu_runtime.colocation.types import (
    FinetuneLaunch,
    IterationContext,
    IterationPlan,
    IterationRecord,
)


class CalibrationPolicy(CoLocationPolicy):
    """Samples decode alone and beside quanta on every split (see the module docstring)."""

    name = "calibrate"

    def __init__(
        self,
        *,
        solo_target: int = 24,
        beside_target: int = 16,
        solo_s: float = 3.0,
        quantum_examples: tuple[int, ...] = (1, 2),
        block: int = 8,
        settle: int = 2,
    ) -> None:
        if solo_target < 1 or beside_target < 0 or solo_s < 0 or not quantum_examples:
            raise ValueError(
                f"solo_target={solo_target} beside_target={beside_target} solo_s={solo_s} "
                f"quantum_examples={quantum_examples}"
            )
        if block < 1 or not 0 <= settle < block:
            raise ValueError(f"need block >= 1 and 0 <= settle < block, got {block}, {settle}")
        self.block = block
        self.settle = settle
        self._current: int | None = None
        self._moved = False
        self._block_left = 0
        self._settle_left = 0
        self.solo_target = solo_target
        self.beside_target = beside_target
        self.solo_s = solo_s
        self.quantum_examples = quantum_examples
        self.solo: Counter[int | None] = Counter()
        self.beside: Counter[int | None] = Counter()
        self.quanta: Counter[int | None] = Counter()
        self._options: tuple[int | None, ...] = ()
        self._started: float | None = None
        self._launches = 0
        self._cursor = 0

    def _splits(self, ctx: IterationContext) -> tuple[int | None, ...]:
        return ctx.decode_sms_options or (None,)

    def _least(self, counts: Counter[int | None]) -> int | None:
        options = self._options
        self._cursor += 1
        rotated = options[self._cursor % len(options) :] + options[: self._cursor % len(options)]
        return min(rotated, key=lambda d: counts[d])

    def _hold(self, counts: Counter[int | None]) -> tuple[int | None, str]:
        """The split for this decode-alone iteration (kept ``block`` iterations) and "settle"
        while it has just changed."""
        if self._block_left <= 0:
            d = self._least(counts)
            self._block_left = self.block
            self._move(d)
        self._block_left -= 1
        return self._current, self._settling()

    def _move(self, d: int | None) -> None:
        if not self._moved or d != self._current:
            self._settle_left = self.settle
        self._current, self._moved = d, True

    def _settling(self) -> str:
        if self._settle_left > 0:
            self._settle_left -= 1
            return " settle"
        return ""

    def solo_phase(self, now: float) -> bool:
        if self._started is None or not self._options:
            return True
        enough = all(self.solo[d] >= self.solo_target for d in self._options)
        return not enough and now - self._started < self.solo_s

    @property
    def done(self) -> bool:
        """Every split has both targets."""
        return bool(self._options) and all(
            self.solo[d] >= self.solo_target and self.beside[d] >= self.beside_target
            for d in self._options
        )

    def plan(self, ctx: IterationContext) -> IterationPlan:
        self._options = self._splits(ctx)
        if self._started is None:
            self._started = ctx.now
        if ctx.in_flight is not None:
            keep = ctx.in_flight.decode_sms if ctx.decode_sms_options else None
            return IterationPlan(decode_sms=keep, note="calibrate: beside" + self._settling())
        if self.solo_phase(ctx.now) or not ctx.jobs or self.beside_target == 0:
            d, settle = self._hold(self.solo)
            return IterationPlan(decode_sms=d, note="calibrate: solo" + settle)
        if ctx.decode.is_idle:  # samples only count with decode work beside the quantum
            d, settle = self._hold(self.solo)
            return IterationPlan(decode_sms=d, note="calibrate: idle" + settle)
        d = self._least(self.beside)
        self._move(d)
        self._block_left = 0
        job = ctx.jobs[0]
        examples = self.quantum_examples[self._launches % len(self.quantum_examples)]
        self._launches += 1
        launch = FinetuneLaunch(job.job_id, examples * job.max_seq_len)
        note = f"calibrate: launch k={examples}" + self._settling()
        return IterationPlan(decode_sms=d, launches=(launch,), note=note)

    def observe(self, record: IterationRecord) -> None:
        for quantum in record.quanta:
            if quantum.error is None:
                self.quanta[quantum.decode_sms] += 1
        if not (record.decode_batch or record.prefill_tokens) or record.note.endswith("settle"):
            return
        if record.beside_tokens:
            self.beside[record.beside_decode_sms] += 1
        else:
            self.solo[record.decode_sms] += 1

    def counts(self) -> dict[str, Any]:
        """Busy iterations gathered per split (solo and beside a quantum) and quanta run."""
        return {
            str(d): {"solo": self.solo[d], "beside": self.beside[d], "quanta": self.quanta[d]}
            for d in self._options
        }

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "solo_target": self.solo_target,
            "beside_target": self.beside_target,
            "solo_s": self.solo_s,
            "quantum_examples": list(self.quantum_examples),
            "block": self.block,
            "settle": self.settle,
        }
