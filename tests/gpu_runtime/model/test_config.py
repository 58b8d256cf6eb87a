from __future__ import annotations

import pytest

from gpu_runtime.model import ModelConfig, ModelConfigError


def test_presets_have_published_shapes() -> None:
    llama = ModelConfig.preset("llama3-8b")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads) == (4096, 32, 8)
    assert llama.num_parameters() == 8_030_261_248
    qwen = ModelConfig.preset("qwen2.5-7b")
    assert qwen.attention_bias and qwen.num_queries_per_kv == 7
    assert qwen.num_parameters() == 7_615_616_512
    assert llama.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    # The 70B-class shapes, served sharded: Llama-3-70B's and Qwen2.5-72B's published counts.
    assert ModelConfig.preset("llama3-70b").num_parameters() == 70_553_706_496
    qwen72 = ModelConfig.preset("qwen2.5-72b")
    assert qwen72.num_parameters() == 72_706_203_648 and qwen72.attention_bias


def test_hf_round_trip_keeps_every_field() -> None:
    for name in ("tiny", "llama3-8b", "qwen2.5-7b", "llama3-70b", "qwen2.5-72b"):
        config = ModelConfig.preset(name)
        assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_from_hf_accepts_rope_parameters_form() -> None:
    hf = ModelConfig.preset("llama3-8b").to_hf_config()
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {**scaling, "rope_theta": hf.pop("rope_theta")}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple"),
        ({"architecture": "gpt2"}, "architecture='gpt2'"),
        ({"hidden_size": 0}, "hidden_size=0"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn' unsupported"),
        ({"architecture": "qwen2"}, "requires attention_bias=True"),
    ],
)
def test_invalid_configs_name_the_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.preset("tiny").replace(**changes)
