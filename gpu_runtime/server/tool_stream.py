"""The streamed deltas of an answer whose request has tools that are parsed (`ToolPlan`).

Each segment of the answer (`ToolCallFormat.segments`) is sent once, as soon as it is settled:
content as it comes, up to where a call may be beginning; a call once it is complete (a Hermes
block at its end tag; Llama 3 JSON calls only when the answer ends, since text after them would
make the whole answer content), as one delta ``{"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments"}}]}``. Content that is only whitespace so far is held (an
answer of only calls has null content) and sent with the next content that is not. So what
OpenAI clients accumulate from the stream is the message a whole answer gets
(`tool_calls.assistant_message`).
"""

from __future__ import annotations

from typing import Any

from gpu_runtime.server.responses import text_delta
from gpu_runtime.server.tool_calls import ToolPlan, openai_tool_call, tool_finish_reason


class ToolCallStream:
    """One streamed answer's tool-aware deltas (see the module docstring)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._done = 0
        """Characters of the answer whose segments were handled."""
        self._calls = 0
        self._blank = ""
        """Content held while all content so far is whitespace."""
        self._content_sent = False

    def deltas(self, text: str, finished: bool, holdback: int) -> list[dict[str, Any]]:
        """The deltas to send now for the answer's text so far; `holdback` as in
        `responses.text_delta` (where a stop string could start)."""
        if not finished:
            _, upto = text_delta(text, self._done, finished, holdback)
            text = text[:upto]
        out: list[dict[str, Any]] = []
        fmt = self._plan.format
        base = self._done if fmt.resumable else 0  # scan only what is new where it may
        for segment in fmt.segments(text[base:], finished, self._plan.accepts):
            start, end = base + segment.start, base + segment.end
            if end <= self._done:
                continue
            if segment.call is None:
                out.extend(self._content(text[max(start, self._done) : end]))
            elif self._calls == 0 or self._plan.parallel:
                call = {"index": self._calls} | openai_tool_call(segment.call)
                out.append({"tool_calls": [call]})
                self._calls += 1
            self._done = end
        if finished and self._calls == 0 and self._blank:
            out.append({"content": self._blank})  # no call: the answer is all content
        return out

    def _content(self, piece: str) -> list[dict[str, Any]]:
        if self._content_sent:
            return [{"content": piece}] if piece else []
        self._blank += piece
        if not self._blank.strip():
            return []
        self._content_sent = True
        piece, self._blank = self._blank, ""
        return [{"content": piece}]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The answer's ``finish_reason`` (after its last `deltas`)."""
        return tool_finish_reason(self._calls > 0, engine_reason)
