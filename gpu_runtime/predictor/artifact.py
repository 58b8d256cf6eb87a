"""Versioned predictor artifacts: layout, metadata, validation.

Layout: ``<root>/<gpu_key>/<model>/<version>/`` holding ``model.onnx`` and ``metadata.json``.
Versions sort lexically by creation time (``vYYYYmmddTHHMMSSZ``), so the latest is the largest.
``metadata.json`` records the input features (names and order), the outputs, the served model's
shape, the training data's hash and source, held-out metrics and the commit that trained it.

Formats: ``harli-latency-predictor/2`` (written now) has one output ``decode_ms`` ``[N, 2]``
(alone, colocated); ``/1`` had two outputs ``decode_alone_ms`` and ``decode_colocated_ms``
``[N]``. Both are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.predictor.schema import STAGE2_FEATURES, ModelShape, SchemaError

FORMAT = "harli-latency-predictor/2"
INPUT_NAME = "features"
OUTPUT_NAME = "decode_ms"
OUTPUTS_BY_FORMAT: dict[str, tuple[str, ...]] = {
    "harli-latency-predictor/1": ("decode_alone_ms", "decode_colocated_ms"),
    FORMAT: (OUTPUT_NAME,),
}
REQUIRED_KEYS = (
    "format",
    "version",
    "gpu",
    "gpu_key",
    "model",
    "model_shape",
    "features",
    "outputs",
    "metrics",
    "data",
    "commit",
    "created",
)


class ArtifactError(RuntimeError):
    """A predictor artifact is missing, malformed, or does not fit the served model."""


@dataclass(frozen=True)
class ArtifactMetadata:
    """Parsed ``metadata.json`` (``raw`` keeps every key)."""

    path: Path
    version: str
    gpu_key: str
    model: str
    model_shape: ModelShape
    features: tuple[str, ...]
    metrics: dict[str, Any]
    raw: dict[str, Any]
    format: str = FORMAT

    @property
    def outputs(self) -> tuple[str, ...]:
        return OUTPUTS_BY_FORMAT[self.format]

    @property
    def onnx_path(self) -> Path:
        return self.path / "model.onnx"


def read_metadata(directory: str | Path) -> ArtifactMetadata:
    """Load and check ``directory/metadata.json`` (ArtifactError naming what is wrong)."""
    path = Path(directory)
    if not path.is_dir():
        raise ArtifactError(f"predictor artifact {path} does not exist")
    meta_path = path / "metadata.json"
    if not meta_path.is_file():
        raise ArtifactError(f"predictor artifact {path} has no metadata.json")
    if not (path / "model.onnx").is_file():
        raise ArtifactError(f"predictor artifact {path} has no model.onnx")
    try:
        raw = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{meta_path} is not JSON: {exc}") from exc
    missing = [k for k in REQUIRED_KEYS if k not in raw]
    if missing:
        raise ArtifactError(f"{meta_path} lacks {missing}")
    if raw["format"] not in OUTPUTS_BY_FORMAT:
        raise ArtifactError(
            f"{meta_path} has format {raw['format']!r}, expected one of {list(OUTPUTS_BY_FORMAT)}"
        )
    features = tuple(raw["features"])
    if features != STAGE2_FEATURES:
        raise ArtifactError(
            f"{meta_path} lists {len(features)} features {list(features)}; this runtime feeds "
            f"{len(STAGE2_FEATURES)}: {list(STAGE2_FEATURES)}"
        )
    try:
        shape = ModelShape.from_dict(raw["model_shape"])
    except (SchemaError, TypeError) as exc:
        raise ArtifactError(f"{meta_path} has an invalid model_shape: {exc}") from exc
    outputs = OUTPUTS_BY_FORMAT[raw["format"]]
    if tuple(raw["outputs"]) != outputs:
        raise ArtifactError(f"{meta_path} outputs {raw['outputs']}, expected {list(outputs)}")
    return ArtifactMetadata(
        path,
        raw["version"],
        raw["gpu_key"],
        raw["model"],
        shape,
        features,
        raw["metrics"],
        raw,
        raw["format"],
    )


def check_model_shape(metadata: ArtifactMetadata, served: ModelShape) -> None:
    """ArtifactError unless the artifact was trained for ``served``'s shape."""
    diffs = metadata.model_shape.mismatches(served)
    if diffs:
        raise ArtifactError(
            f"predictor {metadata.path} was trained for model shape "
            f"{metadata.model_shape.name!r}, the served model differs: {'; '.join(diffs)}"
        )


def artifact_dir(root: str | Path, gpu_key: str, model: str, version: str | None = None) -> Path:
    """``root/gpu_key/model/version``; the latest version when ``version`` is None."""
    base = Path(root) / gpu_key / model
    if version is not None:
        path = base / version
        if not path.is_dir():
            raise ArtifactError(f"no predictor version {version!r} under {base}")
        return path
    versions = (
        sorted(p for p in base.glob("*") if (p / "metadata.json").is_file())
        if (base.is_dir())
        else []
    )
    if not versions:
        raise ArtifactError(
            f"no predictor artifact for gpu {gpu_key!r}, model {model!r} under {Path(root)}"
        )
    return versions[-1]


def list_artifacts(root: str | Path) -> list[ArtifactMetadata]:
    """Every readable artifact under ``root`` (sorted by gpu, model, version)."""
    found = []
    for meta_path in sorted(Path(root).glob("*/*/*/metadata.json")):
        try:
            found.append(read_metadata(meta_path.parent))
        except ArtifactError:
            continue
    return found
