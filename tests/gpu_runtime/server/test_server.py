"""The server under uvicorn on a free port, driven by the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import (
    BearerKeys,
    EngineLoop,
    MetricsCollector,
    create_app,
    static_key_checker,
)
from tests.gpu_runtime.server.serving import serve_in_thread

KEY = "sk-test-key"
MODEL = "tiny-llama"
Served = tuple[str, MetricsCollector, EngineLoop]
"""Base URL, the app's metrics, the engine loop."""


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Served]:
    """The server over a synchronous engine, and over an async-scheduling one as
    `python -m gpu_runtime.server` deploys it (bucketed decode steps, so steps overlap on CPU
    too; the last test checks that they did)."""
    model_dir: Path = build_tiny_model_dir(tmp_path_factory.mktemp("srv"), "llama", seed=3)
    engine = Engine.from_directory(
        model_dir,
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
    metrics = MetricsCollector()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])), metrics)
    try:
        with serve_in_thread(app) as url:
            yield url, metrics, loop
    finally:
        loop.stop()


def _client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)


def test_models_and_completions(served: Served) -> None:
    base, metrics, _ = served
    client = _client(base)
    assert [m.id for m in client.models.list()] == [MODEL]
    first = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=12, temperature=0.0
    )
    again = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=12, temperature=0.0, logprobs=2
    )
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage is not None and first.usage.prompt_tokens > 0
    assert 1 <= first.usage.completion_tokens <= 12
    lp = again.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == again.usage.completion_tokens  # type: ignore[union-attr]
    many = client.completions.create(
        model=MODEL, prompt=["Hello world", "Once upon"], max_tokens=4, temperature=0.0
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == first.choices[0].text[: len(many.choices[0].text)]
    records = metrics.snapshot()
    assert len(records) >= 4
    assert all(r.ttft_s > 0 and r.e2e_s >= r.ttft_s for r in records)
    assert any(r.tpot_s is not None and r.tpot_s > 0 for r in records)


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(served: Served) -> None:
    """The second request with the same long prefix finds it in the engine's prefix cache:
    `usage.prompt_tokens_details.cached_tokens` counts those tokens, whole and streamed."""
    client = _client(served[0])
    prefix = "You are a careful assistant who answers about lighthouses and tides. " * 3
    first = client.completions.create(
        model=MODEL, prompt=prefix + "First question?", max_tokens=2, temperature=0.0
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(
        model=MODEL, prompt=prefix + "Second one!", max_tokens=2, temperature=0.0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < second.usage.prompt_tokens and cached % 8 == 0
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prefix + "A third.",
            max_tokens=2,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_chat_and_streaming_with_usage(served: Served) -> None:
    client = _client(served[0])
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a short poem about the sea."}
    ]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0.0,
    )
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content or ""
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    pieces = list(
        client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=12, temperature=0.0, stream=True
        )
    )
    plain = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=12, temperature=0.0
    )
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_stop_strings_cut_the_stream(served: Served) -> None:
    client = _client(served[0])
    plain = (
        client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, temperature=0.0)
        .choices[0]
        .text
    )
    assert len(plain) > 4
    stop = plain[2:4]
    cut = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=20, temperature=0.0, stop=[stop]
    )
    assert cut.choices[0].text == plain[: plain.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    pieces = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=20,
            temperature=0.0,
            stop=[stop],
            stream=True,
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == cut.choices[0].text


def test_errors_have_openai_shape(served: Served) -> None:
    base = served[0]
    with pytest.raises(openai.AuthenticationError) as auth:
        _client(base, key="wrong").models.list()
    assert auth.value.status_code == 401
    client = _client(base)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(bad.value)
    with pytest.raises(openai.BadRequestError, match="max_model_len=256"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="max_model_len=256"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1000, stream=True
        )
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5.0
        )


def test_async_server_overlapped_steps(served: Served) -> None:
    """Runs last for each engine: the async engine did launch steps ahead (decode steps of
    the tests above), the synchronous one never did."""
    client = _client(served[0])
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0.0)
    engine = served[2].engine
    overlapped = served[2].run_in_loop(lambda: engine.runner.num_overlapped_steps).result(10)
    assert (overlapped > 0) == engine.config.async_scheduling


def test_a_long_prompt_is_tokenized_off_the_event_loop(served: Served) -> None:
    """A 2 MB prompt takes about a second to tokenize; meanwhile the server answers `/health`
    at once (the prompt is then refused as too long, 400)."""
    import threading
    import time

    import httpx

    base, _, _ = served
    root = base.removesuffix("/v1")
    prompt = "hello world, once upon a time " * 70_000
    outcome: list[int] = []

    def long_request() -> None:
        answer = httpx.post(f"{base}/completions", timeout=60,
                            headers={"authorization": f"Bearer {KEY}"},
                            json={"model": MODEL, "prompt": prompt, "max_tokens": 1})  # fmt: skip
        outcome.append(answer.status_code)

    thread = threading.Thread(target=long_request)
    started = time.monotonic()
    thread.start()
    waits = []
    while thread.is_alive():
        sent = time.monotonic()
        assert httpx.get(f"{root}/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - sent)
        time.sleep(0.02)
    thread.join()
    assert outcome == [400]
    took = time.monotonic() - started
    assert took > 0.5, f"the prompt took {took:.2f} s: too short to show a stall"
    assert max(waits) < 0.35 * took, (max(waits), took)
