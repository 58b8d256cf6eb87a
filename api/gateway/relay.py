"""A host's server-sent events on their way to the client, whole events at a time.

The gateway always asks the host for the usage chunk (`stream_options.include_usage`) so it can
account the request; `StreamRelay` takes that chunk's counts and passes it on only when the
client asked for it too. Events leave whole (never split across writes), so an error event the
gateway adds after a host fails cannot land inside one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    exact: bool
    """False when the stream was cut off: completion tokens are then the content events sent
    (a host sends one per decode step that yields text)."""


class StreamRelay:
    def __init__(self, forward_usage: bool) -> None:
        self.forward_usage = forward_usage
        self._pending = b""
        self.usage: dict[str, Any] | None = None
        self.content_events = 0
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """What to send on now of the events `chunk` completes (b"" when none)."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        whole = data[: end + 2]
        if b'"usage"' not in whole and DONE not in whole:
            self.content_events += whole.count(b"\n\n")
            return whole
        out = []
        for event in whole.split(b"\n\n")[:-1]:
            if event.startswith(DONE):
                self.done = True
            elif b'"usage"' in event and self._take_usage(event):
                if not self.forward_usage:
                    continue
            else:
                self.content_events += 1
            out.append(event + b"\n\n")
        return b"".join(out)

    def _take_usage(self, event: bytes) -> bool:
        """Whether `event` is the usage chunk (no choices, a usage object); keeps its counts."""
        try:
            payload = json.loads(event.removeprefix(b"data:").strip())
        except ValueError:
            return False
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if not isinstance(usage, dict) or payload.get("choices"):
            return False
        self.usage = usage
        return True

    def account(self, prompt_tokens_header: str | None) -> Usage:
        """The request's usage: the host's usage chunk, or (cut off) the prompt tokens the host
        named in its response header and the content events relayed."""
        if self.usage is not None:
            return Usage(
                int(self.usage.get("prompt_tokens") or 0),
                int(self.usage.get("completion_tokens") or 0),
                True,
            )
        try:
            prompt = int(prompt_tokens_header or 0)
        except ValueError:
            prompt = 0
        return Usage(prompt, self.content_events, False)


def error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    """An error as OpenAI sends one inside a stream (its clients raise it as an APIError)."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
