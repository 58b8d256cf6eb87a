"""The `python -m gpu_runtime.server` entry point builds a working app from the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.lora import build_training_model
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model.loader import load_model
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server.__main__ import build, parse_args


def test_entry_point_serves_the_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARLI_INFERENCE_API_KEYS", "k1, k2")
    args_list = [
        "--tiny-dir",
        str(tmp_path / "tiny"),
        "--model-name",
        "tiny",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "4",
    ]
    args = parse_args(args_list)
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
        assert loop.engine.config.async_scheduling  # the server's default
    finally:
        loop.stop()
    assert (tmp_path / "tiny" / "config.json").exists()
    sync_args = parse_args([*args_list, "--no-async-scheduling"])
    app, loop = build(sync_args)
    try:
        assert not loop.engine.config.async_scheduling
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        headers = {"Authorization": "Bearer k1"}
        assert TestClient(app).post("/v1/completions", json=body, headers=headers).is_success
    finally:
        loop.stop()


def test_entry_point_serves_adapters_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARLI_INFERENCE_API_KEYS", "k1")
    model_dir = build_tiny_model_dir(tmp_path / "tiny", "llama")
    spec = LoraSpec(rank=4, alpha=8)
    save_adapter(build_training_model(load_model(model_dir), spec, seed=0), spec, tmp_path / "a")
    common = ["--model-dir", str(model_dir), "--model-name", "tiny", "--num-kv-blocks", "64"]
    with pytest.raises(SystemExit):
        parse_args([*common, "--adapter", "no-directory"])
    args = parse_args([*common, "--adapter", f"support={tmp_path / 'a'}", "--lora-slots", "2"])
    app, loop = build(args)
    try:
        client = TestClient(app)
        headers = {"Authorization": "Bearer k1"}
        models = client.get("/v1/models", headers=headers).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            ("tiny", None),
            ("support", "tiny"),
        ]
        body = {"model": "support", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        answer = client.post("/v1/completions", json=body, headers=headers)
        assert answer.status_code == 200 and answer.json()["model"] == "support"
        missing = client.post("/v1/completions", json=body | {"model": "x"}, headers=headers)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        # a finished job's adapter is registered on the loop thread while the server runs
        lora = loop.engine.lora
        assert isinstance(lora, MultiLoraRuntime)
        loop.run_in_loop(lambda: lora.register("x", tmp_path / "a")).result(timeout=30)
        assert client.post(
            "/v1/completions", json=body | {"model": "x"}, headers=headers
        ).is_success
        with pytest.raises(ValueError, match="already registered"):
            loop.run_in_loop(lambda: lora.register("x", tmp_path / "a")).result(timeout=30)
        ids = [m["id"] for m in client.get("/v1/models", headers=headers).json()["data"]]
        assert ids == ["tiny", "support", "x"]
    finally:
        loop.stop()


def test_entry_point_takes_the_request_limits(capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_runtime.server.limits import RequestLimits

    assert parse_args([]).limits == RequestLimits()
    args = parse_args(["--max-prompts-per-request", "8", "--max-request-prompt-tokens", "900"])
    assert args.limits == RequestLimits(8, 900)
    with pytest.raises(SystemExit):
        parse_args(["--max-prompts-per-request", "0"])
    assert "max_prompts_per_request must be >= 1, got 0" in capsys.readouterr().err


def test_entry_point_opens_the_adapter_routes_with_token_and_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HARLI_INFERENCE_API_KEYS", "k1")
    model_dir = build_tiny_model_dir(tmp_path / "tiny", "llama")
    spec = LoraSpec(rank=4, alpha=8)
    roots = tmp_path / "adapters"
    save_adapter(build_training_model(load_model(model_dir), spec, seed=0), spec, roots / "a")
    common = ["--model-dir", str(model_dir), "--model-name", "tiny", "--num-kv-blocks", "64"]
    with pytest.raises(SystemExit):
        parse_args([*common, "--adapter-root", str(roots)])  # no token
    assert "HARLI_HOST_ADMIN_TOKEN and --adapter-root go together" in capsys.readouterr().err
    monkeypatch.setenv("HARLI_HOST_ADMIN_TOKEN", "op-token")
    with pytest.raises(SystemExit):
        parse_args(common)  # a token without roots
    with pytest.raises(SystemExit):
        parse_args([*common, "--adapter-root", str(tmp_path / "missing")])
    assert "is not a directory" in capsys.readouterr().err
    app, loop = build(parse_args([*common, "--adapter-root", str(roots)]))
    try:
        client = TestClient(app)
        admin = {"Authorization": "Bearer op-token"}
        body = {"lora_name": "live", "lora_path": "a"}
        assert client.post("/v1/load_lora_adapter", json=body, headers=admin).status_code == 200
        tenant = {"Authorization": "Bearer k1"}
        assert client.post("/v1/load_lora_adapter", json=body, headers=tenant).status_code == 401
        completion = {"model": "live", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        assert client.post("/v1/completions", json=completion, headers=tenant).is_success
    finally:
        loop.stop()
