"""The host's latency predictor: its version and accuracy in heartbeats, the harvest estimate
placement ranks hosts by, and clear refusals of artifacts for other models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.agent.cli import build_policy
from gpu_runtime.agent.predictor import (
    HarvestTracker,
    estimate_harvest,
    load_host_predictor,
)
from gpu_runtime.agent.serving import EngineSpec
from gpu_runtime.colocation import AnalyticLatencyModel, DecodeSnapshot, HarliPolicy, NaivePolicy
from gpu_runtime.colocation.corrected import CorrectedLatencyModel
from gpu_runtime.colocation.harli_config import GPU_LAUNCH_OVERHEAD_PRIOR_MS, GPU_MAX_QUANTUM_MS
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.contract.storage import LocalStorage
from gpu_runtime.engine import EngineConfig
from gpu_runtime.predictor.artifact import ArtifactError
from tests.gpu_runtime.agent.artifacts import ROOT, VERSION, write_tiny_artifact
from tests.gpu_runtime.agent.conftest import Reports, make_runtime

COMMITTED = ROOT / "predictor_models/artifacts"


def _engine(model_dir: Path) -> Any:
    return EngineSpec(EngineConfig(num_kv_blocks=16, max_model_len=64)).build(model_dir).engine


@pytest.fixture(scope="module")
def tiny_artifacts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact root with `cpu/tiny/<version>` for the tiny model's shape."""
    return write_tiny_artifact(tiny_model_dir, tmp_path_factory.mktemp("predictors"))


def test_heartbeat_reports_the_predictor_and_its_harvest_estimate(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path, tiny_artifacts: Path
) -> None:
    host = make_runtime(tiny_model_dir, storage, tmp_path / "w", Reports(), tiny_artifacts)
    fields = host.runtime.status().heartbeat_fields()
    assert fields["predictor_version"] == VERSION
    assert fields["predictor_mape"] == pytest.approx(0.032)  # stage 2's held-out MAPE
    harvest = fields["harvest"]
    assert harvest["source"] == "predictor" and harvest["solo_source"] == "prior"
    assert 0 < harvest["finetune_fraction"] <= 1 and harvest["decode_alone_ms"] > 0
    assert fields["harvestable_tokens_per_s"] == pytest.approx(
        harvest["solo_tokens_per_s"] * harvest["finetune_fraction"]
    )


def test_an_artifact_is_found_by_shape_under_another_model_name(
    tiny_model_dir: Path, tiny_artifacts: Path
) -> None:
    engine = _engine(tiny_model_dir)
    found = load_host_predictor(tiny_artifacts, engine=engine, base_model="my-tiny")
    assert found.info.version == VERSION
    assert found.predictor.metadata.path.parent.name == "tiny"


def test_artifacts_of_other_models_are_refused(
    tiny_model_dir: Path, storage: LocalStorage, tmp_path: Path
) -> None:
    engine = (
        EngineSpec(EngineConfig(num_kv_blocks=16, max_model_len=64)).build(tiny_model_dir).engine
    )
    h200 = sorted((COMMITTED / "h200" / "llama3-8b").iterdir())[-1]
    with pytest.raises(ArtifactError, match="the served model differs"):
        load_host_predictor(h200, engine=engine, base_model="tiny")
    with pytest.raises(ArtifactError, match="no predictor artifact for gpu 'cpu', model 'tiny'"):
        load_host_predictor(COMMITTED, engine=engine, base_model="tiny")
    # The agent runs without one: no version, and the measured harvest rate.
    host = make_runtime(tiny_model_dir, storage, tmp_path / "w", Reports(), COMMITTED)
    fields = host.runtime.status().heartbeat_fields()
    assert fields["predictor_version"] is None and fields["predictor_mape"] is None
    assert fields["harvest"] == {"tokens_per_s": 0.0, "source": "measured",
                                 "measured_tokens_per_s": 0.0}  # fmt: skip


def test_estimate_takes_the_best_of_time_slicing_and_spatial_shares() -> None:
    model = AnalyticLatencyModel()  # 5 ms + 0.02 ms/seq + 0.05 us/context token
    load = DecodeSnapshot.from_contexts([512] * 8)
    alone = model.predict_ms(decode_iteration(load, 1.0), None)
    shares = (0.25, 0.5, 0.75)  # what splits of 99/66/33 of 132 SMs give finetune
    loose = estimate_harvest(model, load, tpot_slo_ms=50, solo_tokens_per_s=1000,
                             solo_source="prior", finetune_shares=shares)  # fmt: skip
    assert loose.mode == "slice"
    assert loose.finetune_fraction == pytest.approx(1 - alone / 45)
    assert loose.tokens_per_s == pytest.approx(1000 * (1 - alone / 45))
    # At a 10 ms SLO half the SMs for finetune keep decode (on the other half) within 9 ms.
    tight = estimate_harvest(model, load, tpot_slo_ms=10, solo_tokens_per_s=1000,
                             solo_source="prior", finetune_shares=shares)  # fmt: skip
    assert (tight.mode, tight.finetune_fraction, tight.tokens_per_s) == ("spatial 0.5", 0.5, 500)
    # Without SM splits (streams only, or a CPU host) only time slicing counts.
    sliced = estimate_harvest(model, load, tpot_slo_ms=10, solo_tokens_per_s=1000,
                              solo_source="prior")  # fmt: skip
    assert sliced.mode == "slice" and sliced.finetune_fraction == pytest.approx(1 - alone / 9)
    none = estimate_harvest(model, load, tpot_slo_ms=5, solo_tokens_per_s=1000,
                            solo_source="prior", finetune_shares=shares)  # fmt: skip
    assert (none.mode, none.tokens_per_s) == ("none", 0.0)


class _Record:
    def __init__(self, **fields: Any) -> None:
        defaults = dict(decode_batch=4, prefill_tokens=0, context_tokens_total=400,
                        context_tokens_max=120, decode_tokens=4, predicted_ms=None,
                        observed_ms=8.0)  # fmt: skip
        self.__dict__.update(defaults | fields)


def test_tracker_uses_measured_rates_and_pairs_predictions(
    tiny_model_dir: Path, tiny_artifacts: Path
) -> None:
    engine = (
        EngineSpec(EngineConfig(num_kv_blocks=16, max_model_len=64)).build(tiny_model_dir).engine
    )
    predictor = load_host_predictor(tiny_artifacts, engine=engine, base_model="tiny")
    tracker = HarvestTracker(predictor, tpot_slo_ms=50, parameters=10**6)
    tracker.observe(_Record(predicted_ms=6.0, observed_ms=7.0))
    tracker.observe(_Record(predicted_ms=8.0, observed_ms=9.0))
    tracker.observe(_Record(decode_batch=0, decode_tokens=0, context_tokens_total=0,
                            context_tokens_max=0))  # fmt: skip
    assert tracker.interval_done(200.0, [1500.0]) == (7.0, 8.0)
    estimate = tracker.estimate
    assert estimate.solo_source == "measured" and estimate.solo_tokens_per_s == 1500.0
    assert estimate.measured_tokens_per_s == pytest.approx(60.0)  # EMA 0.3 x 200
    assert tracker.interval_done(None, []) == (None, None)
    assert tracker.estimate.solo_tokens_per_s == 1500.0  # kept until a new measurement


def test_policy_harli_plans_with_the_predictor(tiny_model_dir: Path, tiny_artifacts: Path) -> None:
    engine = (
        EngineSpec(EngineConfig(num_kv_blocks=16, max_model_len=64)).build(tiny_model_dir).engine
    )
    predictor = load_host_predictor(tiny_artifacts, engine=engine, base_model="tiny")
    policy = build_policy("harli", predictor)
    assert isinstance(policy, HarliPolicy)
    assert isinstance(policy.latency, CorrectedLatencyModel)  # learns this host's offsets
    probe = decode_iteration(DecodeSnapshot.from_contexts([100]), 1.0)
    assert policy.latency.predict_ms(probe, None) == predictor.predictor.stage1(probe)
    assert policy.launch_overhead.ms == 0.0  # a CPU host: launches are not charged up front
    on_gpu = build_policy("harli", predictor, device="cuda:0")
    assert on_gpu.launch_overhead.ms == GPU_LAUNCH_OVERHEAD_PRIOR_MS > 0
    assert on_gpu.config.idle_slice_ms is None  # no TTFT SLO: slices up to the quantum cap
    assert on_gpu.config.max_quantum_ms == GPU_MAX_QUANTUM_MS
    tight = build_policy("harli", predictor, device="cuda:0", ttft_slo_ms=100.0)
    assert tight.config.idle_slice_ms == 50.0  # half the TTFT SLO
    loose = build_policy("harli", predictor, ttft_slo_ms=2000.0)
    assert loose.config.idle_slice_ms == loose.config.max_quantum_ms
    assert isinstance(build_policy("harli", None), NaivePolicy)
