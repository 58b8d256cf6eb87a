"""`response_format` through the server under uvicorn, driven by the `openai` client: chat and
completions answers parse as JSON matching the schema (streamed too); malformed formats and
schemas the compiler refuses are 400s naming `response_format`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.server import (
    BearerKeys,
    EngineLoop,
    MetricsCollector,
    create_app,
    static_key_checker,
)
from tests.gpu_runtime.server.serving import serve_in_thread
from tests.gpu_runtime.structured.test_engine_structured import SCHEMA

KEY = "sk-structured"
MODEL = "tiny-llama"
FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def served(tiny_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine]]:
    engine = Engine.from_directory(
        tiny_dir,
        EngineConfig(
            num_kv_blocks=256,
            block_size=8,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=256,
            static_decode_batches=True,
            cuda_graph_batch_sizes=(1, 2, 4, 8),
            async_scheduling=request.param,
        ),
    )
    loop = EngineLoop(engine)
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])), MetricsCollector())
    try:
        with serve_in_thread(app) as url:
            yield url, engine
    finally:
        loop.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def test_chat_json_schema_answers_match_the_schema(served: tuple[str, Engine]) -> None:
    client = _client(served[0])
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who are you?"}],
        max_tokens=80,
        temperature=0.0,
        response_format=FORMAT,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Who are you?"}],
        max_tokens=80,
        temperature=0.0,
        response_format=FORMAT,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content


def test_completions_json_schema_json_object_and_text(served: tuple[str, Engine]) -> None:
    client = _client(served[0])
    answer = client.completions.create(
        model=MODEL,
        prompt=["Hello world", "Once upon"],
        max_tokens=80,
        temperature=0.0,
        extra_body={"response_format": FORMAT},
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    obj = client.completions.create(
        model=MODEL,
        prompt="Hello, world!",
        max_tokens=120,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].text), dict)
    plain = client.completions.create(
        model=MODEL,
        prompt="Hello world",
        max_tokens=12,
        temperature=0.0,
        extra_body={"response_format": {"type": "text"}},
    )
    free = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=12, temperature=0
    )
    assert plain.choices[0].text == free.choices[0].text
    assert served[1].structured.num_matchers == 0


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objx"}}}, "objx"),
        ({"type": "json_schema"}, "needs a json_schema"),
        ({"type": "json_object", "json_schema": {"name": "x"}}, "only taken with type"),
        ({"type": "yaml"}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "pattern"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "x": 1}}, "x"),
        ({"type": "json_schema", "json_schema": {"name": "x", "description": "d"}}, "descr"),
    ],
)
def test_bad_response_formats_are_400_naming_the_field(
    served: tuple[str, Engine], response_format: dict[str, Any], message: str
) -> None:
    client = _client(served[0])
    for stream in (False, True):
        request: dict[str, Any] = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            response_format=response_format,
            stream=stream,
        )
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**request)
        error = caught.value.body
        assert isinstance(error, dict)
        assert str(error["param"]).startswith("response_format"), error
        assert message.lower() in str(error["message"]).lower(), error
    assert served[1].structured.num_matchers == 0
    assert not served[1].has_unfinished_requests()


@pytest.mark.parametrize("field", ["structured_outputs", "guided_json", "guided_regex"])
def test_vllm_structured_fields_are_refused_naming_them(
    served: tuple[str, Engine], field: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _client(served[0]).completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={field: {"regex": "a+"}}
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == field
