"""The Llama 3.1 JSON and Hermes (Qwen2.5) tool-call formats: whole answers and partial ones."""

from __future__ import annotations

import pytest

from gpu_runtime.contract.tiny_tokenizer import CHAT_TEMPLATE
from gpu_runtime.server.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    ParsedCall,
    ParsedOutput,
    format_of_template,
)
from tests.gpu_runtime.chat_models import LLAMA3_1_TEMPLATE, QWEN2_5_TEMPLATE

WEATHER = ParsedCall("get_weather", {"city": "Paris", "days": 2})
TIME = ParsedCall("get_time", {})


def test_formats_are_read_off_the_real_templates() -> None:
    assert format_of_template(LLAMA3_1_TEMPLATE) is LLAMA3_JSON
    assert format_of_template(QWEN2_5_TEMPLATE) is HERMES
    assert format_of_template(None) is HERMES  # the fallback render is Hermes-shaped
    assert format_of_template(CHAT_TEMPLATE) is None  # ChatML without tools


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', (WEATHER,)),
        (
            ' \n<|python_tag|>{"name": "get_weather", '
            '"parameters": {"city": "Paris", "days": 2}}\n',
            (WEATHER,),
        ),
        ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', (WEATHER,)),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
            '{"name": "get_time", "parameters": {}}',
            (WEATHER, TIME),
        ),
        ('{"name": "get_time", "parameters": {}};', (TIME,)),
    ],
)
def test_llama3_calls(text: str, expected: tuple[ParsedCall, ...]) -> None:
    assert LLAMA3_JSON.parse(text) == ParsedOutput(None, expected)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        'Sure: {"name": "get_time", "parameters": {}}',  # text before the call
        '{"name": "get_time", "parameters": {}} and more',  # text after it
        '{"name": "get_time", "parameters": {}',  # cut off
        '{"name": "get_time"}',  # no arguments
        '{"name": "get_time", "parameters": {}, "arguments": {}}',  # both
        '{"name": "get_time", "parameters": [1]}',  # arguments not an object
        '{"city": "Paris"}',  # JSON, not a call
        "",
    ],
)
def test_llama3_non_calls_are_content(text: str) -> None:
    assert LLAMA3_JSON.parse(text) is None


def test_hermes_calls_and_the_content_around_them() -> None:
    one = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>"
    )
    two = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert HERMES.parse(one) == ParsedOutput(None, (WEATHER,))
    assert HERMES.parse(f"{one}\n{two}\n") == ParsedOutput(None, (WEATHER, TIME))
    assert HERMES.parse(f"Let me look.\n{one}") == ParsedOutput("Let me look.\n", (WEATHER,))
    assert HERMES.parse(f"{one} done") == ParsedOutput(" done", (WEATHER,))
    # the model stopped right after the JSON: the last block may stay open
    assert HERMES.parse(f'{two}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}') == (
        ParsedOutput(None, (TIME, TIME))
    )


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "get_time", "arguments": {}\n',  # open and incomplete
        '<tool_call>\n{"name": "get_time", "parameters": {}}\n</tool_call>',  # wrong key
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>[]</tool_call>',
    ],
)
def test_hermes_non_calls_are_content(text: str) -> None:
    assert HERMES.parse(text) is None


@pytest.mark.parametrize(
    ("text", "until"),
    [
        ("Hello", 5),
        ("Hello <tool", 6),  # a tag may be starting: held
        ("Hello <tool_call>\n{", 6),
        ("Hello <b>", 9),
        ("<", 0),
        ("", 0),
    ],
)
def test_hermes_content_until(text: str, until: int) -> None:
    assert HERMES.content_until(text) == until


@pytest.mark.parametrize(
    ("text", "until"),
    [
        ("Hello", 5),
        ("  ", 0),
        (' {"na', 0),
        ("<|py", 0),
        ("<|python_tag|>{", 0),
        ("<b>", 3),
    ],
)
def test_llama3_content_until(text: str, until: int) -> None:
    assert LLAMA3_JSON.content_until(text) == until
