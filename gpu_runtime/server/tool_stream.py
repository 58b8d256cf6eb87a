"""The streamed deltas of an answer whose request has tools that are parsed (`ToolPlan`).

Content is sent as it comes while no call can have begun (`ToolCallFormat.content_until`; only
once it holds more than whitespace, since an answer that turns out to be only calls has null
content); from the point where a call may begin, the text is held until the answer ends. Then
it is parsed: the rest of the content (all the held text when it was no call) and one delta
per call, ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}``,
which OpenAI clients accumulate into the same message a whole answer has
(`tool_calls.assistant_message`).
"""

from __future__ import annotations

from typing import Any

from gpu_runtime.server.responses import text_delta
from gpu_runtime.server.tool_calls import (
    ToolPlan,
    openai_tool_calls,
    tool_finish_reason,
)
from gpu_runtime.server.tool_parsers import ParsedOutput


class ToolCallStream:
    """One streamed answer's tool-aware deltas (see the module docstring)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._sent = 0
        self._parsed: ParsedOutput | None = None

    def deltas(self, text: str, finished: bool, holdback: int) -> list[dict[str, Any]]:
        """The deltas to send now for the answer's text so far; `holdback` as in
        `responses.text_delta` (where a stop string could start)."""
        if not finished:
            _, upto = text_delta(text, self._sent, finished, holdback)
            cut = self._plan.format.content_until(text[:upto])
            if cut <= self._sent or not text[:cut].strip():
                return []
            piece, self._sent = text[self._sent : cut], cut
            return [{"content": piece}]
        self._parsed = parsed = self._plan.extract(text)
        content = text if parsed is None else (parsed.content or "")
        out: list[dict[str, Any]] = []
        if len(content) > self._sent and content.startswith(text[: self._sent]):
            out.append({"content": content[self._sent :]})
        self._sent = len(text)
        if parsed is not None:
            for index, call in enumerate(openai_tool_calls(parsed)):
                out.append({"tool_calls": [{"index": index} | call]})
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The answer's ``finish_reason`` (after its last `deltas`)."""
        return tool_finish_reason(self._parsed, engine_reason)
