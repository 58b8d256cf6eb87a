"""Per-request limits of the completion routes: how many prompts one request may carry and how
many prompt tokens in all.

A request past a limit is answered 400 in OpenAI's shape (`invalid_request_error`, `param`
`prompt` or `messages`, the limit in the message) and nothing of it reaches the engine. The
prompt count is checked before any prompt is tokenized; the token count right after
tokenization, before the first prompt is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.server.protocol import OpenAIError

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
"""Prompts one `/v1/completions` request may carry by default (OpenAI's own limit is 2,048;
a host shares one batch among every tenant, so it takes fewer)."""
PROMPT_TOKENS_CONTEXTS = 32
"""Without an explicit token limit, a request may carry the prompt tokens of this many
full-context prompts (`max_model_len` each)."""


class RequestLimitsError(ValueError):
    """A limit out of range; the message names it and its value."""


@dataclass(frozen=True)
class RequestLimits:
    """The limits one request is held to (see the module docstring)."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    """Most prompts in one request (a `/v1/completions` `prompt` list; a chat request is one)."""
    max_request_prompt_tokens: int | None = None
    """Most prompt tokens in one request, summed over its prompts. None: `PROMPT_TOKENS_CONTEXTS`
    times the engine's `max_model_len`, read per request (a host may load another base
    model)."""

    def __post_init__(self) -> None:
        if self.max_prompts_per_request < 1:
            raise RequestLimitsError(
                f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}"
            )
        if self.max_request_prompt_tokens is not None and self.max_request_prompt_tokens < 1:
            raise RequestLimitsError(
                f"max_request_prompt_tokens must be >= 1, got {self.max_request_prompt_tokens}"
            )

    def prompt_tokens_limit(self, max_model_len: int) -> int:
        """The token limit for an engine whose longest sequence is `max_model_len`."""
        if self.max_request_prompt_tokens is not None:
            return self.max_request_prompt_tokens
        return PROMPT_TOKENS_CONTEXTS * max_model_len

    def check_prompt_count(self, count: int) -> None:
        """400 when a request carries more than `max_prompts_per_request` prompts."""
        limit = self.max_prompts_per_request
        if count > limit:
            raise OpenAIError(
                400,
                f"This request has {count} prompts; this server takes at most {limit} prompts "
                "per request. Split them over several requests.",
                param="prompt",
            )

    def check_prompt_tokens(self, tokens: int, max_model_len: int, param: str) -> None:
        """400 (naming `param`) when a request's prompts hold more tokens in all than the
        limit for `max_model_len`."""
        limit = self.prompt_tokens_limit(max_model_len)
        if tokens > limit:
            raise OpenAIError(
                400,
                f"This request's prompts hold {tokens} tokens in all; this server takes at "
                f"most {limit} prompt tokens per request.",
                param=param,
            )
