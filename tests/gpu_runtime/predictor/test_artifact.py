"""Artifact loading and validation: clear errors for missing or mismatched artifacts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_runtime.model import ModelConfig
from gpu_runtime.predictor.artifact import (
    ArtifactError,
    artifact_dir,
    check_model_shape,
    list_artifacts,
    read_metadata,
)
from gpu_runtime.predictor.runtime import LatencyPredictor
from gpu_runtime.predictor.schema import STAGE2_FEATURES, DecodeIteration, ModelShape, SchemaError
from predictor_models.dataset import load_profile
from predictor_models.export import write_artifact
from predictor_models.model import LatencyModel
from predictor_models.roofline import H200, RooflineBaseline
from predictor_models.train import TrainResult

DATA = (
    Path(__file__).resolve().parents[3] / "predictor_models/data/profile-h200-llama3-8b-engine.csv"
)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact of an untrained model (its prediction is the roofline prior)."""
    data = load_profile(DATA)
    model = LatencyModel(data.shape, H200, (4,), ())
    result = TrainResult(
        model=model.eval(),
        baseline=RooflineBaseline(data.shape, H200),
        chosen={"stage1": "mlp4", "stage2": "linear"},
        metrics={},
    )
    root = tmp_path_factory.mktemp("artifacts")
    write_artifact(result, data, root, "profile.csv", version="v20260101T000000Z")
    return write_artifact(result, data, root, "profile.csv", version="v20260102T000000Z")


def _copy(artifact: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    return target


def _edit(directory: Path, **changes: object) -> None:
    path = directory / "metadata.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_loads_and_predicts_the_roofline_prior(artifact: Path) -> None:
    shape = ModelShape.from_model_config(ModelConfig.preset("llama3-8b"), name="llama3-8b")
    predictor = LatencyPredictor.load(artifact, model_shape=shape)
    iteration = DecodeIteration.from_contexts([1024] * 16)
    expected = (shape.weight_bytes + shape.kv_bytes_per_token * (16 * 1024 + 16)) / 4.27e9
    assert predictor.stage1(iteration) == pytest.approx(expected, rel=1e-4)


def test_latest_version_and_listing(artifact: Path) -> None:
    root = artifact.parents[2]
    assert artifact_dir(root, "h200", "llama3-8b") == artifact
    assert artifact_dir(root, "h200", "llama3-8b", "v20260101T000000Z").name == "v20260101T000000Z"
    assert [m.version for m in list_artifacts(root)] == ["v20260101T000000Z", "v20260102T000000Z"]
    with pytest.raises(ArtifactError, match="no predictor artifact for gpu 'h100'"):
        artifact_dir(root, "h100", "llama3-8b")
    with pytest.raises(ArtifactError, match="no predictor version 'v9'"):
        artifact_dir(root, "h200", "llama3-8b", "v9")


def test_missing_artifact_and_files(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="does not exist"):
        LatencyPredictor.load(tmp_path / "nowhere")
    broken = _copy(artifact, tmp_path)
    (broken / "model.onnx").unlink()
    with pytest.raises(ArtifactError, match="has no model.onnx"):
        read_metadata(broken)
    (broken / "metadata.json").unlink()
    with pytest.raises(ArtifactError, match="has no metadata.json"):
        read_metadata(broken)


def test_wrong_feature_list_is_refused(artifact: Path, tmp_path: Path) -> None:
    broken = _copy(artifact, tmp_path)
    _edit(broken, features=list(STAGE2_FEATURES[:6]))
    with pytest.raises(ArtifactError, match="lists 6 features .* this runtime feeds 11"):
        read_metadata(broken)


def test_onnx_graph_with_another_width_is_refused(artifact: Path, tmp_path: Path) -> None:
    broken = _copy(artifact, tmp_path)

    class TenFeatures(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sum(-1), x.sum(-1)

    torch.onnx.export(
        TenFeatures(),
        (torch.ones(2, 10),),
        str(broken / "model.onnx"),
        dynamo=False,
        input_names=["features"],
        output_names=["decode_alone_ms", "decode_colocated_ms"],
        dynamic_axes={"features": {0: "n"}},
    )
    with pytest.raises(ArtifactError, match="takes 10 features per row, this runtime feeds 11"):
        LatencyPredictor.load(broken)


def test_model_shape_mismatch_names_the_fields(artifact: Path) -> None:
    qwen = ModelShape.from_model_config(ModelConfig.preset("qwen2.5-7b"), name="qwen2.5-7b")
    with pytest.raises(ArtifactError, match="hidden_size: 4096 != 3584"):
        LatencyPredictor.load(artifact, model_shape=qwen)
    check_model_shape(read_metadata(artifact), read_metadata(artifact).model_shape)


def test_bad_metadata(artifact: Path, tmp_path: Path) -> None:
    broken = _copy(artifact, tmp_path)
    _edit(broken, format="something-else/9")
    with pytest.raises(ArtifactError, match="format 'something-else/9'"):
        read_metadata(broken)
    _edit(broken, format="harli-latency-predictor/1", model_shape={"hidden_size": 1})
    with pytest.raises(ArtifactError, match="invalid model_shape"):
        read_metadata(broken)
    (broken / "metadata.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not JSON"):
        read_metadata(broken)


def test_schema_validation() -> None:
    with pytest.raises(SchemaError, match="decode_sm_share must be in"):
        DecodeIteration(4, 100, 50, 0, decode_sm_share=0.0)
    with pytest.raises(SchemaError, match="context_tokens_max 10 x batch 4 < total 100"):
        DecodeIteration(4, 100, 10)
    row = DecodeIteration.from_contexts([10, 30], prefill_chunk_tokens=64).row()
    assert row == [2.0, 40.0, 20.0, 30.0, 64.0, 1.0]
    assert np.isfinite(row).all()
