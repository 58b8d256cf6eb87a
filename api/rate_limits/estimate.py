"""The token estimate a request is admitted on, before the host has counted anything."""

from __future__ import annotations

CHARS_PER_TOKEN = 4


def estimate_request_tokens(*, prompt_chars: int, max_tokens: int) -> int:
    """The tokens a request may use: its prompt's characters / 4, rounded up, plus the most
    it may generate (`max_tokens`, or `max_completion_tokens`).

    This is OpenAI's style of estimate for its tokens-per-minute limit: admission counts the
    prompt at about four characters a token and the whole completion budget, before any
    tokenizer runs; `RateLimiter.settle` corrects the bucket once the host reports the real
    counts. For chat requests pass the characters of every message's content.
    """
    for name, value in (("prompt_chars", prompt_chars), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return -(-prompt_chars // CHARS_PER_TOKEN) + max_tokens
