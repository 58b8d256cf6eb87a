"""Tool calls through the official `openai` client, against tiny models whose tokenizers carry
the real Llama 3.1 and Qwen2.5 chat templates, or none (the fallback render): the prompt is the
template's own rendering, calls constrained by `required` or a named tool_choice come back as
`tool_calls` (whole and streamed), answers that are not calls stay content (also streamed), and
bad tool requests are 400s naming their field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gpu_runtime.contract.chat import render_conversation
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.server import BearerKeys, EngineLoop, create_app, static_key_checker
from tests.gpu_runtime.chat_models import MAX_MODEL_LEN, build_chat_model_dir
from tests.gpu_runtime.server.serving import serve_in_thread
from tests.gpu_runtime.server.test_tool_calls import TIME, WEATHER

KEY = "sk-test-key"
MODEL = "tiny-chat"
Served = tuple[openai.OpenAI, Any, str]
"""A client, the engine's tokenizer, the family."""


@pytest.fixture(scope="module", params=["qwen2.5", "llama3.1", "no-template"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Served]:
    model_dir: Path = build_chat_model_dir(tmp_path_factory.mktemp("tools"), request.param, seed=5)
    engine = Engine.from_directory(
        model_dir,
        EngineConfig(
            num_kv_blocks=512,
            block_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=MAX_MODEL_LEN,
        ),
    )
    loop = EngineLoop(engine)
    loop.start()
    app = create_app(loop, MODEL, BearerKeys(static_key_checker([KEY])))
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
            yield client, engine.tokenizer, request.param
    finally:
        loop.stop()


ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 10, "temperature": 0.0}
    return client.chat.completions.create(**(args | kwargs))


def test_an_answer_that_is_no_call_is_content(served: Served) -> None:
    client, _, _ = served
    auto = _chat(client, tools=[WEATHER, TIME])
    none = _chat(client, tools=[WEATHER, TIME], tool_choice="none")
    choice = auto.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content == none.choices[0].message.content  # same prompt, greedy
    assert choice.message.content  # the random model wrote something
    # the tools are in the prompt: it is longer than without them
    assert auto.usage.prompt_tokens > _chat(client).usage.prompt_tokens


def test_streamed_content_equals_the_whole_answer(served: Served) -> None:
    client, _, _ = served
    whole = _chat(client, tools=[WEATHER, TIME], max_tokens=16)
    chunks = list(_chat(client, tools=[WEATHER, TIME], max_tokens=16, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].delta.tool_calls is None for c in chunks)


def test_the_prompt_is_the_templates_own_rendering(served: Served) -> None:
    client, tokenizer, family = served
    calls = 1 if family == "llama3.1" else 2  # Llama 3.1's template takes one call a turn
    tool_calls = [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ][:calls]
    history: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "18 C"} for c in tool_calls),
    ]
    answer = _chat(client, messages=history, tools=[WEATHER, TIME])
    as_template_sees_it = [
        history[0],
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {}},
                },
            ][:calls],
        },
        *({"role": "tool", "content": "18 C", "tool_call_id": c["id"]} for c in tool_calls),
    ]
    if family == "no-template":  # the fallback (its text: tests/gpu_runtime/contract)
        text = render_conversation(tokenizer, as_template_sees_it, [WEATHER, TIME])
        assert "<tool_response>\n18 C\n</tool_response>" in text
    else:
        text = tokenizer.apply_chat_template(
            as_template_sees_it, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True
        )
    assert answer.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_text_parts_are_the_joined_text(served: Served) -> None:
    client, _, _ = served
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the weather"},
                {"type": "text", "text": "in Paris?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "What is the weather\nin Paris?"}]
    a, b = _chat(client, messages=parts), _chat(client, messages=joined)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                    }
                ]
            },
            "messages.0.content",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools.0.function.parameters",
        ),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    served: Served, kwargs: dict[str, Any], param: str
) -> None:
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, **kwargs)
    body: Any = caught.value.body
    assert body["param"] == param, body


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "names"),
    [(NAMED, True, {"get_weather"}), ("required", False, {"get_weather", "get_time"})],
)
def test_constrained_calls_are_parsed_calls(
    served: Served, tool_choice: Any, parallel: bool, names: set[str]
) -> None:
    """A random model held to the call grammar writes one valid call, in its family's format,
    which comes back as `tool_calls`; streamed, the client accumulates the same calls."""
    client, _, _ = served
    kwargs: dict[str, Any] = {
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "max_tokens": 200,
    }
    for seed in (1, 2):
        answer = _chat(client, temperature=1.0, seed=seed, **kwargs)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments in ({"city": "Paris"}, {"city": "Rome"})
        else:
            assert arguments == {}
        with client.chat.completions.stream(
            model=MODEL, messages=ASK, temperature=1.0, seed=seed, **kwargs
        ) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert streamed.message.content is None
        assert streamed.message.tool_calls is not None
        got = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
        assert got == [(call.function.name, call.function.arguments)]


def test_auto_with_a_strict_function_is_text_or_valid_calls(served: Served) -> None:
    """Decoding is constrained to text or calls matching their schemas: whatever the random
    model writes comes back as content or as valid calls."""
    client, _, _ = served
    strict = [WEATHER | {"function": WEATHER["function"] | {"strict": True}}, TIME]
    for seed in range(4):
        choice = _chat(client, tools=strict, temperature=1.0, seed=seed, max_tokens=60).choices[0]
        for call in choice.message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            assert (call.function.name, arguments) in (
                ("get_weather", {"city": "Paris"}),
                ("get_weather", {"city": "Rome"}),
                ("get_time", {}),
            )
        if not choice.message.tool_calls:
            assert choice.message.content is not None


def test_the_answer_goes_back_into_the_history(served: Served) -> None:
    """The assistant message the client got (whole, or accumulated from a stream) is sent back
    with the tool's result, as an agent loop does."""
    client, _, family = served
    kwargs: dict[str, Any] = {"tools": [WEATHER, TIME], "tool_choice": NAMED, "seed": 3}
    whole = _chat(client, temperature=1.0, max_tokens=200, **kwargs).choices[0].message
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, temperature=1.0, max_tokens=200, **kwargs
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message
    for message in (whole, streamed):
        assert message.tool_calls is not None
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}
        history: list[Any] = [*ASK, message, result]
        answer = _chat(client, messages=history, tools=[WEATHER, TIME])
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), family


def test_each_of_n_choices_is_held_to_the_call_grammar(served: Served) -> None:
    """`n` choices of a named tool_choice: one matcher per sequence, each choice a parsed call,
    and the stream gives each choice the calls of the whole answer."""
    client, _, _ = served
    kwargs: dict[str, Any] = {"tools": [WEATHER, TIME], "tool_choice": NAMED, "max_tokens": 200}
    answer = _chat(client, temperature=1.0, seed=3, n=2, **kwargs)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls is not None and [c.function.name for c in calls] == ["get_weather"]
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, temperature=1.0, seed=3, n=2, **kwargs
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices
    assert [
        [(c.function.name, c.function.arguments) for c in s.message.tool_calls or []]
        for s in streamed
    ] == [
        [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []]
        for a in answer.choices
    ]


def test_a_name_the_template_does_not_render_is_a_400(served: Served) -> None:
    """Llama 3.1's and Qwen2.5's templates leave a message's `name` out: it would be accepted
    and dropped, so it is refused naming the message; the fallback renders it."""
    client, _, family = served
    unnamed = [{"role": "system", "content": "Be brief."}, ASK[0]]
    named = [unnamed[0], {**ASK[0], "name": "alice"}]
    if family == "no-template":
        with_name = _chat(client, messages=named, max_tokens=2).usage.prompt_tokens
        assert with_name > _chat(client, messages=unnamed, max_tokens=2).usage.prompt_tokens
        return
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, messages=named)
    body: Any = caught.value.body
    assert body["param"] == "messages.1.name", body
    assert "does not render a message's name" in body["message"]
