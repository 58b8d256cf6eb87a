"""ONNX export of a trained ``LatencyModel`` and versioned artifact writing.

The exported graph takes ``features`` ``[N, 11]`` float32 (raw ``STAGE2_FEATURES``) and returns
``decode_alone_ms`` and ``decode_colocated_ms`` ``[N]``: roofline terms, feature normalisation and
both networks are inside it. Export uses the TorchScript-based exporter (``dynamo=False``, opset
17), which needs no extra package; ``export_onnx`` checks the ONNX Runtime output against torch
on the given rows before anything is written as an artifact.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_runtime.predictor.artifact import FORMAT, INPUT_NAME, OUTPUT_NAMES
from gpu_runtime.predictor.schema import STAGE1_FEATURES, STAGE2_FEATURES
from predictor_models.dataset import ProfileData
from predictor_models.model import STAGE1_DERIVED, STAGE2_DERIVED, LatencyModel
from predictor_models.train import TrainResult

OPSET = 17
ROUNDTRIP_RTOL = 1e-5


class ExportError(RuntimeError):
    """The ONNX graph does not reproduce the torch model."""


def export_onnx(model: LatencyModel, path: Path, check_rows: np.ndarray) -> float:
    """Write ``model`` (normalisation folded into its nets) to ``path``; return the max relative
    error of ONNX Runtime against the unfolded torch model on ``check_rows``.

    Raises ExportError if that error exceeds ``ROUNDTRIP_RTOL``.
    """
    import onnxruntime as ort

    model = model.eval()
    exported = copy.deepcopy(model).fold_normalization()
    example = torch.tensor(check_rows[:4], dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            exported,
            (example,),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=list(OUTPUT_NAMES),
            dynamic_axes={INPUT_NAME: {0: "n"}, **{o: {0: "n"} for o in OUTPUT_NAMES}},
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = check_rows.astype(np.float32)
    onnx_out = session.run(list(OUTPUT_NAMES), {INPUT_NAME: rows})
    with torch.no_grad():
        torch_out = [t.numpy() for t in model(torch.tensor(rows))]
    err = max(
        float(np.max(np.abs(o - t) / np.abs(t))) for o, t in zip(onnx_out, torch_out, strict=True)
    )
    if not err <= ROUNDTRIP_RTOL:
        raise ExportError(f"ONNX output differs from torch by {err:.2e} (> {ROUNDTRIP_RTOL})")
    return err


def _commit() -> str:
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
    rng = np.random.default_rng(0)
    check = np.concatenate(
        [
            data.x,
            data.x[rng.integers(0, len(data), 64)] * rng.uniform(0.5, 1.0, (64, data.x.shape[1])),
        ]
    )
    check[:, STAGE2_FEATURES.index("batch_size")] = np.maximum(
        1.0, np.round(check[:, STAGE2_FEATURES.index("batch_size")])
    )
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
        "derived_features": {"stage1": list(STAGE1_DERIVED), "stage2": list(STAGE2_DERIVED)},
        "input": INPUT_NAME,
        "outputs": list(OUTPUT_NAMES),
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
