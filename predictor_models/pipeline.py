"""End-to-end steps shared by ``manage.py predictors`` and ``bench/predictor/run.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_runtime.predictor.artifact import read_metadata
from gpu_runtime.predictor.runtime import LatencyPredictor
from gpu_runtime.predictor.schema import STAGE2_FEATURES
from predictor_models.dataset import ProfileData, load_profile, split_by_config
from predictor_models.export import write_artifact
from predictor_models.roofline import H200, RooflineBaseline
from predictor_models.train import TrainConfig, TrainResult, error_metrics, train

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "predictor_models/data/profile-h200-llama3-8b-engine-6d741de-varlen.csv"
DEFAULT_ROOT = REPO / "predictor_models/artifacts"
QUICK = TrainConfig(
    stage1_candidates=(((16,), 1e-4),),
    chunk_candidates=(((), 1e-3),),
    stage2_candidates=(((), 1e-1),),
    folds=2,
    steps=120,
)
"""One candidate per stage: seconds instead of minutes (smoke runs and tests)."""


def fit(
    data_path: str | Path = DEFAULT_DATA, quick: bool = False
) -> tuple[ProfileData, TrainResult]:
    """Load a profile and train on it (single-threaded torch: the host CPU is shared)."""
    torch.set_num_threads(1)
    data = load_profile(data_path)
    return data, train(data, QUICK if quick else TrainConfig())


def fit_and_export(
    data_path: str | Path = DEFAULT_DATA, root: str | Path = DEFAULT_ROOT, quick: bool = False
) -> tuple[Path, TrainResult]:
    """Train, then write a new versioned artifact under ``root``; returns its directory."""
    data, result = fit(data_path, quick)
    try:
        data_file = str(Path(data_path).resolve().relative_to(REPO))
    except ValueError:
        data_file = str(data_path)
    return write_artifact(result, data, root, data_file), result


def evaluate_artifact(directory: str | Path, data_path: str | Path) -> dict[str, Any]:
    """Score an artifact through onnxruntime on a profile.

    On the data it was trained from (same hash), only the held-out configurations count (the
    split is recomputed with the artifact's seed and fraction); on other data, every row.
    """
    metadata = read_metadata(directory)
    data = load_profile(data_path)
    predictor = LatencyPredictor.load(directory, model_shape=data.shape, max_batch=len(data))
    rows = np.arange(len(data))
    scope = "all rows"
    if metadata.raw["data"].get("sha256") == data.sha256:
        cfg = metadata.raw.get("train_config", {})
        rows = split_by_config(data, cfg.get("test_fraction", 0.25), cfg.get("seed", 0))[1]
        scope = "held-out configurations"
    subset = data.subset(rows)
    alone, colocated = predictor.predict(subset.x.astype(np.float32))
    pred = np.where(subset.stage == 1, alone, colocated)
    out: dict[str, Any] = {"artifact": str(directory), "version": metadata.version, "scope": scope}
    for stage in (1, 2):
        mask = subset.stage == stage
        out[f"stage{stage}"] = error_metrics(pred[mask], subset.latency_ms[mask])
    prefill = subset.x[:, STAGE2_FEATURES.index("prefill_chunk_tokens")] > 0
    for name, part in (("decode_only", ~prefill), ("with_prefill", prefill)):
        for stage in (1, 2):  # per kind of iteration: graph-replayed decode, or mixed steps
            mask = (subset.stage == stage) & part
            out[f"stage{stage}_{name}"] = error_metrics(pred[mask], subset.latency_ms[mask])
    return out


def roofline_metrics(
    data_path: str | Path, test_fraction: float = 0.25, seed: int = 0
) -> dict[str, dict[str, float]]:
    """The roofline-only baseline fitted on the training split, scored on the held-out rows."""
    data = load_profile(data_path)
    train_idx, test_idx = split_by_config(data, test_fraction, seed)
    train_set, test_set = data.subset(train_idx), data.subset(test_idx)
    baseline = RooflineBaseline(data.shape, H200)
    out = {}
    for stage in (1, 2):
        fit_rows = train_set.stage == stage
        if np.any(fit_rows):
            baseline.fit(
                torch.tensor(train_set.x[fit_rows], dtype=torch.float32),
                torch.tensor(train_set.latency_ms[fit_rows], dtype=torch.float32),
                stage,
            )
        rows = test_set.stage == stage
        pred = baseline.predict(torch.tensor(test_set.x[rows], dtype=torch.float32), stage)
        out[f"stage{stage}"] = error_metrics(pred.numpy(), test_set.latency_ms[rows])
    return out
