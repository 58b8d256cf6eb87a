"""Conversations with tools, assistant tool calls and tool results rendered for inference: with
the real Llama 3.1 and Qwen2.5 templates exactly as the template itself renders them, and by the
documented fallback without a template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.contract.chat import ChatTemplateError, render_conversation
from gpu_runtime.contract.tiny_tokenizer import build_tiny_tokenizer
from gpu_runtime.server.chat_protocol import ChatMessage, ToolDefinition
from tests.gpu_runtime.chat_models import build_chat_tokenizer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def _tokenizer(tmp_path: Path, family: str | None) -> Any:
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path)
    if family is not None:
        build_chat_tokenizer(tmp_path, family)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    if family is None:
        tokenizer.chat_template = None
    return tokenizer


def _request_messages(calls: int) -> list[dict[str, Any]]:
    """The conversation as an OpenAI client sends it."""
    tool_calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ][:calls]
    parts: Any = [{"type": "text", "text": "noon"}]
    results = [
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": parts},
    ][:calls]
    return [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *results,
    ]


def _template_messages(calls: int) -> list[dict[str, Any]]:
    """The same conversation as chat templates expect it (written out by hand)."""
    tool_calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ][:calls]
    results = [
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
    ][:calls]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *results,
    ]


def _rendered(tokenizer: Any, calls: int) -> str:
    messages = [ChatMessage.model_validate(m).template_dict() for m in _request_messages(calls)]
    tools = [ToolDefinition.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]
    return render_conversation(tokenizer, messages, tools)


@pytest.mark.parametrize(("family", "calls"), [("llama3.1", 1), ("qwen2.5", 2)])
def test_the_templates_own_rendering(tmp_path: Path, family: str, calls: int) -> None:
    tokenizer = _tokenizer(tmp_path, family)
    expected = tokenizer.apply_chat_template(
        _template_messages(calls), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    rendered = _rendered(tokenizer, calls)
    assert rendered == expected
    assert '"name": "get_weather"' in rendered and "18 C, sunny" in rendered


def test_a_template_refusing_the_conversation_raises(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        _rendered(_tokenizer(tmp_path, "llama3.1"), 2)


def test_the_fallback_renders_tools_and_calls_hermes_style(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, None)
    messages = [ChatMessage.model_validate(m).template_dict() for m in _request_messages(2)]
    messages.insert(2, {"role": "user", "name": "ann", "content": "And the time?"})
    rendered = render_conversation(tokenizer, messages, TOOLS[1:])
    assert rendered == (
        "<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more "
        "functions to answer. Their signatures, as JSON schemas, are within <tools></tools>:\n"
        '<tools>\n{"type": "function", "function": {"name": "get_time"}}\n</tools>\n\n'
        "To call a function, answer with one block per call:\n<tool_call>\n"
        '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\nWeather\nin Paris?<|im_end|>\n"
        "<|im_start|>user name=ann\nAnd the time?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_fallback_without_tools_is_the_plain_chatml(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, None)
    rendered = render_conversation(tokenizer, [{"role": "user", "content": "Hi"}], None)
    assert rendered == "<|begin_of_text|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
