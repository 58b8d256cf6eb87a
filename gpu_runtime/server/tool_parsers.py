"""Tool-call formats of the model families the server parses, read off the chat template.

- `LLAMA3_JSON` (Llama 3.1 / 3.2 / 3.3 templates, which ask for ``{"name": function name,
  "parameters": dictionary of argument name and its value}``): the whole answer is one or more
  JSON objects ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is taken for
  ``"parameters"``), separated by ``;``, optionally after ``<|python_tag|>`` and surrounded by
  whitespace. Anything else (text before the first object, after the last, JSON that is not a
  call, or a call that is not accepted) makes the whole answer content.
- `HERMES` (Qwen2.5 and other Hermes-style templates, and the fallback render of a tokenizer
  without a template, `gpu_runtime.contract.chat`): each call is a block
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; the last block may be
  left unclosed when its JSON is complete (the model stopped right after it). Text outside the
  blocks is content; so is a block whose JSON is not an accepted call (its text as written).

`ToolCallFormat.segments(text, finished, accept)` splits an answer into content and calls;
for a partial answer (`finished` False) it returns only what is settled whatever follows: the
segments of a longer answer start with those of a shorter one (the last content segment may
grow), so the streaming route sends each segment once, as soon as it is settled.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
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
class Segment:
    """Characters ``[start, end)`` of an answer: a call, or content (``call`` None)."""

    start: int
    end: int
    call: ParsedCall | None = None


Accept = Callable[[ParsedCall], bool]
"""Whether a well-formed call is one the request takes (its function was offered)."""


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
    """A family's call format (see the module docstring)."""

    name: str
    resumable: bool
    """Whether the segments of ``text[k:]``, shifted by ``k``, are those of ``text`` from
    ``k`` on, for any ``k`` where a settled segment ended (a stream then scans only what is
    new)."""

    @abstractmethod
    def segments(self, text: str, finished: bool, accept: Accept) -> list[Segment]:
        """The answer's settled segments, in order; all of it when `finished`."""


class Llama3JsonFormat(ToolCallFormat):
    """See the module docstring."""

    name = "llama3_json"
    resumable = False  # whether the answer is calls depends on all of it

    def segments(self, text: str, finished: bool, accept: Accept) -> list[Segment]:
        if not finished:
            head = text.lstrip()
            if not head or head.startswith("{") or head.startswith(PYTHON_TAG[: len(head)]):
                return []  # may still become calls: nothing is settled
            return [Segment(0, len(text))]
        calls = _llama3_calls(text)
        if not calls or not all(accept(s.call) for s in calls if s.call is not None):
            return [Segment(0, len(text))] if text else []
        return calls


class HermesFormat(ToolCallFormat):
    """See the module docstring."""

    name = "hermes"
    resumable = True

    def segments(self, text: str, finished: bool, accept: Accept) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while (start := text.find(HERMES_START, pos)) >= 0:
            if start > pos:
                out.append(Segment(pos, start))
            body = start + len(HERMES_START)
            end = text.find(HERMES_END, body)
            if end < 0 and not finished:
                return out  # an open block: settled at its end tag or the answer's end
            stop = len(text) if end < 0 else end + len(HERMES_END)
            call = _hermes_call(text[body:stop] if end < 0 else text[body:end])
            out.append(Segment(start, stop, call if call is not None and accept(call) else None))
            pos = stop
        settled = len(text) if finished else len(text) - _partial_tag(text, pos)
        if settled > pos:
            out.append(Segment(pos, settled))
        return out


def _partial_tag(text: str, pos: int) -> int:
    """How many of `text`'s last characters (after `pos`) may begin a `HERMES_START`."""
    for keep in range(min(len(HERMES_START) - 1, len(text) - pos), 0, -1):
        if HERMES_START.startswith(text[-keep:]):
            return keep
    return 0


def _hermes_call(body: str) -> ParsedCall | None:
    try:
        return _call_of(json.loads(body), ("arguments",))
    except json.JSONDecodeError:
        return None


def _llama3_calls(text: str) -> list[Segment]:
    """One segment per call when the whole text is calls, else []."""
    pos = _skip_space(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = _skip_space(text, pos + len(PYTHON_TAG))
    calls: list[Segment] = []
    start = 0
    while pos < len(text):
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return []
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return []
        pos = _skip_space(text, pos)
        if pos < len(text):
            if text[pos] != ";":
                return []
            pos = _skip_space(text, pos + 1)
        calls.append(Segment(start, pos, call))
        start = pos
    return calls


LLAMA3_JSON = Llama3JsonFormat()
HERMES = HermesFormat()


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
