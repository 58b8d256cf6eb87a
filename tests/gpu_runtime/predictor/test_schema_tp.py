"""The predictor's model shape is keyed by the tensor-parallel degree it is served at."""

from __future__ import annotations

import pytest

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.predictor.artifact import ArtifactError, check_model_shape, read_metadata
from gpu_runtime.predictor.schema import ModelShape, predictor_model_key


def test_per_gpu_figures_divide_by_the_degree() -> None:
    config = ModelConfig.preset("llama3-70b")
    one = ModelShape.from_model_config(config, "llama3-70b")
    four = ModelShape.from_model_config(config, "llama3-70b", tensor_parallel_size=4)
    assert one.weight_bytes == 4 * four.weight_bytes  # 64 heads, 8 KV heads, 28672, 128256
    assert one.kv_bytes_per_token == 4 * four.kv_bytes_per_token
    eight_kv = ModelShape.from_model_config(config, "x", tensor_parallel_size=8).kv_dim
    assert eight_kv == 128  # one KV head per GPU
    assert four.mismatches(one) == ["tensor_parallel_size: 4 != 1"]
    assert (one.model_key, four.model_key) == ("llama3-70b", "llama3-70b-tp4")
    assert predictor_model_key("qwen2.5-72b", 8) == "qwen2.5-72b-tp8"


def test_metadata_without_the_degree_reads_as_one_gpu() -> None:
    shape = ModelShape.from_model_config(ModelConfig.preset("llama3-8b"), "llama3-8b")
    data = shape.as_dict()
    del data["tensor_parallel_size"]
    assert ModelShape.from_dict(data) == shape


def test_an_artifact_of_another_degree_is_refused() -> None:
    path = "predictor_models/artifacts/h200/llama3-8b/v20261130T172733Z"
    metadata = read_metadata(path)
    served = ModelShape.from_model_config(ModelConfig.preset("llama3-8b"), "llama3-8b", 2)
    with pytest.raises(ArtifactError, match="tensor_parallel_size: 1 != 2"):
        check_model_shape(metadata, served)
    check_model_shape(metadata, ModelShape.from_model_config(ModelConfig.preset("llama3-8b")))
