"""The Llama 3.1 JSON and Hermes (Qwen2.5) tool-call formats: whole answers (read through a
request's `ToolPlan`, which offers `get_weather` and `get_time`) and the settled segments of
partial ones."""

from __future__ import annotations

import pytest

from gpu_runtime.contract.tiny_tokenizer import CHAT_TEMPLATE
from gpu_runtime.server.chat_protocol import ToolDefinition
from gpu_runtime.server.tool_calls import ParsedOutput, plan_tools
from gpu_runtime.server.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    ParsedCall,
    Segment,
    ToolCallFormat,
    format_of_template,
)
from tests.gpu_runtime.chat_models import LLAMA3_1_TEMPLATE, QWEN2_5_TEMPLATE

WEATHER = ParsedCall("get_weather", {"city": "Paris", "days": 2})
TIME = ParsedCall("get_time", {})
OFFERED = [
    ToolDefinition.model_validate({"type": "function", "function": {"name": name}})
    for name in ("get_weather", "get_time")
]


def _parse(fmt: ToolCallFormat, text: str) -> ParsedOutput | None:
    template = LLAMA3_1_TEMPLATE if fmt is LLAMA3_JSON else QWEN2_5_TEMPLATE
    plan = plan_tools(OFFERED, "auto", True, [], template)
    assert plan is not None and plan.format is fmt
    segments = fmt.segments(text, True, plan.accepts)
    # a whole answer's segments cover it, in order
    assert [(s.start, s.end) for s in segments][:1] == ([(0, segments[0].end)] if text else [])
    assert all(a.end == b.start for a, b in zip(segments, segments[1:], strict=False))
    assert (segments[-1].end if segments else 0) == len(text)
    return plan.extract(text)


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
    assert _parse(LLAMA3_JSON, text) == ParsedOutput(None, expected)


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
        '{"name": "send_mail", "parameters": {}}',  # a function not offered
        "",
    ],
)
def test_llama3_non_calls_are_content(text: str) -> None:
    assert _parse(LLAMA3_JSON, text) is None


def test_hermes_calls_and_the_content_around_them() -> None:
    one = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>"
    )
    two = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _parse(HERMES, one) == ParsedOutput(None, (WEATHER,))
    assert _parse(HERMES, f"{one}\n{two}\n") == ParsedOutput(None, (WEATHER, TIME))
    assert _parse(HERMES, f"Let me look.\n{one}") == ParsedOutput("Let me look.\n", (WEATHER,))
    assert _parse(HERMES, f"{one} done") == ParsedOutput(" done", (WEATHER,))
    # the model stopped right after the JSON: the last block may stay open
    assert _parse(HERMES, f'{two}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}') == (
        ParsedOutput(None, (TIME, TIME))
    )


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "get_time", "arguments": {}\n',  # open and incomplete
        '<tool_call>\n{"name": "get_time", "parameters": {}}\n</tool_call>',  # wrong key
        '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',  # not offered
    ],
)
def test_hermes_non_calls_are_content(text: str) -> None:
    assert _parse(HERMES, text) is None


def test_a_hermes_block_that_is_no_call_is_content_beside_the_calls() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _parse(HERMES, f"{call}<tool_call>[]</tool_call>") == (
        ParsedOutput("<tool_call>[]</tool_call>", (TIME,))
    )


def _settled(fmt: ToolCallFormat, text: str) -> list[Segment]:
    return fmt.segments(text, False, lambda call: True)


@pytest.mark.parametrize(
    ("text", "settled"),
    [
        ("Hello", [Segment(0, 5)]),
        ("Hello <tool", [Segment(0, 6)]),  # a tag may be starting: held
        ("Hello <tool_call>\n{", [Segment(0, 6)]),  # an open block: held
        ("Hello <b>", [Segment(0, 9)]),
        ("<", []),
        ("", []),
        (
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_c',
            [Segment(0, 62, TIME), Segment(62, 63)],
        ),
    ],
)
def test_hermes_partial_answers(text: str, settled: list[Segment]) -> None:
    assert _settled(HERMES, text) == settled


@pytest.mark.parametrize(
    ("text", "settled"),
    [
        ("Hello", [Segment(0, 5)]),
        ("  ", []),
        (' {"na', []),
        ("<|py", []),
        ("<|python_tag|>{", []),
        ('{"name": "get_time", "parameters": {}}; ', []),  # calls settle when the answer ends
        ("<b>", [Segment(0, 3)]),
    ],
)
def test_llama3_partial_answers(text: str, settled: list[Segment]) -> None:
    assert _settled(LLAMA3_JSON, text) == settled
