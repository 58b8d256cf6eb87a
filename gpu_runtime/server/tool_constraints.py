"""Constrained decoding of tool calls: ``tool_choice`` ``"required"`` or a named function.

The answer is held to the family's own call format by an xgrammar structural tag
(`gpu_runtime.structured`, kind ``structural_tag``), so what the model writes is what
`tool_parsers` reads back:

- `HERMES`: ``<tool_call>\\n{"name": "<fn>", "arguments": <object matching its parameters>}
  \\n</tool_call>``, calls separated by ``\\n``;
- `LLAMA3_JSON`: ``{"name": "<fn>", "parameters": <object matching its parameters>}``, calls
  separated by ``; ``.

A named function allows exactly one call to it; ``"required"`` one or more calls to any of the
tools (exactly one with ``parallel_tool_calls: false``). No text is allowed around the calls,
and the grammar ends after the last one (the request then stops). ``"auto"`` with a function
marked ``strict`` allows text too: for `HERMES` any text in which every ``<tool_call>`` begins
a valid call, for `LLAMA3_JSON` either calls or text that cannot read as calls
(`LLAMA3_TEXT`). JSON inside a call is
limited to runs of at most `MAX_JSON_WHITESPACE` whitespace characters, so a model cannot spend
its tokens on layout.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from gpu_runtime.engine.request import SamplingParams
from gpu_runtime.server.protocol import OpenAIError
from gpu_runtime.server.tool_calls import ToolPlan
from gpu_runtime.server.tool_parsers import HERMES_END, HERMES_START, LLAMA3_JSON
from gpu_runtime.structured import StructuredOutputError, StructuredOutputParams
from gpu_runtime.structured.outputs import StructuredOutputs

MAX_JSON_WHITESPACE = 1
"""Longest run of whitespace the grammar allows inside a call's JSON."""
LLAMA3_TEXT = r"(\s*[^\s{<][\s\S]*)?"
"""A Llama 3 answer that is text under ``auto`` with a strict function: one that cannot read
as calls (it starts with neither ``{`` nor ``<``, e.g. ``<|python_tag|>``), or nothing."""


def _call_tag(plan: ToolPlan, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    head = json.dumps(name)
    if plan.format is LLAMA3_JSON:
        begin, end = f'{{"name": {head}, "parameters": ', "}"
    else:
        begin = f'{HERMES_START}\n{{"name": {head}, "arguments": '
        end = f"}}\n{HERMES_END}"
    content = {
        "type": "json_schema",
        "json_schema": parameters,
        "max_whitespace_cnt": MAX_JSON_WHITESPACE,
    }
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def call_structural_tag(plan: ToolPlan) -> dict[str, Any]:
    """The structural tag (xgrammar's JSON form) that holds the answer to `plan`: calls only
    (``required`` or named), or text or valid calls (``auto`` with a strict function)."""
    tools = [t for t in plan.tools if plan.forced is None or t.function.name == plan.forced]
    tags = [_call_tag(plan, t.function.name, t.function.parameters_schema()) for t in tools]
    separator = "; " if plan.format is LLAMA3_JSON else "\n"
    single = plan.forced is not None or not plan.parallel
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": single,
    }
    if plan.constrained:
        answer: dict[str, Any] = calls
    elif not plan.strict_auto:
        raise ValueError(f"tool_choice {plan.mode!r} without strict functions is not constrained")
    elif plan.format is LLAMA3_JSON:
        answer = {"type": "or", "elements": [calls, {"type": "regex", "pattern": LLAMA3_TEXT}]}
    else:
        answer = {
            "type": "triggered_tags",
            "triggers": [HERMES_START],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": single,
        }
    return {"type": "structural_tag", "format": answer}


async def constrain_to_calls(
    plan: ToolPlan | None, params: SamplingParams, structured: StructuredOutputs
) -> SamplingParams:
    """`params` constrained to `plan`'s calls when its tool_choice is ``required`` or named, or
    ``auto`` with a strict function (unchanged otherwise). The grammar is compiled here, in a
    worker thread (the engine then finds it in its compiler's cache), so a large schema never
    stalls the engine loop; one xgrammar cannot compile is a 400 naming ``tools``. A request
    whose ``response_format`` constrains it too is a 400 naming ``response_format``: one answer
    cannot follow two grammars, and neither is dropped silently."""
    if plan is None or not (plan.constrained or plan.strict_auto):
        return params
    if params.structured_output is not None:
        raise OpenAIError(
            400,
            "response_format cannot be combined with tool calls that are constrained "
            "(tool_choice 'required', a named function, or a strict function under 'auto')",
            param="response_format",
        )
    constraint = StructuredOutputParams("structural_tag", json.dumps(call_structural_tag(plan)))
    try:
        await asyncio.to_thread(lambda: structured.compiler.compile(constraint))
    except StructuredOutputError as exc:
        raise OpenAIError(400, f"tools cannot be constrained: {exc}", param="tools") from exc
    return replace(params, structured_output=constraint)
