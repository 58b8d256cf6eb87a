"""`/tokenize`, `/detokenize` and `system_fingerprint` over real HTTP, against a server
over the tiny model (its HF tokenizer compared directly)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.loader import load_model, load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import BearerKeys, EngineLoop, ModelAccess, create_app
from gpu_runtime.server.fingerprint import system_fingerprint
from tests.gpu_runtime.server.serving import serve_in_thread

KEY, NARROW_KEY = "sk-all", "sk-narrow"
MODEL = "tiny-base"
CONFIG = EngineConfig(num_kv_blocks=64, block_size=8, max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=64)  # fmt: skip


def _access(key: str | None) -> ModelAccess | None:
    if key == KEY:
        return ModelAccess()
    if key == NARROW_KEY:
        return ModelAccess(models=frozenset({"some-adapter"}))
    return None


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Engine]]:
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("tok") / "model", "llama", seed=3)
    tokenizer = load_tokenizer(model_dir)
    engine = Engine(load_model(model_dir, dtype="float32"), CONFIG, tokenizer=tokenizer)
    loop = EngineLoop(engine)
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(_access))
    try:
        with serve_in_thread(app) as url:
            yield url.removesuffix("/v1"), tokenizer, engine
    finally:
        loop.stop()


def _post(root: str, path: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(root + path, json=body, headers=headers, timeout=30)


def test_tokenize_text_and_detokenize_round_trip(served: tuple[str, Any, Engine]) -> None:
    root, tokenizer, _ = served
    text = "Once upon a time, there was"
    ids = list(tokenizer(text)["input_ids"])
    out = _post(root, "/tokenize", {"model": MODEL, "prompt": text})
    assert out.status_code == 200, out.text
    assert out.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids}
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    out = _post(root, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                    "return_token_strs": True})  # fmt: skip
    assert out.json() == {"count": len(plain), "max_model_len": 64, "tokens": plain,
                          "token_strs": tokenizer.convert_ids_to_tokens(plain)}  # fmt: skip
    back = _post(root, "/detokenize", {"model": MODEL, "tokens": plain})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(plain)}
    assert text in back.json()["prompt"]


def test_tokenize_chat_applies_the_template(served: tuple[str, Any, Engine]) -> None:
    root, tokenizer, _ = served
    messages = [{"role": "user", "content": "hello there"}]
    for generation in (True, False):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                            tokenize=True, return_dict=False)  # fmt: skip
        out = _post(root, "/tokenize", {"model": MODEL, "messages": messages,
                                        "add_generation_prompt": generation})  # fmt: skip
        assert out.status_code == 200, out.text
        assert out.json()["tokens"] == list(ids) and out.json()["count"] == len(ids)
    with_prompt = _post(root, "/tokenize", {"messages": messages}).json()["count"]
    without = _post(root, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert with_prompt > without.json()["count"]  # the default adds the assistant's header


def test_tokenize_refusals(served: tuple[str, Any, Engine]) -> None:
    root, tokenizer, _ = served
    vocab = len(tokenizer)
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/tokenize", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
        (
            "/tokenize",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "add_special_tokens": True,
            },
            400,
            "add_special_tokens",
        ),  # fmt: skip
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "nobody", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": "word " * 3000}, 400, "prompt"),
        ("/detokenize", {"model": MODEL, "tokens": [1, vocab]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "nobody", "tokens": [1]}, 404, "model"),
    ]
    for path, body, status, param in cases:
        out = _post(root, path, body)
        assert out.status_code == status, (body, out.text)
        assert out.json()["error"]["param"] == param, (body, out.json())
    for path in ("/tokenize", "/detokenize"):
        body = {"prompt": "x", "tokens": [1]} if path == "/detokenize" else {"prompt": "x"}
        assert _post(root, path, body, key=None).status_code == 401
        assert _post(root, path, body, key="sk-wrong").status_code == 401
    # a key limited to other models may not use the base model's tokenizer
    assert _post(root, "/tokenize", {"model": MODEL, "prompt": "x"}, NARROW_KEY).status_code == 404
    assert _post(root, "/detokenize", {"tokens": [1]}, NARROW_KEY).status_code == 404


def test_every_response_and_chunk_carries_the_fingerprint(
    served: tuple[str, Any, Engine],
) -> None:
    root, _, engine = served
    client = openai.OpenAI(base_url=f"{root}/v1", api_key=KEY, max_retries=0, timeout=30)
    expected = system_fingerprint(engine, MODEL)
    assert expected.startswith("fp_") and len(expected) == 15
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert completion.system_fingerprint == chat.system_fingerprint == expected
    text_chunks = list(
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True,
                                  stream_options={"include_usage": True})
    )  # fmt: skip
    chat_chunks = list(
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, stream=True,
                                       stream_options={"include_usage": True})
    )  # fmt: skip
    assert len(text_chunks) >= 2 and len(chat_chunks) >= 2
    assert {c.system_fingerprint for c in text_chunks} == {expected}
    assert {c.system_fingerprint for c in chat_chunks} == {expected}


def test_the_fingerprint_follows_the_configuration(served: tuple[str, Any, Engine]) -> None:
    _, tokenizer, engine = served
    model = engine.runner.model
    same = Engine(model, CONFIG, tokenizer=tokenizer)
    assert system_fingerprint(same, MODEL) == system_fingerprint(engine, MODEL)
    other_config = Engine(model, replace(CONFIG, max_num_seqs=2), tokenizer=tokenizer)
    fingerprints = {
        system_fingerprint(engine, MODEL),
        system_fingerprint(engine, "another-model"),
        system_fingerprint(other_config, MODEL),
    }
    assert len(fingerprints) == 3
