"""A latency predictor artifact for the tiny model, for tests of the agent and the platform."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "predictor_models/data/profile-h200-llama3-8b-engine.csv"
VERSION = "v20261130T000000Z"
METRICS = {
    "stage1": {"harli": {"mape": 0.02, "p95_ape": 0.05, "n": 10}},
    "stage2": {"harli": {"mape": 0.032, "p95_ape": 0.07, "n": 10}},
}


def write_tiny_artifact(model_dir: Path, root: Path) -> Path:
    """Write `root/cpu/tiny/VERSION`: the roofline prior (an untrained model) for the shape of
    the tiny model in `model_dir` (as the CPU agent loads it), by the real export path, with
    held-out metrics METRICS. Returns `root`."""
    from gpu_runtime.model.loader import load_model
    from gpu_runtime.predictor.schema import ModelShape
    from predictor_models.dataset import ProfileData, load_profile
    from predictor_models.export import write_artifact
    from predictor_models.model import LatencyModel
    from predictor_models.roofline import H200, RooflineBaseline
    from predictor_models.train import TrainResult

    shape = ModelShape.from_model_config(load_model(model_dir).config, "tiny")
    profile = load_profile(PROFILE)
    data = ProfileData(
        profile.x,
        profile.latency_ms,
        profile.stage,
        profile.group,
        {**profile.meta, "model_shape": shape.as_dict(), "model": "tiny", "gpu_key": "cpu"},
        profile.sha256,
    )
    result = TrainResult(
        model=LatencyModel(shape, H200, (4,), ()).eval(),
        baseline=RooflineBaseline(shape, H200),
        chosen={"stage1": "mlp4", "stage2": "linear"},
        metrics=METRICS,
    )
    write_artifact(result, data, root, PROFILE.name, version=VERSION)
    return root
