"""What the gateway reads of an inference request's body before it routes it: the model, whether
it streams, and the token estimate the rate limit is charged up front. The host validates the
rest (it answers the same OpenAI errors either way). `/tokenize` and `/detokenize` need a
`model` here (the host defaults to its base model; the gateway routes by it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api.errors import HarliError
from api.rate_limits import estimate_request_tokens

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
ROUTES = {COMPLETIONS: "/completions", CHAT_COMPLETIONS: "/chat/completions",
          TOKENIZE: "/tokenize", DETOKENIZE: "/detokenize"}  # fmt: skip
"""The gateway's paths and the host path each goes to: under the host's `/v1` server URL, or,
for :data:`ROOT_PATHS`, under its root (vLLM serves `/tokenize` and `/detokenize` there)."""
ROOT_PATHS = frozenset({TOKENIZE, DETOKENIZE})
"""Paths that generate nothing: the rate limit's token charge is settled to zero and no usage
is recorded (they count as requests)."""
DEFAULT_COMPLETION_TOKENS = {COMPLETIONS: 16, CHAT_COMPLETIONS: 256, TOKENIZE: 0, DETOKENIZE: 0}
"""The estimate of completion tokens when the request names no limit: OpenAI's default for
completions; for chat, the limit is the model's remaining context, so a typical answer."""


@dataclass(frozen=True)
class InferenceRequest:
    path: str
    body: dict[str, Any]
    model: str
    stream: bool
    client_wants_usage: bool
    estimated_tokens: int

    @property
    def generates(self) -> bool:
        """Whether the host generates tokens for it (its usage is recorded)."""
        return self.path not in ROOT_PATHS

    def host_url(self, server_url: str) -> str:
        """The URL of this request on a host whose `/v1` server URL is `server_url`."""
        base = server_url.removesuffix("/v1") if self.path in ROOT_PATHS else server_url
        return base + ROUTES[self.path]

    def upstream_body(self) -> bytes:
        """The body for the host: the client's, asking for the usage chunk when it streams."""
        if not self.stream:
            return json.dumps(self.body).encode()
        options = dict(self.body.get("stream_options") or {})
        options["include_usage"] = True
        return json.dumps({**self.body, "stream_options": options}).encode()


def parse_inference_request(path: str, raw: bytes) -> InferenceRequest:
    """The request's routing fields; HarliError (400) for a body that is not a JSON object with
    a string `model`, or whose `stream`, `stream_options`, token limits, `n` or `best_of` have
    the wrong type. The estimate charges every sequence: `max(n, best_of)` per prompt."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HarliError("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HarliError("The request body must be a JSON object.", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HarliError("you must provide a model parameter", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise HarliError("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise HarliError("stream_options must be an object", param="stream_options")
    wants_usage = bool(options and options.get("include_usage"))
    limits = []  # max_completion_tokens wins over max_tokens, as on the hosts
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise HarliError(f"{name} must be a non-negative integer", param=name)
        limits.append(value)
    completion = limits[0] if limits else DEFAULT_COMPLETION_TOKENS[path]
    prompts = body.get("prompt") if path in (COMPLETIONS, TOKENIZE) else body.get("messages")
    if path == DETOKENIZE:
        prompts = body.get("tokens")
    prompt_count = len(body["prompt"]) if path == COMPLETIONS and _is_text_list(prompts) else 1
    sequences = max(_count_field(body, "n"), _count_field(body, "best_of"))
    estimate = estimate_request_tokens(
        prompt_chars=_prompt_chars(prompts), max_tokens=completion * prompt_count * sequences
    )
    return InferenceRequest(path, body, model, stream, wants_usage, estimate)


def _count_field(body: dict[str, Any], name: str) -> int:
    """`n` or `best_of`: sequences generated per prompt (1 when absent); HarliError when it is
    not a positive integer."""
    value = body.get(name)
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HarliError(f"{name} must be a positive integer", param=name)
    return value


def _is_text_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and not isinstance(value[0], int)


def _prompt_chars(value: Any) -> int:
    """Characters of a prompt or of chat messages' text; a token id counts as 4 characters."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return 4
    if isinstance(value, list):
        return sum(_prompt_chars(item) for item in value)
    if isinstance(value, dict):
        if "content" in value:
            return _prompt_chars(value["content"])
        text = value.get("text")
        return len(text) if isinstance(text, str) else 0
    return 0
