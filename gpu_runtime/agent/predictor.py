"""The host's latency predictor and what the control plane learns from it.

* :func:`load_host_predictor` opens the artifact for this host (a directory, or the latest one
  for `<gpu key>/<base model>` under an artifact root), refusing one trained for another model
  shape; its version and held-out accuracy go out with every heartbeat.
* :func:`estimate_harvest` turns the predictor into the figure placement ranks hosts by: the
  finetune tokens/s this host can harvest at its recent decode load without breaking the TPOT
  SLO. Decode iterations come every SLO period at most; per period finetune can use
  - the time decode leaves (time slicing): `1 - alone_ms / slo`, with `alone_ms` the stage-1
    prediction on the whole device; or
  - a share `s` of the SMs for the whole period (spatial split), when the stage-2 prediction of
    decode on `1 - s` of the SMs beside a quantum on `s` stays within the SLO; only on a host
    whose sharing splits SMs (green contexts), with the splits it created.
  The best of these fractions times the host's solo finetune rate is the estimate. The solo rate
  is measured (quanta that ran alone) once a job has run here, else a roofline prior from the
  artifact's hardware: `flops/s x 0.5 / (4 x parameters)` (LoRA forward 2N, backward 2N with
  frozen base weights; 50% of peak is within 15% of the measured solo rate at micro-batch 4,
  `bench/results/finetune-h200-20261130.json`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.colocation import DecodeLatencyModel, DecodeSnapshot, StagedPredictorAdapter
from gpu_runtime.engine import Engine
from gpu_runtime.predictor.artifact import ArtifactError, artifact_dir, list_artifacts
from gpu_runtime.predictor.runtime import LatencyPredictor
from gpu_runtime.predictor.schema import (
    DecodeIteration,
    FinetuneQuantum,
    ModelShape,
    predictor_model_key,
)

logger = logging.getLogger(__name__)

QUANTUM_EXAMPLES = 4
"""Examples per finetune quantum assumed for the stage-2 prediction."""
SLO_MARGIN = 0.1
"""Fraction of the SLO kept free (prediction error, scheduling)."""
PRIOR_MFU = 0.5
LORA_FLOPS_PER_PARAM_TOKEN = 4
IDLE_PROBE_CONTEXT = 512
"""With no decode load, the estimate assumes one request of this context is decoding."""


def device_gpu_key(device: str) -> str:
    """The artifact tree's GPU key for `device` ("h200" for an NVIDIA H200; "cpu")."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(torch.device(device))).split()[-1].lower()


@dataclass(frozen=True)
class PredictorInfo:
    """The latency predictor a host loaded: its artifact version and held-out accuracy."""

    version: str
    mape: float | None
    """Stage-2 (co-located) mean absolute percentage error as a fraction, else stage 1's."""


@dataclass
class HostPredictor:
    """A loaded artifact, the latency model policies query, and what heartbeats report."""

    predictor: LatencyPredictor
    info: PredictorInfo

    @property
    def latency_model(self) -> DecodeLatencyModel:
        return StagedPredictorAdapter(self.predictor.stage1, self.predictor.stage2)

    @property
    def flops_per_s(self) -> float | None:
        hardware = self.predictor.metadata.raw.get("hardware") or {}
        per_ms = hardware.get("flops_per_ms")
        return float(per_ms) * 1e3 if per_ms else None


def _mape(metrics: dict[str, Any]) -> float | None:
    for stage in ("stage2", "stage1"):
        value = (metrics.get(stage) or {}).get("harli", {}).get("mape")
        if value is not None:
            return float(value)
    return None


def load_host_predictor(path: Path, *, engine: Engine, base_model: str) -> HostPredictor:
    """Open the artifact at `path`: an artifact directory, or a root holding
    `<gpu key>/<model>/<version>/` (`<model>-tp<t>` for an engine group of t GPUs: predictors
    are profiled per tensor-parallel degree), where the latest version for `base_model` is
    taken, else the latest one under this GPU trained for the served model's shape (the same model
    registered under another name). ArtifactError (a RuntimeError) when there is none, or it
    was trained for another model shape."""
    directory = Path(path)
    degree = engine.runner.model.parallel.size
    shape = ModelShape.from_model_config(engine.model_config, base_model, degree)
    if not (directory / "metadata.json").is_file():
        gpu = device_gpu_key(engine.config.device)
        try:
            directory = artifact_dir(directory, gpu, predictor_model_key(base_model, degree))
        except ArtifactError:
            same_shape = [
                meta
                for meta in list_artifacts(directory)
                if meta.gpu_key == gpu and not meta.model_shape.mismatches(shape)
            ]
            if not same_shape:
                raise
            directory = max(same_shape, key=lambda meta: meta.version).path
    predictor = LatencyPredictor.load(directory, model_shape=shape)
    info = PredictorInfo(predictor.version, _mape(predictor.metadata.metrics))
    return HostPredictor(predictor, info)


@dataclass(frozen=True)
class HarvestEstimate:
    """Harvestable finetune throughput at a decode load (see the module docstring)."""

    tokens_per_s: float
    source: str
    """"predictor" (this estimate) or "measured" (the host has no predictor: the finetune
    tokens/s it achieved recently)."""
    finetune_fraction: float | None = None
    """Share of the device finetune can use per SLO period, 0..1."""
    mode: str | None = None
    """"slice", "spatial <share>", or "none"."""
    solo_tokens_per_s: float | None = None
    solo_source: str | None = None
    """"measured" or "prior"."""
    decode_alone_ms: float | None = None
    measured_tokens_per_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def estimate_harvest(
    latency: DecodeLatencyModel,
    load: DecodeSnapshot,
    *,
    tpot_slo_ms: float,
    solo_tokens_per_s: float,
    solo_source: str,
    finetune_shares: tuple[float, ...] = (),
    seq_len: int = 512,
    lora_rank: int = 16,
) -> HarvestEstimate:
    """See the module docstring. `load` is the decode work of a typical iteration;
    `finetune_shares` the SM shares a spatial split can give finetune (none: time slicing)."""
    if load.batch_size == 0 and load.prefill_tokens == 0:
        load = DecodeSnapshot.from_contexts([IDLE_PROBE_CONTEXT])
    bound = tpot_slo_ms * (1.0 - SLO_MARGIN)

    def iteration(share: float) -> DecodeIteration:
        return DecodeIteration(
            load.batch_size,
            load.context_tokens_total,
            load.context_tokens_max,
            load.prefill_tokens,
            share,
        )

    alone = latency.predict_ms(iteration(1.0), None)
    best, mode = max(0.0, 1.0 - alone / bound), "slice"
    for share in finetune_shares:
        quantum = FinetuneQuantum(QUANTUM_EXAMPLES * seq_len, seq_len, lora_rank, True, share)
        if share > best and latency.predict_ms(iteration(1.0 - share), quantum) <= bound:
            best, mode = share, f"spatial {share:g}"
    if best <= 0.0:
        mode = "none"
    return HarvestEstimate(
        tokens_per_s=solo_tokens_per_s * best,
        source="predictor",
        finetune_fraction=best,
        mode=mode,
        solo_tokens_per_s=solo_tokens_per_s,
        solo_source=solo_source,
        decode_alone_ms=alone,
    )


def prior_solo_tokens_per_s(flops_per_s: float, parameters: int) -> float:
    """Roofline prior of LoRA training tokens/s on the whole device (module docstring)."""
    return flops_per_s * PRIOR_MFU / (LORA_FLOPS_PER_PARAM_TOKEN * parameters)


class HarvestTracker:
    """The heartbeat's harvest figure, refreshed once per metrics interval (loop thread).

    `observe` every iteration record: it sums the decode load (for the estimate) and pairs
    predicted with observed decode latency (for the predictor-accuracy view). `interval_done`
    updates the measured rate (an EMA of finetune tokens/s over intervals that trained), makes
    the new estimate, and returns the interval's mean predicted and observed latency.
    """

    def __init__(
        self,
        predictor: HostPredictor | None,
        *,
        tpot_slo_ms: float,
        parameters: int,
        finetune_shares: tuple[float, ...] = (),
    ) -> None:
        """`finetune_shares`: the SM shares the host's spatial splits give finetune."""
        self.predictor = predictor
        self.finetune_shares = finetune_shares
        self.tpot_slo_ms = tpot_slo_ms
        self.parameters = parameters
        self.measured_tokens_per_s = 0.0
        self.solo_tokens_per_s: float | None = None
        self._reset()
        self.estimate = self._estimate(DecodeSnapshot.from_contexts([]))

    def _reset(self) -> None:
        self._iterations = 0
        self._batch = self._context = self._context_max = self._prefill = 0
        self._pairs = 0
        self._predicted_ms = self._observed_ms = 0.0

    def observe(self, record: Any) -> None:
        if record.decode_batch or record.prefill_tokens:
            self._iterations += 1
            self._batch += record.decode_batch
            self._context += record.context_tokens_total
            self._context_max += record.context_tokens_max
            self._prefill += record.prefill_tokens
        if record.predicted_ms is not None and record.decode_tokens:
            self._pairs += 1
            self._predicted_ms += record.predicted_ms
            self._observed_ms += record.observed_ms

    def _mean_load(self) -> DecodeSnapshot:
        n = self._iterations
        if n == 0:
            return DecodeSnapshot.from_contexts([])
        batch = round(self._batch / n)
        context_max = round(self._context_max / n)
        return DecodeSnapshot(
            batch,
            min(round(self._context / n), batch * context_max),
            context_max,
            round(self._prefill / n),
        )

    def interval_done(
        self, finetune_tokens_per_s: float | None, solo_rates: list[float]
    ) -> tuple[float | None, float | None]:
        """New estimate from this interval; returns its (predicted, observed) mean ms."""
        if finetune_tokens_per_s:
            self.measured_tokens_per_s = (
                0.7 * self.measured_tokens_per_s + 0.3 * finetune_tokens_per_s
            )
        if solo_rates:
            self.solo_tokens_per_s = max(solo_rates)
        self.estimate = self._estimate(self._mean_load())
        pair = (
            (self._predicted_ms / self._pairs, self._observed_ms / self._pairs)
            if self._pairs
            else (None, None)
        )
        self._reset()
        return pair

    def _estimate(self, load: DecodeSnapshot) -> HarvestEstimate:
        measured = self.measured_tokens_per_s
        fallback = HarvestEstimate(measured, "measured", measured_tokens_per_s=measured)
        if self.predictor is None:
            return fallback
        if self.solo_tokens_per_s:
            solo, source = self.solo_tokens_per_s, "measured"
        elif self.predictor.flops_per_s:
            solo = prior_solo_tokens_per_s(self.predictor.flops_per_s, self.parameters)
            source = "prior"
        else:
            return fallback
        try:
            estimate = estimate_harvest(
                self.predictor.latency_model,
                load,
                tpot_slo_ms=self.tpot_slo_ms,
                solo_tokens_per_s=solo,
                solo_source=source,
                finetune_shares=self.finetune_shares,
            )
        except ValueError as exc:  # a load outside the predictor's schema
            logger.warning("harvest estimate failed, reporting the measured rate: %s", exc)
            return fallback
        return HarvestEstimate(**{**asdict(estimate), "measured_tokens_per_s": measured})
