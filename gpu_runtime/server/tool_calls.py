"""A chat request's tools: validated against the model, parsed out of its answer, streamed.

`plan_tools` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` against the model's
chat template (400s naming the field) and returns a `ToolPlan`:

- ``tool_choice`` ``"none"``: the tools are still rendered into the prompt (the model knows
  them, as vLLM and OpenAI do), the answer is never parsed: it is all content.
- ``"auto"`` (the default with tools): the answer is parsed in the template's format
  (`tool_parsers`); malformed JSON or a call to a function not offered is content (for Llama 3
  JSON the whole answer, for Hermes that block). With ``parallel_tool_calls: false`` only the
  first call is returned.
- ``"required"`` and a named function: decoding is constrained (`tool_constraints`) so the
  answer is one or more calls (one with ``parallel_tool_calls: false``), or exactly one call to
  the named function, in the family's format with arguments matching the schema; it is always
  parsed.
- ``"auto"`` with a function marked ``strict``: decoding is constrained too, to text or calls
  whose arguments match their schemas (`tool_constraints`), so every call parsed is valid.

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
from typing import Any, Literal, cast

from gpu_runtime.server.chat_protocol import ChatMessage, NamedToolChoice, ToolDefinition
from gpu_runtime.server.protocol import OpenAIError
from gpu_runtime.server.tool_parsers import ParsedCall, ToolCallFormat, format_of_template

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ParsedOutput:
    """An answer split into calls (at least one) and the content outside them (None when
    that is only whitespace)."""

    content: str | None
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, decoding and answer.

    `mode` is ``none``, ``auto``, ``required`` or ``named`` (then `forced` names the
    function)."""

    tools: tuple[ToolDefinition, ...]
    mode: ToolMode
    forced: str | None
    parallel: bool
    format: ToolCallFormat

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return self.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether decoding is constrained to calls only."""
        return self.mode in ("required", "named")

    @property
    def strict_auto(self) -> bool:
        """Whether decoding is constrained to text or valid calls (``auto`` with a ``strict``
        function)."""
        return self.mode == "auto" and any(t.function.strict for t in self.tools)

    def template_tools(self) -> list[dict[str, Any]]:
        """``tools`` as the chat template receives them (keys present only when set)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def accepts(self, call: ParsedCall) -> bool:
        """Whether a well-formed call is one this request takes: its function is offered
        (and is the named one, when tool_choice names one)."""
        if self.forced is not None:
            return call.name == self.forced
        return any(t.function.name == call.name for t in self.tools)

    def extract(self, text: str) -> ParsedOutput | None:
        """The whole answer's calls (None: it is all content, also when tool_choice is
        ``none``). Without parallel calls only the first call is kept (the others are
        dropped, not made content)."""
        if not self.parses:
            return None
        segments = self.format.segments(text, True, self.accepts)
        calls = [s.call for s in segments if s.call is not None]
        if not calls:
            return None
        content = "".join(text[s.start : s.end] for s in segments if s.call is None)
        kept = tuple(calls if self.parallel else calls[:1])
        return ParsedOutput(content if content.strip() else None, kept)


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
    mode = cast(ToolMode, "named" if forced is not None else choice)
    return ToolPlan(tuple(tools), mode, forced, parallel_tool_calls, template_format)


def new_call_id() -> str:
    """A fresh tool call id, OpenAI-shaped."""
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_call(call: ParsedCall) -> dict[str, Any]:
    """A parsed call as an entry of a message's ``tool_calls``, with a fresh id."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def tool_finish_reason(called: bool, finish_reason: str | None) -> str | None:
    """``tool_calls`` when the model called and stopped on its own, else the engine's."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


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
        "tool_calls": [openai_tool_call(call) for call in parsed.calls],
    }
    return message, tool_finish_reason(True, finish_reason)
