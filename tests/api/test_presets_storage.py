"""The preset table and the local storage backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.presets import PRESETS, preset_get
from api.storage import LocalStorage
from gpu_runtime.contract.model_config import ModelConfig


def test_preset_shapes() -> None:
    llama = preset_get("llama3-8b").config
    assert (llama["hidden_size"], llama["num_hidden_layers"]) == (4096, 32)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (32, 8)
    assert (llama["intermediate_size"], llama["vocab_size"]) == (14336, 128256)
    assert llama["rope_theta"] == 500000.0 and llama["rope_scaling"]["rope_type"] == "llama3"
    qwen = preset_get("qwen2.5-7b").config
    assert (qwen["hidden_size"], qwen["num_hidden_layers"]) == (3584, 28)
    assert (qwen["num_attention_heads"], qwen["num_key_value_heads"]) == (28, 4)
    assert (qwen["intermediate_size"], qwen["vocab_size"]) == (18944, 152064)
    assert qwen["rope_theta"] == 1e6 and qwen["model_type"] == "qwen2"
    # The control plane's presets are the runtime's shapes, read back without loss.
    for name, preset in PRESETS.items():
        assert ModelConfig.from_hf_config(preset.config) == ModelConfig.preset(name)
    assert ModelConfig.from_hf_config(qwen).attention_bias is True
    for preset in PRESETS.values():
        config = preset.config
        assert config["hidden_size"] % config["num_attention_heads"] == 0
        assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    known = "known: llama3-70b, llama3-8b, qwen2.5-72b, qwen2.5-7b, tiny"
    with pytest.raises(KeyError, match=known):
        preset_get("gpt")


def test_local_storage_roundtrip_and_key_checks(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert storage.save("files/1/a.jsonl", [b"ab", b"cd"]) == 4
    assert storage.exists("files/1/a.jsonl")
    assert b"".join(storage.read_chunks("files/1/a.jsonl", chunk_size=3)) == b"abcd"
    storage.delete("files/1/a.jsonl")
    storage.delete("files/1/a.jsonl")
    assert not storage.exists("files/1/a.jsonl")
    for bad in ("../escape", "/abs", "a/./b", ""):
        with pytest.raises(ValueError):
            storage.save(bad, [b"x"])


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)

    def broken() -> list[bytes]:
        raise RuntimeError("client went away")

    def chunks() -> Iterator[bytes]:
        yield b"partial"
        broken()

    with pytest.raises(RuntimeError):
        storage.save("files/x.jsonl", chunks())
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
