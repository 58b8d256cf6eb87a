"""A chat request's tools: validated against the model, parsed out of its answer, streamed.

`plan_tools` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` against the model's
chat template (400s naming the field) and returns a `ToolPlan`:

- ``tool_choice`` ``"none"``: the tools are still rendered into the prompt (the model knows
  them, as vLLM and OpenAI do), the answer is never parsed: it is all content.
- ``"auto"`` (the default with tools): the answer is parsed in the template's format
  (`tool_parsers`); a call to a function not offered, or malformed JSON, leaves the whole
  answer as content. With ``parallel_tool_calls: false`` only the first call is returned.
- ``"required"`` and a named function: decoding is constrained (`tool_constraints`) so the
  answer is one or more calls (one with ``parallel_tool_calls: false``), or exactly one call to
  the named function, in the family's format with arguments matching the schema; it is always
  parsed.

A tokenizer whose template has no tool format this server parses gets a 400 for ``tools``
(rendering tools a template drops would accept them and ignore them), and for assistant
``tool_calls`` in the history.

The answer's message carries ``tool_calls`` ``[{id: "call_...", type: "function", function:
{name, arguments}}]`` (arguments a JSON string), ``content`` null or the text outside the calls,
and ``finish_reason`` ``"tool_calls"`` when the model stopped on its own after calling.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpu_runtime.server.chat_protocol import ChatMessage, NamedToolChoice, ToolDefinition
from gpu_runtime.server.protocol import OpenAIError
from gpu_runtime.server.tool_parsers import ParsedOutput, ToolCallFormat, format_of_template


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, decoding and answer.

    `mode` is ``none``, ``auto``, ``required`` or ``named`` (then `forced` names the
    function)."""

    tools: tuple[ToolDefinition, ...]
    mode: str
    forced: str | None
    parallel: bool
    format: ToolCallFormat

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return self.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether decoding is constrained to calls."""
        return self.mode in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]]:
        """``tools`` as the chat template receives them (keys present only when set)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def extract(self, text: str) -> ParsedOutput | None:
        """The answer's calls (None: it is content). Calls to functions not offered make it
        content; without parallel calls only the first call is kept."""
        if not self.parses:
            return None
        parsed = self.format.parse(text)
        if parsed is None:
            return None
        names = {t.function.name for t in self.tools}
        if any(call.name not in names for call in parsed.calls):
            return None
        if self.forced is not None and any(c.name != self.forced for c in parsed.calls):
            return None
        if not self.parallel and len(parsed.calls) > 1:
            return ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed


def plan_tools(
    tools: Sequence[ToolDefinition] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool,
    messages: Sequence[ChatMessage],
    chat_template: Any,
) -> ToolPlan | None:
    """The request's `ToolPlan`, None without tools; OpenAIError 400 naming the field at fault
    (see the module docstring)."""
    template_format = format_of_template(chat_template)
    for i, message in enumerate(messages):
        if message.tool_calls and template_format is None:
            raise OpenAIError(
                400,
                "this model's chat template has no tool-call format the server renders "
                "(Llama 3.1 JSON or Hermes <tool_call>), so assistant tool_calls cannot be "
                "rendered",
                param=f"messages.{i}.tool_calls",
            )
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, f"tools have duplicate names: {names}", param="tools")
    if template_format is None:
        raise OpenAIError(
            400,
            "tools are not supported by this model: its chat template has no tool-call format "
            "the server parses (Llama 3.1 JSON or Hermes <tool_call>)",
            param="tools",
        )
    choice = tool_choice if tool_choice is not None else "auto"
    forced = None
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in names:
            raise OpenAIError(
                400,
                f"tool_choice names function {forced!r}, which is not among tools {names}",
                param="tool_choice",
            )
    mode = "named" if forced is not None else str(choice)
    for i, tool in enumerate(tools):
        if tool.function.strict and mode not in ("required", "named"):
            raise OpenAIError(
                400,
                f"strict arguments are guaranteed only with tool_choice 'required' or a named "
                f"function (constrained decoding), not {mode!r}",
                param=f"tools.{i}.function.strict",
            )
    return ToolPlan(tuple(tools), mode, forced, parallel_tool_calls, template_format)


def new_call_id() -> str:
    """A fresh tool call id, OpenAI-shaped."""
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_calls(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """The parsed calls as a message's ``tool_calls``."""
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": json.dumps(call.arguments, ensure_ascii=False),
            },
        }
        for call in parsed.calls
    ]


def tool_finish_reason(parsed: ParsedOutput | None, finish_reason: str | None) -> str | None:
    """``tool_calls`` when the model called and stopped on its own, else the engine's."""
    return "tool_calls" if parsed is not None and finish_reason == "stop" else finish_reason


def assistant_message(
    plan: ToolPlan | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole answer's ``message`` and ``finish_reason``."""
    parsed = plan.extract(text) if plan is not None else None
    if parsed is None:
        return {"role": "assistant", "content": text}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": openai_tool_calls(parsed),
    }
    return message, tool_finish_reason(parsed, finish_reason)
