"""The `python -m gpu_runtime.server` entry point builds a working app from the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpu_runtime.server.__main__ import build, parse_args


def test_entry_point_serves_the_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARLI_INFERENCE_API_KEYS", "k1, k2")
    args = parse_args(
        [
            "--tiny-dir",
            str(tmp_path / "tiny"),
            "--model-name",
            "tiny",
            "--num-kv-blocks",
            "64",
            "--max-num-seqs",
            "4",
        ]
    )
    app, loop = build(args)
    try:
        client = TestClient(app)
        assert client.get("/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k2"}
        assert client.get("/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        answer = client.post("/v1/completions", json=body, headers=headers).json()
        assert answer["usage"]["completion_tokens"] <= 3
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        loop.stop()
    assert (tmp_path / "tiny" / "config.json").exists()
