"""Tool-call formats of the model families the server parses, read off the chat template.

- `LLAMA3_JSON` (Llama 3.1 / 3.2 / 3.3 templates, which ask for ``{"name": function name,
  "parameters": dictionary of argument name and its value}``): the whole answer is one or more
  JSON objects ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is taken for
  ``"parameters"``), separated by ``;``, optionally after ``<|python_tag|>`` and surrounded by
  whitespace. Anything else (text before the first object, after the last, or JSON that is not
  a call) makes the whole answer content.
- `HERMES` (Qwen2.5 and other Hermes-style templates, and the fallback render of a tokenizer
  without a template, `gpu_runtime.contract.chat`): each call is a block
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; the last block may be
  left unclosed when its JSON is complete (the model stopped right after it). Text outside
  the blocks is content (null when it is only whitespace). A block whose JSON is not a call
  makes the whole answer content.

`ToolCallFormat.content_until(text)` is how much of a partial answer is content whatever comes
next: the streaming route sends that much as content and holds the rest until the answer ends.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

PYTHON_TAG = "<|python_tag|>"
HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedOutput:
    """An answer split into calls (at least one) and the content outside them (None when
    that is only whitespace)."""

    content: str | None
    calls: tuple[ParsedCall, ...]


def _call_of(obj: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    present = [k for k in arguments_keys if k in obj]
    if len(present) != 1 or set(obj) != {"name", present[0]}:
        return None
    arguments = obj[present[0]]
    return ParsedCall(obj["name"], arguments) if isinstance(arguments, dict) else None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolCallFormat(ABC):
    """A family's call format: `parse` a whole answer, `content_until` for a partial one."""

    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput | None:
        """The answer's calls and content, or None when it holds no well-formed call."""

    @abstractmethod
    def content_until(self, text: str) -> int:
        """Characters of the partial answer `text` that are content whatever follows."""


class Llama3JsonFormat(ToolCallFormat):
    """See the module docstring."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput | None:
        return _parse_llama3(text)

    def content_until(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(PYTHON_TAG[: len(head)]):
            return 0  # may still become a call: hold everything
        return len(text)


class HermesFormat(ToolCallFormat):
    """See the module docstring."""

    name = "hermes"

    def parse(self, text: str) -> ParsedOutput | None:
        return _parse_hermes(text)

    def content_until(self, text: str) -> int:
        start = text.find(HERMES_START)
        if start >= 0:
            return start
        for keep in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
            if HERMES_START.startswith(text[-keep:]):
                return len(text) - keep  # a tag may be starting: hold its first characters
        return len(text)


LLAMA3_JSON = Llama3JsonFormat()
HERMES = HermesFormat()


def _parse_llama3(text: str) -> ParsedOutput | None:
    pos = _skip_space(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = _skip_space(text, pos + len(PYTHON_TAG))
    calls: list[ParsedCall] = []
    while pos < len(text):
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = _skip_space(text, pos)
        if pos < len(text):
            if text[pos] != ";":
                return None
            pos = _skip_space(text, pos + 1)
    return ParsedOutput(None, tuple(calls)) if calls else None


def _parse_hermes(text: str) -> ParsedOutput | None:
    outside: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while (start := text.find(HERMES_START, pos)) >= 0:
        outside.append(text[pos:start])
        body_start = start + len(HERMES_START)
        end = text.find(HERMES_END, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        call = _call_of(obj, ("arguments",))
        if call is None:
            return None
        calls.append(call)
        pos = len(text) if end < 0 else end + len(HERMES_END)
    if not calls:
        return None
    outside.append(text[pos:])
    content = "".join(outside)
    return ParsedOutput(content if content.strip() else None, tuple(calls))


def format_of_template(chat_template: Any) -> ToolCallFormat | None:
    """The call format a chat template teaches (None: one this server does not parse, or no
    tool support). No template at all is `HERMES`: the fallback render uses it."""
    if not chat_template:
        return HERMES
    if isinstance(chat_template, dict):  # named templates: tools may pick "tool_use"
        chat_template = "\n".join(str(t) for t in chat_template.values())
    text = str(chat_template)
    if HERMES_START in text:
        return HERMES
    if "<|start_header_id|>" in text and ('"parameters": ' in text or PYTHON_TAG in text):
        return LLAMA3_JSON
    return None
