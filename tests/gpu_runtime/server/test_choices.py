"""`n`, `best_of` and `echo` through the `openai` client, over a synchronous and an async
engine: choices per prompt (prompt-major indices), streamed per choice, usage over every
sequence, best_of's pick, the echoed prompt and its logprobs against a full forward."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.server import BearerKeys, EngineLoop, create_app, static_key_checker
from tests.gpu_runtime.server.serving import serve_in_thread

KEY = "sk-test-key"
MODEL = "tiny-llama"
Served = tuple[str, Path]
"""Base URL, the model directory."""
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Served]:
    model_dir: Path = build_tiny_model_dir(tmp_path_factory.mktemp("choices"), "llama", seed=3)
    config = EngineConfig(
        num_kv_blocks=128,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=128,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
        async_scheduling=request.param,
    )
    loop = EngineLoop(Engine.from_directory(model_dir, config))
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])))
    try:
        with serve_in_thread(app) as url:
            yield url, model_dir
    finally:
        loop.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def test_n_greedy_choices_equal_the_single_one_prompt_major(served: Served) -> None:
    client = _client(served[0])
    prompts = ["Hello world", "Once upon"]
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0.0)
        for p in prompts
    ]
    many = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0.0, n=3
    )
    assert [c.index for c in many.choices] == list(range(6))
    assert [c.text for c in many.choices] == [s.choices[0].text for s in single for _ in range(3)]
    assert [c.finish_reason for c in many.choices] == [
        s.choices[0].finish_reason for s in single for _ in range(3)
    ]
    usages = [s.usage for s in single]
    assert many.usage is not None and all(u is not None for u in usages)
    assert many.usage.prompt_tokens == sum(u.prompt_tokens for u in usages if u)
    assert many.usage.completion_tokens == 3 * sum(u.completion_tokens for u in usages if u)


def test_n_seeded_choices_repeat_and_differ(served: Served) -> None:
    client = _client(served[0])
    ask: dict[str, Any] = dict(
        model=MODEL, prompt="Hello world", max_tokens=10, temperature=1.0, seed=5, n=3
    )
    first = [c.text for c in client.completions.create(**ask).choices]
    again = [c.text for c in client.completions.create(**ask).choices]
    assert first == again
    assert len(set(first)) == 3


def test_n_streamed_per_choice_with_usage(served: Served) -> None:
    client = _client(served[0])
    ask: dict[str, Any] = dict(
        model=MODEL, prompt=["Hello world", "Once upon"], max_tokens=8, temperature=1.0, seed=9, n=2
    )
    whole = client.completions.create(**ask)
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    chunks = list(
        client.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert dict(finishes) == {c.index: [c.finish_reason] for c in whole.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage == whole.usage


def test_best_of_returns_the_highest_cumulative_logprob(served: Served) -> None:
    client = _client(served[0])
    ask: dict[str, Any] = dict(
        model=MODEL, prompt="Once upon", max_tokens=6, temperature=1.0, seed=3
    )
    candidates = client.completions.create(**ask, n=4, logprobs=0).choices
    sums = [sum(c.logprobs.token_logprobs) for c in candidates]
    ranked = sorted(range(4), key=lambda i: -sums[i])
    picked = client.completions.create(**ask, n=2, best_of=4)
    assert [c.text for c in picked.choices] == [candidates[i].text for i in ranked[:2]]
    assert [c.index for c in picked.choices] == [0, 1]
    assert all(c.logprobs is None for c in picked.choices)  # not asked for
    assert picked.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)


def test_best_of_is_checked_against_n_and_stream(served: Served) -> None:
    client = _client(served[0])
    extras: list[dict[str, Any]] = [{"n": 3, "best_of": 2}, {"n": 1, "best_of": 2, "stream": True}]
    for extra in extras:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)
        assert bad.value.body["param"] == "best_of"  # type: ignore[index]


def _reference_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """log-softmax of HF's full forward: row p predicts token p + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def test_echo_prepends_the_prompt_and_its_logprobs(served: Served) -> None:
    base, model_dir = served
    client = _client(base)
    plain = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=4, temperature=0.0
    )
    echoed = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=4, temperature=0.0, echo=True, n=2
    )
    assert [c.text for c in echoed.choices] == ["Once upon" + plain.choices[0].text] * 2
    prompt = [5, 77, 301, 42, 9, 250, 13]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0, echo=True, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = _reference_logprobs(model_dir, prompt)
    expected = [float(reference[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
    tops = lp.top_logprobs[1 : len(prompt)]  # keyed by text: equal texts may collide
    for position, top in enumerate(tops, start=1):
        assert top is not None and 1 <= len(top) <= 2
        values = reference[position - 1].topk(2).values.tolist()
        assert all(min(abs(v - r) for r in values) < 1e-4 for v in top.values())
    streamed = list(
        client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=4, temperature=0.0, echo=True, stream=True
        )
    )
    assert streamed[0].choices[0].text.startswith("Once upon")
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_chat_n_whole_and_streamed(served: Served) -> None:
    client = _client(served[0])
    single = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0
    )
    many = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.message.content for c in many.choices] == [single.choices[0].message.content] * 2
    assert many.usage is not None and single.usage is not None
    assert many.usage.completion_tokens == 2 * single.usage.completion_tokens
    ask: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=4, n=2
    )
    whole = client.chat.completions.create(**ask)
    texts: dict[int, str] = defaultdict(str)
    roles: dict[int, str] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert roles == {0: "assistant", 1: "assistant"}


def test_streamed_logprobs_per_chunk_equal_the_whole_answers(served: Served) -> None:
    client = _client(served[0])
    ask: dict[str, Any] = dict(
        model=MODEL, prompt=[5, 77, 301, 42], max_tokens=5, temperature=0.0, logprobs=2, n=2
    )
    for echo in (False, True):
        whole = client.completions.create(**ask, echo=echo)
        got: dict[int, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
        for chunk in client.completions.create(**ask, echo=echo, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        got[choice.index][key] += getattr(choice.logprobs, key)
        for choice in whole.choices:
            lp = choice.logprobs
            assert lp is not None
            streamed = got[choice.index]
            assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
            assert streamed["top_logprobs"] == lp.top_logprobs
            assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs)
