"""Our CausalLM against HF transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.model import (
    CausalLM,
    DenseCausalAttention,
    ModelLoadError,
    build_random_model,
    load_model,
    save_model,
)
from gpu_runtime.model.tiny import tiny_config


def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen_dir"])
def test_logits_equal_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    ours = load_model(model_dir)
    hf = _hf_model(model_dir)
    expected_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    assert type(hf).__name__ == expected_class[ours.config.architecture]
    torch.manual_seed(0)
    # positions past original_max_position_embeddings exercise the llama3 RoPE scaling
    ids = torch.randint(0, ours.config.vocab_size, (3, 150))
    positions = torch.arange(150).expand(3, 150)
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, positions))
        reference = hf(ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_state_dict_keys_equal_hf(tiny_qwen_dir: Path) -> None:
    ours = load_model(tiny_qwen_dir)
    hf = _hf_model(tiny_qwen_dir)
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in ours.state_dict()
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_left_padded_batch_matches_unpadded(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir)
    torch.manual_seed(1)
    short = torch.randint(0, 400, (5,))
    long = torch.randint(0, 400, (9,))
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0, 4:] = short
    ids[1] = long
    mask = ids != 0
    mask[0, :4] = False
    mask[1] = True
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model.compute_logits(model(ids, positions, DenseCausalAttention(mask)))
        alone = model.compute_logits(model(short[None], torch.arange(5)[None]))
    torch.testing.assert_close(batched[0, 4:], alone[0], rtol=1e-5, atol=1e-5)


def test_fused_projections_keep_names_values_and_storage() -> None:
    model = build_random_model(tiny_config("qwen2"), seed=3)
    ids = torch.randint(0, 400, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        before = model.compute_logits(model(ids, positions))
        keys = set(model.state_dict())
        model.fuse_projections()
        after = model.compute_logits(model(ids, positions))
    assert set(model.state_dict()) == keys
    attn = model.decoder_layers[0].self_attn
    assert attn.qkv_weight is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_reserved_projection_rows_follow_the_base_rows_of_each_group() -> None:
    model = build_random_model(tiny_config("qwen2"), seed=3)  # q/k/v biases
    ids = torch.randint(0, 400, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        before = model.compute_logits(model(ids, positions))
        keys = set(model.state_dict())
        values = {k: v.clone() for k, v in model.state_dict().items()}
        extended = model.reserve_projection_rows({"qkv": 6, "o": 2, "down": 4})
        after = model.compute_logits(model(ids, positions))
    assert set(model.state_dict()) == keys
    for key, value in model.state_dict().items():
        assert torch.equal(value, values[key]), key
    layer = model.decoder_layers[1]
    attn = layer.self_attn
    weight, bias = extended[1]["qkv"]
    rows = attn.q_proj.weight.shape[0] + 2 * attn.k_proj.weight.shape[0]
    assert weight.shape == (rows + 6, attn.q_proj.weight.shape[1]) and bias is not None
    assert attn.qkv_weight is not None and attn.qkv_weight.data_ptr() == weight.data_ptr()
    assert attn.qkv_weight.shape[0] == rows and attn.qkv_bias is not None
    assert attn.v_proj.weight.data_ptr() == weight[rows - attn.v_proj.weight.shape[0]].data_ptr()
    assert torch.equal(weight[rows:], torch.zeros(6, weight.shape[1]))
    assert torch.equal(bias[rows:], torch.zeros(6))
    o_weight, o_bias = extended[1]["o"]
    assert o_weight.shape[0] == attn.o_proj.weight.shape[0] + 2 and o_bias is None
    assert attn.o_proj.weight.data_ptr() == o_weight.data_ptr()
    assert layer.mlp.down_proj.weight.data_ptr() == extended[1]["down"][0].data_ptr()
    assert "gate_up" not in extended[1]
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown projection groups"):
        model.reserve_projection_rows({"lm_head": 1})


def test_random_build_is_seeded_and_sharded_save_round_trips(tmp_path: Path) -> None:
    config = tiny_config("llama")
    a = build_random_model(config, seed=7)
    b = build_random_model(config, seed=7)
    c = build_random_model(config, seed=8)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    save_model(a, tmp_path, max_shard_bytes=50_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_model(tmp_path)
    for name, tensor in a.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_load_rejects_mismatched_shapes(tmp_path: Path) -> None:
    save_model(build_random_model(tiny_config("llama"), seed=0), tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(
        config_path.read_text().replace('"intermediate_size": 128', '"intermediate_size": 96')
    )
    with pytest.raises(ModelLoadError, match="checkpoint shape"):
        load_model(tmp_path)


def test_meta_built_tree_can_share_serving_weights() -> None:
    serving = build_random_model(tiny_config("llama"), seed=0)
    with torch.device("meta"):
        tree = CausalLM(serving.config)
    for name, param in serving.named_parameters():
        module_name, _, attr = name.rpartition(".")
        setattr(
            tree.get_submodule(module_name), attr, torch.nn.Parameter(param, requires_grad=False)
        )
    tree.reset_rope("cpu")
    ids = torch.randint(0, 400, (1, 6))
    positions = torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(tree(ids, positions), serving(ids, positions))
    assert tree.decoder_layers[1].mlp.up_proj.weight.data_ptr() == (
        serving.decoder_layers[1].mlp.up_proj.weight.data_ptr()
    )
