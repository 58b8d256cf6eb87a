"""Tool requests checked against the model's template, answers split into calls, the streamed
deltas (accumulated as the openai client does) equal to the whole answer, and the structural
tags that constrain `required` and named calls, compiled by xgrammar over a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gpu_runtime.contract.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from gpu_runtime.server.chat_protocol import ChatMessage, NamedToolChoice, ToolDefinition
from gpu_runtime.server.protocol import OpenAIError
from gpu_runtime.server.tool_calls import ToolPlan, assistant_message, plan_tools
from gpu_runtime.server.tool_constraints import call_structural_tag
from gpu_runtime.server.tool_stream import ToolCallStream
from tests.gpu_runtime.chat_models import LLAMA3_1_TEMPLATE, QWEN2_5_TEMPLATE

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [ToolDefinition.model_validate(WEATHER), ToolDefinition.model_validate(TIME)]
USER = [ChatMessage(role="user", content="hi")]


def _plan(choice: Any = None, parallel: bool = True, template: str = QWEN2_5_TEMPLATE) -> ToolPlan:
    named = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
    plan = plan_tools(TOOLS, named, parallel, USER, template)
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "only 'text' parts",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "must be {'type': 'text'"),
        ({"role": "user"}, "content is required"),
        ({"role": "assistant", "content": None}, "content is required"),
        ({"role": "tool", "content": "x"}, "tool_call_id is required"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id is required"),
        ({"role": "user", "content": "x", "tool_calls": []}, "only allowed on assistant"),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                ],
            },
            "must be a JSON object",
        ),
        ({"role": "assistant", "content": "x", "refusal": "no"}, "refusal"),
        ({"role": "function", "content": "x"}, "role"),
    ],
)
def test_bad_messages_are_refused(message: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ChatMessage.model_validate(message)


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ({"name": "f", "parameters": {"type": "nope"}}, "not a valid JSON schema"),
        ({"name": "f", "parameters": {"type": "array"}}, "must describe an object"),
        ({"name": "no spaces"}, "string_pattern_mismatch|should match pattern"),
    ],
)
def test_bad_tools_are_refused(function: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ToolDefinition.model_validate({"type": "function", "function": function})


@pytest.mark.parametrize(
    ("tools", "choice", "template", "param"),
    [
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            QWEN2_5_TEMPLATE,
            "tool_choice",
        ),
        (None, "required", QWEN2_5_TEMPLATE, "tool_choice"),
        (TOOLS, "auto", CHAT_TEMPLATE, "tools"),  # a template without tools
        (TOOLS + TOOLS[:1], "auto", QWEN2_5_TEMPLATE, "tools"),  # duplicate names
    ],
)
def test_plans_that_cannot_be_served(
    tools: list[ToolDefinition] | None, choice: Any, template: str, param: str
) -> None:
    named = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else choice
    with pytest.raises(OpenAIError) as caught:
        plan_tools(tools, named, True, USER, template)
    assert caught.value.status == 400 and caught.value.param == param


def test_history_calls_need_a_template_that_renders_them() -> None:
    history = [
        *USER,
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            }
        ),
    ]
    with pytest.raises(OpenAIError) as caught:
        plan_tools(None, None, True, history, CHAT_TEMPLATE)
    assert caught.value.param == "messages.1.tool_calls"
    assert plan_tools(None, None, True, history, QWEN2_5_TEMPLATE) is None


def _call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_answers_split_into_calls_and_content() -> None:
    two = f"Checking.\n{_call('get_weather', {'city': 'Rome'})}\n{_call('get_time', {})}"
    message, finish = assistant_message(_plan(), two, "stop")
    assert finish == "tool_calls" and message["content"] == "Checking.\n\n"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # one call only without parallel calls; the engine's reason when it did not stop itself
    message, finish = assistant_message(_plan(parallel=False), two, "length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert finish == "length"
    # tool_choice none, an unknown function, or no call at all: content as generated
    unknown = _call("send_mail", {})
    for plan, text in [(_plan("none"), two), (_plan(), unknown), (_plan(), "Hello")]:
        assert assistant_message(plan, text, "stop") == (
            {"role": "assistant", "content": text},
            "stop",
        )


def _accumulate(plan: ToolPlan, text: str, step: int, holdback: int = 0) -> dict[str, Any]:
    """Stream `text` `step` characters at a time, as the route frames the deltas, through the
    openai client's own stream accumulation; the final message and finish reason."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()

    def send(delta: dict[str, Any], finish: str | None = None) -> None:
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))

    stream = ToolCallStream(plan)
    send({"role": "assistant", "content": None})
    ends = [*range(step, len(text), step), len(text)]
    for end in ends:
        for delta in stream.deltas(text[:end], end == len(text), holdback):
            send(delta)
    send({}, stream.finish_reason("stop"))
    choice = state.get_final_completion().choices[0]
    merged: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        merged["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in choice.message.tool_calls
        ]
    return merged | {"finish_reason": choice.finish_reason}


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", [])]
    return message | ({"tool_calls": calls} if calls else {})


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    ("template", "text"),
    [
        (QWEN2_5_TEMPLATE, f"Checking <now>.\n{_call('get_weather', {'city': 'Rome'})}"),
        (QWEN2_5_TEMPLATE, f"{_call('get_time', {})} \n<tool_call>[]</tool_call> \n"),
        (QWEN2_5_TEMPLATE, f"{_call('get_time', {})}\n{_call('send_mail', {})}"),
        (QWEN2_5_TEMPLATE, "\n <tool_call>\n{broken"),
        (QWEN2_5_TEMPLATE, f"\n{_call('get_time', {})}\n{_call('get_time', {})}\n"),
        (QWEN2_5_TEMPLATE, "No <tool_call> here"),
        (QWEN2_5_TEMPLATE, "  plain text"),
        (
            LLAMA3_1_TEMPLATE,
            '{"name": "get_time", "parameters": {}}; '
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        ),
        (LLAMA3_1_TEMPLATE, '{"not": "a call"}'),
        (LLAMA3_1_TEMPLATE, "The weather is fine."),
    ],
)
def test_streamed_deltas_accumulate_to_the_whole_answer(
    template: str, text: str, step: int, parallel: bool
) -> None:
    plan = _plan(template=template, parallel=parallel)
    message, finish = assistant_message(plan, text, "stop")
    streamed = _accumulate(plan, text, step, holdback=2)
    assert _without_ids(streamed) == _without_ids(message) | {"finish_reason": finish}


def test_a_hermes_call_streams_once_its_block_is_closed() -> None:
    stream = ToolCallStream(_plan())
    first = _call("get_weather", {"city": "Rome"})
    assert stream.deltas(first[:-1], False, 0) == []
    (delta,) = stream.deltas(f"{first}\n<tool", False, 0)
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    (delta,) = stream.deltas(f"{first}\n{_call('get_time', {})}", True, 0)
    assert delta["tool_calls"][0]["index"] == 1  # the "\n" between them: blank, held
    assert stream.finish_reason("stop") == "tool_calls"


def test_content_streams_before_the_call_and_holds_from_it() -> None:
    stream = ToolCallStream(_plan())
    assert stream.deltas("   ", False, 0) == []  # only whitespace so far: may be no content
    assert stream.deltas("   Sure <tool", False, 0) == [{"content": "   Sure "}]
    assert stream.deltas('   Sure <tool_call>\n{"name": "get_time", ', False, 0) == []
    llama = ToolCallStream(_plan(template=LLAMA3_1_TEMPLATE))
    assert llama.deltas("Hi", False, 0) == [{"content": "Hi"}]
    assert llama.deltas("Hi {", False, 0) == [{"content": " {"}]


def _matcher(tmp_path: Path, plan: ToolPlan) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=512, stop_token_ids=[tokenizer.eos_token_id]
    )
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(
        json.dumps(call_structural_tag(plan))
    )
    return lambda: xgr.GrammarMatcher(grammar)


@pytest.mark.parametrize(
    ("template", "separator"), [(QWEN2_5_TEMPLATE, "\n"), (LLAMA3_1_TEMPLATE, "; ")]
)
def test_constrained_calls_are_exactly_what_the_parser_reads(
    tmp_path: Path, template: str, separator: str
) -> None:
    def calls(*pairs: tuple[str, dict[str, Any]]) -> str:
        if template is QWEN2_5_TEMPLATE:
            return separator.join(_call(name, args) for name, args in pairs)
        return separator.join(
            json.dumps({"name": name, "parameters": args}) for name, args in pairs
        )

    weather: tuple[str, dict[str, Any]] = ("get_weather", {"city": "Rome"})
    time: tuple[str, dict[str, Any]] = ("get_time", {})
    for choice, parallel, accepted, refused in [
        (
            "required",
            True,
            [calls(weather, time), calls(time)],
            [calls(("get_weather", {"city": "Oslo"})), "Hello", calls(("send_mail", {}))],
        ),
        ("required", False, [calls(time)], [calls(weather, time)]),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            True,
            [calls(weather)],
            [calls(time), calls(weather, weather)],
        ),
    ]:
        plan = _plan(choice, parallel, template)
        matcher = _matcher(tmp_path, plan)
        for text in accepted:
            m = matcher()
            assert m.accept_string(text) and m.is_completed(), text
            parsed = plan.extract(text)
            assert parsed is not None and parsed.content is None
        for text in refused:
            m = matcher()
            assert not (m.accept_string(text) and m.is_completed()), text


STRICT_TOOLS = [
    ToolDefinition.model_validate(WEATHER | {"function": WEATHER["function"] | {"strict": True}}),
    TOOLS[1],
]


@pytest.mark.parametrize("template", [QWEN2_5_TEMPLATE, LLAMA3_1_TEMPLATE])
def test_auto_with_a_strict_function_allows_text_or_valid_calls(
    tmp_path: Path, template: str
) -> None:
    plan = plan_tools(STRICT_TOOLS, "auto", True, USER, template)
    assert plan is not None and plan.strict_auto and not plan.constrained
    matcher = _matcher(tmp_path, plan)
    if template is QWEN2_5_TEMPLATE:
        good = _call("get_weather", {"city": "Rome"})
        bad = _call("get_weather", {"city": "Oslo"})
        accepted = ["Hello", f"Let me see.\n{good}", f"{good}\n{_call('get_time', {})}", ""]
        refused = [bad, f"Let me see.\n{bad}", _call("send_mail", {})]
    else:
        good = json.dumps({"name": "get_weather", "parameters": {"city": "Rome"}})
        bad = json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}})
        accepted = ["Hello {x}", good, f'{good}; {{"name": "get_time", "parameters": {{}}}}', ""]
        refused = [bad, '{"city": "Rome"}', " {", "<|python_tag|>" + bad]
    for text in accepted:
        m = matcher()
        assert m.accept_string(text) and m.is_completed(), text
    for text in refused:
        m = matcher()
        assert not (m.accept_string(text) and m.is_completed()), text
    # a plan without strict functions under auto is not constrained
    loose = plan_tools(TOOLS, "auto", True, USER, template)
    assert loose is not None and not loose.strict_auto
