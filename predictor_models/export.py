"""ONNX export of a trained ``LatencyModel`` and versioned artifact writing.

The exported graph takes ``features`` ``[N, 11]`` float32 (raw ``STAGE2_FEATURES``) and returns
``decode_ms`` ``[N, 2]`` (alone, colocated): roofline terms, feature normalisation and both
networks are inside it, folded into few wide ops (``predictor_models.compact``: 14 nodes after
ONNX Runtime's optimisations for a two-layer stage-1 MLP and a linear stage 2). Export uses the
TorchScript-based exporter (``dynamo=False``, opset 17), which needs no extra package;
``export_onnx`` checks the ONNX Runtime output against the trained (unfolded) torch model on the
given rows before anything is written as an artifact.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_runtime.predictor.artifact import FORMAT, INPUT_NAME, OUTPUT_NAME
from gpu_runtime.predictor.schema import (
    NO_FINETUNE_ROW,
    STAGE1_FEATURES,
    STAGE2_FEATURES,
    DecodeIteration,
    FinetuneQuantum,
)
from predictor_models.compact import CompactLatencyModel
from predictor_models.dataset import ProfileData
from predictor_models.model import STAGE1_DERIVED, STAGE2_DERIVED, LatencyModel
from predictor_models.train import TrainResult

OPSET = 17
ROUNDTRIP_RTOL = 1e-5


class ExportError(RuntimeError):
    """The ONNX graph does not reproduce the torch model."""


def export_onnx(model: LatencyModel, path: Path, check_rows: np.ndarray) -> float:
    """Write ``model`` as its ``CompactLatencyModel`` to ``path``; return the max relative error
    of ONNX Runtime against the trained torch model on ``check_rows``.

    Raises ExportError if that error exceeds ``ROUNDTRIP_RTOL``.
    """
    import onnxruntime as ort

    model = model.eval()
    compact = CompactLatencyModel(model).eval()
    example = torch.tensor(check_rows[:4], dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            compact,
            (example,),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "n"}, OUTPUT_NAME: {0: "n"}},
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = check_rows.astype(np.float32)
    (onnx_out,) = session.run([OUTPUT_NAME], {INPUT_NAME: rows})
    with torch.no_grad():
        torch_out = torch.stack(model(torch.tensor(rows)), dim=1).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):  # equal values (0, inf) count as 0
        rel = np.where(onnx_out == torch_out, 0.0, np.abs(onnx_out - torch_out) / torch_out)
    err = float(np.max(np.abs(rel)))
    if not err <= ROUNDTRIP_RTOL:
        raise ExportError(f"ONNX output differs from torch by {err:.2e} (> {ROUNDTRIP_RTOL})")
    return err


def roundtrip_rows(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """Rows the export checks: the profile's, 64 perturbed ones, and edge cases (batch sizes and
    decode + chunk tokens at and past bucket boundaries, a prefill-only iteration, time-shared
    and spatial quanta, no quantum)."""
    rng = np.random.default_rng(seed)
    perturbed = x[rng.integers(0, len(x), 64)] * rng.uniform(0.5, 1.0, (64, x.shape[1]))
    batch = STAGE2_FEATURES.index("batch_size")
    perturbed[:, batch] = np.maximum(1.0, np.round(perturbed[:, batch]))
    for name in ("context_tokens_total", "context_tokens_max", "prefill_chunk_tokens"):
        column = STAGE2_FEATURES.index(name)  # token counts are integers (bucket boundaries)
        perturbed[:, column] = np.round(perturbed[:, column])
    edges = []
    for share in (32 / 132, 1.0):
        quanta = [
            NO_FINETUNE_ROW,
            *(
                FinetuneQuantum(2048, 1024, 16, bool(b), 1.0 if share == 1.0 else 1 - share).row()
                for b in (0, 1)
            ),
        ]
        iterations = [DecodeIteration(0, 0, 0, 512, share)] + [
            DecodeIteration(b, b * c, c, p, share)
            for b in (1, 2, 4, 8, 24, 25, 48, 64, 256)  # at and past bucket boundaries
            for c in (64, 1024)
            for p in (0, 1, 40, 256)
        ]
        edges += [it.row() + list(q) for it in iterations for q in quanta]
    return np.concatenate([x, perturbed, np.array(edges)])


def _commit() -> str:
    """``HARLI_COMMIT`` or ``GIT_COMMIT`` when set (a copied tree's ``.git`` may be stale or
    absent), else git's HEAD."""
    for name in ("HARLI_COMMIT", "GIT_COMMIT"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def new_version(now: dt.datetime | None = None) -> str:
    """``vYYYYmmddTHHMMSSZ`` (sorts by creation time)."""
    return f"v{(now or dt.datetime.now(dt.UTC)):%Y%m%dT%H%M%SZ}"


def write_artifact(
    result: TrainResult,
    data: ProfileData,
    root: str | Path,
    data_file: str,
    version: str | None = None,
) -> Path:
    """Export ``result.model`` and its metadata to ``root/<gpu_key>/<model>/<version>/``."""
    gpu_key = str(data.meta.get("gpu_key") or data.meta["gpu"].split()[-1].lower())
    model_name = str(data.meta.get("model") or data.shape.name)
    version = version or new_version()
    directory = Path(root) / gpu_key / model_name / version
    if directory.exists():
        raise FileExistsError(f"artifact {directory} already exists")
    directory.mkdir(parents=True)
    check = roundtrip_rows(data.x)
    try:
        err = export_onnx(result.model, directory / "model.onnx", check)
    except Exception:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()
        raise
    counts = {f"stage{s}_rows": int(np.sum(data.stage == s)) for s in (1, 2)}
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "version": version,
        "gpu": data.meta.get("gpu"),
        "gpu_key": gpu_key,
        "model": model_name,
        "model_shape": data.shape.as_dict(),
        "features": list(STAGE2_FEATURES),
        "stage1_features": list(STAGE1_FEATURES),
        "derived_features": {
            "stage1": list(STAGE1_DERIVED),
            "stage1_chunk": list(result.model.chunk_derived),
            "stage2": list(STAGE2_DERIVED),
        },
        "engine": data.meta.get("engine"),
        "buckets": {
            "batch": list(result.model.batch_buckets),
            "tokens": list(result.model.token_buckets),
            "decode_sm_share_splits": list(result.model.share_splits),
        },
        "input": INPUT_NAME,
        "outputs": [OUTPUT_NAME],
        "opset": OPSET,
        "hardware": result.model.hw.as_dict(),
        "data": {
            "file": data_file,
            "sha256": data.sha256,
            "rows": len(data),
            **counts,
            "source": data.meta.get("source"),
            "profile_commit": data.meta.get("commit"),
        },
        "metrics": result.metrics,
        "chosen": result.chosen,
        "cv_mape": result.cv,
        "n_train": result.n_train,
        "train_config": result.config,
        "roofline_efficiency": result.baseline.efficiency,
        "roundtrip_max_rel_err": err,
        "commit": _commit(),
        "created": dt.datetime.now(dt.UTC).isoformat(),
    }
    (directory / "metadata.json").write_text(json.dumps(metadata, indent=1, default=str))
    return directory
